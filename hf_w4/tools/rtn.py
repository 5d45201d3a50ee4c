"""Round-to-nearest (RTN) quantization of one weight matrix, per output row and K-group: the integer codes and
stored scales of every format hf_w4 writes, and the exact dense weight they mean. Used by the checkpoint writers and
the benchmarks; no calibration. The conventions per format (scale rule, zero point, NVFP4 global scale) are in
docs/formats.md, and in :func:`quantize_rtn`'s ``kind``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import layouts

FP8_MAX = 448.0
FP8_MIN = 2.0 ** -9           # smallest positive float8_e4m3fn (subnormal)
E2M1_MAX = 6.0


class QuantizationError(ValueError):
    """A matrix that cannot be quantized as asked (shape, scale range, unknown kind); the message names it."""


@dataclass
class RTNResult:
    """One matrix quantized: the inputs of :func:`hf_w4.layouts.pack` plus the exact dense weight.

    ``codes`` [N, K]: int4 unsigned 0..15 (dense = (code - zero) * scale); int8 signed; nvfp4 E2M1 codes.
    ``scales`` [N, G] float32 holding the *stored* values (already rounded to ``scale_dtype``); nvfp4:
    float32 [N, K/16] holding fp8 values. ``zeros`` [N, G] int64 true zero points (None = 8, symmetric).
    ``global_scale``: nvfp4 only, in the file's convention (CT divisor, ModelOpt multiplier).
    """

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    group_size: int
    scale_dtype: torch.dtype
    global_scale: Optional[float] = None
    g_idx: Optional[torch.Tensor] = None

    def dense(self) -> torch.Tensor:
        """The exact fp32 weight these codes and stored scales represent (independent of the loader)."""
        return _dequant(self)

    def pack(self, spec) -> dict:
        """The module's tensors in ``spec``'s on-disk layout (:func:`hf_w4.layouts.pack`)."""
        return layouts.pack(spec, self.codes, self.scales, self.zeros, self.global_scale, self.g_idx,
                            scale_dtype=self.scale_dtype if self.scale_dtype != layouts.FP8 else None)

    def qweight(self, spec) -> layouts.QWeight:
        """The canonical QWeight a kernel repacks from, read back through the layout (as a loaded layer's)."""
        n, k = self.codes.shape
        return layouts.to_qweight(spec, self.pack(spec), n, k)


def _round_scale(s: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    r = s.to(dtype)
    if not bool(torch.isfinite(r).all()):
        raise QuantizationError(f"{what}: a scale overflows {str(dtype).replace('torch.', '')} "
                          f"(max |scale| = {s.abs().max().item():.4g}); the weights are too large for this format")
    r = torch.where(r == 0, torch.tensor(torch.finfo(dtype).tiny, dtype=dtype), r)
    return r.to(torch.float32)


def _grouped(w: torch.Tensor, gs: int) -> torch.Tensor:
    n, k = w.shape
    return w.reshape(n, k // gs, gs)


def quantize_rtn(w: torch.Tensor, kind: str = "int4", group_size: Optional[int] = 128, sym: bool = True, *,
                 sym_scale: str = "amax7", zero_min: int = 0, scale_dtype: torch.dtype = torch.float16,
                 g_idx: Optional[torch.Tensor] = None, name: str = "<weight>") -> RTNResult:
    """Round-to-nearest quantization of ``w`` [N, K] per output row and K-group.

    ``kind``: ``"int4"`` (GPTQ/AWQ/auto-round conventions, ``sym_scale`` "amax7" or "signed"), ``"ct-int4"``
    (compressed-tensors, sym scale amax/7.5), ``"int8"`` (amax/127.5), ``"int4in8"`` (CT W4A8: amax/7.5,
    signed codes), ``"nvfp4-ct"``, ``"nvfp4-modelopt"``. ``group_size`` -1/None = one group over K.
    ``g_idx`` [K] (act-order): column k belongs to group g_idx[k]; groups must all hold group_size columns.
    """
    w = w.detach().to(torch.float32)
    n, k = w.shape
    if kind in ("nvfp4-ct", "nvfp4-modelopt"):
        return _quantize_nvfp4(w, kind, name)
    gs = k if group_size in (None, 0, -1) else int(group_size)
    if gs <= 0 or k % gs:
        raise QuantizationError(f"{name}: K={k} is not divisible by group_size={group_size}")
    perm = None
    if g_idx is not None:
        perm = layouts.act_order_perm(g_idx, gs)
    wp = w[:, perm] if perm is not None else w
    x = _grouped(wp, gs)
    zeros = None
    if kind in ("int8", "int4in8"):
        if not sym:
            raise QuantizationError(f"{name}: {kind} weights are symmetric only")
        qmax = 127 if kind == "int8" else 7
        s = _round_scale(x.abs().amax(-1) / (qmax + 0.5), scale_dtype, name)
        q = torch.clamp(torch.round(x / s.unsqueeze(-1)), -qmax - 1, qmax)
    elif kind in ("int4", "ct-int4"):
        if sym:
            if kind == "ct-int4":
                s = x.abs().amax(-1) / 7.5
            elif sym_scale == "amax7":
                s = x.abs().amax(-1) / 7.0
            elif sym_scale == "signed":
                idx = x.abs().argmax(-1, keepdim=True)
                s = torch.gather(x, -1, idx).squeeze(-1) / -8.0
            else:
                raise QuantizationError(f"sym_scale={sym_scale!r} is not supported; supported: 'amax7', 'signed'")
            s = _round_scale(s, scale_dtype, name)
            q = torch.clamp(torch.round(x / s.unsqueeze(-1)), -8, 7) + 8
        else:
            lo = x.amin(-1).clamp(max=0)
            hi = x.amax(-1).clamp(min=0)
            s = _round_scale((hi - lo) / 15.0, scale_dtype, name)
            z = torch.clamp(torch.round(-lo / s), zero_min, 15)
            q = torch.clamp(torch.round(x / s.unsqueeze(-1)) + z.unsqueeze(-1), 0, 15)
            zeros = z.to(torch.int64)
    else:
        raise QuantizationError(f"unknown quantization kind {kind!r}; supported: int4, ct-int4, int8, int4in8, "
                          "nvfp4-ct, nvfp4-modelopt")
    codes = q.reshape(n, k).to(torch.int64)
    if perm is not None:
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(k)
        codes = codes[:, inv]
    return RTNResult(kind, codes, s, zeros, gs, scale_dtype, None,
                     None if g_idx is None else g_idx.to(torch.int64))


def _quantize_nvfp4(w: torch.Tensor, kind: str, name: str) -> RTNResult:
    n, k = w.shape
    if k % 16:
        raise QuantizationError(f"{name}: NVFP4 needs K divisible by 16, got K={k}")
    amax = float(w.abs().max().clamp(min=1e-12))
    ba = _grouped(w, 16).abs().amax(-1)
    if kind == "nvfp4-ct":
        # CT computes the global scale 448*6/amax in bf16 and stores it as fp32 (a divisor)
        g = float(torch.tensor(FP8_MAX * E2M1_MAX / amax).to(torch.bfloat16).float())
        if not (g > 0 and g < float("inf")):
            raise QuantizationError(f"{name}: NVFP4 global scale {g} is not finite (amax={amax:.4g})")
        bs = (ba / E2M1_MAX * g).clamp(FP8_MIN, FP8_MAX).to(layouts.FP8).to(torch.float32)
        x = _grouped(w, 16) * g / bs.unsqueeze(-1)
    else:
        g = float(torch.tensor(amax / (E2M1_MAX * FP8_MAX), dtype=torch.float32))
        bs = (ba / (E2M1_MAX * g)).clamp(FP8_MIN, FP8_MAX).to(layouts.FP8).to(torch.float32)
        x = _grouped(w, 16) / (bs.unsqueeze(-1) * g)
    codes = e2m1_codes(x.reshape(n, k))
    return RTNResult(kind, codes, bs, None, 16, layouts.FP8, g)


_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Same result as :func:`hf_w4.layouts.e2m1_encode` (nearest E2M1 value, ties to the even code, int64),
    vectorized with ``bucketize`` instead of an 8-way distance table: that one needs ~3 us per weight, i.e.
    minutes for a 135M-parameter model. Equality with ``e2m1_encode`` is checked in the writers' tests."""
    a = x.abs().to(torch.float32).clamp(max=E2M1_MAX).contiguous()
    code = torch.bucketize(a, _E2M1_MIDPOINTS)          # a == midpoint -> the lower code
    tie = (code < 7) & (a == _E2M1_MIDPOINTS[code.clamp(max=6)]) & (code % 2 == 1)
    code = code + tie.to(code.dtype)
    return code | (((x < 0) & (code > 0)).to(code.dtype) << 3)


def _dequant(r: RTNResult) -> torch.Tensor:
    n, k = r.codes.shape
    if r.kind.startswith("nvfp4"):
        v = torch.tensor(layouts.E2M1_VALUES, dtype=torch.float32)[r.codes] * r.scales.repeat_interleave(16, 1)
        g = torch.tensor(r.global_scale, dtype=torch.float32)
        return v / g if r.kind == "nvfp4-ct" else v * g
    gi = r.g_idx if r.g_idx is not None else torch.arange(k) // r.group_size
    s = r.scales[:, gi]
    if r.kind in ("int8", "int4in8"):
        return r.codes.to(torch.float32) * s
    z = 8.0 if r.zeros is None else r.zeros[:, gi].to(torch.float32)
    return (r.codes.to(torch.float32) - z) * s
