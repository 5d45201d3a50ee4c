"""``evaluate``: one model against an optional dense reference, and its printed summary."""
from __future__ import annotations

import gc
import time
from typing import Dict, Optional, Union

import torch

from ...log import hidden_progress_bars
from .dist import Dist
from .metrics import decode, model_bytes, peak_rss_bytes, perplexity
from .model import ACTIVATION_TEXT, activation_used, has_tokenizer, kernels_used, load_model, load_tokenizer, quant_format
from .text import DEFAULT_MAX_TOKENS, DEFAULT_PROMPT, DEFAULT_WINDOW, default_text, make_windows, needs_bos


def evaluate(path, text: Optional[str] = None, max_tokens: Optional[int] = DEFAULT_MAX_TOKENS,
             window: int = DEFAULT_WINDOW, reference=None, dtype: torch.dtype = torch.bfloat16,
             decode_tokens: int = 32, prompt: str = DEFAULT_PROMPT, bos: Union[str, bool] = "auto",
             dist: Optional[Dist] = None, progress: bool = True, model=None, tokenizer=None,
             activation: str = "auto", device: str = "cpu") -> Dict:
    """Evaluate one checkpoint; returns a JSON-able dict (the ``hf-w4 eval`` output).

    ``text``: a string (None = default corpus). ``reference``: a dense checkpoint path (or a loaded model)
    for top-1 agreement. ``tokenizer``: a loaded tokenizer instead of the checkpoint's own (which a checkpoint
    saved from a model object does not have). ``activation``: ``"auto"`` (the checkpoint's own scheme) or an
    activation mode to load the quantized checkpoint with (:func:`load_model`); the result's ``activation`` is
    the scheme its layers ran. ``device``: where checkpoints loaded here go (``device_map``; ``"cpu"`` loads as
    transformers does by default). Decoding speed is measured on rank 0 only, after the perplexity pass, while the
    other ranks wait, so it is not disturbed by them. ``peak_rss_bytes`` (the maximum over the ranks) is sampled
    after the checkpoint's own perplexity and decoding, before the reference is loaded: the reference then runs
    alone on the same windows against the checkpoint's argmax.
    """
    with hidden_progress_bars(not progress):   # progress=False hides transformers' loading bars too
        if decode_tokens and decode_tokens < 2:
            raise ValueError(f"decode_tokens must be 0 (skip decoding) or >= 2, got {decode_tokens}")
        dist = dist or Dist.detect()
        t0 = time.perf_counter()
        if device != "cpu":
            torch.cuda.reset_peak_memory_stats(device)
        model = model if model is not None else load_model(path, dtype, activation, device)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
        load_s = time.perf_counter() - t0
        text = text if text is not None else default_text()
        use_bos = needs_bos(tokenizer, model.config) if bos == "auto" else bool(bos)
        windows = make_windows(tokenizer, text, window, max_tokens, use_bos, model.config)
        _check_ids(windows, model, path)
        if reference is not None:           # before the long part: config and tokenizer only
            if isinstance(reference, torch.nn.Module):
                ref_config = reference.config
            else:
                from transformers import AutoConfig
                ref_config = AutoConfig.from_pretrained(str(reference))
            _check_reference(path, model, reference, ref_config, windows[:, 1:] if use_bos else windows, text)
        ppl = perplexity(model, windows, None, dist, progress)
        out = {"path": str(path), "format": quant_format(model), "kernels": kernels_used(model),
               "activation": activation_used(model), "activation_requested": activation,
               "dtype": str(dtype).replace("torch.", ""), "device": device, "load_s": load_s, "world": dist.world,
               "bos": use_bos,
               "perplexity": ppl.ppl, "nll": ppl.nll, "tokens": ppl.tokens, "windows": ppl.windows,
               "window": ppl.window, "top1_agreement": None, "reference_perplexity": None,
               "reference": None if reference is None else str(getattr(reference, "name_or_path", reference)),
               "memory": model_bytes(model)}
        dec = None
        if decode_tokens:
            if dist.main:
                dec = decode(model, tokenizer, prompt, decode_tokens)
            dist.barrier()
        if dec is not None:
            out.update(answer=dec.text, decode_tok_per_s=dec.tok_per_s, decode_mean_tok_per_s=dec.mean_tok_per_s,
                       decode_tok_per_s_min=dec.tok_per_s_min, decode_tok_per_s_max=dec.tok_per_s_max,
                       decode_repeats=dec.repeats, prefill_s=dec.prefill_s, decode_tokens=dec.new_tokens)
        rss = dist.per_rank(peak_rss_bytes())      # the checkpoint's own run, without the reference
        out["peak_rss_bytes"] = int(max(rss))
        out["peak_rss_bytes_per_rank"] = [int(r) for r in rss]
        if device != "cpu":
            out["peak_cuda_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["threads"] = torch.get_num_threads()
        if reference is not None:
            model = None                           # ours, if loaded here: freed before the reference comes in
            gc.collect()
            ref_model = (reference if isinstance(reference, torch.nn.Module)
                         else load_model(reference, dtype, device=device))
            ref = perplexity(ref_model, windows, ppl.argmax, dist, progress, desc="reference perplexity")
            del ref_model
            out.update(top1_agreement=ref.top1, reference_perplexity=ref.ppl)
        return out


def _check_ids(windows: torch.Tensor, model, path) -> None:
    v = getattr(model.config, "vocab_size", None)
    if isinstance(v, int) and int(windows.max()) >= v:
        raise ValueError(f"the tokenizer gives token id {int(windows.max())} but {path} has a vocabulary of {v} "
                         "tokens: the tokenizer does not belong to this model")


def _check_reference(path, model, reference, ref_config, text_ids: torch.Tensor, text: str) -> None:
    """Top-1 agreement compares token ids: the reference must have the same vocabulary, and (when its directory
    has a tokenizer) that tokenizer must give the same ids for the evaluation text."""
    name = getattr(reference, "name_or_path", reference)
    v, rv = getattr(model.config, "vocab_size", None), getattr(ref_config, "vocab_size", None)
    if isinstance(v, int) and isinstance(rv, int) and v != rv:
        raise ValueError(f"{path} has a vocabulary of {v} tokens, the reference {name} one of {rv}: top-1 "
                         "agreement needs two models with the same tokenizer")
    if isinstance(reference, torch.nn.Module) or not has_tokenizer(reference):
        return
    ref_ids = load_tokenizer(reference)(text, add_special_tokens=False)["input_ids"][: text_ids.numel()]
    if ref_ids != text_ids.flatten().tolist():
        raise ValueError(f"the tokenizers of {path} and the reference {name} differ (same vocabulary size {v}, "
                         "different token ids for the evaluation text): top-1 agreement needs the same tokenizer")


def format_eval(r: Dict) -> str:
    """Human-readable lines for an :func:`evaluate` result."""
    mb = 1 / 2**20
    ks = ", ".join(f"{k} x{v}" for k, v in r["kernels"].items()) or "dense (torch)"
    lines = [f"model        {r['path']}",
             f"format       {r['format']}    kernels: {ks}",
             f"perplexity   {r['perplexity']:.4f}   ({r['tokens']} tokens in {r['windows']} windows of "
             f"{r['window']}{', BOS' if r['bos'] else ''}; {r['world']} process(es)"
             f"{'' if r.get('device', 'cpu') == 'cpu' else ' on ' + r['device']})"]
    if r.get("activation"):
        req = r.get("activation_requested") or "auto"
        why = "the checkpoint's own scheme" if req == "auto" else f"requested: {req}"
        text = ACTIVATION_TEXT.get(r["activation"], r["activation"])
        lines.insert(2, f"activation   {r['activation']} ({text}; {why})")
    if r.get("top1_agreement") is not None:
        lines.append(f"top-1        {100 * r['top1_agreement']:.2f} % agreement with {r['reference']} "
                     f"(reference perplexity {r['reference_perplexity']:.4f})")
    if r.get("decode_tok_per_s") is not None:
        lines.append(f"decode       {r['decode_tok_per_s']:.1f} tokens/s, median of {r['decode_repeats']} runs "
                     f"(min {r['decode_tok_per_s_min']:.1f}, max {r['decode_tok_per_s_max']:.1f}; "
                     f"{r['decode_tokens']} greedy tokens, {r['threads']} threads, prefill "
                     f"{r['prefill_s'] * 1000:.0f} ms)")
        lines.append(f"answer       {r['answer']!r}")
    m = r["memory"]
    mem = f"weights {m['total'] * mb:.1f} MiB"
    if m["quantized_layers"]:
        mem += (f"; {m['quantized_layers']} quantized layers {m['packed'] * mb:.1f} MiB packed vs "
                f"{m['dense'] * mb:.1f} MiB dense bf16")
    lines.append(f"memory       {mem}")
    per = r.get("peak_rss_bytes_per_rank") or [r["peak_rss_bytes"]]
    lines.append("peak RSS     " + ", ".join(f"{x * mb:.0f} MiB" for x in per) + (" (per rank)" if len(per) > 1 else "")
                 + (" (before the reference was loaded)" if r.get("reference") else ""))
    if r.get("peak_cuda_bytes") is not None:
        lines.append(f"peak CUDA    {r['peak_cuda_bytes'] * mb:.0f} MiB allocated on {r['device']}")
    return "\n".join(lines)
