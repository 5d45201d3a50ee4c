"""cuda_w4a16: CUDA kernels for int4 (GPTQ / AWQ / AutoRound / compressed-tensors) and NVFP4 weights with fp16 /
bf16 activations, on NVIDIA GPUs of compute capability 8.0 or newer (sm_80 / sm_90 code; newer GPUs run it too).

``prepare`` repacks the layer once, on the device its tensors are on, with torch ops (no dense copy of the whole
layer at once): the codes go into the mma.sync m16n8k16 B-fragment order (:func:`pack_fragments`, layout in
csrc/cuda/w4a16_math.cuh), int4 scales into fp16 and bf16 copies (one rounding of the checkpoint's scales into the
activation type) and zero points into bytes, NVFP4 block scales stay E4M3 bytes; GPTQ act-order becomes a K
permutation of the activations. ``apply`` runs, for up to ``HF_W4_CUDA_LARGE_M`` - 1 rows (default 127; 319
where the fused path is the sm_90a wgmma kernel), the fused kernel (weights streamed once, dequantized in registers
with magic-number fp16 / bf16 conversions, fp32 accumulators, split-K where N is small) and above that dequantizes
the layer into a transient fp16 / bf16 weight for the dense GEMM (cuBLAS). NVFP4's global scale is applied in fp32
before the output cast. fp32 activations (not a declared dtype: fp32 models take another kernel; an fp32 input
reaches a layer of a half-precision model that upcasts) run through a bf16 dequantization and an fp32 product.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import env, layouts
from ..ops import linear_call
from ..formats.spec import W4Spec
from .base import Kernel, OK
from .registry import register

TILE_N, TILE_K = 64, 16


def large_m(wgmma: bool = False) -> int:
    """Rows from which apply takes dequantize + dense GEMM instead of the fused kernel: ``HF_W4_CUDA_LARGE_M``, else
    128, or 320 for a layer whose fused path is the sm_90a wgmma kernel (``wgmma``; on an H100 it beat dequantize +
    cuBLAS by 1.02-1.35x at M = 256 and lost by 0.80-0.88x at M = 512 on the layers it is taken for)."""
    v = env.text("HF_W4_CUDA_LARGE_M") or ("320" if wgmma else "128")
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"HF_W4_CUDA_LARGE_M={v!r}: expected an integer number of rows") from None


def _npad(n: int) -> int:
    return (n + TILE_N - 1) // TILE_N * TILE_N


# Codes [N, K] <-> qpack [Npad/64, K/16, 32 lanes, 4 words]: column n = 64 nt + 16 j + 8 p + g, row k = 16 kt + 8 b
# + 2 t + h sits in lane 4 g + t, word j, nibble slot 4 h + 2 p + b (w4a16_math.cuh). As tensor dims:
# (nt, j, p, g, kt, b, t, h) <-> (nt, kt, g, t, j, h, p, b).
_TO_FRAG = (0, 4, 3, 6, 1, 7, 2, 5)
_FROM_FRAG = (0, 4, 6, 2, 1, 7, 3, 5)


def pack_fragments(codes: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Codes ``[N, K]`` (0..15, any integer dtype, K a multiple of 16) -> int32 ``[Npad/64, K/16, 32, 4]``; the
    padding columns get code 0. Works ``chunk`` k16 steps at a time (bounded temporaries)."""
    n, k = codes.shape
    npad, kt, nt = _npad(n), k // TILE_K, _npad(n) // TILE_N
    out = torch.empty((nt, kt, 32, 4), dtype=torch.int32, device=codes.device)
    for k0 in range(0, kt, chunk):
        c = codes[:, k0 * TILE_K:(k0 + chunk) * TILE_K].to(torch.int32)
        if npad != n:
            c = F.pad(c, (0, 0, 0, npad - n))
        kc = c.shape[1] // TILE_K
        v = c.reshape(nt, 4, 2, 8, kc, 2, 4, 2).permute(*_TO_FRAG).reshape(nt, kc, 32, 32)
        out[:, k0:k0 + kc] = layouts.pack_nibbles(v, -1)
    return out


def unpack_fragments(qpack: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_fragments`: uint8 codes ``[N, K]``."""
    nt, kt = qpack.shape[:2]
    v = layouts.unpack_nibbles(qpack.reshape(nt, kt, 32, 4), -1)
    return v.reshape(nt, kt, 8, 4, 4, 2, 2, 2).permute(*_FROM_FRAG).reshape(nt * TILE_N, kt * TILE_K)[:n]


def pack_groups(t: torch.Tensor) -> torch.Tensor:
    """Per-(column, group) values ``[N, G]`` -> ``[Npad/64, G, 8, 8]``: column 64 nt + 8 sub + g at [nt, .., g,
    sub] (a lane reads its 8 sub-tiles' values in one load, a strip's groups are contiguous); padding columns get 0."""
    n, g = t.shape
    if _npad(n) != n:
        t = torch.cat([t, t.new_zeros((_npad(n) - n, g))])
    return t.reshape(-1, 8, 8, g).permute(0, 3, 2, 1).contiguous()


def unpack_groups(t: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_groups`: ``[N, G]``."""
    g = t.shape[1]
    return t.permute(0, 3, 2, 1).reshape(-1, g)[:n]


@register
class CudaW4A16Kernel(Kernel):
    NAME = "cuda_w4a16"
    PRIORITY = 100
    DEVICES = ("cuda",)
    WEIGHT_TYPES = frozenset({"int4", "nvfp4"})
    ACTIVATIONS = frozenset({"none"})
    ACT_DTYPES = (torch.float16, torch.bfloat16)  # the mma.sync operand types; fp32 models take the reference
    K_MULTIPLE = 16                               # one mma k16 step per packed tile
    DESCRIPTION = ("CUDA (sm_80+): fused dequantize + mma.sync kernel streaming the 4-bit weights once for small M "
                   "(split-K where N is small), dequantize + cuBLAS for large M; NVFP4 global scale in fp32; K and "
                   "int4 group sizes multiples of 16")

    @classmethod
    def is_supported(cls):
        from .. import _ext, ops  # noqa: F401  (ops: the schemas the library's implementations belong to)
        if not _ext.load_cuda():
            return False, f"the CUDA library is not available: {_ext.cuda_load_error()}"
        for op in ("cuda_w4a16_gemm", "cuda_w4a16_dequant"):
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"hf_w4::{op}", "CUDA"):
                return False, f"the CUDA library has no {op} (rebuild it)"
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
            major, minor = torch.cuda.get_device_capability()
            return False, f"compute capability {major}.{minor} < 8.0 (mma.sync bf16 / fp16 m16n8k16 needs sm_80+)"
        return OK

    @classmethod
    def can_implement(cls, spec: W4Spec, n: int, k: int, device: torch.device, dtype: torch.dtype):
        if device.type not in cls.DEVICES:  # before the library check: CPU loads never build the CUDA library
            return False, f"device {device.type} not in {list(cls.DEVICES)}"
        if spec.bits != 4:
            return False, f"{spec.bits}-bit weights not supported (4-bit only)"
        if spec.weight_type == "int4" and k % 16 == 0:
            gs = spec.effective_group(k)
            if gs % 16:
                return False, f"group size {gs} is not a multiple of 16 (a k16 mma step must lie in one group)"
        return super().can_implement(spec, n, k, device, dtype)

    def prepare(self, layer: torch.nn.Module, qw: layouts.QWeight) -> None:
        name = getattr(layer, "name", "<module>")
        perm = layouts.act_order_perm(qw.g_idx, qw.group_size, name) if qw.g_idx is not None else None
        codes = layouts.unpack_codes(qw)
        if perm is not None:
            codes = codes[:, perm]
        layer.register_buffer("cuda_w4a16_q", pack_fragments(codes), persistent=False)
        del codes
        if qw.weight_type == "nvfp4":
            s = qw.scales.view(torch.uint8)
            if bool(((s & 0x7F) == 0x7F).any()):
                raise layouts.LayoutError(f"{name}.weight_scale: holds the E4M3 NaN byte 0x7f / 0xff; block scales "
                                          "must be finite")
            layer.register_buffer("cuda_w4a16_s", pack_groups(s), persistent=False)
            zeros = None
        else:
            layer.register_buffer("cuda_w4a16_s16", pack_groups(qw.scales.to(torch.float16)), persistent=False)
            layer.register_buffer("cuda_w4a16_sbf", pack_groups(qw.scales.to(torch.bfloat16)), persistent=False)
            zeros = None
            if qw.zeros is not None:
                z = qw.zeros
                bad = (z != z.round()) | (z < 0) | (z > 127)
                if bool(bad.any()):
                    i = tuple(int(v) for v in bad.nonzero()[0])
                    raise NotImplementedError(
                        f"{name}: zero point {float(z[i])} at [column, group] {list(i)}; the cuda_w4a16 kernel "
                        "supports integer zero points in 0..127")
                zeros = pack_groups(z.to(torch.uint8))
        layer.register_buffer("cuda_w4a16_z", zeros, persistent=False)
        layer.register_buffer("cuda_w4a16_perm", perm, persistent=False)
        self.weight_type = qw.weight_type
        self.group_size = 16 if qw.weight_type == "nvfp4" else qw.group_size
        self.global_scale = float(qw.global_scale) if qw.global_scale is not None else 1.0
        # does the fused path take the wgmma kernel on this layer and device? (asking also runs the device's one
        # wgmma probe here, not inside a later CUDA graph capture)
        q, wgmma = layer.cuda_w4a16_q, False
        if q.is_cuda:
            with torch.cuda.device(q.device):
                plan = torch.ops.hf_w4.cuda_w4a16_plan(256, self.n, self.k, qw.weight_type, zeros is not None, True)
            wgmma = plan[7] > 0
        self.large_m = large_m(wgmma)  # here, not per call: apply stays free of environment lookups (torch.compile)

    CAN_UNPACK_CODES = True

    def unpack_codes(self, layer: torch.nn.Module) -> torch.Tensor:
        """The inverse of the repack; with act-order the kernel's column k' is the checkpoint's column perm[k']."""
        from .. import ops
        codes = unpack_fragments(layer.cuda_w4a16_q, self.n, self.k)
        return ops.unpermute(codes, layer.cuda_w4a16_perm)

    def _scales(self, b, dtype: torch.dtype) -> torch.Tensor:
        if self.weight_type == "nvfp4":
            return b["cuda_w4a16_s"]
        return b["cuda_w4a16_sbf"] if dtype == torch.bfloat16 else b["cuda_w4a16_s16"]

    def dense_weight(self, layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight ``[N, K]`` in ``dtype`` (fp16 / bf16) as the kernels see it, in the kernel's (act-order)
        column order."""
        b = layer._buffers
        return torch.ops.hf_w4.cuda_w4a16_dequant(b["cuda_w4a16_q"], self._scales(b, dtype), b["cuda_w4a16_z"],
                                                  self.n, self.k, self.group_size, self.weight_type,
                                                  self.global_scale, dtype)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        b = layer._buffers
        x2 = x.reshape(-1, self.k)
        if b["cuda_w4a16_perm"] is not None:
            x2 = x2.index_select(1, b["cuda_w4a16_perm"])
        if x.dtype not in (torch.float16, torch.bfloat16):
            w = self.dense_weight(layer, torch.bfloat16).to(x.dtype)
            y = F.linear(x2, w, None if bias is None else bias.to(x.dtype))
        elif x2.shape[0] >= self.large_m:
            y = F.linear(x2, self.dense_weight(layer, x.dtype), None if bias is None else bias.to(x.dtype))
        else:
            y = linear_call(torch.ops.hf_w4.cuda_w4a16_gemm, x2, b["cuda_w4a16_q"], self._scales(b, x.dtype),
                            b["cuda_w4a16_z"], bias, self.n, self.group_size, self.weight_type, self.global_scale)
        return y.reshape(*x.shape[:-1], self.n)
