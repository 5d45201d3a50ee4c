"""Which Linear modules a write quantizes, and how: the options checked against the format's table entry, then one
plan per module (its spec, RTN kind and group size, or why it stays dense)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch
from torch import nn

from ...formats.spec import W4Spec, matches
from .formats import GPTQ_CHECKPOINT_FORMATS, FORMATS, Format, WriterError


@dataclass
class Plan:
    name: str
    n: int
    k: int
    spec: Optional[W4Spec]          # None = dense
    kind: str = ""
    group_size: int = -1
    sym: bool = True
    zero_min: int = 0
    reason: str = ""
    in_block: bool = True


def check_options(f: Format, group_size, sym, quantize_lm_head, sym_scale, **own) -> dict:
    """The write's options, checked against what format ``f`` takes; ``own``: the format-specific options
    (desc_act, checkpoint_format, extra_config, hf_quant_config_only), falsy when not given."""
    gs = norm_group(group_size) if f.group_size is None else f.group_size
    if gs == -1 and not f.per_channel:
        raise WriterError(f"{f.name}: group_size={group_size} (per channel) is not supported by the AWQ GEMM layout; "
                          "supported: a positive group size such as 32, 64 or 128")
    if not sym and not f.asym:
        raise WriterError(f"{f.name}: sym=False is not supported; {f.name} weights are symmetric only (supported: "
                          "sym=True)")
    for opt, given in own.items():
        if given not in (None, False) and given != {} and opt not in f.options:
            takes = [n for n, g in FORMATS.items() if opt in g.options]
            raise WriterError(f"{f.name}: {opt} is not an option of this format; supported formats: {takes}")
    cf = own.get("checkpoint_format")
    if cf is not None and cf not in GPTQ_CHECKPOINT_FORMATS:
        raise WriterError(f"{f.name}: checkpoint_format={cf!r} is not supported; "
                          f"supported: None, {sorted(GPTQ_CHECKPOINT_FORMATS)}")
    if quantize_lm_head and not f.lm_head:
        raise WriterError(f"{f.name}: quantize_lm_head=True is not supported (the producer keeps lm_head dense); "
                          f"supported: {[n for n, g in FORMATS.items() if g.lm_head]}")
    if sym_scale is not None and sym_scale not in ("amax7", "signed"):
        raise WriterError(f"sym_scale={sym_scale!r} is not supported; supported: 'amax7', 'signed'")
    if sym_scale is not None and f.sym_scale is None:
        raise WriterError(f"{f.name}: sym_scale applies to {[n for n, g in FORMATS.items() if g.sym_scale]} only")
    return dict(group_size=gs, sym=bool(sym), quantize_lm_head=bool(quantize_lm_head),
                sym_scale=sym_scale or f.sym_scale or "amax7", desc_act=bool(own.get("desc_act")),
                checkpoint_format=cf, extra_config=dict(own.get("extra_config") or {}),
                hf_quant_config_only=bool(own.get("hf_quant_config_only")))



def check_ignore(ignore: Sequence[str], names: Sequence[str], lm_name: str, quantize_lm_head: bool) -> None:
    """A pattern that matches nothing is almost always a typo (``down_porj``) that would silently quantize
    the module the user wanted dense; ignoring lm_head while asking to quantize it is a contradiction."""
    unmatched = [p for p in ignore if not any(matches(p, n) for n in names)]
    if unmatched:
        eg = names[:3] + names[-2:] if len(names) > 5 else list(names)
        raise WriterError(f"ignore pattern(s) {unmatched} match no Linear module; modules are named like {eg} "
                          "(a pattern is a full name, a dotted suffix such as 'mlp.down_proj', a glob, or a regex "
                          "with the 're:' prefix)")
    if quantize_lm_head:
        hit = [p for p in ignore if matches(p, lm_name)]
        if hit:
            raise WriterError(f"quantize_lm_head=True (--lm-head) and ignore pattern(s) {hit} both name {lm_name}; "
                              "drop one of them")


def norm_group(group_size) -> int:
    if group_size in (None, 0, -1):
        return -1
    g = int(group_size)
    if g <= 0:
        raise WriterError(f"group_size={group_size} is invalid; supported: a positive group size or -1/None "
                          "(one group per output channel)")
    return g


def find_blocks(model: nn.Module, linears: Sequence[str]) -> Optional[str]:
    """Name of the ModuleList holding the decoder layers (the one with the most Linear descendants)."""
    best, count = None, 0
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and name:
            c = sum(1 for l in linears if l.startswith(name + "."))
            if c > count:
                best, count = name, c
    return best


def _layout_problem(layout: str, n: int, k: int, gs: int, sym: bool) -> Optional[str]:
    """Why this module cannot be written in ``layout`` (None if it can)."""
    if layout in ("ct_nvfp4", "modelopt_nvfp4"):
        return None if k % 16 == 0 else "NVFP4 needs K divisible by 16"
    g = k if gs == -1 else gs
    probs = []
    if k % g:
        probs.append(f"K is not divisible by group_size={gs}")
    if layout == "gptq" and (k % 8 or n % 8):
        probs.append("GPTQ packing needs N and K divisible by 8")
    if layout == "awq" and n % 8:
        probs.append("AWQ packing needs N divisible by 8")
    if layout == "ct_pack" and (k % 8 or (not sym and n % 8)):
        probs.append("pack-quantized needs K (and N when asymmetric) divisible by 8")
    return "; ".join(probs) or None


def _supported_groups(f: Format, k: int) -> str:
    fits = [g for g in (32, 64, 128, 256) if k % g == 0]
    if f.per_channel:
        fits.append(-1)
    return f"group sizes that fit K={k}: {fits}" if fits else f"no group size in [32, 64, 128, 256] divides K={k}"


def plan_modules(f: Format, opts: dict, linears, lm_name: str, blocks: Sequence[str], ignore: Sequence[str],
                 skip_incompatible: bool) -> Dict[str, Plan]:
    """module name -> Plan for every Linear (``linears``: (name, module) pairs)."""
    plans: Dict[str, Plan] = {}
    extra = opts["extra_config"]
    for name, m in linears:
        n, k = m.out_features, m.in_features
        p = Plan(name, n, k, None)
        plans[name] = p
        p.in_block = not blocks or any(name.startswith(b + ".") for b in blocks)
        if name == lm_name:
            if not opts["quantize_lm_head"]:
                continue
        elif any(matches(pat, name) for pat in ignore):
            p.reason = "ignored"
            continue
        elif f.blocks_only and not p.in_block:
            p.reason = f"outside the quantized blocks {list(blocks)}"
            continue
        gs, sym = opts["group_size"], opts["sym"]
        over = next((v for key, v in extra.items() if matches(key, name)), None)
        if over is not None:
            bits = over.get("bits", 4)
            if bits is None or bits >= 16 or over.get("data_type") in ("float", "fp"):
                p.reason = "extra_config: kept at 16 bits"
                continue
            if bits != 4:
                raise WriterError(f"{f.name}: extra_config[{name!r}] bits={bits} is not supported; supported: 4 or 16")
            gs = norm_group(over.get("group_size", gs))
            sym = bool(over.get("sym", sym))
            if gs == -1 and not f.per_channel:
                raise WriterError(f"{f.name}: extra_config[{name!r}] group_size=-1 is not supported by the AWQ layout")
        spec = f.spec(gs, sym, opts)
        problem = _layout_problem(spec.layout, n, k, gs, sym)
        if problem:
            msg = (f"{f.name}: {name} (Linear out_features N={n}, in_features K={k}, weight [{n}, {k}]): {problem}; "
                   f"supported: {_supported_groups(f, k) if 'group_size' in problem else 'N, K multiples of 8/16'}"
                   ", or pass skip_incompatible=True (hf-w4 convert --skip-incompatible) to leave such modules "
                   "dense")
            if not skip_incompatible:
                raise WriterError(msg)
            p.reason = f"incompatible shape: {problem}"
            continue
        p.spec, p.kind, p.group_size, p.sym = spec, f.kind, gs, sym
        p.zero_min = 1 if spec.zero_plus_one else 0   # GPTQ v1 stores zero - 1: it must not wrap
    return plans


def measure_input_amax(model: nn.Module, plans: Dict[str, Plan], given, seed: int) -> Dict[str, float]:
    """Per quantized module, the activation amax its static input_scale is made from."""
    names = [p.name for p in plans.values() if p.spec is not None]
    if given is not None:
        if isinstance(given, dict):
            missing = [n for n in names if n not in given]
            if missing:
                raise WriterError(f"modelopt-nvfp4: input_amax has no value for {missing[:3]} ...")
            return {n: float(given[n]) for n in names}
        return {n: float(given) for n in names}
    # calibration-free stand-in: max |x| seen by each Linear on one forward of seeded random tokens
    amax = {n: 0.0 for n in names}
    mods = dict(model.named_modules())
    hooks = []
    for n in names:
        def hook(_m, inp, _out, n=n):
            amax[n] = max(amax[n], float(inp[0].detach().abs().max()))
        hooks.append(mods[n].register_forward_hook(hook))
    try:
        vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 0)
        dev = next(model.parameters()).device
        ids = torch.randint(0, max(vocab, 2), (1, 32), generator=torch.Generator().manual_seed(seed)).to(dev)
        was = model.training
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)
        model.train(was)
    except Exception:  # noqa: BLE001 - an exotic forward: fall back to a constant
        amax = {n: 0.0 for n in names}
    finally:
        for h in hooks:
            h.remove()
    return {n: (v if v > 0 else 1.0) for n, v in amax.items()}
