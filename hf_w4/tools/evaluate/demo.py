"""``run_demo``: every format on one model, one row each against the dense model (``hf-w4 demo``)."""
from __future__ import annotations

import gc
import time
from typing import Dict, List, Optional, Sequence

import torch

from ...log import hidden_progress_bars
from ...loading.config import checkpoint_quant_method
from .. import models, writers
from .dist import Dist
from .metrics import decode, model_bytes, perplexity, progress_bar
from .model import kernels_used, load_model, load_tokenizer
from .text import DEFAULT_PROMPT, DEFAULT_WINDOW, default_text, make_windows


from ..defaults import DEMO_GROUP_SIZE, W4A8_FORMATS  # noqa: F401 (re-exported)


def demo_formats() -> List[str]:
    """Every format the checkpoint writers know (``writers.FORMATS``)."""
    return list(writers.FORMATS)


def _kernel_summary(kernels: Dict[str, int]) -> str:
    if not kernels:
        return "torch (dense)"
    return ", ".join(k if len(kernels) == 1 else f"{k} x{v}" for k, v in kernels.items())


def _check_group_size(group_size) -> None:
    if not (isinstance(group_size, int) and (group_size == -1 or group_size > 0)):
        raise ValueError(f"group_size={group_size!r} is invalid; supported: a positive group size (e.g. "
                         f"{DEMO_GROUP_SIZE}) or -1 (one group per output channel)")


def demo_w4a8_rows(formats: Sequence[str], w4a8: Optional[Sequence[str]] = None) -> List[str]:
    """The formats that get a ``"<fmt> +int8 act"`` row: ``w4a8`` checked against :data:`W4A8_FORMATS` and
    ``formats``; None = ``["gptq"]`` when gptq is among ``formats`` (else none)."""
    if w4a8 is None:
        return ["gptq"] if "gptq" in formats else []
    w4a8 = list(w4a8)
    bad = [f for f in w4a8 if f not in W4A8_FORMATS]
    if bad:
        raise ValueError(f"W4A8 row(s) (--w4a8) for {bad}: not a 4-bit integer weight-only format; supported: "
                         f"{list(W4A8_FORMATS)}")
    missing = [f for f in w4a8 if f not in formats]
    if missing:
        raise ValueError(f"W4A8 row(s) (--w4a8) for {missing}: not among the formats (--formats) {list(formats)}; "
                         "a W4A8 row reloads that format's checkpoint: add the format, or leave it out of --w4a8")
    return w4a8


def run_demo(model_path=None, formats: Optional[Sequence[str]] = None, group_size: int = DEMO_GROUP_SIZE,
             ppl_tokens: Optional[int] = 2048, window: int = DEFAULT_WINDOW, decode_tokens: int = 32,
             prompt: str = DEFAULT_PROMPT, text: Optional[str] = None, out_dir=None,
             dtype: torch.dtype = torch.bfloat16, progress: bool = True, log=print,
             w4a8: Optional[Sequence[str]] = None, device: str = "cpu") -> List[Dict]:
    """Write ``model_path`` (default: the embedded SmolLM2-135M-Instruct) in every format, load each
    through ``from_pretrained`` with hf_w4, and measure it against the dense ``dtype`` model.

    Returns one row per format, the dense baseline first. Row keys: ``format``, ``status``
    (``ok``/``skipped``/``failed``), ``reason``, ``kernel``, ``kernels``, ``activation`` (what the format was
    loaded with: ``auto`` = its own scheme, ``int8``), ``packed_bytes``, ``dense_bytes``
    (the quantized layers, packed vs as bf16), ``weights_bytes`` (whole model), ``perplexity``,
    ``ppl_ratio`` (vs dense), ``top1`` (next-token agreement with dense), ``tok_per_s``, ``speedup``
    (decode vs dense), ``answer`` (greedy reply to ``prompt``), ``write_s``, ``load_s``.
    A format the writers cannot apply to this model is *skipped* with the writer's reason; one that fails
    to load or run is *failed* with the error. Checkpoints (with the source's tokenizer, so ``hf-w4 eval`` takes
    them) go to ``out_dir`` (default: a temporary directory, removed afterwards). ``ppl_tokens`` None = the
    whole text.

    ``w4a8``: formats (4-bit integer ones, :data:`W4A8_FORMATS`, each among ``formats``) whose checkpoint is
    loaded a second time with ``activation="int8"`` (W4A8: dynamic int8 activations, the cpu_int8 kernel) and
    measured the same way, as a row ``"<fmt> +int8 act"`` right after the format's own row: the accuracy cost
    and the speed gain of the opt-in side by side. None = gptq when gptq is among ``formats``; ``()`` = none.

    ``device``: where the dense baseline and every checkpoint run (``device_map``; the writers quantize on the CPU).

    Usage errors (an unknown format, a bad group size or count, a quantized source model) raise ValueError before
    anything is measured.
    """
    with hidden_progress_bars(not progress):   # progress=False hides transformers' loading bars too
        import shutil
        import tempfile
        from pathlib import Path


        formats = list(formats) if formats else list(writers.FORMATS)
        unknown = [f for f in formats if f not in writers.FORMATS]
        if unknown:
            raise ValueError(f"unknown format(s) {unknown}; known: {list(writers.FORMATS)}")
        w4a8 = demo_w4a8_rows(formats, w4a8)
        _check_group_size(group_size)
        if decode_tokens < 2:
            raise ValueError(f"decode_tokens must be >= 2 (the demo times decoding), got {decode_tokens}")
        if ppl_tokens is not None and ppl_tokens < 2:
            raise ValueError(f"ppl_tokens must be >= 2 or None (the whole text), got {ppl_tokens}")
        src = models.resolve(model_path)
        method = checkpoint_quant_method(src)
        if method is not None:
            raise ValueError(f"{src} is a quantized checkpoint (quant_method {method!r}); the demo writes every format "
                             "from a dense model: pass the dense checkpoint it was made from")
        tmp = None
        if out_dir is None:
            tmp = out_dir = tempfile.mkdtemp(prefix="hf_w4_demo_")
        out_dir = Path(out_dir)
        dist = Dist()                                    # the demo is a single-process tool
        rows: List[Dict] = []
        try:
            tok = load_tokenizer(src)
            source = load_model(src, torch.float32)         # what the writers quantize (kept in memory once)
            dense = load_model(src, dtype, device=device) if dtype != torch.float32 or device != "cpu" else source
            windows = make_windows(tok, text if text is not None else default_text(), window, ppl_tokens, "auto",
                                   dense.config)
            where = f"{torch.get_num_threads()} threads" if device == "cpu" else device
            log(f"dense {str(dtype).replace('torch.', '')}: {src} ({windows.shape[0]} x {windows.shape[1]}-token "
                f"windows, {decode_tokens} decode tokens, {where})")
            ref = perplexity(dense, windows, None, dist, progress)
            dec = decode(dense, tok, prompt, decode_tokens)
            nbytes = model_bytes(dense)
            lin = _linear_bytes(dense)
            base = {"format": f"dense {str(dtype).replace('torch.', '')}", "status": "ok", "reason": "",
                    "reference": _reference_text(src), "device": device,
                    "kernel": "torch (dense)", "kernels": {}, "activation": None, "packed_bytes": lin,
                    "dense_bytes": lin, "weights_bytes": nbytes["total"], "perplexity": ref.ppl, "ppl_ratio": 1.0,
                    "top1": 1.0, "tok_per_s": dec.tok_per_s, "tok_per_s_min": dec.tok_per_s_min,
                    "tok_per_s_max": dec.tok_per_s_max, "speedup": 1.0, "answer": dec.text, "write_s": 0.0,
                    "load_s": 0.0, "ppl_s": None, "decode_s": None}
            rows.append(base)
            del dense

            def new_row(name, activation):
                row = {"format": name, "status": "ok", "reason": "", "kernel": "", "kernels": {},
                       "activation": activation, "packed_bytes": None, "dense_bytes": None, "weights_bytes": None,
                       "perplexity": None, "ppl_ratio": None, "top1": None, "tok_per_s": None,
                       "tok_per_s_min": None, "tok_per_s_max": None, "speedup": None,
                       "answer": "", "write_s": None, "load_s": None, "ppl_s": None, "decode_s": None}
                rows.append(row)
                return row

            def measure(row, path, note):
                try:
                    t0 = time.perf_counter()
                    model = load_model(path, dtype, row["activation"], device)
                    row["load_s"] = time.perf_counter() - t0
                    ks = kernels_used(model)
                    mb = model_bytes(model)
                    t0 = time.perf_counter()
                    p = perplexity(model, windows, ref.argmax, dist, progress)
                    row["ppl_s"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    d = decode(model, tok, prompt, decode_tokens)
                    row["decode_s"] = time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001 - the demo reports every format, it does not stop
                    row.update(status="failed", reason=f"load/run: {type(e).__name__}: {_one_line(e)}")
                    log(f"{row['format']}: FAILED {row['reason']}")
                    return
                finally:
                    model = None
                    gc.collect()
                row.update(kernel=_kernel_summary(ks), kernels=ks, packed_bytes=mb["packed"],
                           dense_bytes=mb["dense"], weights_bytes=mb["total"], perplexity=p.ppl,
                           ppl_ratio=p.ppl / ref.ppl, top1=p.top1,
                           tok_per_s=d.tok_per_s, tok_per_s_min=d.tok_per_s_min, tok_per_s_max=d.tok_per_s_max,
                           speedup=d.tok_per_s / base["tok_per_s"], answer=d.text, reason=note)
                log(f"{row['format']}: ppl {p.ppl:.3f} ({row['ppl_ratio']:.3f}x), {d.tok_per_s:.1f} tok/s "
                    f"[{d.tok_per_s_min:.1f}-{d.tok_per_s_max:.1f}], "
                    f"kernel {row['kernel']} (" + (f"write {row['write_s']:.1f} s, " if row["write_s"] else "")
                    + f"load {row['load_s']:.1f} s, perplexity {row['ppl_s']:.1f} s, decode {row['decode_s']:.1f} s)")

            it = progress_bar(formats, len(formats), "demo formats", progress)
            for fmt in it:
                row = new_row(fmt, "auto")
                path = note = None
                t0 = time.perf_counter()
                try:
                    res = writers.write_checkpoint(source, str(out_dir / fmt), fmt, group_size=group_size,
                                                   dtype=dtype)
                    path = getattr(res, "path", res)
                    tok.save_pretrained(path)   # a kept checkpoint is complete: hf-w4 eval takes it
                except (ValueError, NotImplementedError) as e:
                    row.update(status="skipped", reason=_one_line(e))
                    log(f"{fmt}: skipped: {row['reason']}")
                except Exception as e:  # noqa: BLE001 - the demo reports every format, it does not stop
                    row.update(status="failed", reason=f"write: {type(e).__name__}: {_one_line(e)}")
                    log(f"{fmt}: FAILED {row['reason']}")
                if row["status"] == "ok":
                    row["write_s"] = time.perf_counter() - t0
                    skipped = getattr(res, "skipped", None)
                    note = f"{len(skipped)} layer(s) left dense" if skipped else ""
                    measure(row, path, note)
                if fmt in w4a8:                          # the same checkpoint again, activations in int8 (W4A8)
                    arow = new_row(f"{fmt} +int8 act", "int8")
                    if path is None:
                        arow.update(status="skipped", reason=f"no {fmt} checkpoint ({row['status']})")
                        log(f"{arow['format']}: skipped: {arow['reason']}")
                    else:
                        measure(arow, path, note)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        return rows


def _one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return (s[0] if s else type(e).__name__)[:300]


def _linear_bytes(model) -> int:
    """Bytes of the decoder's Linear weights (not embeddings / lm_head) in bf16: the dense counterpart of
    what the quantized formats pack."""
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"):
            n += m.weight.numel() * 2
    return n


def format_demo_table(rows: List[Dict]) -> str:
    """The demo table as aligned plain text (also valid GitHub markdown)."""
    mib = 1 / 2**20
    head = ["format (RTN)", "kernel", "memory packed / dense (MiB)", "perplexity (x dense)", "top-1 vs dense",
            "decode tok/s [min-max] (x dense)", "note"]
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append([r["format"], "-", "-", "-", "-", "-", f"{r['status']}: {r['reason']}"])
            continue
        mem = f"{r['packed_bytes'] * mib:.1f} / {r['dense_bytes'] * mib:.1f}" if r["dense_bytes"] else "-"
        body.append([r["format"], r["kernel"], mem, f"{r['perplexity']:.3f} ({r['ppl_ratio']:.3f}x)",
                     f"{100 * r['top1']:.1f} %", f"{r['tok_per_s']:.1f} [{r['tok_per_s_min']:.1f}-"
                     f"{r['tok_per_s_max']:.1f}] ({r['speedup']:.2f}x)", r["reason"]])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    lines = [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(b) for b in body]
    return "\n".join(lines)


def format_demo_caption(rows: List[Dict]) -> str:
    """What the table compares, in two sentences: how the formats were quantized and what the reference is."""
    return ("Every format is quantized by hf_w4's writers with round-to-nearest (RTN, no calibration): the gptq, awq "
            "and auto-round rows hold the same RTN weights in different layouts, not the results of the GPTQ, AWQ or "
            f"AutoRound algorithms. Reference (perplexity ratio, top-1, speedup): {rows[0]['reference']}. Decode "
            "tokens/s: the median of 3 timed runs, [min-max] their spread."
            + ("" if rows[0].get("device", "cpu") == "cpu" else f" Every model ran on {rows[0]['device']}."))


def _reference_text(src) -> str:
    if models.is_converted(src):
        return (f"the dense {models.DEFAULT_NAME}, i.e. its Q4_1 GGUF dequantized (exact in fp32), not the original "
                "bf16 release")
    return f"the dense model {src}"


def format_demo_answers(rows: List[Dict], prompt: str = DEFAULT_PROMPT) -> str:
    lines = [f"prompt: {prompt!r}"]
    w = max([16] + [len(r["format"]) for r in rows if r["status"] == "ok"])
    for r in rows:
        if r["status"] == "ok":
            lines.append(f"  {r['format']:<{w}} {r['answer']!r}")
    return "\n".join(lines)
