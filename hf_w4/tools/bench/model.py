"""Whole-model greedy decode: dense bf16 against the same model written as int4 (GPTQ) and NVFP4 (ModelOpt)
checkpoints and loaded through ``from_pretrained``, so every quantized projection is a real ``QuantLinear``."""
from __future__ import annotations

import statistics
import tempfile
import time
from typing import Optional

import torch

from ... import integration
from ...log import hidden_progress_bars
from .. import writers

def bench_model(layers=2, tokens=32, prompt=8, group_size=128, rounds=5, log=print, hidden=4096,
                intermediate=11008):
    """Greedy decode of a Llama-shaped model (hidden 4096, random bf16 weights) against the same model loaded from
    GPTQ int4 and ModelOpt NVFP4 checkpoints."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    transformers.logging.set_verbosity_error()
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=2048, max_position_embeddings=512)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return _decode_rates(_with_quantized(model, group_size), torch.randint(0, cfg.vocab_size, (1, prompt)), tokens,
                         rounds, log)


def _with_quantized(model, group_size: int) -> dict:
    """{"bf16": model, "ours_int4": ..., "ours_nvfp4": ...}: the quantized ones written by the writers and loaded
    with from_pretrained (each format's writer defaults decide which layers are quantized)."""
    from transformers import AutoModelForCausalLM
    models = {"bf16": model}
    # the timing tables are the output: no writer / loading bars between their lines
    with tempfile.TemporaryDirectory() as d, integration.enabled(), hidden_progress_bars():
        for name, fmt in (("ours_int4", "gptq"), ("ours_nvfp4", "modelopt-nvfp4")):
            res = writers.write_checkpoint(model, f"{d}/{fmt}", fmt, group_size=group_size)
            models[name] = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16).eval()
    return models


def _decode_rates(models: dict, ids: torch.Tensor, tokens: int, rounds: int, log) -> dict:
    """Median greedy-decode tokens/s of each model (``bf16`` first: the others' ratios are to it), by the wall clock
    and by the calling thread's CPU time (on a shared host the latter leaves out the time other processes held its
    core, so its ratios move less from run to run)."""
    runs = {k: [] for k in models}
    cpu = {k: [] for k in models}
    with torch.inference_mode():
        for mdl in models.values():   # warm-up
            mdl.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        # rounds interleaved (dense, int4, nvfp4, dense, ...): the host's load drifts over a run, and a ratio of
        # medians from interleaved rounds is far steadier than one of back-to-back blocks
        for _ in range(rounds):
            for k, mdl in models.items():
                t0, c0 = time.perf_counter(), time.thread_time()
                mdl.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
                runs[k].append(tokens / (time.perf_counter() - t0))
                cpu[k].append(tokens / (time.thread_time() - c0))
        # then where each token's time goes, from runs of its own (hooks add a few microseconds per layer)
        splits = {k: [] for k in models}
        for _ in range(min(rounds, 3)):
            for k, mdl in models.items():
                splits[k].append(_time_split(mdl, ids, tokens))
        split = {k: tuple(statistics.median(part) for part in zip(*v)) for k, v in splits.items()}
    out = {k: statistics.median(v) for k, v in runs.items()}
    by_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    text = {k: _split_text(split[k], _linear_bytes(mdl)) for k, mdl in models.items()}
    log(f"  dense bf16: {out['bf16']:.2f} tok/s (thread CPU time: {by_cpu['bf16']:.2f} tok/s; {text['bf16']})")
    for k in [k for k in out if k != "bf16"]:
        # each round's ratio to the dense round beside it: how far a single round strays from the median
        per_round = [a / b for a, b in zip(runs[k], runs["bf16"])]
        log(f"  {k}: {out[k]:.2f} tok/s ({out[k] / out['bf16']:.2f}x dense bf16, rounds {min(per_round):.2f}-"
            f"{max(per_round):.2f}x; by thread CPU time {by_cpu[k]:.2f} tok/s, {by_cpu[k] / by_cpu['bf16']:.2f}x; "
            f"{text[k]})")
    return out


def _time_split(model, ids: torch.Tensor, tokens: int) -> tuple:
    """(ms per token inside linear layers, ms per token in everything else) of one greedy decode, timed with forward
    hooks on every ``nn.Linear`` / ``QuantLinear`` and every MoE experts module taken as a whole (its projections
    are not hooked: a hooked projection would take the experts off their one-call path): the part a 4-bit kernel
    can shrink, and the part every model shares (attention, norms, routing, sampling, Python)."""
    inside, start = [0.0], [0.0]

    def pre(mod, args):
        start[0] = time.perf_counter()

    def post(mod, args, out):
        inside[0] += time.perf_counter() - start[0]

    timed, _ = _timed_modules(model)
    hooks = [h for m in timed for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        total = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    return 1e3 * inside[0] / tokens, 1e3 * (total - inside[0]) / tokens


def _timed_modules(model) -> tuple:
    """(the modules _time_split hooks, the names of the MoE experts modules among them + "."): every ``nn.Linear`` /
    ``QuantLinear``, and every MoE experts module as a whole instead of its projections."""
    from ...loading.moe import UnfusedExperts, is_fused_experts
    from ...nn import QuantLinear
    timed, experts = [], ()
    for name, m in model.named_modules():
        if experts and name.startswith(experts):
            continue
        if isinstance(m, UnfusedExperts) or is_fused_experts(m):
            experts += (name + ".",)
            timed.append(m)
        elif isinstance(m, (torch.nn.Linear, QuantLinear)):
            timed.append(m)
    return timed, experts


def _linear_bytes(model) -> Optional[int]:
    """Bytes of weights the timed linear layers read per token (packed weights, scales, zero points and biases of
    every ``QuantLinear``, weight and bias of every ``nn.Linear``), or None for a model with routed experts, whose
    bytes per token depend on the routing."""
    from ...nn import QuantLinear
    timed, experts = _timed_modules(model)
    if experts:
        return None
    return sum(m.packed_bytes() if isinstance(m, QuantLinear) else
               sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in timed)


def _split_text(split: tuple, nbytes: Optional[int] = None) -> str:
    # the weight-read rate shows when a run's ratios moved because the machine's memory rate did
    rate = f" ({nbytes / split[0] / 1e6:.1f} GB/s of their weights)" if nbytes and split[0] > 0 else ""
    return f"linear layers {split[0]:.2f} ms/token{rate}, the rest {split[1]:.2f} ms/token"


MOE_SHAPE = dict(hidden_size=2048, moe_intermediate_size=768, num_experts_per_tok=8, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128)   # Qwen3-30B-A3B's layer widths


def bench_moe(layers=2, tokens=32, prompt=8, group_size=128, rounds=5, experts=32, log=print):
    """Greedy decode of a Qwen3-MoE-shaped model (random bf16 weights) against the same model loaded through the
    real path: written as GPTQ int4 and ModelOpt NVFP4 checkpoints (one Linear per expert, as the producers
    write), loaded with from_pretrained (experts unfused by hf_w4.loading.moe, each projection a QuantLinear; a
    decode step's routed experts run as one cpu_w4a16_moe call per layer, hf_w4.loading.moe_stack)."""
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    transformers.logging.set_verbosity_error()
    cfg = Qwen3MoeConfig(**MOE_SHAPE, num_experts=experts, num_hidden_layers=layers, vocab_size=2048,
                         intermediate_size=6144, max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, prompt))
    models = _with_quantized(model, group_size)
    return _decode_rates(models, ids, tokens, rounds, log)
