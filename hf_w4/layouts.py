"""The one home for on-disk tensor layouts and bit-packing.

For every layout of :data:`hf_w4.formats.spec.LAYOUTS` this module knows

* which tensors a module has on disk, with shapes and dtypes (:func:`declare`),
* how to turn them into the canonical :class:`QWeight` every kernel repacks from (:func:`to_qweight`),
* how to write them from integer codes and scales (:func:`pack`, used by the checkpoint writers),
* the exact dense weight (:func:`dequantize`, the test oracle and the ``model.dequantize()`` path).

Each producer's layout, nibble order and zero / scale conventions: docs/formats.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .formats.spec import W4Spec

SEQ_SLOTS = (0, 1, 2, 3, 4, 5, 6, 7)
# AWQ: slot i of a word holds column 8c + [0,2,4,6,1,3,5,7][i]; i.e. column 8c+j sits in slot AWQ_SLOTS[j]
AWQ_SLOTS = (0, 4, 1, 5, 2, 6, 3, 7)
# E2M1 code -> value; bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn


class LayoutError(ValueError):
    """A checkpoint tensor does not fit the layout; the message names module, tensor, found and expected."""


# ----------------------------------------------------------------------------------------------
# nibble packing


# GPTQ v1 qzeros are the true zeros' int32 words minus this, in word arithmetic (so a true zero of 0 borrows from
# the next slot), as GPTQModel writes and reads them; without a zero of 0 it is the same as zero - 1 per nibble
V1_ZERO_OFFSET = 0x11111111


def pack_nibbles(values: torch.Tensor, dim: int, slots: Tuple[int, ...] = SEQ_SLOTS) -> torch.Tensor:
    """Pack 4-bit values (0..15, any int dtype) 8 per int32 along ``dim``: element j of each run of 8
    goes to bits [4*slots[j], 4*slots[j]+4)."""
    v = values.movedim(dim, -1)
    if v.shape[-1] % 8:
        raise LayoutError(f"cannot pack {v.shape[-1]} values 8 per int32 (not a multiple of 8)")
    v = (v.to(torch.int32) & 0xF).reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    words = v[..., 0] << (4 * slots[0])
    for j in range(1, 8):   # int32 shifts wrap into the sign bit: the word's two's-complement bit pattern
        words |= v[..., j] << (4 * slots[j])
    return words.movedim(-1, dim).contiguous()


def unpack_nibbles(words: torch.Tensor, dim: int, slots: Tuple[int, ...] = SEQ_SLOTS) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: int32 words -> uint8 values 0..15, 8x longer along ``dim``."""
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.tensor([4 * s for s in slots], dtype=torch.int64, device=w.device)
    v = (w.unsqueeze(-1) >> shifts) & 0xF
    v = v.reshape(*w.shape[:-1], w.shape[-1] * 8).to(torch.uint8)
    return v.movedim(-1, dim)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even code), returning codes 0..15 (uint8)."""
    mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)
    a = x.abs().float().clamp(max=6.0)
    # nearest magnitude; on exact ties pick the even code (round-half-even on the code grid)
    d = (a.unsqueeze(-1) - mags).abs()
    best = d.min(-1, keepdim=True).values
    cand = (d == best) & ((torch.arange(8) % 2 == 0) | ((d == best).sum(-1, keepdim=True) == 1))
    code = cand.to(torch.int64).argmax(-1)
    code = code | ((x < 0) & (code > 0)).to(torch.int64) << 3
    return code.to(torch.uint8)


# ----------------------------------------------------------------------------------------------
# the canonical form every kernel repacks from


@dataclass
class QWeight:
    """One layer's quantized weight in a canonical, cheap-to-build form.

    ``codes`` is a *view* whenever possible (no copy of the packed weight):

    * ``pack_dim == "k"``: int32 ``[N, K/8]``, element ``(n, 8c+j)`` in nibble ``slots[j]`` of ``codes[n, c]``;
    * ``pack_dim == "n"``: int32 ``[N/8, K]``, element ``(8r+j, k)`` in nibble ``slots[j]`` of ``codes[r, k]``;
    * ``pack_dim == "none"``: int8 ``[N, K]`` signed values (weight_type ``int8``).

    Dense weight: int4 ``(code - zero) * scale``; int8 ``code * scale``; nvfp4
    ``e2m1(code) * fp8(scale) * global_scale``. The group of input column k is ``g_idx[k]`` when
    ``g_idx`` is given, else ``k // group_size``.
    """

    weight_type: str
    n: int
    k: int
    group_size: int
    codes: torch.Tensor
    pack_dim: str
    slots: Tuple[int, ...]
    scales: torch.Tensor                  # float32 [N, G]; nvfp4: uint8 [N, K/16] (fp8 e4m3 bit patterns)
    zeros: Optional[torch.Tensor] = None  # int4: float32 [N, G] in code units; None = 8
    global_scale: Optional[float] = None  # nvfp4 multiplier
    g_idx: Optional[torch.Tensor] = None  # int64 [K]

    @property
    def groups(self) -> int:
        return self.scales.shape[1]


def unpack_codes(qw: QWeight) -> torch.Tensor:
    """Codes as an int64 ``[N, K]`` tensor (signed values for int8, 0..15 otherwise)."""
    if qw.pack_dim == "none":
        return qw.codes.to(torch.int64)
    if qw.pack_dim == "k":
        return unpack_nibbles(qw.codes, 1, qw.slots).to(torch.int64)
    return unpack_nibbles(qw.codes, 0, qw.slots).to(torch.int64)


def act_order_perm(g_idx: torch.Tensor, group_size: int, name: str = "<module>") -> Optional[torch.Tensor]:
    """Permutation of K that makes groups contiguous (None if they already are).

    Raises NotImplementedError naming ``<name>.g_idx`` when the groups are not all of ``group_size`` columns."""
    k = g_idx.numel()
    g = g_idx.to(torch.int64)
    in_order = torch.arange(k, device=g.device) // group_size
    if torch.equal(g, in_order):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], in_order):
        values, counts = torch.unique(g, return_counts=True)
        odd = (counts != group_size).nonzero()
        found = (f"group {int(values[odd[0]])} has {int(counts[odd[0]])} columns" if odd.numel() else
                 f"it uses the group indices {values.tolist()[:8]}{'...' if values.numel() > 8 else ''}")
        raise NotImplementedError(
            f"{name}.g_idx: assigns groups of unequal size ({found}; expected groups 0..{k // group_size - 1} of "
            f"{group_size} columns each, K={k}); only act-order permutations of equal groups are supported")
    return perm


def group_index(qw: QWeight) -> torch.Tensor:
    if qw.g_idx is not None:
        return qw.g_idx.to(torch.int64)
    return torch.arange(qw.k, device=qw.scales.device) // qw.group_size


def fp8_decode(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(FP8).to(torch.float32)


def dequantize(qw: QWeight) -> torch.Tensor:
    """The exact dense fp32 weight ``[N, K]`` (the reference every kernel is tested against)."""
    c = unpack_codes(qw)
    if qw.weight_type == "nvfp4":
        s = fp8_decode(qw.scales).repeat_interleave(16, dim=1)
        return e2m1_decode(c) * s * qw.global_scale
    gi = group_index(qw)
    s = qw.scales[:, gi]
    if qw.weight_type == "int8":
        return c.to(torch.float32) * s
    z = qw.zeros[:, gi] if qw.zeros is not None else 8.0
    return (c.to(torch.float32) - z) * s


# ----------------------------------------------------------------------------------------------
# on-disk declarations


@dataclass(frozen=True)
class TensorDecl:
    shape: Tuple[int, ...]
    dtypes: Tuple[torch.dtype, ...]   # accepted on-disk dtypes; the first one is the default
    optional: bool = False


def declare(spec: W4Spec, n: int, k: int, name: str = "<module>") -> Dict[str, TensorDecl]:
    """The on-disk tensors of one module (without bias). Raises for shapes the layout cannot hold."""
    gs = spec.effective_group(k)
    if spec.weight_type == "nvfp4":
        gs = 16
    if spec.weight_type != "int8" and spec.bits != 4:
        raise NotImplementedError(f"{name}: {spec.bits}-bit {spec.layout} weights are not supported; supported bits: [4]")
    if spec.group_size != -1 and (spec.group_size <= 0 or k % gs):
        raise LayoutError(
            f"{name}: in_features K={k} is not divisible by group_size={spec.group_size} ({spec.layout}); "
            "a group size that divides K is required")
    g = k // gs
    F = SCALE_DTYPES
    L = spec.layout
    if L in ("gptq", "awq"):
        if n % 8 or (L == "gptq" and k % 8):
            raise LayoutError(f"{name}: {L} packing needs N and K divisible by 8, got N={n}, K={k}")
        d = {
            "qweight": TensorDecl((k // 8, n) if L == "gptq" else (k, n // 8), (torch.int32,)),
            "qzeros": TensorDecl((g, n // 8), (torch.int32,)),
            "scales": TensorDecl((g, n), (torch.float16,) + F),
        }
        if L == "gptq" and spec.has_g_idx:
            d["g_idx"] = TensorDecl((k,), (torch.int32, torch.int64))
        return d
    if L == "ct_pack":
        if k % 8 or (not spec.sym and n % 8):
            raise LayoutError(f"{name}: pack-quantized needs K (and N when asymmetric) divisible by 8, got N={n}, K={k}")
        d = {
            "weight_packed": TensorDecl((n, k // 8), (torch.int32,)),
            "weight_scale": TensorDecl((n, g), (torch.bfloat16,) + F),
            "weight_shape": TensorDecl((2,), (torch.int64, torch.int32)),
        }
        if not spec.sym:
            d["weight_zero_point"] = TensorDecl((n // 8, g), (torch.int32,))
        return d
    if L == "ct_int":
        return {"weight": TensorDecl((n, k), (torch.int8,)), "weight_scale": TensorDecl((n, g), (torch.bfloat16,) + F)}
    if L in ("ct_nvfp4", "modelopt_nvfp4"):
        if k % 16:
            raise LayoutError(f"{name}: NVFP4 needs K divisible by 16, got K={k}")
        key = "weight_packed" if L == "ct_nvfp4" else "weight"
        d = {key: TensorDecl((n, k // 2), (torch.uint8,)), "weight_scale": TensorDecl((n, k // 16), (FP8,))}
        if L == "ct_nvfp4":
            d["weight_global_scale"] = TensorDecl((1,), (torch.float32,))
            if spec.has_input_scale:
                d["input_global_scale"] = TensorDecl((1,), (torch.float32,))
        else:
            d["weight_scale_2"] = TensorDecl((), (torch.float32,))
            if spec.has_input_scale:
                d["input_scale"] = TensorDecl((), (torch.float32,))
        return d
    raise NotImplementedError(f"{name}: layout {L!r} has no declaration")


# ----------------------------------------------------------------------------------------------
# checkpoint tensors -> QWeight


def _finite(name: str, tname: str, t: torch.Tensor) -> None:
    bad = ~torch.isfinite(t.float())
    if bool(bad.any()):
        i = tuple(int(x) for x in bad.nonzero()[0])
        raise LayoutError(f"{name}.{tname}: {int(bad.sum())} non-finite value(s) (first at index {i}: "
                          f"{t[i].item()}); scales must be finite")


def to_qweight(spec: W4Spec, t: Dict[str, torch.Tensor], n: int, k: int, name: str = "<module>") -> QWeight:
    """Build the canonical :class:`QWeight` from a module's checkpoint tensors (views, no weight copy)."""
    L = spec.layout
    gs = spec.effective_group(k)
    if L in ("gptq", "awq"):
        _finite(name, "scales", t["scales"])
        scales = t["scales"].to(torch.float32).t().contiguous()
        qzeros = t["qzeros"]
        if L == "gptq" and spec.zero_plus_one:
            qzeros = qzeros.to(torch.int64) + V1_ZERO_OFFSET  # carries included; unpack_nibbles drops bit 32 up
        zeros = unpack_nibbles(qzeros, 1, SEQ_SLOTS if L == "gptq" else AWQ_SLOTS).to(torch.float32)
        g_idx = None
        if L == "gptq" and "g_idx" in t:
            g_idx = t["g_idx"].to(torch.int64)
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[1]:
                raise LayoutError(f"{name}.g_idx: values range over [{int(g_idx.min())}, {int(g_idx.max())}], "
                                  f"expected group indices in [0, {scales.shape[1] - 1}]")
            if torch.equal(g_idx, torch.arange(k, device=g_idx.device) // gs):
                g_idx = None
        if L == "gptq":
            codes, pack_dim, slots = t["qweight"].t(), "k", SEQ_SLOTS
        else:
            codes, pack_dim, slots = t["qweight"].t(), "n", AWQ_SLOTS
        # symmetric GPTQ / AWQ checkpoints store every zero point as 8: say "symmetric" (None), so the kernels take
        # their symmetric path and hold no zero * scale tensor (the same weights: (q - 8) * s either way)
        zeros = None if bool((zeros == 8).all()) else zeros.t().contiguous()
        return QWeight("int4", n, k, gs, codes, pack_dim, slots, scales, zeros, None, g_idx)
    if L == "ct_pack":
        _finite(name, "weight_scale", t["weight_scale"])
        shape = tuple(int(x) for x in t["weight_shape"].tolist())
        if shape != (n, k):
            raise LayoutError(f"{name}.weight_shape: found {list(shape)}, expected [{n}, {k}] (the module's [out, in])")
        zeros = None
        if "weight_zero_point" in t:
            zeros = unpack_nibbles(t["weight_zero_point"], 0, SEQ_SLOTS).to(torch.float32)
        return QWeight("int4", n, k, gs, t["weight_packed"], "k", SEQ_SLOTS,
                       t["weight_scale"].to(torch.float32), zeros)
    if L == "ct_int":
        _finite(name, "weight_scale", t["weight_scale"])
        w = t["weight"]
        if spec.bits == 4:
            lo, hi = int(w.min()), int(w.max())
            if lo < -8 or hi > 7:
                raise LayoutError(f"{name}.weight: int4-in-int8 values range over [{lo}, {hi}], expected [-8, 7]")
        return QWeight("int8", n, k, gs, w, "none", SEQ_SLOTS, t["weight_scale"].to(torch.float32))
    if L in ("ct_nvfp4", "modelopt_nvfp4"):
        key = "weight_packed" if L == "ct_nvfp4" else "weight"
        _finite(name, "weight_scale", t["weight_scale"])
        if L == "ct_nvfp4":
            gsc = t["weight_global_scale"]
            _finite(name, "weight_global_scale", gsc)
            # compressed-tensors writes 448*6/amax(W) (clamped to the fp32 max for an all-zero W): always > 0. A
            # negative divisor would silently flip the sign of every weight, 0 has no meaning
            if not float(gsc.reshape(-1)[0]) > 0.0:
                raise LayoutError(f"{name}.weight_global_scale: found {float(gsc.reshape(-1)[0])}, expected a "
                                  "positive divisor (compressed-tensors writes 448*6/amax(W))")
            glob = 1.0 / float(gsc.reshape(-1)[0])
        else:
            _finite(name, "weight_scale_2", t["weight_scale_2"])
            glob = float(t["weight_scale_2"].reshape(-1)[0])
            # ModelOpt writes amax(W)/(6*448) >= 0. A negative multiplier would silently flip the sign of every
            # weight; 0 is what ModelOpt writes for an all-zero weight and dequantizes to exactly those zeros, so it
            # stays accepted
            if glob < 0.0:
                raise LayoutError(f"{name}.weight_scale_2: found {glob}, expected a multiplier >= 0 "
                                  "(ModelOpt writes amax(W)/(6*448))")
        packed = t[key]
        codes = packed.contiguous().view(torch.int32)  # little-endian: low nibble of byte j = column 2j
        return QWeight("nvfp4", n, k, 16, codes, "k", SEQ_SLOTS, t["weight_scale"].view(torch.uint8), None, glob)
    raise NotImplementedError(f"{name}: layout {L!r} is not supported")


# ----------------------------------------------------------------------------------------------
# codes + scales -> checkpoint tensors (the writers' half)


# The tensor of each layout that holds the weight codes (the big one). QuantLinear may drop it once a kernel has
# repacked it, and rebuild it with pack_codes from the kernel's copy when it is asked for (state_dict, save).
CODE_TENSOR = {"gptq": "qweight", "awq": "qweight", "ct_pack": "weight_packed", "ct_int": "weight",
               "ct_nvfp4": "weight_packed", "modelopt_nvfp4": "weight"}


def pack_codes(spec: W4Spec, codes: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The code tensor (``CODE_TENSOR[spec.layout]``) exactly as on disk, from codes ``[N, K]`` (int4 / E2M1
    codes 0..15, or int8 values). Packs ``chunk`` rows or columns at a time (bounded int32 temporaries)."""
    n, k = codes.shape
    L = spec.layout
    if L == "gptq":     # [K/8, N], nibbles along K
        return torch.cat([pack_nibbles(codes[i:i + chunk].t(), 0, SEQ_SLOTS) for i in range(0, n, chunk)], 1)
    if L == "awq":      # [K, N/8], nibbles along N in AWQ order
        return torch.cat([pack_nibbles(codes[:, i:i + chunk].t(), 1, AWQ_SLOTS) for i in range(0, k, chunk)], 0)
    if L == "ct_pack":  # [N, K/8], nibbles along K
        return torch.cat([pack_nibbles(codes[i:i + chunk], 1, SEQ_SLOTS) for i in range(0, n, chunk)], 0)
    if L == "ct_int":
        return codes.to(torch.int8).contiguous()
    if L in ("ct_nvfp4", "modelopt_nvfp4"):  # [N, K/2] bytes, even k in the low nibble
        c = codes.to(torch.uint8)
        return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()
    raise NotImplementedError(f"layout {L!r} is not supported")


def pack(spec: W4Spec, codes: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor] = None,
         global_scale: Optional[float] = None, g_idx: Optional[torch.Tensor] = None,
         scale_dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """Write one module's tensors in ``spec.layout``.

    ``codes`` ``[N, K]``: int4 unsigned codes 0..15 (dense = (code - zero) * scale, zero 8 when
    ``zeros`` is None); int8 signed values; nvfp4 E2M1 codes. ``scales`` float ``[N, G]`` (nvfp4:
    float8_e4m3fn ``[N, K/16]``); ``zeros`` int ``[N, G]`` true zero points in code units;
    ``global_scale``: nvfp4 value in the file's convention (CT divisor, ModelOpt multiplier).
    """
    n, k = codes.shape
    L = spec.layout
    if L in ("gptq", "awq"):
        z = zeros if zeros is not None else torch.full(scales.shape, 8, dtype=torch.int64)
        z = z.to(torch.int64)
        sd = scale_dtype or torch.float16
        out = {"scales": scales.t().contiguous().to(sd), "qweight": pack_codes(spec, codes)}
        if L == "gptq":
            out["qzeros"] = pack_nibbles(z.t(), 1, SEQ_SLOTS)
            if spec.zero_plus_one:
                w = (out["qzeros"].to(torch.int64) - V1_ZERO_OFFSET) & 0xFFFFFFFF
                out["qzeros"] = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
            if g_idx is not None or spec.has_g_idx:
                gs = spec.effective_group(k)
                out["g_idx"] = (g_idx if g_idx is not None else torch.arange(k) // gs).to(torch.int32)
        else:
            out["qzeros"] = pack_nibbles(z.t(), 1, AWQ_SLOTS)
        return out
    if L == "ct_pack":
        out = {"weight_packed": pack_codes(spec, codes),
               "weight_scale": scales.to(scale_dtype or torch.bfloat16).contiguous(),
               "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        if not spec.sym:
            out["weight_zero_point"] = pack_nibbles(zeros.to(torch.int64), 0, SEQ_SLOTS)
        return out
    if L == "ct_int":
        return {"weight": pack_codes(spec, codes),
                "weight_scale": scales.to(scale_dtype or torch.bfloat16).contiguous()}
    if L in ("ct_nvfp4", "modelopt_nvfp4"):
        packed = pack_codes(spec, codes)
        out = {"weight_scale": scales.to(FP8).contiguous()}
        if L == "ct_nvfp4":
            out["weight_packed"] = packed
            out["weight_global_scale"] = torch.tensor([global_scale], dtype=torch.float32)
        else:
            out["weight"] = packed
            out["weight_scale_2"] = torch.tensor(global_scale, dtype=torch.float32)
        return out
    raise NotImplementedError(f"layout {L!r} is not supported")
