"""What is measured: perplexity and top-1 agreement over the windows, greedy decode speed, memory."""
from __future__ import annotations

import dataclasses
import math
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from ... import log
from ...report import layer_table
from .dist import Dist
from .text import DEFAULT_PROMPT


@dataclass
class PerplexityResult:
    ppl: float
    nll: float                       # mean NLL per predicted token (nats)
    tokens: int                      # predicted tokens
    windows: int
    window: int
    top1: Optional[float] = None     # fraction of positions whose argmax equals the reference's
    ref_ppl: Optional[float] = None  # the reference model's perplexity on the same windows
    world: int = 1
    per_window_nll: List[float] = field(default_factory=list, repr=False)
    argmax: Optional[torch.Tensor] = field(default=None, repr=False)   # [windows, window-1] predicted ids

    def to_dict(self) -> Dict:
        d = dataclasses.asdict(self)
        d.pop("argmax")
        return d


def progress_bar(iterable, total, desc, enabled):
    """transformers' progress bar (``disable_progress_bar()`` hides it), or none when not ``enabled``."""
    return log.progress(iterable, total=total, desc=desc) if enabled else iterable


def _device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


@torch.inference_mode()
def perplexity(model, windows: torch.Tensor, reference=None, dist: Optional[Dist] = None,
               progress: bool = True, desc: str = "perplexity") -> PerplexityResult:
    """Perplexity of ``model`` on ``windows`` (from :func:`make_windows`); with ``reference``, also the
    top-1 next-token agreement with it. ``reference`` is a model (its perplexity is reported too) or the
    ``argmax`` tensor of an earlier result on the same windows. ``dist`` (default: :meth:`Dist.detect`)
    splits the windows between ranks; every rank returns the same, complete result, including ``argmax``."""
    dist = dist or Dist.detect()
    n, length = windows.shape
    mine = dist.split(list(range(n)))
    # per window: nll sum, predicted tokens, agreeing positions, reference nll sum
    stats = torch.zeros(4, n, dtype=torch.float64)
    top = torch.zeros(n, length - 1, dtype=torch.int64)
    ref_top = reference if isinstance(reference, torch.Tensor) else None
    if ref_top is not None and tuple(ref_top.shape) != (n, length - 1):
        raise ValueError(f"reference argmax has shape {tuple(ref_top.shape)}, expected {(n, length - 1)}")
    ref_model = reference if isinstance(reference, torch.nn.Module) else None
    dev = _device_of(model)
    rdev = _device_of(ref_model) if ref_model is not None else None
    desc = desc + (f" [rank {dist.rank}/{dist.world}]" if dist.world > 1 else "")
    for i in progress_bar(mine, len(mine), desc, progress and (dist.main or dist.world == 1)):
        ids = windows[i: i + 1]
        target = ids[0, 1:]
        logits = model(input_ids=ids.to(dev)).logits[0, :-1].float().cpu()
        nll = torch.nn.functional.cross_entropy(logits, target, reduction="none").double()
        stats[0, i] = math.fsum(nll.tolist())
        stats[1, i] = target.numel()
        top[i] = logits.argmax(-1)
        if ref_top is not None:
            stats[2, i] = (top[i] == ref_top[i]).sum().item()
        elif ref_model is not None:
            rlogits = ref_model(input_ids=ids.to(rdev)).logits[0, :-1].float().cpu()
            stats[2, i] = (top[i] == rlogits.argmax(-1)).sum().item()
            rnll = torch.nn.functional.cross_entropy(rlogits, target, reduction="none").double()
            stats[3, i] = math.fsum(rnll.tolist())
    dist.all_reduce_sum(stats)
    dist.all_reduce_sum(top)
    tokens = int(stats[1].sum().item())
    nll = math.fsum(stats[0].tolist()) / tokens
    res = PerplexityResult(ppl=math.exp(nll), nll=nll, tokens=tokens, windows=n, window=length, world=dist.world,
                           per_window_nll=stats[0].tolist(), argmax=top)
    if reference is not None:
        res.top1 = math.fsum(stats[2].tolist()) / tokens
    if ref_model is not None:
        res.ref_ppl = math.exp(math.fsum(stats[3].tolist()) / tokens)
    return res


@dataclass
class DecodeResult:
    text: str                # the greedy answer, cut at the first EOS
    new_tokens: int          # tokens generated (fixed count, EOS is not a stop for timing)
    prefill_s: float         # prompt forward
    decode_s: float          # the new_tokens - 1 cached single-token steps, in total
    tok_per_s: float         # median over the repeats of 1 / median step time (robust to a busy machine)
    mean_tok_per_s: float    # (new_tokens - 1) / decode_s, in the repeat that gave the median
    prompt_tokens: int
    tok_per_s_min: float = 0.0   # the spread of tok_per_s over the repeats
    tok_per_s_max: float = 0.0
    repeats: int = 1

    def to_dict(self) -> Dict:
        return dataclasses.asdict(self)


def encode_prompt(tokenizer, prompt: str = DEFAULT_PROMPT, chat: bool = True) -> torch.Tensor:
    """``[1, T]`` ids; through the chat template when the tokenizer has one and ``chat``."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = torch.as_tensor(ids, dtype=torch.long)
    else:
        ids = torch.tensor(tokenizer(prompt)["input_ids"], dtype=torch.long)
    return ids.view(1, -1)


@torch.inference_mode()
def decode(model, tokenizer, prompt: str = DEFAULT_PROMPT, new_tokens: int = 32, chat: bool = True,
           warmup: bool = True, repeats: int = 3) -> DecodeResult:
    """Greedy decoding with the KV cache, timed: one prompt forward, then ``new_tokens - 1`` single-token
    steps, ``repeats`` times. The count is fixed (EOS does not stop the loop), so tokens/s compare across models.
    Per repeat, tokens/s is 1 / the median step time (a shared machine's stalls do not skew it); ``tok_per_s`` is
    the median over the repeats and ``tok_per_s_min`` / ``tok_per_s_max`` their spread (one run can be 2x off on a
    busy machine); ``mean_tok_per_s`` is steps / total time. A 3-token warm-up run comes first."""
    if new_tokens < 2:
        raise ValueError("new_tokens must be >= 2 to time decoding")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    dev = _device_of(model)
    ids = encode_prompt(tokenizer, prompt, chat).to(dev)
    # a GPU runs ahead of the host: wait for it at each clock reading, so a step's time is its own
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def run(steps):
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t1 = time.perf_counter()
        past, toks, steps_s = out.past_key_values, [nxt], []
        for _ in range(steps - 1):
            ts = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(nxt)
            sync()
            steps_s.append(time.perf_counter() - ts)
        t2 = time.perf_counter()
        return torch.cat(toks, 1)[0].tolist(), t1 - t0, t2 - t1, steps_s

    if warmup:
        run(3)
    runs = []
    for _ in range(repeats):
        toks, pre, dec, steps_s = run(new_tokens)
        med = statistics.median(steps_s)
        runs.append((1.0 / med if med > 0 else float("inf"), pre, dec))
    speeds = sorted(r[0] for r in runs)
    tok_per_s, pre, dec = sorted(runs)[(len(runs) - 1) // 2]     # the median run (the lower one of an even count)
    eos = getattr(tokenizer, "eos_token_id", None)
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    cut = next((i for i, t in enumerate(toks) if t in eos), len(toks))
    text = tokenizer.decode(toks[:cut], skip_special_tokens=True)
    return DecodeResult(text=text.strip(), new_tokens=new_tokens, prefill_s=pre, decode_s=dec,
                        tok_per_s=tok_per_s, mean_tok_per_s=(new_tokens - 1) / dec if dec > 0 else float("inf"),
                        prompt_tokens=ids.shape[1], tok_per_s_min=speeds[0], tok_per_s_max=speeds[-1],
                        repeats=repeats)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``getrusage``; Linux reports KiB)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def model_bytes(model) -> Dict[str, int]:
    """Memory of a loaded model: ``total`` (parameters + buffers: transformers' ``get_memory_footprint``), and for
    hf_w4 ``QuantLinear`` layers ``packed`` (what they hold) vs ``dense`` (the same layers as bf16 Linear weights)."""
    total = int(model.get_memory_footprint(return_buffers=True))
    packed = dense = layers = 0
    for r in layer_table(model):
        packed += int(r["packed_bytes"])
        dense += int(r["dense_bytes"])
        layers += 1
    return {"total": total, "packed": packed, "dense": dense, "quantized_layers": layers}
