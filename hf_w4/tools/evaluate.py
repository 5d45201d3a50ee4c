"""Model evaluation: perplexity, top-1 agreement with a dense reference, greedy decode speed, peak RSS.

Perplexity method (fixed, so numbers are comparable between formats and runs):

* the text (a file, or the default corpus: every topic of the standard library's ``pydoc_data.topics``
  joined in sorted order, 113 k SmolLM2 tokens, nothing to install) is tokenized once *without* special
  tokens and its first ``max_tokens`` tokens are cut into non-overlapping windows of ``window`` tokens
  (a trailing partial window is dropped);
* if the model needs a BOS token (the tokenizer has one and adds it by default, or the model is a Gemma),
  each window is ``BOS + window-1`` text tokens;
* every window is one forward pass with batch size 1; the loss is the mean NLL of all predicted tokens
  (``window - 1`` per window) and perplexity = ``exp(mean NLL)``.

Data parallel: under ``accelerate launch`` (or any initialized ``torch.distributed`` group) the windows are
dealt round-robin to the ranks, per-window sums are combined with an all-reduce over a zero-filled
per-window vector (adding exact zeros), and the totals are summed in window order on every rank; the result
is the same as the single-process run (bit for bit once ``HF_W4_LARGE_PATH`` fixes cpu_w4a16's large-M path, which
each process otherwise times for itself; see README).
"""
from __future__ import annotations

import dataclasses
import gc
import math
import os
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import torch

from ..integration import enabled
from ..loading.config import activation_config, checkpoint_quant_method
from ..nn import QuantLinear
from ..report import layer_table
from . import models, writers

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
DEFAULT_WINDOW = 512
DEFAULT_MAX_TOKENS = 4096
BOS_MODEL_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")


# --------------------------------------------------------------------------------------------- text
def default_text() -> str:
    """The default corpus: ``pydoc_data.topics`` (CPython's language reference topics, PSF license)."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def read_text(path: Optional[Union[str, os.PathLike]] = None) -> str:
    if path is None:
        return default_text()
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def needs_bos(tokenizer, config=None) -> bool:
    """True when the tokenizer has a BOS token and the model expects it at the start of a sequence: the
    tokenizer adds it by default (Llama-2/3, Gemma tokenizers do; SmolLM2's does not), or the model type
    is known to need it (Gemma)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    if config is not None and getattr(config, "model_type", None) in BOS_MODEL_TYPES:
        return True
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def make_windows(tokenizer, text: str, window: int = DEFAULT_WINDOW, max_tokens: Optional[int] = DEFAULT_MAX_TOKENS,
                 bos: Union[str, bool] = "auto", config=None) -> torch.Tensor:
    """``[n_windows, window]`` int64 token ids as described in the module docstring.

    ``max_tokens`` caps the number of text tokens used (None = all). If fewer tokens than one window are
    available, a single shorter window is returned.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    if max_tokens is not None and max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0 (or None for all), got {max_tokens}")
    use_bos = needs_bos(tokenizer, config) if bos == "auto" else bool(bos)
    if use_bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise ValueError("BOS requested (--bos yes) but the tokenizer has no bos_token; use --bos auto or no")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    per = window - 1 if use_bos else window
    n = len(ids) // per
    if n == 0:
        per, n = len(ids), 1
        if per < (1 if use_bos else 2):
            raise ValueError(f"text too short for perplexity: {len(ids)} tokens")
    t = torch.tensor(ids[: n * per], dtype=torch.long).view(n, per)
    if use_bos:
        t = torch.cat([torch.full((n, 1), tokenizer.bos_token_id, dtype=torch.long), t], dim=1)
    n_ctx = getattr(config, "max_position_embeddings", None)
    if isinstance(n_ctx, int) and t.shape[1] > n_ctx:
        raise ValueError(f"window of {t.shape[1]} tokens is longer than the model's context of {n_ctx} tokens "
                         f"(config max_position_embeddings); use --window {n_ctx} or less")
    return t


# --------------------------------------------------------------------------------------------- data parallel
class Dist:
    """Rank/world of this process and the two collectives the evaluation needs (no-ops for one process)."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    @classmethod
    def detect(cls) -> "Dist":
        """The current process group; under ``accelerate launch`` (``WORLD_SIZE`` > 1) it is initialized
        through ``accelerate.PartialState(cpu=True)`` (gloo on CPU)."""
        import torch.distributed as td
        if not td.is_available():
            return cls()
        if not td.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from accelerate import PartialState
            PartialState(cpu=not torch.cuda.is_available())
        if td.is_initialized():
            return cls(td.get_rank(), td.get_world_size())
        return cls()

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as td
            td.all_reduce(t, op=td.ReduceOp.SUM)
        return t

    def per_rank(self, value: float) -> List[float]:
        """Every rank's ``value`` (as a list indexed by rank), on every rank."""
        t = torch.zeros(self.world, dtype=torch.float64)
        t[self.rank] = float(value)
        return self.all_reduce_sum(t).tolist()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as td
            td.barrier()

    def close(self) -> None:
        """Destroys the process group (after a barrier). Left for interpreter exit, gloo's teardown sometimes
        aborted a rank after its work was done ("terminate called without an active exception", exit -6)."""
        import torch.distributed as td
        if self.world > 1 and td.is_available() and td.is_initialized():
            td.barrier()
            td.destroy_process_group()

    def __repr__(self) -> str:
        return f"Dist(rank={self.rank}, world={self.world})"


# --------------------------------------------------------------------------------------------- perplexity
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



def _progress(iterable, total, desc, enabled):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr)


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
    mine = list(range(dist.rank, n, dist.world))
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
    for i in _progress(mine, len(mine), desc, progress and (dist.main or dist.world == 1)):
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


# --------------------------------------------------------------------------------------------- decoding
@dataclass
class DecodeResult:
    text: str                # the greedy answer, cut at the first EOS
    new_tokens: int          # tokens generated (fixed count, EOS is not a stop for timing)
    prefill_s: float         # prompt forward
    decode_s: float          # the new_tokens - 1 cached single-token steps, in total
    tok_per_s: float         # 1 / median step time (robust to a busy machine)
    mean_tok_per_s: float    # (new_tokens - 1) / decode_s
    prompt_tokens: int

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
           warmup: bool = True) -> DecodeResult:
    """Greedy decoding with the KV cache, timed: one prompt forward, then ``new_tokens - 1`` single-token
    steps. The count is fixed (EOS does not stop the loop), so tokens/s compare across models.
    ``tok_per_s`` is 1 / the median step time (a shared machine's stalls do not skew it);
    ``mean_tok_per_s`` is steps / total time. A 3-token warm-up run comes first."""
    if new_tokens < 2:
        raise ValueError("new_tokens must be >= 2 to time decoding")
    dev = _device_of(model)
    ids = encode_prompt(tokenizer, prompt, chat).to(dev)

    def run(steps):
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t1 = time.perf_counter()
        past, toks, steps_s = out.past_key_values, [nxt], []
        for _ in range(steps - 1):
            ts = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(nxt)
            steps_s.append(time.perf_counter() - ts)
        t2 = time.perf_counter()
        return torch.cat(toks, 1)[0].tolist(), t1 - t0, t2 - t1, steps_s

    if warmup:
        run(3)
    toks, pre, dec, steps_s = run(new_tokens)
    med = statistics.median(steps_s)
    eos = getattr(tokenizer, "eos_token_id", None)
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    cut = next((i for i, t in enumerate(toks) if t in eos), len(toks))
    text = tokenizer.decode(toks[:cut], skip_special_tokens=True)
    return DecodeResult(text=text.strip(), new_tokens=new_tokens, prefill_s=pre, decode_s=dec,
                        tok_per_s=1.0 / med if med > 0 else float("inf"),
                        mean_tok_per_s=(new_tokens - 1) / dec if dec > 0 else float("inf"),
                        prompt_tokens=ids.shape[1])


# --------------------------------------------------------------------------------------------- memory
def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``getrusage``; Linux reports KiB)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def model_bytes(model) -> Dict[str, int]:
    """Memory of a loaded model: ``total`` (parameters + buffers), and for hf_w4 ``QuantLinear`` layers
    ``packed`` (what they hold) vs ``dense`` (the same layers as bf16 Linear weights)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or t.device.type == "meta":
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    packed = dense = layers = 0
    for r in layer_table(model):
        packed += int(r["packed_bytes"])
        dense += int(r["dense_bytes"])
        layers += 1
    return {"total": total, "packed": packed, "dense": dense, "quantized_layers": layers}


# --------------------------------------------------------------------------------------------- loading
def load_model(path, dtype: torch.dtype = torch.bfloat16, activation: str = "auto", **kwargs):
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` with hf_w4 enabled (quantized
    checkpoints go through hf_w4, dense ones load as usual), in eval mode. ``activation`` other than ``"auto"``
    (the checkpoint's own scheme) loads a quantized checkpoint with its family's hf_w4 config class and that
    activation mode (:func:`activation_config`), e.g. ``"int8"``: a 4-bit checkpoint runs as W4A8."""
    from transformers import AutoModelForCausalLM
    with enabled(), warnings.catch_warnings():
        if activation != "auto":
            kwargs["quantization_config"] = activation_config(path, activation)
            # transformers' notice that the passed config's loading attributes (here: activation) replace the
            # checkpoint's: that is the point
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
    return model.eval()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def has_tokenizer(path) -> bool:
    return any(os.path.isfile(os.path.join(str(path), f)) for f in TOKENIZER_FILES)


def load_tokenizer(path):
    from transformers import AutoTokenizer
    if os.path.isdir(str(path)) and not has_tokenizer(path):
        raise FileNotFoundError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...), e.g. a "
                                "checkpoint saved from a model object; pass the tokenizer of the model it was made "
                                "from (hf-w4 eval --tokenizer PATH)")
    return AutoTokenizer.from_pretrained(str(path))


def quant_format(model) -> str:
    """``quant_method`` of a loaded model's checkpoint ("dense" if none), with its format variant."""
    q = getattr(model.config, "quantization_config", None)
    if q is None:
        return "dense"
    d = q if isinstance(q, dict) else (q.to_dict() if hasattr(q, "to_dict") else vars(q))
    m = d.get("quant_method", "?")
    m = getattr(m, "value", m)
    fmt = d.get("format") or d.get("packing_format") or d.get("version") or d.get("quant_algo")
    label = f"{m}:{fmt}" if fmt and isinstance(fmt, str) else str(m)
    if m == "compressed-tensors":     # the same format name holds W8A8 and W4A8: add the bits of each scheme
        schemes = sorted({_ct_scheme(g) for g in (d.get("config_groups") or {}).values() if isinstance(g, dict)})
        if schemes:
            label += " " + "+".join(schemes)
    return label


def _ct_scheme(group: Dict) -> str:
    """``W4A16``, ``W8A8``, ``W4A8``, ... of one compressed-tensors config group (no input_activations: A16)."""
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    return f"W{w.get('num_bits', '?')}A{a.get('num_bits', 16)}"


# what ran: the QuantLinear spec's activation scheme (``W4Spec.act``)
ACTIVATION_TEXT = {"none": "weight-only, float activations", "int8_token": "dynamic int8, per token",
                   "int8_group": "dynamic int8, per token and weight group"}


def activation_used(model) -> Optional[str]:
    """The activation scheme the quantized layers run (``"none"``, ``"int8_token"``, ``"int8_group"``; several
    joined by ``+``), None for a model without hf_w4 layers."""
    acts = sorted({m.spec.act for m in model.modules() if isinstance(m, QuantLinear)})
    return "+".join(acts) or None


def kernels_used(model) -> Dict[str, int]:
    """kernel name -> number of quantized layers running on it (empty for a dense model)."""
    out: Dict[str, int] = {}
    for r in layer_table(model):
        out[r["kernel"]] = out.get(r["kernel"], 0) + 1
    return out


# --------------------------------------------------------------------------------------------- one model
def evaluate(path, text: Optional[str] = None, max_tokens: Optional[int] = DEFAULT_MAX_TOKENS,
             window: int = DEFAULT_WINDOW, reference=None, dtype: torch.dtype = torch.bfloat16,
             decode_tokens: int = 32, prompt: str = DEFAULT_PROMPT, bos: Union[str, bool] = "auto",
             dist: Optional[Dist] = None, progress: bool = True, model=None, tokenizer=None,
             activation: str = "auto") -> Dict:
    """Evaluate one checkpoint; returns a JSON-able dict (the ``hf-w4 eval`` output).

    ``text``: a string (None = default corpus). ``reference``: a dense checkpoint path (or a loaded model)
    for top-1 agreement. ``tokenizer``: a loaded tokenizer instead of the checkpoint's own (which a checkpoint
    saved from a model object does not have). ``activation``: ``"auto"`` (the checkpoint's own scheme) or an
    activation mode to load the quantized checkpoint with (:func:`load_model`); the result's ``activation`` is
    the scheme its layers ran. Decoding speed is measured on rank 0 only, after the perplexity pass, while the
    other ranks wait, so it is not disturbed by them. ``peak_rss_bytes`` (the maximum over the ranks) is sampled
    after the checkpoint's own perplexity and decoding, before the reference is loaded: the reference then runs
    alone on the same windows against the checkpoint's argmax.
    """
    if decode_tokens and decode_tokens < 2:
        raise ValueError(f"decode_tokens must be 0 (skip decoding) or >= 2, got {decode_tokens}")
    dist = dist or Dist.detect()
    t0 = time.perf_counter()
    model = model if model is not None else load_model(path, dtype, activation)
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
           "dtype": str(dtype).replace("torch.", ""), "load_s": load_s, "world": dist.world,
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
                   prefill_s=dec.prefill_s,
                   decode_tokens=dec.new_tokens)
    rss = dist.per_rank(peak_rss_bytes())      # the checkpoint's own run, without the reference
    out["peak_rss_bytes"] = int(max(rss))
    out["peak_rss_bytes_per_rank"] = [int(r) for r in rss]
    out["threads"] = torch.get_num_threads()
    if reference is not None:
        model = None                           # ours, if loaded here: freed before the reference comes in
        gc.collect()
        ref_model = reference if isinstance(reference, torch.nn.Module) else load_model(reference, dtype)
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
             f"{r['window']}{', BOS' if r['bos'] else ''}; {r['world']} process(es))"]
    if r.get("activation"):
        req = r.get("activation_requested") or "auto"
        why = "the checkpoint's own scheme" if req == "auto" else f"requested: {req}"
        text = ACTIVATION_TEXT.get(r["activation"], r["activation"])
        lines.insert(2, f"activation   {r['activation']} ({text}; {why})")
    if r.get("top1_agreement") is not None:
        lines.append(f"top-1        {100 * r['top1_agreement']:.2f} % agreement with {r['reference']} "
                     f"(reference perplexity {r['reference_perplexity']:.4f})")
    if r.get("decode_tok_per_s") is not None:
        lines.append(f"decode       {r['decode_tok_per_s']:.1f} tokens/s ({r['decode_tokens']} greedy tokens, "
                     f"{r['threads']} threads, prefill {r['prefill_s'] * 1000:.0f} ms)")
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
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- demo
DEMO_GROUP_SIZE = 64       # SmolLM2's K = 576 is not a multiple of 128; 64 and 32 fit every projection
# 4-bit integer weight formats, which the cpu_int8 kernel also runs with dynamic int8 activations (W4A8); the NVFP4
# formats have no int8 kernel (they would fall back to the slow reference kernel)
W4A8_FORMATS = ("gptq", "autoround", "autoround-awq", "awq", "ct-w4a16")


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
             w4a8: Optional[Sequence[str]] = None) -> List[Dict]:
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

    Usage errors (an unknown format, a bad group size or count, a quantized source model) raise ValueError before
    anything is measured.
    """
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
        dense = load_model(src, dtype) if dtype != torch.float32 else source
        windows = make_windows(tok, text if text is not None else default_text(), window, ppl_tokens, "auto",
                               dense.config)
        log(f"dense {str(dtype).replace('torch.', '')}: {src} ({windows.shape[0]} x {windows.shape[1]}-token "
            f"windows, {decode_tokens} decode tokens, {torch.get_num_threads()} threads)")
        ref = perplexity(dense, windows, None, dist, progress)
        dec = decode(dense, tok, prompt, decode_tokens)
        nbytes = model_bytes(dense)
        lin = _linear_bytes(dense)
        base = {"format": f"dense {str(dtype).replace('torch.', '')}", "status": "ok", "reason": "",
                "kernel": "torch (dense)", "kernels": {}, "activation": None, "packed_bytes": lin,
                "dense_bytes": lin, "weights_bytes": nbytes["total"], "perplexity": ref.ppl, "ppl_ratio": 1.0,
                "top1": 1.0, "tok_per_s": dec.tok_per_s, "speedup": 1.0, "answer": dec.text, "write_s": 0.0,
                "load_s": 0.0, "ppl_s": None, "decode_s": None}
        rows.append(base)
        del dense

        def new_row(name, activation):
            row = {"format": name, "status": "ok", "reason": "", "kernel": "", "kernels": {},
                   "activation": activation, "packed_bytes": None, "dense_bytes": None, "weights_bytes": None,
                   "perplexity": None, "ppl_ratio": None, "top1": None, "tok_per_s": None, "speedup": None,
                   "answer": "", "write_s": None, "load_s": None, "ppl_s": None, "decode_s": None}
            rows.append(row)
            return row

        def measure(row, path, note):
            try:
                t0 = time.perf_counter()
                model = load_model(path, dtype, row["activation"])
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
                       tok_per_s=d.tok_per_s, speedup=d.tok_per_s / base["tok_per_s"], answer=d.text, reason=note)
            log(f"{row['format']}: ppl {p.ppl:.3f} ({row['ppl_ratio']:.3f}x), {d.tok_per_s:.1f} tok/s, "
                f"kernel {row['kernel']} (" + (f"write {row['write_s']:.1f} s, " if row["write_s"] else "")
                + f"load {row['load_s']:.1f} s, perplexity {row['ppl_s']:.1f} s, decode {row['decode_s']:.1f} s)")

        it = _progress(formats, len(formats), "demo formats", progress)
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
    head = ["format", "kernel", "memory packed / dense (MiB)", "perplexity (x dense)", "top-1 vs dense",
            "decode tok/s (x dense)", "note"]
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append([r["format"], "-", "-", "-", "-", "-", f"{r['status']}: {r['reason']}"])
            continue
        mem = f"{r['packed_bytes'] * mib:.1f} / {r['dense_bytes'] * mib:.1f}" if r["dense_bytes"] else "-"
        body.append([r["format"], r["kernel"], mem, f"{r['perplexity']:.3f} ({r['ppl_ratio']:.3f}x)",
                     f"{100 * r['top1']:.1f} %", f"{r['tok_per_s']:.1f} ({r['speedup']:.2f}x)", r["reason"]])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    lines = [fmt(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(b) for b in body]
    return "\n".join(lines)


def format_demo_answers(rows: List[Dict], prompt: str = DEFAULT_PROMPT) -> str:
    lines = [f"prompt: {prompt!r}"]
    w = max([16] + [len(r["format"]) for r in rows if r["status"] == "ok"])
    for r in rows:
        if r["status"] == "ok":
            lines.append(f"  {r['format']:<{w}} {r['answer']!r}")
    return "\n".join(lines)
