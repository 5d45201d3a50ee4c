"""A MoE layer's experts in one compiled call per step (``ops.cpu_w4a16_moe``) where they all run on cpu_w4a16.

At decode a Qwen3-MoE layer runs 8 small experts, three projections each: called one ``QuantLinear`` at a time,
the per-call costs (dispatch, argument checks, activation quantization, thread start, the act and the weighted sum
as separate torch ops) rivalled the weight stream. :func:`stack` gathers the layer's kernel buffers (``w4a16_qpack``,
``w4a16_scales``, ``w4a16_zs``) into per-layer tensors (gate and up of an expert next to each other, then the down
projections) and makes each expert's own buffers views into them: the packed weights are held once, and the
per-expert modules keep working unchanged (``state_dict`` / ``save_pretrained`` rebuild the checkpoint tensors from
those views, the per-expert forward reads them). Where the experts cannot run as one call (a projection that is not
a cpu_w4a16 ``QuantLinear``: dense, another kernel, LoRA-wrapped; offloaded, sharded for tensor parallelism, with
an act-order permutation, a bias or hooks; an activation other than silu; projections that differ in format), the
layer keeps the per-expert forward and :func:`stack` says why.

The stack stays valid as long as ``hf_w4.nn.layout_epoch()`` does (a kernel re-selected, a layer offloaded or moved,
a hook added) and the expert modules are the same (``hf_w4.loading.moe.Expert`` bumps the epoch when one is
swapped); then the layer checks again, re-using the stacked tensors where the experts still hold views of them.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from .. import ops
from ..kernels.cpu_w4a16 import CpuW4A16Kernel
from ..nn import QuantLinear

BUFFERS = ("w4a16_qpack", "w4a16_scales", "w4a16_zs")
# tokens per call up to which the layer takes the one call: above it each expert's rows make one gemm (per-call costs
# are spread over many rows) and the large-M paths (AMX tiles, dequantize + GEMM) apply
MAX_TOKENS = 16
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_silu(act) -> bool:
    """``act`` computes silu (``nn.SiLU``, transformers' ``SiLUActivation``, ``F.silu``) with its stock forward."""
    if act is torch.nn.functional.silu:
        return True
    if not isinstance(act, nn.Module) or "forward" in act.__dict__ or act._forward_hooks or act._forward_pre_hooks:
        return False
    if type(act) is nn.SiLU:
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return False
    return type(act) is SiLUActivation and type(act).forward is SiLUActivation.forward


class StackedExperts:
    """One layer's cpu_w4a16 expert buffers stacked (``gate_up``: [E, 2, ...], ``down``: [E, ...]); callable as the
    experts module: ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``."""

    def __init__(self, gate_up: Tuple[torch.Tensor, ...], down: Tuple[torch.Tensor, ...], global_scales: torch.Tensor,
                 intermediate: int, gate_up_group: int, down_group: int, weight_type: str):
        self.gate_up, self.down, self.global_scales = gate_up, down, global_scales
        self.intermediate, self.gate_up_group, self.down_group = intermediate, gate_up_group, down_group
        self.weight_type = weight_type

    def takes(self, x: torch.Tensor, weights: torch.Tensor) -> bool:
        """This call can run here: few tokens on the CPU, no gradient wanted (the per-expert ops have backwards)."""
        return (x.dim() == 2 and x.shape[0] <= MAX_TOKENS and x.device.type == "cpu" and weights.dtype in _WEIGHT_DTYPES
                and not (torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad)))

    def __call__(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.hf_w4.cpu_w4a16_moe(
            x, top_k_index, top_k_weights, *self.gate_up, *self.down, self.global_scales, self.intermediate,
            self.gate_up_group, self.down_group, self.weight_type, "silu", "")


def _problem(path: str, names, experts, act) -> Optional[str]:
    """Why the experts cannot run as one cpu_w4a16_moe call (None: they can)."""
    if not is_silu(act):
        return f"its activation is {type(act).__name__}, not silu"
    kinds = {}
    for e, ex in enumerate(experts):
        for j, name in enumerate(names):
            m, where = getattr(ex, name, None), f"{path}.{e}.{name}"
            if not isinstance(m, QuantLinear):
                return f"{where} is a {type(m).__name__} (not an hf_w4 QuantLinear: dense, or wrapped by an adapter)"
            if not isinstance(m.kernel, CpuW4A16Kernel):
                return f"{where} runs the {m.kernel} kernel"
            if m._offload_source is not None:
                return f"{where} is offloaded"
            if m.tp_shard is not None:
                return f"{where} holds a tensor-parallel slice"
            if m.bias is not None:
                return f"{where} has a bias"
            if m._buffers.get("w4a16_perm") is not None:
                return f"{where} has an act-order permutation"
            if m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ or hasattr(m, "_hf_hook"):
                return f"{where} has forward hooks, which one call would skip"
            q = m._buffers.get("w4a16_qpack")
            if q is None or q.device.type != "cpu":
                return f"{where} holds no CPU kernel buffers"
            kind = (m.kernel.weight_type, m.kernel.group_size, m._buffers["w4a16_zs"].numel() > 0, m.held_features)
            kinds.setdefault(0 if j < 2 else 1, set()).add(kind)
    gu, dn = kinds.get(0, set()), kinds.get(1, set())
    if len(gu) != 1 or len(dn) != 1 or len({k[0] for k in gu | dn}) != 1:
        return ("its expert projections differ in weight type, group size, zero points or shape: gate/up "
                f"{sorted(gu)}, down {sorted(dn)}")
    (_, _, _, (n_gu, k_gu)), = gu
    (_, _, _, (n_dn, k_dn)), = dn
    if (n_dn, k_dn) != (k_gu, n_gu):
        return f"its down projection is {n_dn}x{k_dn}, gate/up {n_gu}x{k_gu}"
    return None


def _stacked(mods: List[QuantLinear]) -> Tuple[torch.Tensor, ...]:
    """Per-layer tensors of these modules' kernel buffers (module i's at index i), one per name in ``BUFFERS``: the
    common base of their buffers where they are views of one already (a check after an unrelated change: nothing
    moves), else a new one, each module's buffer moved in as a view of it, one at a time (the old copy goes as its view
    comes: the packed weights are never held twice)."""
    out = []
    for b in BUFFERS:
        views = [m._buffers[b] for m in mods]
        base = views[0]._base
        if not (base is not None and base.shape == (len(mods),) + tuple(views[0].shape) and all(
                v._base is base and v.data_ptr() == base[i].data_ptr() for i, v in enumerate(views))):
            base = ops.empty_weight((len(mods),) + tuple(views[0].shape), views[0].dtype, views[0].device)
            del views
            for i, m in enumerate(mods):
                base[i].copy_(m._buffers[b])
                m._buffers[b] = base[i]
        out.append(base)
    return tuple(out)


def stack(path: str, names, experts: List[nn.Module], act) -> Tuple[Optional[StackedExperts], str]:
    """The experts' kernel buffers stacked per layer (each expert's own buffers become views of them), or (None, why
    they cannot run as one call)."""
    why = _problem(path, names, experts, act)
    if why:
        return None, why
    gate, up, down = names
    e = len(experts)
    # built outside inference mode, so that the per-expert path (whose ops save these for their backwards) can use
    # them later under autograd
    with torch.inference_mode(False), torch.no_grad():
        gate_up = tuple(t.view((e, 2) + tuple(t.shape[1:]))
                        for t in _stacked([getattr(ex, p) for ex in experts for p in (gate, up)]))
        down_t = _stacked([getattr(ex, down) for ex in experts])
        gscale = torch.tensor([[getattr(ex, p).kernel.global_scale for p in names] for ex in experts],
                              dtype=torch.float32)
    g, d = getattr(experts[0], gate), getattr(experts[0], down)
    return StackedExperts(gate_up, down_t, gscale, g.held_features[0], g.kernel.group_size, d.kernel.group_size,
                          g.kernel.weight_type), ""
