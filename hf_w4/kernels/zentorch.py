"""zentorch kernels: AMD's ZenDNN plugin for PyTorch (``pip install zentorch==2.13.0.2`` for torch 2.13), used
only when ``zentorch`` imports, the CPU is an AMD Zen (``/proc/cpuinfo`` vendor AuthenticAMD, family >= 0x17) and it
has AVX-512 (F/BW/VL/DQ, x86-64-v4: Zen 4 and later; ``zentorch_woq_linear`` also AVX512-BF16). On an AVX2-only
Zen 3 (EPYC Milan) zentorch 2.13.0.2 imports, then ``zentorch_dynamic_qlinear`` dies of SIGILL and
``zentorch_woq_linear`` returns wrong results; on an Intel Xeon whose AVX-512 came without BF16 (a VM hiding it)
``zentorch_woq_linear`` returned garbage (values up to 1e36, NaN) while ``zentorch_dynamic_qlinear`` was right.

Two kernel classes, because the two zentorch ops rank differently against hf_w4's own kernels
(``python -m hf_w4.tools.bench --int8``; numbers in docs/performance.md):

* ``zentorch_w4a16``: ``zentorch_woq_linear`` for int4 weights with bf16 activations (no g_idx). Symmetric
  weights use ``zentorch_woq_repack_weight`` (int4 values -8..7) with fp32 group scales; asymmetric ones the
  int4pack route (``_convert_weight_to_int4pack_for_cpu`` + ``zentorch_woq_repack_from_int4pack``) with bf16
  scales and bf16 additive zeros ``(8 - zero) * scale``, i.e. the zero point is rounded to bf16 as in
  torch's int4pack. Group count K/G must be a multiple of 4 or 1 (zentorch returns wrong results for K/G = 2).
* ``zentorch_int8``: ``zentorch_dynamic_qlinear`` for W8A8 (int8 weights, per-channel scales, fp32/bf16
  activations, prepacked with ``zentorch_weight_prepack_for_dynamic_qlinear``) and W4A8 (symmetric int4, or
  compressed-tensors int4-in-int8, K/G a multiple of 4, bf16 activations). zentorch quantizes activations
  with its own rule, not compressed-tensors' (max|x|/127.5, round half to even): results differ from the
  reference path by ~1 % of max |y| (measured in tests/kernels/test_zentorch.py), versus fp32 rounding for cpu_int8.

Priorities come from the decode regime (M = 1..4, cold weights; ``python -m hf_w4.tools.bench --int8``): both classes
rank below hf_w4's own kernels (see PRIORITY below), so they are used only when those cannot run a layer or are
disabled (``disabled_kernels=["cpu_int8"]``) or forced (``kernel="zentorch_int8"``).

Caveat (seen in tests/kernels/test_zentorch.py): ZenDNN caches reordered weights / zero-point compensation keyed by the
weight's address; with the default in-place cache a tensor freed and another allocated at the same address gave
stale results and NaN. hf_w4 sets ``ZENDNNL_MATMUL_WEIGHT_CACHE=0`` and ``ZENDNNL_ZP_COMP_CACHE=0`` (unless set)
before importing zentorch; even then, results were only reliable while every prepared weight stayed alive, which
holds for a loaded model (its buffers live as long as the model) but not if layers are re-prepared in a loop.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from .. import layouts
from ..formats.spec import W4Spec
from .base import OK, Kernel
from .registry import register

# read once per process by ZenDNN, so they are set before the first `import zentorch` (see zentorch_import_status)
_ZENDNN_SAFE_ENV = ("ZENDNNL_MATMUL_WEIGHT_CACHE", "ZENDNNL_ZP_COMP_CACHE")


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> dict:
    """The first CPU's ``/proc/cpuinfo`` fields (empty with an ``error`` key when it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError as e:
        return {"error": f"cannot read /proc/cpuinfo ({e})"}
    out = {}
    for line in info.splitlines():
        key, sep, val = line.partition(":")
        if sep:
            out.setdefault(key.strip(), val.strip())
    return out


@functools.lru_cache(maxsize=None)
def _amd_zen() -> Optional[str]:
    """None when this is an AMD Zen CPU, else the reason it is not."""
    info = _cpuinfo()
    if "error" in info:
        return info["error"]
    vendor = info.get("vendor_id")
    try:
        family = int(info.get("cpu family", ""))
    except ValueError:
        family = None
    if vendor != "AuthenticAMD":
        return f"CPU vendor is {vendor or 'unknown'}, not AuthenticAMD (zentorch targets AMD Zen)"
    if family is None or family < 0x17:
        return f"AMD CPU family {family} is older than Zen (family 0x17)"
    return None


_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


@functools.lru_cache(maxsize=None)
def _avx512(bf16: bool = False) -> Optional[str]:
    """None when the CPU has the AVX-512 subsets ZenDNN's kernels execute (``bf16``: also AVX512-BF16, which
    zentorch_woq_linear needs), else the reason."""
    info = _cpuinfo()
    if "error" in info:
        return info["error"]
    flags = info.get("flags", "").split()
    missing = [f for f in _AVX512 if f not in flags]
    if missing:
        return (f"this CPU lacks {'/'.join(missing)} (zentorch needs AVX-512: Zen 4 or later; on an AVX2-only "
                "CPU its int8 op dies of SIGILL and its int4 op returns wrong results)")
    if bf16 and "avx512_bf16" not in flags:
        return ("this CPU lacks avx512_bf16 (zentorch_woq_linear computes in bf16; on an AVX-512 CPU without it "
                "its results were garbage)")
    return None


@functools.lru_cache(maxsize=None)
def zentorch_runnable(w4a16: bool = False) -> str:
    """'' when zentorch's ops (``w4a16``: zentorch_woq_linear) can run on this CPU (AVX-512, zentorch importable),
    whatever the vendor, else why not."""
    return _avx512(bf16=w4a16) or zentorch_import_status()


@functools.lru_cache(maxsize=None)
def zentorch_status(w4a16: bool = False) -> str:
    """'' when the zentorch kernels (``w4a16``: the W4A16 one) may be selected here (AMD Zen with AVX-512, zentorch
    importable), else why not."""
    return _amd_zen() or zentorch_runnable(w4a16)


@functools.lru_cache(maxsize=None)
def zentorch_import_status() -> str:
    """'' when ``import zentorch`` works and has the ops used here (whatever the CPU), else why not."""
    # ZenDNN caches reordered weights keyed by their address, by default *in place* (it rewrites the caller's
    # buffer), plus zero-point compensation: a tensor freed and another allocated at the same address then
    # reads the stale cache (wrong results / NaN seen in tests/kernels/test_zentorch.py). Off unless the user chose.
    for var in _ZENDNN_SAFE_ENV:
        os.environ.setdefault(var, "0")
    try:
        import zentorch  # noqa: F401  (registers torch.ops.zentorch)
    except Exception as e:  # noqa: BLE001 - any import failure means unavailable
        return f"zentorch is not importable: {type(e).__name__}: {e}"
    need = ("zentorch_woq_linear", "zentorch_woq_repack_weight", "zentorch_woq_repack_from_int4pack",
            "zentorch_dynamic_qlinear", "zentorch_weight_prepack_for_dynamic_qlinear")
    missing = [op for op in need if not hasattr(torch.ops.zentorch, op)]
    if missing:
        return f"this zentorch lacks {missing}"
    return ""


def _groups_ok(k: int, gs: int) -> bool:
    g = k // gs
    return g == 1 or g % 4 == 0


def _sym_int4(qw: layouts.QWeight) -> bool:
    return qw.weight_type == "int4" and (qw.zeros is None or bool((qw.zeros == 8).all()))


def _signed_int4(qw: layouts.QWeight) -> torch.Tensor:
    """int8 [N, K] with values -8..7 (symmetric int4 QWeight, or int4 held in int8)."""
    if qw.weight_type == "int8":
        return qw.codes.to(torch.int8).contiguous()
    return (layouts.unpack_codes(qw) - 8).to(torch.int8)


# ------------------------------------------------------------------------------------------------ prepare/run
def _require_zentorch(w4a16: bool = False) -> None:
    why = zentorch_runnable(w4a16)
    if why:
        raise RuntimeError(why)


def prepare_w4a16(qw: layouts.QWeight):
    """-> (packed int32 [N, K/8], scales [G, N], zeros bf16 [G, N] or None) for zentorch_woq_linear."""
    _require_zentorch(w4a16=True)
    if _sym_int4(qw):
        w4 = torch.ops.zentorch.zentorch_woq_repack_weight(_signed_int4(qw))
        return w4, qw.scales.t().contiguous(), None
    codes = layouts.unpack_codes(qw).to(torch.int32)
    w4 = torch.ops.zentorch.zentorch_woq_repack_from_int4pack(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
    z = ((8.0 - qw.zeros) * qw.scales).t().contiguous().to(torch.bfloat16)
    return w4, qw.scales.t().contiguous().to(torch.bfloat16), z


def run_w4a16(state, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    w4, s, z = state
    lead = x.shape[:-1]
    b = None if bias is None else bias.to(torch.bfloat16)
    y = torch.ops.zentorch.zentorch_woq_linear(x.reshape(-1, x.shape[-1]), w4.t(), s, z, b,
                                               zentorch_op_name="zentorch_woq_linear")
    return y.reshape(*lead, y.shape[-1])


def prepare_w8a8(qw: layouts.QWeight):
    """-> (prepacked int8 weight, fp32 per-channel scales [N]) for zentorch_dynamic_qlinear."""
    _require_zentorch()
    w8 = torch.ops.zentorch.zentorch_weight_prepack_for_dynamic_qlinear(qw.codes.to(torch.int8).contiguous())
    return w8, qw.scales.reshape(-1).contiguous()


def run_w8a8(state, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    w8, s = state
    lead = x.shape[:-1]
    b = None if bias is None else bias.to(x.dtype)
    y = torch.ops.zentorch.zentorch_dynamic_qlinear(x.reshape(-1, x.shape[-1]), w8, s, b, is_weight_prepacked=True)
    return y.reshape(*lead, y.shape[-1])


def prepare_w4a8(qw: layouts.QWeight):
    """-> (int32 [N, K/8] packed int4, fp32 scales [G, N]) for zentorch_dynamic_qlinear (W4A8)."""
    _require_zentorch()
    w4 = torch.ops.zentorch.zentorch_woq_repack_weight(_signed_int4(qw))
    return w4, qw.scales.t().contiguous()


def run_w4a8(state, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    w4, s = state
    lead = x.shape[:-1]
    b = None if bias is None else bias.to(x.dtype)
    y = torch.ops.zentorch.zentorch_dynamic_qlinear(x.reshape(-1, x.shape[-1]), w4, s, b)
    return y.reshape(*lead, y.shape[-1])


# ------------------------------------------------------------------------------------------------ kernels
class _ZentorchBase(Kernel):
    DEVICES = ("cpu",)
    SUPPORTS_G_IDX = False
    W4A16 = False  # zentorch_woq_linear: needs AVX512-BF16 too

    @classmethod
    def is_supported(cls):
        why = zentorch_status(cls.W4A16)
        return (False, why) if why else OK


@register
class ZentorchW4A16Kernel(_ZentorchBase):
    NAME = "zentorch_w4a16"
    W4A16 = True
    # decode (M=1, 4096x4096 g128, cold): zentorch_woq_linear is ~2x slower than cpu_w4a16 and torch int4pack
    # (docs/performance.md), faster only for M >= 256 where it runs a dequantize + bf16 GEMM -> below cpu_w4a16
    # (100), above the reference (-100)
    PRIORITY = 40
    WEIGHT_TYPES = frozenset({"int4"})
    ACTIVATIONS = frozenset({"none"})
    ACT_DTYPES = (torch.bfloat16,)
    K_MULTIPLE = 8
    DESCRIPTION = "zentorch_woq_linear (AMD ZenDNN) W4A16, bf16 activations"

    @classmethod
    def can_implement(cls, spec: W4Spec, n: int, k: int, device: torch.device, dtype: torch.dtype):
        ok, why = super().can_implement(spec, n, k, device, dtype)
        if not ok:
            return ok, why
        if not _groups_ok(k, spec.effective_group(k)):
            return False, f"K/group = {k // spec.effective_group(k)} is not 1 or a multiple of 4 (zentorch limit)"
        return OK

    def prepare(self, layer, qw):
        w4, s, z = prepare_w4a16(qw)
        layer.register_buffer("zt_weight", w4, persistent=False)
        layer.register_buffer("zt_scales", s, persistent=False)
        layer.register_buffer("zt_zeros", z, persistent=False)

    def apply(self, layer, x, bias):
        return run_w4a16((layer.zt_weight, layer.zt_scales, layer.zt_zeros), x, bias)


@register
class ZentorchInt8Kernel(_ZentorchBase):
    NAME = "zentorch_int8"
    # below cpu_int8 (100): zentorch_dynamic_qlinear was slower at M = 1..16 on 4096x4096 (docs/performance.md)
    PRIORITY = 90
    WEIGHT_TYPES = frozenset({"int8", "int4"})
    ACTIVATIONS = frozenset({"int8_token"})
    ACT_DTYPES = (torch.float32, torch.bfloat16)
    SUPPORTS_ASYM = False
    K_MULTIPLE = 8
    DESCRIPTION = ("zentorch_dynamic_qlinear (AMD ZenDNN) W8A8 / W4A8; its own activation quantization "
                   "(~1% of max|y| from compressed-tensors' rule)")

    @classmethod
    def can_implement(cls, spec: W4Spec, n: int, k: int, device: torch.device, dtype: torch.dtype):
        ok, why = super().can_implement(spec, n, k, device, dtype)
        if not ok:
            return ok, why
        gs = spec.effective_group(k)
        w8a8 = spec.weight_type == "int8" and spec.bits == 8
        if w8a8:
            if gs != k:
                return False, f"W8A8 needs per-channel scales (group {spec.group_size})"
            return OK
        if dtype != torch.bfloat16:
            return False, f"W4A8 needs bfloat16 activations (zentorch: 'W4A8 does not support f32 source'), got {dtype}"
        if k // gs % 4:
            return False, f"W4A8 needs K/group a multiple of 4 (zentorch limit), got {k // gs}"
        return OK

    def prepare(self, layer, qw):
        self.w8a8 = qw.weight_type == "int8" and self.spec.bits == 8
        if not self.w8a8 and qw.weight_type == "int4" and not _sym_int4(qw):
            raise NotImplementedError(f"{self.NAME}: W4A8 needs symmetric int4 weights (zero point 8)")
        st = prepare_w8a8(qw) if self.w8a8 else prepare_w4a8(qw)
        layer.register_buffer("zt_weight", st[0], persistent=False)
        layer.register_buffer("zt_scales", st[1], persistent=False)

    def apply(self, layer, x, bias):
        st = (layer.zt_weight, layer.zt_scales)
        return run_w8a8(st, x, bias) if self.w8a8 else run_w4a8(st, x, bias)
