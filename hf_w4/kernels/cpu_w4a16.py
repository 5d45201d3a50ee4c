"""cpu_w4a16: compiled CPU kernel for int4 (GPTQ/AWQ/AutoRound/compressed-tensors) and NVFP4 weights with
float activations (fp32 / bf16 / fp16).

``prepare`` repacks the layer once into 32-column panels (``ops.cpu_w4a16_repack``); ``apply`` calls
``hf_w4::cpu_w4a16_gemm``, which picks the ISA at run time (AVX-512, AVX2, portable C++; ``HF_W4_ISA``) and the path
by fixed rules on M, weight type, group size and dtype (int16 activations x raw codes, AMX tiles, a fused fp32
kernel, or dequantize + GEMM; ``ops.cpu_w4a16_path`` / ``ops.cpu_w4a16_info`` report it). Layouts, paths,
crossovers and their measurements: docs/cpu-kernels.md.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import layouts
from ..ops import linear_call
from ..formats.spec import W4Spec
from .base import Kernel, OK
from .registry import register



@register
class CpuW4A16Kernel(Kernel):
    NAME = "cpu_w4a16"
    PRIORITY = 100
    REQUIRES_OPS = ("cpu_w4a16_repack", "cpu_w4a16_gemm")
    DEVICES = ("cpu",)
    WEIGHT_TYPES = frozenset({"int4", "nvfp4"})
    ACTIVATIONS = frozenset({"none"})
    DESCRIPTION = ("compiled CPU W4A16/NVFP4 kernel: bf16 activations as int16 blocks x raw codes (AVX-512 "
                   "VNNI / AVX2), AMX-BF16 tiles on Intel, fused AVX-512 / AVX2 / portable fp32 decode for small M, "
                   "dequantize + GEMM for large M; the path by fixed per-CPU-family rules (docs/cpu-kernels.md)")

    @classmethod
    def can_implement(cls, spec: W4Spec, n: int, k: int, device: torch.device, dtype: torch.dtype):
        ok, why = super().can_implement(spec, n, k, device, dtype)
        if not ok:
            return ok, why
        if spec.bits != 4:
            return False, f"{spec.bits}-bit weights not supported (4-bit only)"
        gs = 16 if spec.weight_type == "nvfp4" else spec.effective_group(k)
        if k % 2:
            return False, f"K={k} is odd (the packed layout pairs K columns)"
        if gs <= 0 or gs % 2 or k % gs:
            return False, f"group size {gs} must be even and divide K={k}"
        return OK

    def prepare(self, layer: torch.nn.Module, qw: layouts.QWeight) -> None:
        from .. import ops
        perm = None
        if qw.g_idx is not None:
            perm = layouts.act_order_perm(qw.g_idx, qw.group_size, getattr(layer, "name", "<module>"))
        q, s, z = ops.cpu_w4a16_repack(qw, perm)
        layer.register_buffer("w4a16_qpack", q, persistent=False)
        layer.register_buffer("w4a16_scales", s, persistent=False)
        layer.register_buffer("w4a16_zs", z, persistent=False)
        layer.register_buffer("w4a16_perm", perm, persistent=False)
        self.group_size = 16 if qw.weight_type == "nvfp4" else qw.group_size
        self.weight_type = qw.weight_type
        self.global_scale = float(qw.global_scale) if qw.global_scale is not None else 1.0

    CAN_UNPACK_CODES = True

    def unpack_codes(self, layer: torch.nn.Module) -> torch.Tensor:
        """Inverse of the repack's code placement (``ops.w4a16_codes``); with an act-order permutation the kernel's
        column k' is the checkpoint's column perm[k']."""
        from .. import ops
        codes = ops.w4a16_codes(layer.w4a16_qpack, self.n, self.k)
        return ops.unpermute(codes, layer.w4a16_perm)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        # the repacked tensors straight from the buffer dict (through QuantLinear.__getattr__ they cost ~1 us each:
        # an MoE decode step makes hundreds of small calls), no reshape for 2-D x
        b = layer._buffers
        x2 = x if x.dim() == 2 else x.reshape(-1, self.k)
        y = linear_call(torch.ops.hf_w4.cpu_w4a16_gemm,
                        x2, b["w4a16_qpack"], b["w4a16_scales"], b["w4a16_zs"], b["w4a16_perm"], bias,
                        self.n, self.group_size, self.weight_type, self.global_scale, "", -1)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.n)
