"""cpu_w4a16: the compiled W4A16 / NVFP4 CPU kernel against layouts.dequantize + F.linear (fp32).

Error budgets (elementwise, A = |x| @ |W|^T, ref = fp32 x @ W^T):
* fp32 activations: |y - ref| <= 2e-6 * A + 1e-6 * |ref| (fp32 accumulation; the fused kernels compute in
  fp32 with exact LUT weights and scale each group's partial sum; the large-M path dequantizes to fp32)
* fp16 activations: the output is rounded to fp16: |y - ref| <= 2^-11 * |ref| + 2e-6 * A
* bf16 activations (x exactly bf16): fused path: |y - ref| <= 2^-8 * |ref| + 2e-6 * A (output rounding);
  large-M path (weights rounded to bf16 once, then oneDNN bf16 GEMM): + 2^-8 * A
* int16-activation path (path 3; auto for bf16 x at small M on AVX-512): x is rounded per block of the group
  to multiples of a power of two 2^e <= the block's max|x| / 2^14, so |dx| <= 2^-15 * max|x| of its group:
  + 2^-15 * B with B = (per-group max|x|) @ |W|^T
  NVFP4 there: blocks of 16 k, or (AVX-512 VBMI, M >= 8, scales folded into the weights) of L = 128 / 64 / 32 k
  with 2^e also large enough that the block's sum of |x| / 2^e stays under ~745000 (int32 headroom), so
  |dx| <= max(2^-15 * max|x|, sum|x| / 745000) of its L-block; the budget takes the larger of the two schemes.
* blocked path (path 5; bf16 x, AVX512-BF16): the bf16 weights are exact (int4 code values; NVFP4 e2m1 x e4m3) and
  so is every product; vdpbf16ps adds two products per step into an fp32 sum (two roundings), so a sum over n <= K
  products is off by at most ~n * 2^-24 of its sum of |terms|; then one group-scale FMA / zero-point term and the
  output rounding: |y - ref| <= 2^-8 * |ref| + (K + 8) * 2^-24 * A + 2e-6 * A
"""
from __future__ import annotations

import os
import random
import re
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import default_model_as, w4a16_isa_available
from hf_w4 import _ext, layouts, ops
from hf_w4.formats.spec import W4Spec
from qweight_cases import make_qweight

pytestmark = pytest.mark.needs_ext


def _built():
    return ops.has_impl("cpu_w4a16_gemm") and ops.has_impl("cpu_w4a16_repack"), _ext.load_error()


_ok, _err = _built()
if not _ok:
    pytest.skip(f"hf_w4 extension with cpu_w4a16 ops not built: {_err}", allow_module_level=True)


_FLAGS = _ext.cpu_flags()


# the ISA levels this CPU (as the library detects it; csrc/cpu/common/cpu_features.h) can run
ISAS = [isa for isa in ("generic", "avx2", "avx512") if w4a16_isa_available(isa)]

# (layout, sym, act_order, zero_plus_one)
LAYOUTS = [
    ("gptq", True, False, False),
    ("gptq", False, False, True),       # GPTQ v1 zero-1 storage
    ("gptq", True, True, False),        # act-order g_idx
    ("gptq", False, True, False),
    ("awq", False, False, False),
    ("ct_pack", True, False, False),
    ("ct_pack", False, False, False),
    ("ct_nvfp4", True, False, False),
    ("modelopt_nvfp4", True, False, False),
]


# what a child process runs first to use this file's helpers (this folder for test_cpu_w4a16, tests/ for qweight_cases)
_HERE = os.path.dirname(os.path.abspath(__file__))
_SUBPROCESS_PRELUDE = ("import sys, torch\nsys.path[:0] = %r\nfrom test_cpu_w4a16 import make_qweight, prep\n"
                       "from hf_w4 import ops\n" % ([_HERE, os.path.dirname(_HERE)],))


def prep(qw):
    perm = layouts.act_order_perm(qw.g_idx, qw.group_size) if qw.g_idx is not None else None
    q, s, z = ops.cpu_w4a16_repack(qw, perm)
    return q, s, z, perm


def check(y, x, W, bias, path_large, what, i16_group=None, blocked=False):
    xf = x.float()
    ref = F.linear(xf, W, None if bias is None else bias.float())
    A = F.linear(xf.abs(), W.abs()) + (0 if bias is None else bias.float().abs())
    yf = y.float()
    assert y.dtype == x.dtype and y.shape == ref.shape, what
    if x.dtype == torch.float32:
        bud = 2e-6 * A + 1e-6 * ref.abs()
    elif x.dtype == torch.float16:
        bud = 2.0 ** -11 * ref.abs() + 2e-6 * A + (2.0 ** -8 * A if path_large else 0)
    else:
        bud = 2.0 ** -8 * ref.abs() + 2e-6 * A + (2.0 ** -8 * A if path_large else 0)
    if blocked:  # fp32 sums over up to K exact products (module docstring)
        bud = bud + (x.shape[1] + 8) * 2.0 ** -24 * A
    if i16_group:  # the int16-activation path may have run
        m, k = xf.shape

        def blocks(g, f):
            return f(xf.abs().reshape(m, k // g, g)).repeat_interleave(g, 1)

        if i16_group == "nvfp4":
            L = next(g for g in (128, 64, 32, 16) if k % g == 0)
            dx = torch.maximum(2.0 ** -15 * blocks(16, lambda a: a.amax(-1)),
                               torch.maximum(2.0 ** -15 * blocks(L, lambda a: a.amax(-1)),
                                             blocks(L, lambda a: a.sum(-1)) / 745000))
        else:
            dx = 2.0 ** -15 * blocks(i16_group, lambda a: a.amax(-1))
        bud = bud + F.linear(dx, W.abs())
    bad = (yf - ref).abs() > bud + 1e-30
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} elements over budget; max excess "
                                 f"{float(((yf - ref).abs() - bud).max()):.3g}")


SHAPES = [(192, 576), (96, 256), (64, 128), (40, 512), (256, 1024), (72, 160)]
GROUPS = [32, 64, 128, -1]


def _cases():
    rnd = random.Random(1234)
    cases = []
    for li, (layout, sym, ao, zp1) in enumerate(LAYOUTS):
        for j in range(3):
            n, k = SHAPES[(li + j) % len(SHAPES)] if j else (192, 576)
            gs = rnd.choice([g for g in GROUPS if g == -1 or k % g == 0])
            if layout == "awq" and n % 8 or (layout == "gptq" and k % 8):
                continue
            cases.append((layout, sym, ao, zp1, n, k, gs, li * 10 + j))
    return cases


def _group(qw, k):
    return "nvfp4" if qw.weight_type == "nvfp4" else (k if qw.group_size in (-1, 0, None) else qw.group_size)


@pytest.mark.parametrize("layout,sym,ao,zp1,n,k,gs,seed", _cases())
def test_fuzz_against_reference(layout, sym, ao, zp1, n, k, gs, seed):
    spec, qw = make_qweight(layout, n, k, gs, sym, ao, zp1, seed)
    W = layouts.dequantize(qw)
    q, s, z, perm = prep(qw)
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bias_f = torch.randn(n, generator=gen)
    for isa in ISAS:
        for M in rnd.sample([1, 2, 3, 5, 16, 17, 64, 300], 4) + [1, 4]:
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                x = torch.randn(M, k, generator=gen).to(dt)
                bias = bias_f.to(dt) if rnd.random() < 0.5 else None
                for path in (-1, 0, 1, 2, 3, 4, 5) if M in (3, 17) else (-1,):
                    y = ops.cpu_w4a16_gemm(x, q, s, z, n, qw.group_size, qw.weight_type, perm=perm, bias=bias,
                                           global_scale=qw.global_scale or 1.0, isa=isa, path=path)
                    # auto may pick the AMX path from M=3 (int4 groups of 128 or more; 64: M=4; otherwise above
                    # M=4); with the scales folded in (not the raw-code kernel) it rounds the scaled weights to bf16
                    # like the large-M path, so it gets the same budget
                    # 3 without AVX-512, 5 without AVX512-BF16 or with x not bf16 = auto
                    large = path in (1, 2) or (path in (-1, 3, 5) and M > 3) or (path == 5 and dt != torch.float32)
                    i16 = isa != "generic" and (path == 3 or (path in (-1, 5) and dt == torch.bfloat16))
                    check(y, x, W, bias, large, f"{spec.describe()} N={n} K={k} M={M} {dt} isa={isa} path={path}",
                          i16_group=_group(qw, k) if i16 else None, blocked=path == 5)


@pytest.mark.parametrize("isa", ISAS)
def test_isa_paths_agree_smollm_shape(isa):
    """SmolLM2 shape (N=192 is not a multiple of 64, K=576): every ISA path equals the reference."""
    spec, qw = make_qweight("gptq", 192, 576, 64, sym=False)
    W = layouts.dequantize(qw)
    q, s, z, perm = prep(qw)
    for M in (1, 2, 7):
        x = torch.randn(M, 576)
        y = ops.cpu_w4a16_gemm(x, q, s, z, 192, 64, "int4", isa=isa, path=0)
        check(y, x, W, None, False, f"isa={isa} M={M}")


def test_repack_layout_and_rate():
    spec, qw = make_qweight("ct_pack", 256, 1024, 128)
    q, s, z, _ = prep(qw)
    assert q.shape == (8, 512, 32) and q.dtype == torch.uint8
    assert s.shape == (8, 8, 32) and s.dtype == torch.float32 and z.numel() == 0
    codes = layouts.unpack_codes(qw)
    # byte i of k-pair j in panel p: low nibble = column 32p + i//2, high = 32p + 16 + i//2, k = 2j + i%2
    assert int(q[1, 3, 5]) & 15 == int(codes[32 + 2, 7]) and int(q[1, 3, 5]) >> 4 == int(codes[48 + 2, 7])
    # rate: loose floor here (shared, noisy box); hf-w4 bench reports the real number
    spec, qw = make_qweight("gptq", 2048, 2048, 128)
    prep(qw)
    t0 = time.perf_counter()
    prep(qw)
    dt = time.perf_counter() - t0
    assert 2048 * 2048 / 2 / dt > 0.05e9


def test_opcheck():
    spec, qw = make_qweight("ct_pack", 64, 256, 64, sym=False)
    args = (qw.codes, qw.pack_dim, list(qw.slots), qw.scales, qw.zeros, None, qw.n, qw.k, qw.group_size, "int4")
    torch.library.opcheck(torch.ops.hf_w4.cpu_w4a16_repack, args)
    q, s, z = torch.ops.hf_w4.cpu_w4a16_repack(*args)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.hf_w4.cpu_w4a16_gemm, (x, q, s, z, None, None, 64, 64, "int4", 1.0, "", -1))
    spec, qw = make_qweight("modelopt_nvfp4", 64, 256, 16)
    q, s, z = torch.ops.hf_w4.cpu_w4a16_repack(qw.codes, "k", list(qw.slots), qw.scales, None, None, 64, 256, 16,
                                               "nvfp4")
    torch.library.opcheck(torch.ops.hf_w4.cpu_w4a16_gemm,
                          (torch.randn(2, 256), q, s, z, None, torch.randn(64), 64, 16, "nvfp4", 0.5, "", -1))
    # the registered autograd formula (input and bias gradients)
    torch.library.opcheck(torch.ops.hf_w4.cpu_w4a16_gemm, (torch.randn(2, 256, requires_grad=True), q, s, z, None,
                                                           torch.randn(64, requires_grad=True), 64, 16, "nvfp4", 0.5,
                                                           "", -1))
    torch.library.opcheck(torch.ops.hf_w4.cpu_w4a16_quant_x16, (torch.randn(3, 256, dtype=torch.bfloat16), 32, 0, ""))


def test_registry_selects_and_rejects():
    from hf_w4.kernels import registry
    from hf_w4.kernels.cpu_w4a16 import CpuW4A16Kernel
    cpu = torch.device("cpu")
    spec = W4Spec(method="gptq", layout="gptq", weight_type="int4", bits=4, group_size=128, sym=True)
    cls, _ = registry.select(spec, 4096, 4096, cpu, torch.bfloat16)
    assert cls is CpuW4A16Kernel
    nv = W4Spec(method="modelopt", layout="modelopt_nvfp4", weight_type="nvfp4", bits=4, group_size=16, sym=True)
    assert registry.select(nv, 192, 576, cpu, torch.float32)[0] is CpuW4A16Kernel
    # a shape the kernel rejects: odd K (channel-wise) -> falls back with the reason text
    odd = spec.replace(layout="ct_pack", group_size=-1)
    ok, why = CpuW4A16Kernel.can_implement(odd, 64, 4095, cpu, torch.float32)
    assert not ok and "odd" in why
    cls, reasons = registry.select(odd, 64, 4095, cpu, torch.float32)
    assert cls is not CpuW4A16Kernel and "odd" in reasons["cpu_w4a16"]
    assert not CpuW4A16Kernel.can_implement(spec, 64, 64, torch.device("meta"), torch.float32)[0]


def test_kernel_class_prepare_apply():
    from hf_w4.kernels.cpu_w4a16 import CpuW4A16Kernel
    spec, qw = make_qweight("gptq", 96, 256, 32, sym=False, act_order=True)
    W = layouts.dequantize(qw)
    layer = torch.nn.Module()
    kern = CpuW4A16Kernel(spec, 96, 256)
    kern.prepare(layer, qw)
    assert "w4a16_qpack" in dict(layer.named_buffers()) and not layer.state_dict()
    x = torch.randn(2, 5, 256)
    bias = torch.randn(96)
    y = kern.apply(layer, x, bias)
    assert y.shape == (2, 5, 96)
    check(y.reshape(10, 96), x.reshape(10, 256), W, bias, False, "kernel class")


@pytest.mark.parametrize("layout,n", [("awq", 4096 // 16), ("awq", 72), ("gptq", 96), ("ct_pack", 80)])
def test_repack_simd_matches_portable(layout, n, monkeypatch):
    """The AWQ SIMD repack (auto ISA) must give byte-identical output to the portable code (exact: no error budget),
    including a partial last panel (n = 72, 80) that falls back to the portable loop."""
    spec, qw = make_qweight(layout, n, 512, 128, sym=False, seed=3)
    monkeypatch.setenv("HF_W4_ISA", "generic")
    ref = ops.cpu_w4a16_repack(qw)
    monkeypatch.delenv("HF_W4_ISA")
    for isa in ISAS:
        monkeypatch.setenv("HF_W4_ISA", isa)
        got = ops.cpu_w4a16_repack(qw)
        for a, b in zip(ref, got):
            assert torch.equal(a, b), f"{layout} n={n} isa={isa}"


AMX = {"amx_bf16", "amx_tile", "avx512_bf16"} <= _FLAGS


@pytest.mark.parametrize("layout,sym,ao,gs", [("gptq", True, False, 128), ("gptq", False, True, 64),
                                              ("awq", False, False, 32), ("gptq", False, False, 16),
                                              ("gptq", True, False, 16),
                                              ("ct_nvfp4", True, False, 16),
                                              ("modelopt_nvfp4", True, False, 16)])
def test_amx_path(layout, sym, ao, gs, monkeypatch):
    """Forced AMX path (path=2, bf16 x) incl. 1, 2 and 3 16-row blocks, the raw-code kernel (M <= 32: int4 groups
    of a multiple of 32), NVFP4's fp16-product decode (M <= 32 with AVX512-FP16; see also
    test_amx_nvfp4_fp32_decode_fallback), the streaming scale-folding one (M <= 32 otherwise: int4 g16) and the
    blocked scale-folding one (M > 32), a
    partial last panel (N=200) and bias; budget = the large-M budget (weights*scales rounded to bf16, fp32
    accumulation): 2^-8 |ref| + 2^-8 sum|x||w| + 2e-6 sum|x||w|. Without AMX (other CPUs, isa capped to
    avx2/generic, or HF_W4_AMX=0 in the environment) path=2 must fall back to a correct path."""
    n, k = 200, 512
    spec, qw = make_qweight(layout, n, k, gs, sym=sym, act_order=ao, seed=11)
    W = layouts.dequantize(qw)
    q, s, z, perm = prep(qw)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    for isa in ISAS:
        for M in (1, 6, 8, 9, 16, 17, 33, 70):
            x = torch.randn(M, k, generator=gen).to(torch.bfloat16)
            for b in (None, bias):
                y = ops.cpu_w4a16_gemm(x, q, s, z, n, qw.group_size, qw.weight_type, perm=perm, bias=b,
                                       global_scale=qw.global_scale or 1.0, isa=isa, path=2)
                check(y, x, W, b, True, f"amx {layout} M={M} isa={isa} bias={b is not None}",
                      i16_group=_group(qw, k) if isa != "generic" and not AMX else None)
                y2 = ops.cpu_w4a16_gemm(x, q, s, z, n, qw.group_size, qw.weight_type, perm=perm, bias=b,
                                        global_scale=qw.global_scale or 1.0, isa=isa, path=-1)
                check(y2, x, W, b, M > 4, f"auto {layout} M={M} isa={isa}",
                      i16_group=_group(qw, k) if isa != "generic" else None)


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX-BF16")
@pytest.mark.parametrize("threads,k", [(1, 1024), (1, 8192), (2, 2176), (2, 10240)])
def test_amx_panel_blocks(threads, k):
    """The AMX path for M > 32 decodes blocks of 8 panels x K chunks of <= 2048 (N = 328 -> 11 panels: a full
    block, a short last block and a partial last panel; K = 1024: one short chunk; 8192 / 10240: 4 / 5 chunks with
    the C tiles spilled in between; 2176: a 128-k last chunk), with the next row block prefetched; same budget as
    above."""
    n = 328
    spec, qw = make_qweight("gptq", n, k, 128, sym=False, act_order=False, seed=12)
    W = layouts.dequantize(qw)
    q, s, z, perm = prep(qw)
    x = torch.randn(97, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = ops.cpu_w4a16_gemm(x, q, s, z, n, qw.group_size, qw.weight_type, perm=perm, path=2)
    finally:
        torch.set_num_threads(old)
    check(y, x, W, None, True, f"amx blocks threads={threads} K={k}")


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX-BF16")
@pytest.mark.parametrize("k,gs,sym", [(128, 128, True), (384, 128, False), (192, 64, True), (96, 32, False),
                                      (640, 640, True)])
def test_amx_raw_group_counts(k, gs, sym):
    """The raw-code AMX kernel (int4, M <= 32, groups of a multiple of 32) with one, an odd and an even number of
    groups per panel: with M <= 16 the groups alternate between two tile sets and each group's C is read back behind
    the next group's products (the last group after the loop); M = 17 / 32 take the two-block tiles. Same budget as
    test_amx_path."""
    n = 72
    spec, qw = make_qweight("gptq", n, k, gs, sym=sym, act_order=False, seed=13)
    W = layouts.dequantize(qw)
    q, s, z, perm = prep(qw)
    gen = torch.Generator().manual_seed(7)
    for M in (1, 2, 5, 16, 17, 32):
        x = torch.randn(M, k, generator=gen).to(torch.bfloat16)
        y = ops.cpu_w4a16_gemm(x, q, s, z, n, qw.group_size, qw.weight_type, perm=perm, path=2)
        check(y, x, W, None, True, f"amx raw K={k} g={gs} sym={sym} M={M}")


def quant_x16_ref(x, block, l1max=0):
    """The int16 path's activation quantizer (csrc/cpu/w4a16.h) in torch: per row and block, the scale 2^s with
    s = (exponent of the block's max |x|; -100 for a zero block) - 14, raised while the block's sum of |x| / 2^s
    exceeds (l1max - block / 2) (1 - 2^-10); xq = x / 2^s rounded half to even, saturated to int16; xd = the sum of
    xq. (A nonzero max below 2^-100 is an error there: test_quant_x16_bit_exact.)"""
    xf = x.float()
    m, k = xf.shape
    b = xf.reshape(m, k // block, block)
    amax = b.abs().amax(-1)
    e = torch.where(amax > 0, torch.frexp(amax).exponent - 1, torch.full_like(amax, -100, dtype=torch.int32))
    s = e.clamp(min=-100) - 14
    if l1max > 0:
        l1 = b.abs().double().sum(-1)
        t = (l1max - block // 2) * (1 - 2.0 ** -10)
        while True:
            over = l1 * torch.pow(2.0, -s.double()) > t
            if not bool(over.any()):
                break
            s = s + over.int()
    q = torch.round(b * torch.pow(2.0, -s.float()).unsqueeze(-1)).clamp(-32768, 32767)
    return q.reshape(m, k).to(torch.int16), torch.pow(2.0, s.float()), q.sum(-1).int()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quant_x16_bit_exact(isa, dtype):
    """cpu_w4a16_quant_x16 (the int16 path's activation quantizer; portable, AVX2, AVX-512; rows in parallel from
    16 Ki elements) against quant_x16_ref, bit for bit: blocks of 16 .. 128 and 20 (not a multiple of 16: the portable
    code on AVX2), rows of 1e-29 .. 1e29 (fp16: 1e-4 .. 1e4), zeros, fp16-flushed denormals, exact ties, fp32 values
    that round up to 32768 (saturated to 32767, and summed as such), a block-sum bound (l1max) that raises the scale,
    and inf / nan or a block whose nonzero max is below 2^-100, denormals included (alone, anywhere in a block: an
    error; the gemm takes its fp32 path there)."""
    gen = torch.Generator().manual_seed(3)
    for k, block in ((256, 16), (256, 32), (320, 64), (512, 128), (160, 20)):
        for M in (1, 5, 130):
            span = 4 if dtype == torch.float16 else 29
            x = torch.randn(M, k, generator=gen) * torch.logspace(-span, span, M)[:, None]
            x[0, :block] = 0.0
            if M > 1:
                if dtype == torch.float16:
                    x[1, :block] = torch.randn(block, generator=gen) * 1e-40  # zero in fp16
                x[1, block:2 * block] = torch.arange(block) * 0.5 - block / 4  # 2^-15 steps of 2^14: ties
                if dtype == torch.float32:
                    x[M - 1, :block] = torch.randn(block, generator=gen)
                    x[M - 1, :2] = torch.tensor([1.9999999, -1.9999999]) * 2.0 ** 5  # 32767.998 -> 32768
            x = x.to(dtype)
            for l1max in (0, 745654, 3000):
                xq, xs, xd = torch.ops.hf_w4.cpu_w4a16_quant_x16(x, block, l1max, isa)
                rq, rs, rd = quant_x16_ref(x, block, l1max)
                what = f"isa={isa} {dtype} K={k} block={block} M={M} l1max={l1max}"
                assert torch.equal(xq, rq), (what, int((xq.int() - rq.int()).abs().max()))
                assert torch.equal(xs, rs) and torch.equal(xd, rd), what
        tiny = () if dtype == torch.float16 else (("below 2\\^-100", 2.0 ** -101, 1e-40),)
        for match, *bads in (("inf / nan", float("nan"), float("inf"), float("-inf")),) + tiny:
            for bad in bads:
                for at in (0, block // 2 + 1, block - 1):
                    x = torch.randn(3, k, generator=gen).to(dtype)
                    if bad < 1:  # the only nonzero element of its block
                        x[2, k - block:] = 0
                    x[2, k - block + at] = bad
                    with pytest.raises(RuntimeError, match=match):
                        torch.ops.hf_w4.cpu_w4a16_quant_x16(x, block, 0, isa)


def test_quant_x16_errors():
    """cpu_w4a16_quant_x16's argument checks name what is wrong."""
    x = torch.randn(2, 64)
    for args, msg in (((x[0], 16), "x must be 2-D"), ((x.double(), 16), "x must be float32, bfloat16 or float16"),
                      ((x, 24), "block must be a multiple of 4 up to 4096 that divides K, got 24"),
                      ((x, 6), "got 6"), ((x, 8192), "got 8192")):
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.hf_w4.cpu_w4a16_quant_x16(*args, 0, "")


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "generic"])
@pytest.mark.parametrize("layout,sym", [("gptq", True), ("awq", False), ("modelopt_nvfp4", True)])
def test_int16_path_exact_on_grid_and_nonfinite(layout, sym, isa):
    """path 3 (int16 activations, vpdpwssd / vpmaddwd on the raw codes): (a) x on a grid of 2^-7 converts exactly, so with fp32
    output the result meets the fp32 budget (no int16 term); (b) inf / nan in x make the call fall back to the fp32
    kernel, bit for bit."""
    n, k = 96, 512
    spec, qw = make_qweight(layout, n, k, 128, sym=sym, seed=21)
    W = layouts.dequantize(qw)
    q, s, z, perm = prep(qw)
    gen = torch.Generator().manual_seed(22)
    for M in (1, 3, 4, 6, 9):  # 9: int4 in a block of 8 rows + 1, NVFP4 6 + 3
        x = torch.randint(-256, 257, (M, k), generator=gen).float() / 128
        y = ops.cpu_w4a16_gemm(x, q, s, z, n, qw.group_size, qw.weight_type, perm=perm,
                               global_scale=qw.global_scale or 1.0, isa=isa, path=3)
        check(y, x, W, None, False, f"grid {layout} M={M} {isa}")
        xb = x.to(torch.bfloat16)
        xb[M - 1, 7] = float("inf")
        xb[0, 100] = float("nan")
        y3 = ops.cpu_w4a16_gemm(xb, q, s, z, n, qw.group_size, qw.weight_type, perm=perm,
                                global_scale=qw.global_scale or 1.0, isa=isa, path=3)
        y0 = ops.cpu_w4a16_gemm(xb, q, s, z, n, qw.group_size, qw.weight_type, perm=perm,
                                global_scale=qw.global_scale or 1.0, isa=isa, path=0)
        assert torch.equal(y3.isnan(), y0.isnan()) and torch.equal(y3.nan_to_num(), y0.nan_to_num()), layout


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "generic"])
def test_int16_path_int32_headroom(isa):
    """Channel-wise K = 8192 runs in 4096-k blocks; every code 15 (w = 7 s) and every |x| at the largest bf16
    significand (D = 32640) drive each int32 lane to 2048 pairs x 2 x 32640 x 15 = 2.005e9 < 2^31 - exact."""
    n, k = 32, 8192
    spec = W4Spec(method="test", layout="ct_pack", weight_type="int4", bits=4, group_size=-1, sym=True)
    t = layouts.pack(spec, torch.full((n, k), 15), torch.full((n, 1), 0.01), scale_dtype=torch.float32)
    qw = layouts.to_qweight(spec, t, n, k)
    q, s, z, _ = prep(qw)
    for sign in (1.0, -1.0):
        x = torch.full((2, k), sign * 1.9921875, dtype=torch.bfloat16)
        y = ops.cpu_w4a16_gemm(x, q, s, z, n, qw.group_size, "int4", isa=isa, path=3)
        expect = sign * 1.9921875 * 7 * 0.01 * k
        assert torch.allclose(y.float(), torch.full((2, n), expect), rtol=2 ** -8), (sign, y[0, :4], expect)


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "generic"])
@pytest.mark.parametrize("k,gs", [(480, 48), (520, 40), (8200, -1), (8248, -1)])
def test_int16_path_activation_blocks(isa, k, gs):
    """Activation blocks of the int16 path = the largest divisor of the group that is a multiple of 4 and at most
    4096: 48, 40 (masked tails in the quantizer), 1640 for channel-wise K = 8200; none for K = 8248 = 8 x 1031
    (then path 3 falls back to the fp32 kernel). Asymmetric, with bias."""
    n = 40
    spec, qw = make_qweight("ct_pack", n, k, gs, sym=False, seed=k)
    W = layouts.dequantize(qw)
    q, s, z, perm = prep(qw)
    gen = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    for M in (1, 2, 5, 12):  # 12: a block of 8 rows + one of 4 on AVX-512
        x = torch.randn(M, k, generator=gen).to(torch.bfloat16)
        y = ops.cpu_w4a16_gemm(x, q, s, z, n, qw.group_size, "int4", bias=bias, isa=isa, path=3)
        check(y, x, W, bias, False, f"{isa} K={k} g={gs} M={M}", i16_group=_group(qw, k))


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "generic"])
@pytest.mark.parametrize("layout,k,gs,sym", [("gptq", 512, 128, True), ("awq", 360, -1, False),
                                             ("ct_pack", 1000, 40, False), ("ct_nvfp4", 96, 16, True),
                                             ("modelopt_nvfp4", 640, 16, True)])
def test_int16_path_many_rows(isa, layout, k, gs, sym):
    """Several rows on the int16 path (AVX2: weights decoded once per chunk of up to 64 k-pairs into a buffer that
    tiles of two rows read, up to 24 rows per pass): odd row counts, more than one pass (25, 49), a channel-wise
    block of 180 k-pairs (chunks of 64, 64, 52), a partial last panel (N = 72), with bias."""
    n = 72
    spec, qw = make_qweight(layout, n, k, gs, sym=sym, seed=k + n)
    W = layouts.dequantize(qw)
    q, s, z, perm = prep(qw)
    gen = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    for M in (2, 3, 24, 25, 49):
        x = torch.randn(M, k, generator=gen) * torch.logspace(-2, 2, M)[:, None]
        x = x.to(torch.bfloat16)
        y = ops.cpu_w4a16_gemm(x, q, s, z, n, qw.group_size, qw.weight_type, perm=perm, bias=bias,
                               global_scale=qw.global_scale or 1.0, isa=isa, path=3)
        check(y, x, W, bias, False, f"{isa} {layout} K={k} M={M}",
              i16_group="nvfp4" if qw.weight_type == "nvfp4" else _group(qw, k))


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "generic"])
@pytest.mark.parametrize("k", [80, 96, 640])
def test_int16_path_nvfp4_shapes(isa, k):
    """NVFP4 on the int16 path for K that is an odd (80), even (96) and large (640) number of 16-k blocks, rows of
    very different magnitude, with bias."""
    n = 72
    spec, qw = make_qweight("ct_nvfp4", n, k, 16, seed=k)
    W = layouts.dequantize(qw)
    q, s, z, perm = prep(qw)
    gen = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    # AVX-512: 2-7 activation blocks of up to 128 k (7 = a block of 6 rows + 1), from 8 scales folded with VBMI
    # (8, 13 and 15: an 8-row block decoded in registers, 13 and 15 the rest as 4 + 1 and 4 + 3 from the L1 buffer;
    # 20: blocks of 8 + 8 + 4, all from the buffer; without VBMI: one block of 8, 6 + 6 + 1, ...)
    for M in (1, 2, 3, 4, 7, 8, 13, 15, 20):
        x = torch.randn(M, k, generator=gen) * torch.logspace(-3, 3, M)[:, None]
        x = x.to(torch.bfloat16)
        y = ops.cpu_w4a16_gemm(x, q, s, z, n, 16, "nvfp4", bias=bias, global_scale=qw.global_scale, isa=isa, path=3)
        check(y, x, W, bias, False, f"{isa} K={k} M={M}", i16_group="nvfp4")


# the library's view of the CPU (the emulated AVX-512 build reports AVX512-BF16 on any AVX2 CPU)
BLOCKED = "avx512" in ISAS and re.search(r"cpu: .*\bavx512_bf16\b", ops.cpu_w4a16_info("avx512")) is not None


@pytest.mark.skipif(not BLOCKED, reason="the blocked kernel needs AVX-512 with AVX512-BF16")
@pytest.mark.parametrize("layout,sym,ao,n,k,gs", [
    ("gptq", True, False, 72, 640, 128),           # 3 panels, the last one partial
    ("gptq", False, True, 40, 520, 40),            # act order, asymmetric, K % 32 != 0, groups of 20 k-pairs
    ("awq", False, False, 64, 256, 32),
    ("ct_pack", True, False, 96, 8200, -1),        # channel-wise; K = 8200: 2 row chunks from M = 505
    ("gptq", False, False, 40, 8320, 128),         # asymmetric (the rows' group sums) over 2 row chunks
    ("ct_pack", True, False, 32, 360, 18),         # a group size without an int16 block
    ("ct_nvfp4", True, False, 72, 80, 16),         # an odd number of 16-k blocks
    ("modelopt_nvfp4", True, False, 200, 8192, 16),  # 2 row chunks from M = 505
])
def test_blocked_path(layout, sym, ao, n, k, gs):
    """path 5 (the blocked kernel: each panel decoded once to bf16, 12-row vdpbf16ps blocks over it) against the
    reference: every row count of a last block (1-12 rows: the 4 / 8 / 12-row kernels on zero-padded rows), more
    than one chunk of row blocks, rows of very different magnitude, bias, bf16 output; bit-identical with 1 and 2
    threads (each output is summed by one thread, in one order) and when the same rows come in a larger batch."""
    spec, qw = make_qweight(layout, n, k, gs, sym=sym, act_order=ao, seed=n + k)
    W = layouts.dequantize(qw)
    q, s, z, perm = prep(qw)
    gen = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    run = lambda x: ops.cpu_w4a16_gemm(x, q, s, z, n, qw.group_size, qw.weight_type, perm=perm, bias=bias,
                                       global_scale=qw.global_scale or 1.0, path=5)
    Ms = (1, 5, 12, 23, 30) + ((600,) if k >= 8192 else (36, 47))
    for M in Ms:
        x = (torch.randn(M, k, generator=gen) * torch.logspace(-3, 3, M)[:, None]).to(torch.bfloat16)
        y = run(x)
        check(y, x, W, bias, False, f"{spec.describe()} K={k} M={M}", blocked=True)
        if M in (23, 600):
            threads = torch.get_num_threads()
            torch.set_num_threads(2 if threads == 1 else 1)
            try:
                assert torch.equal(run(x), y), f"{spec.describe()} M={M}: differs with another thread count"
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(run(x[:13]), y[:13]), f"{spec.describe()}: rows 0-12 alone differ"


def _same_outputs_with_env_flag(tmp_path, var, body):
    """Runs `body` (Python that appends the tensors to compare to `out`; make_qweight, prep, ops and torch are
    imported) in a subprocess with var=1 and with var=0 in the environment - the kernels read such switches once per
    process - and asserts that both give bit for bit the same outputs; returns how many."""
    import os
    import subprocess
    import sys
    code = _SUBPROCESS_PRELUDE + "out = []\n" + body + "torch.save(out, sys.argv[1])\n"
    outs = []
    for flag in ("1", "0"):
        path = tmp_path / f"out_{flag}.pt"
        subprocess.run([sys.executable, "-c", code, str(path)], check=True, env=dict(os.environ, **{var: flag}))
        outs.append(torch.load(path))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    return len(outs[0])


def _large_choice(isa):
    """cpu_w4a16_info(isa) -> {weight type: [(path number, largest M or None)]} of the large-M bf16 rule; weight type
    "int4_no_i16": int4 group sizes without an int16 block."""
    import re
    info = ops.cpu_w4a16_info(isa)
    num = {"int16": 3, "bf16": 1, "fp32": 4, "blocked": 5}
    m = re.search(r"isa=(\w+) amx=(yes|no) bf16_gemm=(?:yes|no) large_m_bf16 int4=\[(.*?)\] int4_no_i16=\[(.*?)\] "
                  r"nvfp4=\[(.*?)\] \((.*)\)$", info)
    assert m, info
    assert m.group(1) == (isa or m.group(1)), info
    assert m.group(6).startswith(("fixed rules for " + m.group(1), "HF_W4_LARGE_PATH")), info
    segs = {}
    for wt, seg in (("int4", m.group(3)), ("int4_no_i16", m.group(4)), ("nvfp4", m.group(5))):
        parts = [re.fullmatch(r"(int16|bf16|fp32|blocked)(?: M<=(\d+))?", p.strip()) for p in seg.split(",")]
        assert all(parts) and all(p.group(2) for p in parts[:-1]) and not parts[-1].group(2), info
        segs[wt] = [(num[p.group(1)], int(p.group(2)) if p.group(2) else None) for p in parts]
    return segs


def _path_at(segs, M):
    return next(p for p, upto in segs if upto is None or M <= upto)


PATH_NUM = {"fused": 0, "bf16": 1, "amx": 2, "int16": 3, "fp32": 4, "blocked": 5}


BLOCKED_INT4_MIN_M = 128  # csrc/cpu/w4a16_path.h, kBlockedInt4MinM


def _onednn_bf16_allowed(env=os.environ):
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").upper()
    return cap in ("", "DEFAULT", "ALL") or cap.startswith(
        ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10"))


@pytest.mark.parametrize("isa", ISAS)
def test_large_m_bf16_rule(isa):
    """bf16 x above the small-M kernels where AMX does not take them follows fixed rules (no timing): on AVX-512
    with AVX512-BF16 at full rate (AMD) the blocked kernel for NVFP4 and for int4 groups without an int16 block at
    every M, for other int4 from M = 256 (int16 x raw codes below); other AVX-512 CPUs int16 at every M; on AVX2 int16
    up to M = 80 (int4) / 32 (NVFP4), on AMD CPUs without bf16 arithmetic at every M; else dequantize + bf16 GEMM on
    CPUs with bf16 arithmetic that oneDNN may use, + fp32 GEMM otherwise. cpu_w4a16_info reports the same rule as
    cpu_w4a16_path."""
    segs = _large_choice(isa)
    info = ops.cpu_w4a16_info(isa)
    bf16 = re.search(r"cpu: .*\b(avx512_bf16|amx_bf16)\b", info) is not None and _onednn_bf16_allowed()
    assert ("bf16_gemm=yes" in info) == bf16, info
    gemm = 1 if bf16 else 4
    amx = "amx=yes" in info
    if amx:
        want = {"int4": [(gemm, None)], "int4_no_i16": [(gemm, None)], "nvfp4": [(gemm, None)]}
    elif isa == "avx512":
        full_rate = re.search(r"cpu: .*avx512_bf16.*\bamd\b", info) is not None
        if full_rate:
            want = {"int4": [(3, BLOCKED_INT4_MIN_M - 1), (5, None)], "int4_no_i16": [(5, None)], "nvfp4": [(5, None)]}
        else:
            want = {"int4": [(3, None)], "int4_no_i16": [(gemm, None)], "nvfp4": [(3, None)]}
    elif isa == "avx2" and not bf16 and re.search(r"cpu: .*\bamd\b", info):
        # AMD without bf16 arithmetic: vpmaddwd does twice the multiply-adds of the fp32 GEMM's FMAs
        want = {"int4": [(3, None)], "int4_no_i16": [(gemm, None)], "nvfp4": [(3, None)]}
    elif isa == "avx2":
        want = {"int4": [(3, 80), (gemm, None)], "int4_no_i16": [(gemm, None)], "nvfp4": [(3, 32), (gemm, None)]}
    else:
        want = {"int4": [(gemm, None)], "int4_no_i16": [(gemm, None)], "nvfp4": [(gemm, None)]}
    assert segs == want, (isa, segs)
    for wt, gs, key in (("int4", 128, "int4"), ("int4", 18, "int4_no_i16"), ("nvfp4", 16, "nvfp4")):
        for M in (40, 80, 81, 112, 113, BLOCKED_INT4_MIN_M - 1, BLOCKED_INT4_MIN_M, 5000):
            k = 4104 if amx else 4096  # (K % 32 != 0: where AMX exists, the shape AMX cannot take)
            k = k // gs * gs
            got = ops.cpu_w4a16_path(M, k, wt, gs, torch.bfloat16, isa=isa)
            assert PATH_NUM[got] == _path_at(segs[key], M), (isa, wt, gs, M, got, segs[key])


@pytest.mark.parametrize("isa", ISAS)
def test_auto_path_is_the_named_path(isa):
    """The automatic choice runs the path cpu_w4a16_path names, bit for bit, for small and large M and every
    activation dtype - and, at large M with bf16 x, every forced candidate stays within the reference budget.
    Int4 sym / asym, a group size without an int16 block (g18) and NVFP4."""
    cases = [("gptq", True, 48, 336), ("ct_pack", False, 48, 336), ("ct_nvfp4", True, 16, 336),
             ("ct_pack", True, 18, 360)]
    for layout, sym, gs, k in cases:
        spec, qw = make_qweight(layout, 80, k, gs, sym=sym, seed=k + gs)
        W = layouts.dequantize(qw)
        q, s, z, perm = prep(qw)
        gen = torch.Generator().manual_seed(gs)
        for M, dt in ((3, torch.bfloat16), (3, torch.float32), (40, torch.bfloat16), (70, torch.float16),
                      (130, torch.bfloat16), (130, torch.float32)):
            x = torch.randn(M, k, generator=gen).to(dt)
            run = lambda path: ops.cpu_w4a16_gemm(x, q, s, z, 80, qw.group_size, qw.weight_type, perm=perm,
                                                  global_scale=qw.global_scale or 1.0, isa=isa, path=path)
            name = ops.cpu_w4a16_path(M, k, qw.weight_type, qw.group_size, dt, asym=not sym, isa=isa)
            what = f"{spec.describe()} K={k} M={M} {dt} isa={isa}"
            assert torch.equal(run(-1), run(PATH_NUM[name])), f"{what}: auto is not path {name}"
            if gs == 18 or isa == "generic":
                assert torch.equal(run(3), run(-1)), f"{what}: path 3 without an int16 block is not auto"
            if dt == torch.bfloat16 and M > 32:
                for path in (1, 4, 5) + ((3,) if isa != "generic" and gs != 18 else ()):
                    # path 5 where the blocked kernel cannot run is the automatic choice: the largest budget
                    check(run(path), x, W, None, path in (1, 5), f"{what} path={path}",
                          i16_group=_group(qw, k) if path in (3, 5) and gs != 18 and isa != "generic" else None,
                          blocked=path == 5)


def test_same_outputs_in_every_process(tmp_path):
    """The path is a fixed function of the inputs and the machine: two processes give bit-identical outputs for
    large-M bf16 calls of every weight type (where the choice used to be timed at run time and could differ)."""
    import subprocess
    import sys
    code = (_SUBPROCESS_PRELUDE + "out = [ops.cpu_w4a16_info()]\n"
            "for layout, gs in (('gptq', 128), ('ct_nvfp4', 16)):\n"
            "    spec, qw = make_qweight(layout, 256, 512, gs, seed=3)\n"
            "    q, s, z, perm = prep(qw)\n"
            "    for M in (48, 200, 600):\n"
            "        x = torch.randn(M, 512, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16)\n"
            "        out.append(ops.cpu_w4a16_gemm(x, q, s, z, 256, qw.group_size, qw.weight_type, perm=perm,\n"
            "                                      global_scale=qw.global_scale or 1.0))\n"
            "torch.save(out, sys.argv[1])\n")
    outs = []
    for i in range(2):
        path = tmp_path / f"out{i}.pt"
        subprocess.run([sys.executable, "-c", code, str(path)], check=True)
        outs.append(torch.load(path))
    assert outs[0][0] == outs[1][0], outs
    for a, b in zip(outs[0][1:], outs[1][1:]):
        assert torch.equal(a, b)


def test_onednn_cap_below_bf16_takes_the_fp32_gemm():
    """Where oneDNN is capped below bf16 instructions (ONEDNN_MAX_CPU_ISA, else DNNL_MAX_CPU_ISA, any case),
    at::linear's bf16 GEMM emulates them (up to ~100x slower with the dequantize path's transposed weight chunks): the rule then
    takes the fp32 GEMM, on every ISA, and the auto path is that path bit for bit. A cap at or above AVX512_CORE_BF16
    leaves the rule as it is."""
    import subprocess
    import sys
    code = (_SUBPROCESS_PRELUDE + "print(ops.cpu_w4a16_info())\n"
            "spec, qw = make_qweight('gptq', 80, 336, 48)\nq, s, z, perm = prep(qw)\n"
            "x = torch.randn(200, 336).to(torch.bfloat16)\n"
            "r = lambda p: ops.cpu_w4a16_gemm(x, q, s, z, 80, 48, 'int4', perm=perm, path=p)\n"
            "print(ops.cpu_w4a16_path(200, 336, 'int4', 48, torch.bfloat16), torch.equal(r(-1), r(4)))\n")
    plain = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    for cap, allowed in ((dict(ONEDNN_MAX_CPU_ISA="avx2"), False), (dict(DNNL_MAX_CPU_ISA="AVX512_CORE_VNNI"), False),
                         (dict(ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16", DNNL_MAX_CPU_ISA="AVX2"), True),
                         (dict(ONEDNN_MAX_CPU_ISA="default"), True)):
        assert _onednn_bf16_allowed(cap) == allowed
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(plain, **cap))
        assert out.returncode == 0, out.stderr
        info, last = out.stdout.split("\n")[:2]
        bf16_cpu = re.search(r"cpu: .*\b(avx512_bf16|amx_bf16)\b", info) is not None
        assert ("bf16_gemm=yes" in info) == (bf16_cpu and allowed), (cap, info)
        if not (bf16_cpu and allowed):
            # group 48 has an int16 block; at M = 200 the rule takes int16 / blocked / AMX or the fp32 GEMM, never bf16
            assert "bf16]" not in info and last.split()[0] != "bf16", (cap, info, last)
            if last.split()[0] == "fp32":
                assert last.split()[1] == "True", last


def test_large_m_path_env_setting(tmp_path):
    """HF_W4_LARGE_PATH=fp32 sets the choice (reported as such, auto == path 4 bit for bit); a value that is not
    int16 / bf16 / fp32 is an error that names the variable, the value and the choices; a path the ISA lacks is an
    error that says what it needs."""
    import os
    import subprocess
    import sys
    code = (_SUBPROCESS_PRELUDE + "print(ops.cpu_w4a16_info())\n"
            "spec, qw = make_qweight('gptq', 80, 336, 48)\nq, s, z, perm = prep(qw)\n"
            "x = torch.randn(40, 336).to(torch.bfloat16)\n"
            "r = lambda p: ops.cpu_w4a16_gemm(x, q, s, z, 80, 48, 'int4', perm=perm, path=p)\n"
            "print(torch.equal(r(-1), r(4)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, HF_W4_LARGE_PATH="fp32"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[1] == "True", out.stdout
    assert "large_m_bf16 int4=[fp32] int4_no_i16=[fp32] nvfp4=[fp32] (HF_W4_LARGE_PATH" in out.stdout, out.stdout
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, HF_W4_LARGE_PATH="fast"))
    assert bad.returncode != 0
    assert "HF_W4_LARGE_PATH must be 'int16', 'bf16', 'fp32' or 'blocked', got 'fast'" in bad.stderr, bad.stderr
    # a path this ISA does not have (the portable C++ path has no int16 kernel)
    na = subprocess.run([sys.executable, "-c", "from hf_w4 import ops\nops.cpu_w4a16_info('generic')"],
                        capture_output=True, text=True, env=dict(os.environ, HF_W4_LARGE_PATH="int16"))
    assert na.returncode != 0
    assert "HF_W4_LARGE_PATH=int16 is not available with isa generic (needs avx512 or avx2)" in na.stderr, na.stderr


def test_gemm_rejects_unknown_path():
    spec, qw = make_qweight("gptq", 64, 128, 32)
    q, s, z, perm = prep(qw)
    with pytest.raises(RuntimeError,
                       match="path must be -1 \\(auto\\) or 0..5 \\(fused, bf16, amx, int16, fp32, blocked\\), got 7"):
        ops.cpu_w4a16_gemm(torch.randn(2, 128), q, s, z, 64, 32, "int4", perm=perm, path=7)


@pytest.mark.skipif(not ("avx512" in ISAS and "avx512vbmi" in _FLAGS), reason="this CPU has no AVX-512 VBMI")
def test_int16_nvfp4_vbmi_decoder_matches_vpermw(tmp_path):
    """The NVFP4 int16 path decodes e2m1 with vpermb on bytes where the CPU has AVX512-VBMI, with vpermw on words
    otherwise (HF_W4_VBMI=0, read once per process, so in a subprocess): the same integers, so bit for bit the same
    outputs, for M = 1..5 and 7 (every row-block kernel), K of 5, 6 and 40 blocks, rows of very different magnitude,
    negative block scales and a bias. Both also stay within the reference budget (test_int16_path_nvfp4_shapes)."""
    body = (
        "for k in (80, 96, 640):\n"
        "    spec, qw = make_qweight('ct_nvfp4', 72, k, 16, seed=k)\n"
        "    qw.scales[::3] |= 0x80\n"
        "    q, s, z, perm = prep(qw)\n"
        "    gen = torch.Generator().manual_seed(k)\n"
        "    bias = torch.randn(72, generator=gen).to(torch.bfloat16)\n"
        "    for M in (1, 2, 3, 4, 5, 7):\n"
        "        x = (torch.randn(M, k, generator=gen) * torch.logspace(-3, 3, M)[:, None]).to(torch.bfloat16)\n"
        "        out.append(ops.cpu_w4a16_gemm(x, q, s, z, 72, 16, 'nvfp4', bias=bias,"
        " global_scale=qw.global_scale, isa='avx512', path=3))\n")
    assert _same_outputs_with_env_flag(tmp_path, "HF_W4_VBMI", body) == 18


@pytest.mark.parametrize("flush_denormal", [False, True])
def test_nvfp4_denormal_scales_and_activation_range(flush_denormal):
    """NVFP4 block scales that are e4m3 denormals (2^-9 .. 7 * 2^-9), or negative, decode exactly on every path,
    also with torch.set_flush_denormal(True) (MXCSR.DAZ: an fp32 denormal built on the way used to read as 0), and the
    AMX path that moves fp16 products into bf16 position (w * 2^-108, rows of x scaled by powers of two) keeps the
    budget for rows of very different magnitude (1e-30 .. 1e30, zeros, bf16 denormals) and gives non-finite
    output exactly where the reference does. Budgets as in check()."""
    n, k = 72, 256
    gen = torch.Generator().manual_seed(31)
    spec = W4Spec(method="test", layout="modelopt_nvfp4", weight_type="nvfp4", bits=4, group_size=16, sym=True)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(n, k // 16, generator=gen) * 3 + 0.05
    scales[:, 1::2] = torch.randint(1, 8, (n, k // 32), generator=gen).float() * 2.0 ** -9   # e4m3 denormals
    scales[::3, 2::3] *= -1   # negative scales: the repack moves their sign into the codes
    scales[1, 5] = -0.0
    qw = layouts.to_qweight(spec, layouts.pack(spec, codes, scales, global_scale=0.37), n, k)
    W = layouts.dequantize(qw)
    q, s, z, perm = prep(qw)
    torch.set_flush_denormal(flush_denormal)
    try:
        for M in (1, 4, 12, 24, 40):
            x = torch.randn(M, k, generator=gen)
            row_scale = torch.tensor([1e-30, 1e30, 0.0, 1e-39, 1.0, 3e-3][:M] + [1.0] * max(0, M - 6))
            x = (x * row_scale[:, None]).to(torch.bfloat16)
            xinf = x.clone()
            xinf[M - 1, 3] = float("inf")
            for isa in ISAS:
                for path in (-1, 0, 2, 3):
                    if path == 3 and isa == "generic":
                        continue
                    what = f"nvfp4 denormal scales M={M} isa={isa} path={path} flush={flush_denormal}"
                    y = ops.cpu_w4a16_gemm(x, q, s, z, n, 16, "nvfp4", global_scale=qw.global_scale, isa=isa,
                                           path=path)
                    check(y, x, W, None, path in (-1, 2) and M > 4, what,
                          i16_group="nvfp4" if path in (-1, 3) else None)
                    yi = ops.cpu_w4a16_gemm(xinf, q, s, z, n, 16, "nvfp4", global_scale=qw.global_scale, isa=isa,
                                            path=path)
                    ref = F.linear(xinf.float(), W)
                    assert torch.equal(torch.isfinite(yi.float()), torch.isfinite(ref)), what + " (inf in x)"
                    check(yi[:M - 1], xinf[:M - 1], W, None, path in (-1, 2) and M > 4, what + " (inf in x)",
                          i16_group="nvfp4" if path in (-1, 3) else None)
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX-BF16")
def test_amx_nvfp4_fp32_decode_fallback(tmp_path):
    """HF_W4_AMX_FP16=0 (read once per process, so in a subprocess): NVFP4 on AMX takes the fp32 decode
    (amx_small_folded up to M = 32, the blocked kernel's FoldedDecoder above), as on a build without AVX512-FP16;
    its results are bit for bit those of the fp16 decode (both round the same exact products), checked here for
    M = 1, 4, 9, 16, 17, 32, 33, 70."""
    body = (
        "spec, qw = make_qweight('modelopt_nvfp4', 200, 512, 16, seed=41)\n"
        "q, s, z, perm = prep(qw)\n"
        "gen = torch.Generator().manual_seed(42)\n"
        "out += [ops.cpu_w4a16_gemm(torch.randn(M, 512, generator=gen).to(torch.bfloat16), q, s, z, 200, 16, 'nvfp4',"
        " global_scale=qw.global_scale, path=2) for M in (1, 4, 9, 16, 17, 32, 33, 70)]\n")
    assert _same_outputs_with_env_flag(tmp_path, "HF_W4_AMX_FP16", body) == 8


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "generic"])
@pytest.mark.parametrize("k", [384, 320, 224])
def test_int16_path_nvfp4_folded_blocks(isa, k):
    """NVFP4 on the int16 path with activation blocks of 128 / 64 / 32 k for K = 384 / 320 / 224: from 8 rows (AVX-512
    VBMI) or from 4 rows (AVX2) block scales folded into the int16 weights, one flush per activation block; AVX-512 at
    2-7 rows one FMA per 16-k block and row (M = 2, 5): scales within a factor 8 of
    each other (one flush per activation block), then spread over 2^-9 .. 448 so that most blocks take one flush per
    16 k; rows of very different magnitude, outlier channels, with bias."""
    n = 96
    spec = W4Spec(method="test", layout="modelopt_nvfp4", weight_type="nvfp4", bits=4, group_size=16, sym=True)
    gen = torch.Generator().manual_seed(k)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    for scales in (torch.rand(n, k // 16, generator=gen) * 7 + 1,
                   2.0 ** (torch.rand(n, k // 16, generator=gen) * 17 - 9)):
        qw = layouts.to_qweight(spec, layouts.pack(spec, codes, scales, global_scale=0.37), n, k)
        W = layouts.dequantize(qw)
        q, s, z, perm = prep(qw)
        for M in (2, 5, 8, 9, 16, 33):
            x = torch.randn(M, k, generator=gen) * torch.logspace(-3, 3, M)[:, None]
            x[:, ::37] *= 100
            x = x.to(torch.bfloat16)
            y = ops.cpu_w4a16_gemm(x, q, s, z, n, 16, "nvfp4", bias=bias, global_scale=qw.global_scale, isa=isa,
                                   path=3)
            check(y, x, W, bias, False, f"{isa} K={k} M={M}", i16_group="nvfp4")


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "generic"])
def test_int16_path_nvfp4_int32_headroom(isa):
    """The largest folded NVFP4 weights (code 6.0 = 12 doubled, times mantissa 15 << 4 where a 128-k block's scales
    span exactly 2^4: 2880) against activations of one size: the quantizer's bound on the sum of |x| keeps each int32
    lane below 2^31, and the result is exact up to the bf16 output."""
    n, k = 32, 512
    spec = W4Spec(method="test", layout="ct_nvfp4", weight_type="nvfp4", bits=4, group_size=16, sym=True)
    codes = torch.full((n, k), 7)  # +6.0
    scales = torch.full((n, k // 16), 1.875)  # e4m3 mantissa 7: mt = 15
    scales[:, 1::8] = 1.875 / 16  # one block per 128 k four binades lower: the others fold with shift 4
    qw = layouts.to_qweight(spec, layouts.pack(spec, codes, scales, global_scale=1.0), n, k)
    W = layouts.dequantize(qw).double()
    q, s, z, _ = prep(qw)
    for sign in (1.0, -1.0):
        x = torch.full((12, k), sign * 1.9921875, dtype=torch.bfloat16)
        y = ops.cpu_w4a16_gemm(x, q, s, z, n, 16, "nvfp4", global_scale=qw.global_scale, isa=isa, path=3)
        expect = x.double() @ W.T
        assert torch.allclose(y.double(), expect, rtol=2 ** -8), (sign, y[0, :4], expect[0, :4])


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "generic"])
def test_int16_path_nvfp4_folded_sum_overflow_falls_back(isa):
    """The folded NVFP4 kernel's quantizer (AVX-512; the portable one on AVX2) sums |x| per 128-k block in fp32;
    finite bf16 activations near the bf16 maximum overflow that sum to inf, and the call must then take the fp32
    kernel (as for inf / nan in x), bit for bit the same as path 0 (an unguarded search for the scale would never
    end)."""
    n, k = 32, 256
    spec, qw = make_qweight("modelopt_nvfp4", n, k, 16, seed=5)
    q, s, z, _ = prep(qw)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(12, k, generator=gen) * 1e-3).to(torch.bfloat16)
    x[3, :128] = 3.0e38  # finite in bf16; 128 of them sum past the fp32 range
    y3 = ops.cpu_w4a16_gemm(x, q, s, z, n, 16, "nvfp4", global_scale=qw.global_scale, isa=isa, path=3)
    y0 = ops.cpu_w4a16_gemm(x, q, s, z, n, 16, "nvfp4", global_scale=qw.global_scale, isa=isa, path=0)
    assert torch.equal(y3.isnan(), y0.isnan()) and torch.equal(y3.nan_to_num(), y0.nan_to_num())


@pytest.mark.parametrize("isa", ISAS)
def test_tiny_bf16_activations_take_the_fp32_path(isa):
    """bf16 rows whose block maxima are normal numbers below 2^-100 (or denormals): the int16 path's scale would
    leave fp32's normal range, so those calls take the fp32 kernel and keep the usual budget (they used to lose bits
    and, from ~1e-36, give zeros)."""
    spec, qw = make_qweight("ct_pack", 64, 256, 64, sym=False)
    q, s, z = ops.cpu_w4a16_repack(qw)
    W = layouts.dequantize(qw)
    gen = torch.Generator().manual_seed(5)
    for scale in (1e-31, 1e-33, 1e-36):  # outputs stay normal bf16 numbers (denormal ones round coarser)
        x = (torch.randn(3, 256, generator=gen) * scale).bfloat16()
        ref = F.linear(x.float(), W)
        for path in (-1, 3):
            y = ops.cpu_w4a16_gemm(x, q, s, z, 64, 64, "int4", isa=isa, path=path).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (scale, path, err)


def test_bad_perm_and_isa_are_refused(monkeypatch):
    """A direct op call with a perm that is not a permutation of K, or an unknown ISA name, is an error (a perm's
    entries index the activations; an unknown ISA used to run on the best one silently)."""
    spec, qw = make_qweight("ct_pack", 64, 256, 64)
    q, s, z = ops.cpu_w4a16_repack(qw)
    x = torch.randn(2, 256)
    ident = torch.arange(256)
    bad = {"out of range": torch.where(ident == 7, 1 << 40, ident), "repeated": torch.where(ident == 7, 3, ident),
           "K=256": ident[:128]}
    for what, perm in bad.items():
        with pytest.raises(RuntimeError, match=r"cpu_w4a16_repack: perm .*" + what.replace("=", ".")):
            ops.cpu_w4a16_repack(qw, perm)
        with pytest.raises(RuntimeError, match=r"cpu_w4a16_gemm: perm .*" + what.replace("=", ".")):
            ops.cpu_w4a16_gemm(x, q, s, z, 64, 64, "int4", perm=perm)
    with pytest.raises(RuntimeError, match="cpu_w4a16_gemm: isa='avx-2' is not an ISA name; use auto, .*avx2, "
                                           "generic"):
        ops.cpu_w4a16_gemm(x, q, s, z, 64, 64, "int4", isa="avx-2")
    if "avx512" not in ISAS:  # a level the CPU lacks: an error that says what the CPU has
        with pytest.raises(RuntimeError, match="isa='avx512' is not available: this CPU has "):
            ops.cpu_w4a16_gemm(x, q, s, z, 64, 64, "int4", isa="avx512")
    monkeypatch.setenv("HF_W4_ISA", "portable")
    with pytest.raises(RuntimeError, match="HF_W4_ISA='portable' is not an ISA name; use auto, .*generic"):
        ops.cpu_w4a16_gemm(x, q, s, z, 64, 64, "int4")


def test_isa_setting_means_the_same_for_every_kernel_family(monkeypatch):
    """HF_W4_ISA has one meaning (csrc/cpu/common/cpu_features.h): the W4A16 and int8 ops resolve every value to
    the same level, and refuse the same values with the same text."""
    if not ops.has_impl("int8_gemm"):
        pytest.skip("int8 ops not built")
    level = {"avx512": "avx512", "avxvnni": "avx2", "avx2": "avx2", "generic": "generic"}
    for v in ["", "auto", "bogus", "avx2novnni", "avx512", "avx2", "generic"]:
        monkeypatch.setenv("HF_W4_ISA", v)
        try:
            w4 = re.search(r"isa=(\w+)", ops.cpu_w4a16_info()).group(1)
        except RuntimeError as e:
            w4 = str(e).split("\n")[0].split(": ", 1)[1]
        try:
            i8 = level[torch.ops.hf_w4.int8_isa("")]
        except RuntimeError as e:
            i8 = str(e).split("\n")[0].split(": ", 1)[1]
        assert w4 == i8, (v, w4, i8)
        assert (v in ("", "auto") or v in ISAS) == (w4 in ISAS), (v, w4)


def test_nvfp4_nan_scale_bytes_are_refused():
    """An NVFP4 block scale byte 0x7f / 0xff is fp8 e4m3 NaN: the AVX2 / AVX-512 decodes would read it as +-480, a
    finite scale, so the result would depend on the ISA. cpu_w4a16_repack refuses it (as to_qweight refuses
    non-finite scales); the largest finite bytes 0x7e / 0xfe (+-448) still repack."""
    import dataclasses
    spec, qw = make_qweight("ct_nvfp4", 32, 64, 16, seed=4)
    for at, byte, shown in (((0, 1), 0x7F, "7f"), ((1, 2), 0xFF, "ff")):
        sc = qw.scales.clone()
        sc[at] = byte
        with pytest.raises(RuntimeError, match=rf"cpu_w4a16_repack: nvfp4 scale \[{at[0]}, {at[1]}\] is the fp8 e4m3 "
                                               rf"NaN byte 0x{shown}; block scales must be finite"):
            ops.cpu_w4a16_repack(dataclasses.replace(qw, scales=sc))
    sc = qw.scales.clone()
    sc[0, 1], sc[1, 2] = 0x7E, 0xFE
    qw = dataclasses.replace(qw, scales=sc)
    x = torch.randn(2, 64)
    y = ops.cpu_w4a16_gemm(x, *ops.cpu_w4a16_repack(qw), 32, 16, "nvfp4", global_scale=qw.global_scale)
    check(y, x, layouts.dequantize(qw), None, False, "nvfp4 scale bytes 0x7e / 0xfe")


def test_gemm_and_repack_shape_errors():
    """K = 0 is an error (it used to return zeros on the fused path and kill the process with SIGFPE on the
    others: an integer division by K); group_size -1 (channel-wise in the checkpoint) says to pass K; 1-D zeros /
    nvfp4 scales get the op's message, not torch's IndexError."""
    q0, s0, z0 = torch.empty(1, 0, 32, dtype=torch.uint8), torch.empty(1, 0, 32), torch.empty(0)
    for path, M, dt in ((0, 3, torch.float32), (4, 3, torch.float32), (-1, 100, torch.float32),
                        (-1, 1, torch.bfloat16), (3, 1, torch.float32)):
        for isa in ISAS:
            with pytest.raises(RuntimeError, match="cpu_w4a16_gemm: x has K=0 columns; K must be positive"):
                ops.cpu_w4a16_gemm(torch.randn(M, 0).to(dt), q0, s0, z0, 5, 16, "int4", isa=isa, path=path)
    with pytest.raises(RuntimeError, match="cpu_w4a16_quant_x16: x has K=0 columns; K must be positive"):
        torch.ops.hf_w4.cpu_w4a16_quant_x16(torch.randn(2, 0), 4, 0, "")
    spec, qw = make_qweight("ct_pack", 64, 128, 32)
    q, s, z, perm = prep(qw)
    with pytest.raises(RuntimeError, match=r"cpu_w4a16_gemm: the group size must be even and divide K \(channel-wise: "
                                           r"group_size = K, not -1; nvfp4: 16\), got K=128, group_size=-1"):
        ops.cpu_w4a16_gemm(torch.randn(2, 128), q, s, z, 64, -1, "int4")
    args = lambda **kw: {**dict(codes=qw.codes, pack_dim=qw.pack_dim, slots=list(qw.slots), scales=qw.scales,
                                zeros=None, perm=None, n=64, k=128, group_size=32, weight_type="int4"), **kw}
    for kw, msg in ((dict(group_size=-1), r"channel-wise: group_size = K, not -1; nvfp4: 16\), got K=128, "
                                          r"group_size=-1"),
                    (dict(k=0, codes=qw.codes[:, :0]), "need K > 0 even .* got K=0"),
                    (dict(zeros=torch.zeros(64)), r"zeros must be \[N, G\] = \[64, 4\], got \[64\]"),
                    (dict(scales=torch.zeros(64, dtype=torch.uint8), group_size=16, weight_type="nvfp4"),
                     r"nvfp4 scales must be uint8 \(fp8 e4m3 bits\) \[N, K/16\] = \[64, 8\], got Byte \[64\]"),
                    (dict(slots=[0, 1, 2, 3, 4, 5, 6, 9]), r"slots must be in 0..7, got slots\[7\] = 9")):
        with pytest.raises(RuntimeError, match="cpu_w4a16_repack: .*" + msg):
            torch.ops.hf_w4.cpu_w4a16_repack(*args(**kw).values())


def test_quant_x16_l1max_is_checked():
    """l1max (the block-sum bound of the folded NVFP4 kernel) must be 0 or at least 2 * block: at or below block / 2
    the bound cannot be met (the scale search never ended, or gave inf scales at block / 2)."""
    x = torch.randn(2, 64)
    for isa in ISAS:
        for l1max in (-5, 8, 1, 5, 31):
            with pytest.raises(RuntimeError, match=rf"cpu_w4a16_quant_x16: l1max must be 0 \(no bound\) or at least "
                                                   rf"2 \* block = 32, got {l1max}"):
                torch.ops.hf_w4.cpu_w4a16_quant_x16(x, 16, l1max, isa)
        for l1max in (0, 32):
            xq, xs, xd = torch.ops.hf_w4.cpu_w4a16_quant_x16(x, 16, l1max, isa)
            rq, rs, rd = quant_x16_ref(x, 16, l1max)
            assert torch.equal(xq, rq) and torch.equal(xs, rs) and torch.equal(xd, rd), (isa, l1max)
            assert bool(torch.isfinite(xs).all())


def test_registry_rejects_k0_with_a_reason():
    """A layer with no input features: a rejection reason from can_implement, not a ZeroDivisionError."""
    from hf_w4.kernels import registry
    from hf_w4.kernels.cpu_w4a16 import CpuW4A16Kernel
    cpu = torch.device("cpu")
    for spec in (W4Spec(method="test", layout="ct_pack", weight_type="int4", bits=4, group_size=-1, sym=True),
                 W4Spec(method="test", layout="ct_nvfp4", weight_type="nvfp4", bits=4, group_size=16, sym=True)):
        ok, why = CpuW4A16Kernel.can_implement(spec, 64, 0, cpu, torch.float32)
        assert not ok and "K=0" in why
        cls, reasons = registry.select(spec, 64, 0, cpu, torch.float32)
        assert cls is not CpuW4A16Kernel and "K=0" in reasons["cpu_w4a16"]


@pytest.fixture(scope="module")
def smollm2_nvfp4(tmp_path_factory):
    """The embedded default model (SmolLM2-135M) written as compressed-tensors NVFP4, and two windows of 512
    tokens of the default text."""
    return default_model_as("ct-nvfp4", tmp_path_factory.mktemp("nvfp4") / "c", max_tokens=1024)


@pytest.mark.slow
def test_every_large_m_path_within_budget_on_a_real_model(smollm2_nvfp4, monkeypatch):
    """Perplexity of SmolLM2-135M NVFP4 in bf16 (M = 512 rows per call: the large-M paths) on each path the kernel
    can take there - int16 x raw codes, dequantize + bf16 GEMM, dequantize + fp32 GEMM, the fused fp32 kernel, the
    blocked kernel (where the CPU has AVX512-BF16; elsewhere path 5 is the automatic choice) - and
    on the automatic choice, against the fp32 reference kernel: each within 0.5 % (the bf16 reference itself is
    ~0.2 % off), and the automatic choice gives exactly the perplexity of the path cpu_w4a16_path names."""
    import hf_w4
    from hf_w4.tools import evaluate
    path, windows = smollm2_nvfp4

    def load(dtype, **cfg):
        with hf_w4.enabled():
            from transformers import AutoModelForCausalLM
            return AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, quantization_config=hf_w4.CompressedTensorsConfig(**cfg)).eval()

    def ppl(model):
        with torch.no_grad():
            return evaluate.perplexity(model, windows, progress=False).ppl

    ref = ppl(load(torch.float32, kernel="torch_reference"))
    model = load(torch.bfloat16)
    kern = {type(m.kernel) for m in model.modules() if getattr(getattr(m, "kernel", None), "NAME", "") == "cpu_w4a16"}
    assert len(kern) == 1, kern
    cls = kern.pop()

    def forced(path):
        def apply(self, layer, x, bias):
            b = layer._buffers
            y = torch.ops.hf_w4.cpu_w4a16_gemm(x.reshape(-1, self.k), b["w4a16_qpack"], b["w4a16_scales"],
                                               b["w4a16_zs"], b["w4a16_perm"], bias, self.n, self.group_size,
                                               self.weight_type, self.global_scale, "", path)
            return y.reshape(*x.shape[:-1], self.n)
        return apply

    auto = ppl(model)
    got = {}
    for name, num in PATH_NUM.items():
        if name == "amx" or (name == "int16" and ISAS == ["generic"]):
            continue
        monkeypatch.setattr(cls, "apply", forced(num))
        got[name] = ppl(model)
    named = ops.cpu_w4a16_path(windows.shape[1], 576, "nvfp4", 16, torch.bfloat16)
    print(f"fp32 reference {ref:.4f}; auto ({named}) {auto:.4f}; "
          + ", ".join(f"{k} {v:.4f} ({(v - ref) / ref:+.3%})" for k, v in got.items()))
    if named in got:
        assert auto == got[named], (named, auto, got)
    for name, v in got.items():
        assert abs(v - ref) <= 0.005 * ref, f"path {name}: perplexity {v:.4f} vs fp32 reference {ref:.4f}"


@pytest.mark.parametrize("isa", ISAS)
def test_nan_weight_stays_nan_through_bf16_dequantize(isa):
    """A NaN group scale (payload 0x7fffffff: all mantissa bits set) makes its column NaN on every path. Rounding it
    to bf16 by adding 0x7fff would carry into the sign bit and give -0 - a finite output - so every fp32 -> bf16
    conversion keeps NaN (csrc/cpu/common/convert.h)."""
    spec, qw = make_qweight("gptq", 64, 256, 128, seed=2)
    q, s, z, perm = prep(qw)
    s = s.clone()
    s.view(torch.int32)[0, 0, 5] = 0x7fffffff   # column 5, group 0
    x = torch.randn(40, 256).to(torch.bfloat16)
    for path in (0, 1, 3, 4):
        y = ops.cpu_w4a16_gemm(x, q, s, z, 64, 128, "int4", perm=perm, isa=isa, path=path)
        assert torch.isnan(y[:, 5]).all(), (isa, path, y[:, 5])
        assert not torch.isnan(y[:, 6]).any(), (isa, path)
