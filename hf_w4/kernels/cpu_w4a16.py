"""cpu_w4a16: compiled CPU kernel for int4 (GPTQ/AWQ/AutoRound/compressed-tensors) and NVFP4 weights with
float activations (fp32 / bf16 / fp16).

``prepare`` repacks the layer once into 32-column N-panels with K contiguous (two k per byte pair, nibble
order chosen so that a zero-extension + and/shift gives bf16 VNNI-2 operands), per-group fp32 scales (NVFP4:
fp8 block scales kept as bytes) and, for asymmetric int4, per-group zero*scale; GPTQ act-order becomes a K
permutation of the activations. ``apply`` calls ``hf_w4::cpu_w4a16_gemm``, which picks the ISA at run time
(AVX-512 BF16, AVX2, portable C++; ``HF_W4_ISA`` caps it) and the algorithm by M: for bf16 activations at small
M (AVX-512 with AMX: up to 4, for int4 groups of a multiple of 32 up to 2 (groups of 128 or more), 3 (64) or 4 (32);
32 without AMX; AVX2: up to 16), the activations become int16 per block with a power-of-two scale (exact for every
element within 2^7 of its block's max) and meet the raw codes in vpdpwssd (AVX2: vpmaddwd), which streams the
weights at memory speed; on CPUs with AMX-BF16, AMX tiles above that. Up to M = 32 the weights stream through an L1
buffer one 32-k step at a time (int4 groups of a multiple of 32: code values straight into the tiles, scales on the
accumulators; otherwise decoded with the scales folded in); for larger M, blocks of panels are decoded once with the
scales folded in and every 32-row block runs over them. NVFP4 folds its block scales in through fp16 products moved
into bf16 position where the CPU has AVX512-FP16 (fp32 otherwise). Otherwise (fp32 / fp16 activations) a fused
dequantize-in-registers fp32-FMA kernel for small M and dequantize + GEMM (oneDNN / MKL) for large M. bf16
activations at large M without AMX take whichever of the int16 kernel, dequantize + bf16 GEMM and dequantize + fp32
GEMM is fastest on this CPU at the call's M: each is timed at two M once per process and weight type, and a straight
line through the two timings predicts the rest (``hf_w4.ops.cpu_w4a16_info()`` shows the choice by M and the times;
``HF_W4_LARGE_PATH`` sets one path). On the AMX Xeon with AMX turned off for us and for oneDNN, the int16 kernel (rows 8
at a time; NVFP4 with its block scales folded in, decoded once per 32 rows) ran int4 2.6-3.3x and NVFP4 2.6-3.2x the
dense bf16 GEMM from M = 64 on; capped to AVX2, the int16 kernel up to M ~ 70 (int4) / ~ 35 (NVFP4), then the fp32
GEMM; with AMX, the bf16 GEMM. Crossovers measured in csrc/cpu/w4a16_torch.cpp.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import layouts
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
                   "VNNI / AVX2) for small M, AMX-BF16 tiles on Intel from M = 3 (int4, groups of 128 or more), 4 "
                   "(groups of 64) or 5; fused AVX-512 / AVX2 / portable fp32 decode for small M; large M without "
                   "AMX: int16 kernel, dequantize + bf16 GEMM or + fp32 GEMM, whichever this CPU ran fastest at the "
                   "call's M (timed at two M once per process and weight type)")

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
        y = torch.ops.hf_w4.cpu_w4a16_gemm(
            x2, b["w4a16_qpack"], b["w4a16_scales"], b["w4a16_zs"], b["w4a16_perm"], bias,
            self.n, self.group_size, self.weight_type, self.global_scale, "", -1)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.n)
