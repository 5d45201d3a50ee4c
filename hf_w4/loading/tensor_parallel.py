"""Tensor parallelism for :class:`QuantLinear`: each rank loads, repacks and runs its own slice of a layer.

transformers (``from_pretrained(..., tp_plan="auto")`` under ``torchrun``) shards a Linear by its plan: ``colwise``
splits the output features N, ``rowwise`` the input features K, and hooks around the forward gather or all-reduce the
slices. It slices parameters only, by the dense weight's dimensions; a QuantLinear's checkpoint tensors are buffers in
packed layouts. So the quantizer points the plan entries that reach a QuantLinear at hf_w4's variants of the same
styles (``hf_w4_colwise``, ...; registered by ``hf_w4.install()``): before loading they turn each buffer into a
DTensor sharded along the dimension that holds N or K in its layout, which makes transformers' loader read only this
rank's slice of the file; after loading the slices become plain buffers, the kernel repacks only them, and the
forward hooks and the reduction stay transformers' own.

A slice must be whole packed words and whole groups: N (colwise) or K (rowwise) splits evenly over the ranks, and
the slice is a multiple of the layout's packing and of the group size. Act-order GPTQ layers (``desc_act``) scatter
a group's columns over K and so cannot be split along K. Quantized MoE experts are not split: they run whole on every
rank.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from transformers.distributed.parallel_utils import _get_parameter_plan, replace_layer_number_by_wildcard
from transformers.distributed.tensor_parallel import (ALL_PARALLEL_STYLES, ColwiseParallel, MoeExpertsParallel,
                                                      RowwiseParallel, TensorParallelLayer)

from .. import layouts
from ..nn import QuantLinear
from .checkpoint import CheckpointError

PREFIX = "hf_w4_"


class TensorParallelError(CheckpointError):
    """A tp_plan entry hf_w4 cannot apply to a quantized layer; the message names the layer and says why."""


def _split_dim(style) -> Optional[str]:
    """"out" for transformers' column-parallel styles, "in" for its row-parallel ones, else None."""
    return "out" if type(style) is ColwiseParallel else "in" if type(style) is RowwiseParallel else None


def register_styles() -> Dict[str, object]:
    """An hf_w4 variant of every column- and row-parallel style transformers has registered (same input and output
    layouts), under ``PREFIX + name``. Returns what was registered (for :func:`unregister_styles`)."""
    registry = ALL_PARALLEL_STYLES
    added = {}
    for name in list(registry):
        style = registry[name]
        dim = _split_dim(style)
        if name.startswith(PREFIX) or dim is None:
            continue
        cls = QuantColwise if dim == "out" else QuantRowwise
        ours = cls.__new__(cls)
        ours.__dict__.update(style.__dict__)   # the same input / output layouts
        ours.base_name = name
        registry.register(PREFIX + name, ours)
        added[PREFIX + name] = ours
    return added


def unregister_styles(names) -> None:
    for name in names:
        type(ALL_PARALLEL_STYLES)._global_mapping.pop(name, None)


def update_plan(model: nn.Module, plan: Dict[str, str]) -> None:
    """Point the column- and row-parallel entries of ``plan`` that reach a QuantLinear at hf_w4's variants (a dense
    Linear under the same entry is served by them as by transformers' own). MoE experts stored quantized (one
    QuantLinear per expert projection) run whole on every rank: their ``moe_tp_experts`` entry, which would have each
    rank run a slice of every expert and sum the slices, goes, with the entries for the fused experts' parameters
    under it. Harmless without tensor parallelism: the plan is only read when ``tp_size > 1``."""
    if not plan:
        return
    registry = ALL_PARALLEL_STYLES
    quant = [replace_layer_number_by_wildcard(n) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    for key, style in list(plan.items()):
        if isinstance(registry.get(style), MoeExpertsParallel) and any(q.startswith(key + ".") for q in quant):
            for k in [k for k in plan if k == key or k.startswith(key + ".")]:
                del plan[k]
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        style = _get_parameter_plan(name, plan, is_weight=False)
        if style is None or style.startswith(PREFIX) or style not in registry:
            continue
        if _split_dim(registry[style]) is not None and PREFIX + style in registry:
            plan[replace_layer_number_by_wildcard(name)] = PREFIX + style


def shard_buffers(module: QuantLinear, dim: str, style: str, mesh) -> None:
    """Mark ``module``'s checkpoint tensors as DTensors sharded along N (``dim="out"``) or K (``"in"``), so the
    loader reads this rank's slice; raises :class:`TensorParallelError` for a layer that cannot be split so."""
    from torch.distributed.tensor import Shard, distribute_tensor
    rank, ws = mesh.get_local_rank(), mesh.size()
    n, k = module.out_features, module.in_features
    spec, name = module.spec, module.name
    what, total = ("out_features N", n) if dim == "out" else ("in_features K", k)
    why = f"{name}: tp_plan style {style!r} splits {what}={total} over {ws} ranks"
    if total % ws:
        raise TensorParallelError(f"{why}, which does not divide evenly; packed weights are split only evenly")
    if dim == "in" and spec.layout == "gptq" and spec.desc_act:
        raise TensorParallelError(
            f"{why}, but this GPTQ layer is act-order (desc_act: g_idx scatters each group's columns over K), so "
            "no slice of K holds whole groups; use a checkpoint without act-order, or a tp_plan that leaves this "
            "layer unsplit")
    if dim == "in" and spec.act != "none":
        span = k if spec.act == "int8_token" else spec.effective_group(k)
        if (k // ws) % span:
            raise TensorParallelError(
                f"{why}, but its activations are quantized to int8 at run time with one scale per token over "
                f"{'all of K' if span == k else f'groups of {span}'}: a slice would get scales of its own, and "
                "numbers other than one process gives; load it with activation='none' (weight-only)"
                + (", or 'int8_group' (one scale per token and weight group)" if spec.effective_group(k) < k else ""))
    local = (n // ws, k) if dim == "out" else (n, k // ws)
    full = layouts.declare(spec, n, k, name)
    try:
        part = layouts.declare(spec, *local, name)
    except (layouts.LayoutError, NotImplementedError) as e:
        raise TensorParallelError(f"{why}: a slice of {total // ws} is not whole packed words and groups of "
                                  f"{spec.method} ({spec.describe()}): {str(e).removeprefix(name + ': ')}") from None
    for t in module.tensor_names:
        f, p = full[t].shape, part[t].shape
        dims = [d for d in range(len(f)) if f[d] != p[d]]
        if not dims:
            continue  # the same on every rank (scales per tensor, one group over all of K, weight_shape, ...)
        if len(dims) != 1 or f[dims[0]] != p[dims[0]] * ws:
            raise TensorParallelError(f"{why}: {name}.{t} {list(f)} does not split into {ws} slices {list(p)}")
        module._buffers[t] = distribute_tensor(module._buffers[t], mesh, [Shard(dims[0])], src_data_rank=None)
    module.tp_shard = (dim, rank, ws)
    # transformers' hooks then run the forward on plain local tensors (its path for quantized modules)
    module._hf_quantized_needs_local_tp = True


def localize(module: QuantLinear) -> None:
    """After loading: this rank's slices of the checkpoint tensors as plain buffers, with what records the layer's
    whole shape (``weight_shape``, ``g_idx``) made this slice's."""
    from torch.distributed.tensor import DTensor
    for t in module.tensor_names:
        v = module._parameters.get(t, module._buffers.get(t))
        if not isinstance(v, DTensor):
            continue
        module._parameters.pop(t, None)   # the loader stores a DTensor as a Parameter
        module._buffers[t] = v
        _set(module, t, v.to_local().detach())
    dim, rank, ws = module.tp_shard
    n, k = module.held_features
    if "weight_shape" in module.tensor_names:
        ws_t = module.weight_shape
        if not ws_t.is_meta:
            full = [int(x) for x in ws_t.tolist()]
            if full != [module.out_features, module.in_features]:
                raise layouts.LayoutError(f"{module.name}.weight_shape: found {full}, expected "
                                          f"[{module.out_features}, {module.in_features}] (the module's [out, in])")
            _set(module, "weight_shape", torch.tensor([n, k], dtype=ws_t.dtype))
    if dim == "in" and "g_idx" in module.tensor_names and not module.g_idx.is_meta:
        gs = module.spec.effective_group(module.in_features)
        g = module.g_idx.to(torch.int64) - rank * (k // gs)
        if not torch.equal(g, torch.arange(k) // gs):
            raise TensorParallelError(
                f"{module.name}.g_idx: this rank's slice of K (columns {rank * k}..{(rank + 1) * k - 1}) does not hold "
                "whole groups in order (act-order); a row-parallel split needs groups contiguous in K")
        _set(module, "g_idx", g.to(module.g_idx.dtype))


def _set(module: QuantLinear, t: str, value: torch.Tensor) -> None:
    """Replace a loaded buffer, keeping transformers' "loaded from the checkpoint" mark (check_loaded reads it)."""
    value._is_hf_initialized = getattr(module._buffers[t], "_is_hf_initialized", False)
    module._buffers[t] = value


def check_model(model: nn.Module) -> None:
    """After loading under tensor parallelism: every QuantLinear a splitting style reached was split by hf_w4's
    variant, and none sits inside a module whose style splits its children's work (MoE experts)."""
    if (getattr(model, "_tp_size", None) or 1) <= 1:
        return
    registry = ALL_PARALLEL_STYLES
    plan = getattr(model, "tp_plan", None) or {}
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        style = _get_parameter_plan(name, plan, is_weight=False)
        if style is not None and m.tp_shard is None and not style.startswith(PREFIX) and style in registry:
            st = registry[style]
            if _split_dim(st) is not None or type(st).shard_param is not TensorParallelLayer.shard_param:
                raise TensorParallelError(
                    f"{name}: tp_plan style {style!r} ({type(st).__name__}) splits this layer's weight as a dense "
                    f"one's, but it is an hf_w4 QuantLinear ({m.spec.method}) with packed tensors; hf_w4 splits "
                    f"packed weights for the column- and row-parallel styles only (a tp_plan override must name "
                    f"them {PREFIX}<style>, e.g. '{PREFIX}colwise')")
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:i])
            ps = _get_parameter_plan(parent, plan, is_weight=False)
            if ps is not None and ps in registry and isinstance(registry[ps], MoeExpertsParallel):
                raise TensorParallelError(
                    f"{name}: tp_plan style {ps!r} on {parent} has each rank run a slice of every expert, but the "
                    "experts are hf_w4 QuantLinears, which that style does not split; quantized experts load "
                    "without tensor parallelism only")


class _SplitsPacked:
    """Mixed into transformers' column- / row-parallel styles: a QuantLinear's packed tensors are split too."""
    DIM = ""
    base_name = ""

    def install_forward(self, module, mesh):
        if isinstance(module, QuantLinear):
            shard_buffers(module, self.DIM, self.base_name, mesh)
        return super().install_forward(module, mesh)


class QuantColwise(_SplitsPacked, ColwiseParallel):
    DIM = "out"


class QuantRowwise(_SplitsPacked, RowwiseParallel):
    DIM = "in"
