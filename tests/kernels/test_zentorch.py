"""zentorch kernels against the reference path (runs where zentorch imports; skips with the reason otherwise).

Error budgets (relative to max |y| of the reference): zentorch_woq_linear computes in bf16 (bf16 output,
bf16 scales/zeros on the asymmetric route): 1.5e-2. zentorch_dynamic_qlinear quantizes activations with its
own rule (not compressed-tensors' max|x|/127.5 + round-half-even): 3e-2 (measured ~1e-2).
"""
import pytest
import torch
import torch.nn.functional as F

from hf_w4 import layouts
from hf_w4.formats.spec import W4Spec
from hf_w4.kernels import zentorch as zt
from hf_w4.kernels.base import fake_quantize_act

_why, _why_w4a16 = zt.zentorch_runnable(), zt.zentorch_runnable(w4a16=True)
needs_zentorch = pytest.mark.skipif(bool(_why), reason=f"zentorch unavailable: {_why}")
needs_zentorch_w4a16 = pytest.mark.skipif(bool(_why_w4a16), reason=f"zentorch_woq_linear unavailable: {_why_w4a16}")

WOQ_TOL, DYNQ_TOL = 1.5e-2, 3e-2
# ZenDNN keys internal caches by weight address; a model keeps its weights alive, so the tests do too (freed and
# re-allocated weights at a recycled address have produced stale results / NaN, see hf_w4/kernels/zentorch.py)
_KEEP = []


def keep(state):
    _KEEP.append(state)
    return state


def qweight(layout, n, k, gs, sym=True, bits=4, seed=0):
    """(spec, QWeight); the QWeight is kept alive (zentorch may reference the source tensors' addresses)."""
    g = torch.Generator().manual_seed(seed)
    G = 1 if gs == -1 else k // gs
    scales = torch.rand(n, G, generator=g) * 0.02 + 0.001
    if layout == "ct_int":
        spec = W4Spec("compressed-tensors", "ct_int", "int8", bits, gs, True, act="int8_token")
        lim = 2 ** (bits - 1)
        t = layouts.pack(spec, torch.randint(-lim, lim, (n, k), generator=g), scales)
    else:
        spec = W4Spec("gptq", layout, "int4", 4, gs, sym)
        zeros = None if sym else torch.randint(0, 16, (n, G), generator=g)
        t = layouts.pack(spec, torch.randint(0, 16, (n, k), generator=g), scales, zeros)
    qw = layouts.to_qweight(spec, t, n, k)
    _KEEP.append((t, qw))
    return spec, qw


def rel_err(y, y0):
    return float((y.float() - y0).abs().max() / y0.abs().max())


@needs_zentorch_w4a16
@pytest.mark.parametrize("layout,gs,sym", [("gptq", 128, True), ("ct_pack", 32, True), ("awq", 64, False),
                                           ("gptq", 128, False), ("ct_pack", -1, True)])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_w4a16_vs_reference(layout, gs, sym, m):
    spec, qw = qweight(layout, 192, 512, gs, sym, seed=m)
    x = torch.randn(m, 512).bfloat16()
    bias = torch.randn(192)
    y = zt.run_w4a16(keep(zt.prepare_w4a16(qw)), x, bias)
    y0 = F.linear(x.float(), layouts.dequantize(qw), bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 192)
    assert rel_err(y, y0) < WOQ_TOL


@needs_zentorch
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_w8a8_vs_reference(dtype, m):
    spec, qw = qweight("ct_int", 192, 576, -1, bits=8, seed=m)
    x = torch.randn(2, m, 576).to(dtype)
    y = zt.run_w8a8(keep(zt.prepare_w8a8(qw)), x, None)
    y0 = F.linear(fake_quantize_act(x, "int8_token", 576), layouts.dequantize(qw))
    assert y.dtype == dtype and y.shape == (2, m, 192)
    assert rel_err(y, y0) < DYNQ_TOL


@needs_zentorch
@pytest.mark.parametrize("src", ["gptq", "ct_int"])
@pytest.mark.parametrize("m", [1, 16])
def test_w4a8_vs_reference(src, m):
    spec, qw = qweight(src, 128, 1024, 128, True, bits=4, seed=m)
    x = torch.randn(m, 1024).bfloat16()
    bias = torch.randn(128)
    y = zt.run_w4a8(keep(zt.prepare_w4a8(qw)), x, bias)
    y0 = F.linear(fake_quantize_act(x, "int8_token", 1024), layouts.dequantize(qw), bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 128)
    assert rel_err(y, y0) < DYNQ_TOL


def test_cpu_gate_needs_avx512(monkeypatch):
    """An AVX2-only AMD Zen 3 is refused with the missing flags named (zentorch crashes there); Zen 4 passes. An
    AVX-512 Intel Xeon without AVX512-BF16 may run zentorch's int8 op but not zentorch_woq_linear (garbage there)."""
    zen3 = {"vendor_id": "AuthenticAMD", "cpu family": "25", "flags": "fpu sse avx avx2 fma f16c"}
    zen4 = dict(zen3, flags=zen3["flags"] + " avx512f avx512dq avx512bw avx512vl avx512_bf16")
    xeon = {"vendor_id": "GenuineIntel", "cpu family": "6", "flags": "avx2 avx512f avx512dq avx512bw avx512vl"}
    for info, ok, ok_bf16 in ((zen3, False, False), (zen4, True, True), (xeon, True, False)):
        monkeypatch.setattr(zt, "_cpuinfo", lambda info=info: info)
        zt._amd_zen.cache_clear(), zt._avx512.cache_clear()
        assert (zt._amd_zen() is None) == (info is not xeon)
        assert (zt._avx512() is None) == ok, zt._avx512()
        assert (zt._avx512(bf16=True) is None) == ok_bf16, zt._avx512(bf16=True)
        if not ok:
            assert "avx512f/avx512bw/avx512vl/avx512dq" in zt._avx512() and "SIGILL" in zt._avx512()
        elif not ok_bf16:
            assert "lacks avx512_bf16" in zt._avx512(bf16=True)
    zt._amd_zen.cache_clear(), zt._avx512.cache_clear()


@needs_zentorch
def test_kernel_classes_gate_on_amd_and_limits():
    from hf_w4.kernels.zentorch import ZentorchInt8Kernel, ZentorchW4A16Kernel
    ok, why = ZentorchW4A16Kernel.is_supported()
    amd = zt._amd_zen() is None
    assert ok == (amd and not _why_w4a16), why
    if not amd:
        assert "AuthenticAMD" in why or "Zen" in why
    dev = torch.device("cpu")
    spec = W4Spec("gptq", "gptq", "int4", 4, 256, True)
    ok, why = ZentorchW4A16Kernel.can_implement(spec, 64, 512, dev, torch.bfloat16)  # K/G = 2
    assert not ok and ("multiple of 4" in why or not amd)
    ok, why = ZentorchW4A16Kernel.can_implement(spec.replace(group_size=128), 64, 512, dev, torch.float32)
    assert not ok
    ok, why = ZentorchInt8Kernel.can_implement(spec.replace(group_size=128, act="int8_token"), 64, 512, dev,
                                               torch.float32)
    assert not ok and ("bfloat16" in why or not amd)


@needs_zentorch_w4a16
@pytest.mark.skipif(zt._amd_zen() is not None, reason=f"not an AMD Zen CPU: {zt._amd_zen()}")
def test_kernel_classes_prepare_apply_on_zen():
    from hf_w4.kernels.zentorch import ZentorchInt8Kernel, ZentorchW4A16Kernel

    class L(torch.nn.Module):
        pass

    spec, qw = qweight("gptq", 128, 512, 128, True)
    k = ZentorchW4A16Kernel(spec, 128, 512)
    layer = L()
    k.prepare(layer, qw)
    x = torch.randn(3, 512).bfloat16()
    assert rel_err(k.apply(layer, x, None), F.linear(x.float(), layouts.dequantize(qw))) < WOQ_TOL
    spec8, q8 = qweight("ct_int", 128, 512, -1, bits=8)
    k8 = ZentorchInt8Kernel(spec8, 128, 512)
    layer8 = L()
    k8.prepare(layer8, q8)
    y0 = F.linear(fake_quantize_act(x, "int8_token", 512), layouts.dequantize(q8))
    assert rel_err(k8.apply(layer8, x, None), y0) < DYNQ_TOL
