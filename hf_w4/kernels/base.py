"""The kernel contract: what a kernel declares, and the two calls the layer makes.

A kernel class declares its static capabilities as class attributes, answers
``is_supported()`` (is it usable in this process: op built, ISA present) and
``can_implement(spec, n, k, device, dtype)`` (can it run this layer), both as ``(ok, reason)``.
An instance is bound to one layer: ``prepare(layer, qw)`` repacks the canonical
:class:`~hf_w4.layouts.QWeight` into the kernel's layout (stored on the layer as *non-persistent*
buffers, so ``state_dict``/``save_pretrained`` write the checkpoint tensors), and
``apply(layer, x, bias)`` computes ``x @ W.T + bias`` in ``x.dtype``.
"""
from __future__ import annotations

from typing import FrozenSet, Optional, Tuple

import torch

from ..formats.spec import W4Spec
from ..layouts import QWeight

Verdict = Tuple[bool, str]
OK: Verdict = (True, "")


class Kernel:
    NAME: str = ""
    PRIORITY: int = 0                                   # higher wins among kernels that can implement a layer
    DEVICES: Tuple[str, ...] = ("cpu",)
    WEIGHT_TYPES: FrozenSet[str] = frozenset()          # subset of spec.WEIGHT_TYPES
    LAYOUTS: Optional[FrozenSet[str]] = None            # None = every layout (kernels repack from QWeight)
    ACTIVATIONS: FrozenSet[str] = frozenset({"none"})   # subset of spec.ACTIVATIONS
    ACT_DTYPES: Tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    GROUP_SIZES: Optional[FrozenSet[int]] = None        # None = any group size that divides K (-1 = channel)
    SUPPORTS_G_IDX: bool = True
    SUPPORTS_ASYM: bool = True
    REQUIRES_OPS: Tuple[str, ...] = ()                 # torch.ops.hf_w4 ops that must have a CPU/device impl
    K_MULTIPLE: int = 1
    N_MULTIPLE: int = 1
    SUPPORTS_EMPTY_K: bool = False                      # runs a layer with no input features (K = 0)
    DESCRIPTION: str = ""

    # ---- declarations -> verdicts
    @classmethod
    def is_supported(cls) -> Verdict:
        """Usable in this process? Default: every op in REQUIRES_OPS is built (the library loaded)."""
        if cls.REQUIRES_OPS:
            from .. import _ext, ops
            missing = [op for op in cls.REQUIRES_OPS if not ops.has_impl(op, "CPU")]
            if missing:
                err = _ext.load_error()
                return False, (f"the hf_w4 op library has no {', '.join(missing)}"
                               + (f": {err}" if err else " (rebuild the extension)"))
        return OK

    @classmethod
    def can_implement(cls, spec: W4Spec, n: int, k: int, device: torch.device, dtype: torch.dtype) -> Verdict:
        if device.type not in cls.DEVICES:
            return False, f"device {device.type} not in {list(cls.DEVICES)}"
        if spec.weight_type not in cls.WEIGHT_TYPES:
            return False, f"weight type {spec.weight_type} not in {sorted(cls.WEIGHT_TYPES)}"
        if cls.LAYOUTS is not None and spec.layout not in cls.LAYOUTS:
            return False, f"layout {spec.layout} not in {sorted(cls.LAYOUTS)}"
        if spec.act not in cls.ACTIVATIONS:
            return False, f"activation scheme {spec.act} not in {sorted(cls.ACTIVATIONS)}"
        if dtype not in cls.ACT_DTYPES:
            return False, f"activation dtype {dtype} not in {[str(d) for d in cls.ACT_DTYPES]}"
        if cls.GROUP_SIZES is not None and spec.group_size not in cls.GROUP_SIZES:
            return False, f"group size {spec.group_size} not in {sorted(cls.GROUP_SIZES)}"
        if spec.has_g_idx and not cls.SUPPORTS_G_IDX:
            return False, "g_idx (act-order) not supported"
        if not spec.sym and not cls.SUPPORTS_ASYM:
            return False, "asymmetric zero points not supported"
        if k % cls.K_MULTIPLE:
            return False, f"K={k} is not a multiple of {cls.K_MULTIPLE}"
        if n % cls.N_MULTIPLE:
            return False, f"N={n} is not a multiple of {cls.N_MULTIPLE}"
        if k <= 0 and not cls.SUPPORTS_EMPTY_K:
            return False, f"K={k}: the layer has no input features"
        return cls.is_supported()

    # ---- per layer
    def __init__(self, spec: W4Spec, n: int, k: int):
        self.spec, self.n, self.k = spec, n, k

    def prepare(self, layer: torch.nn.Module, qw: QWeight) -> None:
        """Repack ``qw`` into this kernel's layout and register the result on ``layer``
        (``layer.register_buffer(name, t, persistent=False)``)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    # Kernels whose repacked copy holds every code exactly set this and implement unpack_codes; the layer then
    # drops the checkpoint's code tensor after prepare (one copy of the packed weight in memory, not two).
    CAN_UNPACK_CODES: bool = False

    def unpack_codes(self, layer: torch.nn.Module) -> torch.Tensor:
        """The weight codes ``[N, K]`` back from this kernel's buffers, in the original column order and as
        :func:`~hf_w4.layouts.pack` takes them (int4 / E2M1 codes 0..15, or int8 values)."""
        raise NotImplementedError(f"{self.NAME} cannot give the weight codes back")

    def __repr__(self) -> str:
        return self.NAME


def quantize_act_int8(x: torch.Tensor, group: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' dynamic symmetric int8 activations: scale = max|x| / 127.5 per token (or per token
    and K-group of ``group`` columns), q = clamp(round_half_even(x / scale), -128, 127).
    Returns (q as int8 [..., K], scale as float32 [..., 1] or [..., K/group]); x ~= q * scale."""
    xf = x.float()
    if group is not None:
        xf = xf.unflatten(-1, (-1, group))
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.5
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(xf / scale), -128, 127).to(torch.int8)
    if group is not None:
        return q.flatten(-2), scale.squeeze(-1)
    return q, scale


def fake_quantize_act(x: torch.Tensor, act: str, group_size: int) -> torch.Tensor:
    """x rounded through the activation scheme ``act`` (fp32 result); identity for "none"."""
    if act == "none":
        return x.float()
    if act == "int8_token":
        q, s = quantize_act_int8(x)
        return q.float() * s
    if act == "int8_group":
        q, s = quantize_act_int8(x, group_size)
        return (q.float().unflatten(-1, (-1, group_size)) * s.unsqueeze(-1)).flatten(-2)
    raise ValueError(f"unknown activation scheme {act!r}")
