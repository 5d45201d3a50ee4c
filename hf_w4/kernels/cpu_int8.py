"""cpu_int8: compiled CPU kernel for int8 activations (W8A8 and W4A8) with ``vpdpbusd``.

Runs compressed-tensors ``int-quantized`` checkpoints (W8A8; W4A8 with int4 values held one per int8) and, opt-in,
every 4-bit int format with dynamically quantized activations (``spec.act`` "int8_token" or "int8_group"),
quantized exactly as compressed-tensors does; the integer dot products are exact, so the result equals the reference
path up to fp32 rounding. ``prepare`` repacks the layer once into 64-column VNNI-4 panels (``ops.int8_repack``);
``apply`` calls ``hf_w4::int8_gemm`` (AVX-512 VNNI, AVX2 + AVX-VNNI, AVX2 with an exact emulation, portable C++;
``HF_W4_ISA``; AMX-INT8 from M = 8 on Intel, ``HF_W4_AMX=0`` turns it off). Design: docs/cpu-kernels.md.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import layouts
from ..ops import linear_call
from ..formats.spec import W4Spec
from .base import OK, Kernel
from .registry import register

# |sum over a group of u8 * s8| must fit in int32: Gp * 255 * 128 < 2^31
_MAX_GROUP = 65536


@register
class CpuInt8Kernel(Kernel):
    NAME = "cpu_int8"
    PRIORITY = 100
    REQUIRES_OPS = ("int8_repack", "int8_gemm")
    DEVICES = ("cpu",)
    WEIGHT_TYPES = frozenset({"int8", "int4"})
    ACTIVATIONS = frozenset({"int8_token", "int8_group"})
    DESCRIPTION = ("compiled CPU W8A8/W4A8 kernel: dynamic per-token (or per-group) int8 activations, "
                   "vpdpbusd on AVX-512 VNNI / AVX-VNNI, AVX2 emulation, portable C++; AMX-INT8 from M >= 8 on Intel")

    @classmethod
    def can_implement(cls, spec: W4Spec, n: int, k: int, device: torch.device, dtype: torch.dtype):
        ok, why = super().can_implement(spec, n, k, device, dtype)
        if not ok:
            return ok, why
        if spec.weight_type == "int4" and spec.bits != 4:
            return False, f"{spec.bits}-bit int4 weights?"
        gs = spec.effective_group(k)
        if gs <= 0 or k % gs:
            return False, f"group size {gs} does not divide K={k}"
        if gs > _MAX_GROUP:
            return False, f"group of {gs} columns > {_MAX_GROUP}: the int32 accumulation could overflow"
        if spec.act == "int8_group" and spec.desc_act:
            return False, ("int8_group activations are grouped by contiguous K columns, act-order (desc_act) weight "
                           "groups are not: an integer dot product cannot span both")
        return OK

    def prepare(self, layer: torch.nn.Module, qw: layouts.QWeight) -> None:
        from .. import ops
        perm = None
        if qw.g_idx is not None:
            perm = layouts.act_order_perm(qw.g_idx, qw.group_size, getattr(layer, "name", "<module>"))
            if perm is not None and self.spec.act == "int8_group":
                raise NotImplementedError(f"{self.NAME}: int8_group activations with an act-order g_idx")
        # int4 values held in int8 (compressed-tensors W4A8) run on the int4 layout: half the bytes
        as_int4 = qw.weight_type == "int8" and self.spec.bits == 4
        packed, scales, zeros = ops.int8_repack(qw, perm, as_int4=as_int4)
        layer.register_buffer("int8_packed", packed, persistent=False)
        layer.register_buffer("int8_scales", scales, persistent=False)
        layer.register_buffer("int8_zeros", zeros if zeros.numel() else None, persistent=False)
        layer.register_buffer("int8_perm", perm, persistent=False)
        self.weight_type = "int4" if as_int4 else qw.weight_type
        self.as_int4 = as_int4
        self.group_size = qw.group_size
        self.act_group = self.spec.act == "int8_group"

    CAN_UNPACK_CODES = True

    def unpack_codes(self, layer: torch.nn.Module) -> torch.Tensor:
        """Inverse of the repack (``ops.int8_codes``). Returns int4 codes 0..15 (uint8), or int8 values (int8; also
        for int4 values held in int8, stored here as codes v + 8)."""
        from .. import ops
        w = ops.int8_codes(layer.int8_packed, self.weight_type, self.n, self.k, self.group_size)
        if self.weight_type == "int8" or self.as_int4:
            w = (w.to(torch.int16) - (8 if self.as_int4 else 0)).to(torch.int8)
        return ops.unpermute(w, layer.int8_perm)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return linear_call(torch.ops.hf_w4.int8_gemm, x, layer.int8_packed, layer.int8_scales, layer.int8_zeros,
                           layer.int8_perm, bias, self.weight_type, self.n, self.k, self.group_size, self.act_group, "")
