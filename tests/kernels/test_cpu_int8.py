"""cpu_int8 (W8A8 / W4A8, vpdpbusd): fuzz against the reference path on every ISA path of this CPU.

The reference is ``layouts.dequantize`` (exact fp32 weight) + ``fake_quantize_act`` (compressed-tensors'
dynamic int8 rule) + fp32 ``F.linear``. The kernel's integer dot products are exact, so the only differences
are fp32 rounding (order of the sums, one rounding per group) and, for bf16/fp16 activations, the rounding
of the output to that dtype. Error budgets below are stated per case.
"""
import pytest
import torch
import torch.nn.functional as F

from hf_w4 import layouts, ops
from hf_w4.formats.spec import W4Spec
from hf_w4.kernels import registry
from hf_w4.kernels.base import fake_quantize_act, quantize_act_int8

pytestmark = pytest.mark.skipif(not ops.has_impl("int8_gemm"), reason="hf_w4 int8 ops not built")

ALL_ISAS = ("generic", "avx2novnni", "avxvnni", "avx512")


def _isas():
    out = []
    for isa in ALL_ISAS:
        try:
            torch.ops.hf_w4.int8_isa(isa)
            out.append(isa)
        except RuntimeError:
            pass
    return out


ISAS = _isas() if ops.has_impl("int8_gemm") else []
# one output ulp of each activation dtype (relative; y and the reference may round to neighbouring values)
# + fp32 accumulation-order slack (relative to max |y|)
OUT_RTOL = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
ACC_TOL = 2e-6


def make_qweight(kind, n, k, gs, sym=True, g_idx=False, seed=0, zero_plus_one=False):
    """(spec, QWeight) built the way a checkpoint would be: layouts.pack + layouts.to_qweight."""
    g = torch.Generator().manual_seed(seed)
    G = 1 if gs == -1 else k // gs
    if kind in ("w8a8", "w4a8_ct"):
        bits = 8 if kind == "w8a8" else 4
        spec = W4Spec("compressed-tensors", "ct_int", "int8", bits, gs, True, act="int8_token")
        lim = 2 ** (bits - 1)
        codes = torch.randint(-lim, lim, (n, k), generator=g)
        scales = torch.rand(n, G, generator=g) * 0.02 + 0.001
        t = layouts.pack(spec, codes, scales)
        return spec, layouts.to_qweight(spec, t, n, k)
    spec = W4Spec("gptq", kind, "int4", 4, gs, sym, has_g_idx=g_idx, act="int8_token", zero_plus_one=zero_plus_one)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, G, generator=g) * 0.02 + 0.001
    zeros = None if sym else torch.randint(1 if zero_plus_one else 0, 16, (n, G), generator=g)
    gi = None
    if g_idx:
        gi = (torch.arange(k) // (k if gs == -1 else gs))[torch.randperm(k, generator=g)]
    t = layouts.pack(spec, codes, scales, zeros, g_idx=gi)
    return spec, layouts.to_qweight(spec, t, n, k)


def reference(qw, x, act, bias=None):
    w = layouts.dequantize(qw)
    xf = fake_quantize_act(x, act, qw.group_size if qw.group_size > 0 else qw.k)
    return F.linear(xf, w, None if bias is None else bias.float())


def run_kernel(qw, x, act, isa, bias=None, as_int4=False):
    perm = layouts.act_order_perm(qw.g_idx, qw.group_size) if qw.g_idx is not None else None
    packed, s, z = ops.int8_repack(qw, perm, as_int4=as_int4)
    wt = "int4" if as_int4 else qw.weight_type
    return ops.int8_gemm(x, packed, s, z if z.numel() else None, wt, qw.n, qw.k, qw.group_size, perm=perm,
                         bias=bias, act_group=act == "int8_group", isa=isa)


def check(y, y0, dtype, what):
    assert y.dtype == dtype, what
    y0d = y0.to(dtype).float()
    err = (y.float() - y0d).abs()
    budget = ACC_TOL * y0.abs().max() + OUT_RTOL[dtype] * y0.abs() * 1.01 + 1e-30
    bad = err > budget
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {y.numel()} outputs over budget; worst "
                                 f"{float((err - budget).max()):.3g} (max |y| {float(y0.abs().max()):.3g})")


# ------------------------------------------------------------------------------------------------
# activation quantization: bit for bit equal to quantize_act_int8 on every path

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quant_act_bit_exact(isa, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(13, 576, generator=g) * 3).to(dtype)
    x[3] = 0                                   # zero row: scale 1
    x[4, :] = 0.0
    x[4, 0] = 127.5                            # scale exactly 1 -> exact .5 ties (round half to even)
    x[4, 1:9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.5])
    x[5, 17] = -x[5].abs().max() * 1.5        # -128 reachable
    for group in (-1, 64, 576, 48):
        q, s = torch.ops.hf_w4.int8_quant_act(x, group, isa)
        qr, sr = quantize_act_int8(x, None if group in (-1, 576) else group)
        assert torch.equal(q, qr), (group, (q.int() - qr.int()).abs().max())
        assert torch.equal(s, sr), group


# ------------------------------------------------------------------------------------------------
# the gemm against the reference, every ISA path

CASES = [
    # kind, N, K, group, sym, g_idx
    ("w8a8", 192, 576, -1, True, False),
    ("w8a8", 130, 1024, -1, True, False),
    ("w4a8_ct", 192, 576, 64, True, False),
    ("w4a8_ct", 64, 512, 128, True, False),
    ("gptq", 192, 576, 64, True, False),
    ("gptq", 192, 576, 64, True, True),
    ("gptq", 256, 512, 128, False, False),
    ("gptq", 64, 1152, -1, True, False),     # per channel, K > the 512 block: int32 partials between blocks
    ("awq", 192, 576, 64, False, False),
    ("ct_pack", 100, 256, 32, True, False),  # N not a multiple of 64
    ("ct_pack", 72, 240, 48, False, False),  # group 48 (padded to 48), N = 72
    ("gptq", 96, 96, 24, True, False),       # group 24 -> padded to 24 (multiple of 8)
    ("ct_pack", 64, 120, 40, True, False),   # group 40 -> padded 40
    ("ct_pack", 104, 768, 192, False, False),  # group 192 straddles the 512-column K blocks: int32 partials
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-N{c[1]}-K{c[2]}-g{c[3]}-{'sym' if c[4] else 'asym'}"
                         + ("-gidx" if c[5] else ""))
def test_gemm_vs_reference(case, isa):
    kind, n, k, gs, sym, gidx = case
    spec, qw = make_qweight(kind, n, k, gs, sym, gidx, seed=n + k)
    g = torch.Generator().manual_seed(k)
    acts = ["int8_token"] + ([] if gidx else ["int8_group"])
    for M, dtype in ((1, torch.bfloat16), (5, torch.float32), (7, torch.float16), (16, torch.bfloat16),
                     (45, torch.float32)):
        x = torch.randn(M, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g) if M % 2 else None
        for act in acts:
            y0 = reference(qw, x, act, bias)
            y = run_kernel(qw, x, act, isa, bias)
            check(y, y0, dtype, f"{kind} M={M} {dtype} {act} {isa}")
            if kind == "w4a8_ct":  # int4-in-int8 packed as nibbles: same numbers
                y4 = run_kernel(qw, x, act, isa, bias, as_int4=True)
                check(y4, y0, dtype, f"{kind} as int4 M={M} {dtype} {act} {isa}")


@pytest.mark.parametrize("isa", ISAS)
def test_nonfinite_activations_give_nan_rows(isa):
    """inf / nan in x: compressed-tensors' forward makes the row's scale inf / nan, so the whole output row is nan.
    Every path does the same (a float max over the row used to drop a nan: finite, wrong numbers), at any position
    (vector body or scalar tail, K = 200), per token and per group, act-order, every row tile; the other rows match
    the reference."""
    g = torch.Generator().manual_seed(11)
    for kind, gs, gidx in (("w8a8", -1, False), ("gptq", 40, False), ("gptq", 40, True), ("w4a8_ct", -1, False)):
        spec, qw = make_qweight(kind, 48, 200, gs, g_idx=gidx, seed=3)
        acts = ["int8_token"] + ([] if gidx or gs == -1 else ["int8_group"])
        for M, dtype in ((1, torch.bfloat16), (7, torch.float32), (20, torch.float16)):
            x = torch.randn(M, 200, generator=g).to(dtype)
            bad_rows = sorted({0, M // 2, M - 1})
            for r, c, v in zip(bad_rows, (3, 199, 117), ("nan", "inf", "-inf")):
                x[r, c] = float(v)
            ok = [r for r in range(M) if r not in bad_rows]
            for act in acts:
                y = run_kernel(qw, x, act, isa)
                y0 = reference(qw, x, act)
                assert bool(y0[bad_rows].isnan().all()), "the reference's rows"
                assert bool(y[bad_rows].isnan().all()), (kind, act, M, isa, y[bad_rows].isnan().sum(-1))
                if ok:
                    check(y[ok], y0[ok], dtype, f"{kind} {act} M={M} {isa}")
            q, sc = torch.ops.hf_w4.int8_quant_act(x, -1, isa)
            assert bool(sc[bad_rows].isnan().all()) and bool(sc[ok].isfinite().all()), isa


@pytest.mark.parametrize("seed", range(6))
def test_fuzz_random_shapes(seed):
    g = torch.Generator().manual_seed(100 + seed)
    kind = ["w8a8", "w4a8_ct", "gptq", "awq", "ct_pack", "gptq"][seed]
    n = 8 * int(torch.randint(1, 40, (1,), generator=g))
    gs = [-1, 32, 64, 128, 16, 8][int(torch.randint(0, 6, (1,), generator=g))]
    k = (gs if gs > 0 else 8) * int(torch.randint(1, 12, (1,), generator=g)) * (1 if gs > 0 else 16)
    if kind == "w4a8_ct" and gs == -1:
        gs = k
    sym = kind not in ("awq",) and bool(seed % 2 == 0)
    if kind.startswith("w"):
        sym = True
    gidx = kind == "gptq" and seed == 5 and gs > 0
    spec, qw = make_qweight(kind, n, k, gs, sym, gidx, seed=seed, zero_plus_one=kind == "gptq" and not sym)
    M = int(torch.randint(1, 70, (1,), generator=g))
    x = torch.randn(M, k, generator=g).bfloat16()
    for act in ("int8_token",) + (() if gidx else ("int8_group",)):
        y0 = reference(qw, x, act)
        for isa in ISAS:
            check(run_kernel(qw, x, act, isa), y0, torch.bfloat16, f"fuzz {seed} {kind} N={n} K={k} g={gs} {isa}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("gs", [-1, 128, 32])
def test_int4_extreme_codes(isa, gs):
    # code 15 in every weight of half the columns against activations quantized to -128 / 127 everywhere: the
    # largest pair sums (2 x 15 x 128) the AVX2 path without VNNI accumulates in int16 lanes (8 quads before it
    # widens); one quad too many would wrap and be far off. M = 9 takes the decoded-buffer tiles, M = 3 the
    # on-the-fly ones.
    n, k = 64, 2048
    G = 1 if gs == -1 else k // gs
    spec = W4Spec("gptq", "gptq", "int4", 4, gs, True, act="int8_token")
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(5))
    codes[: n // 2] = 15
    t = layouts.pack(spec, codes, torch.full((n, G), 0.01))
    qw = layouts.to_qweight(spec, t, n, k)
    signs = torch.ones(k)
    signs[1::2] = -1
    for M in (3, 9):
        x = torch.stack([-torch.ones(k), torch.ones(k), signs] * 3)[:M].bfloat16()
        check(run_kernel(qw, x, "int8_token", isa), reference(qw, x, "int8_token"), torch.bfloat16,
              f"extreme codes g={gs} M={M} {isa}")


@pytest.mark.parametrize("isa", ISAS)
def test_large_m_blocks_and_3d_input(isa):
    # several row chunks and K blocks; a 3-D input [B, S, K]
    spec, qw = make_qweight("gptq", 128, 1024, 128, False, False, seed=3)
    x = torch.randn(2, 300, 1024).bfloat16()
    y = run_kernel(qw, x, "int8_token", isa)
    assert y.shape == (2, 300, 128)
    check(y, reference(qw, x, "int8_token"), torch.bfloat16, f"large M {isa}")


def _amx_usable():
    try:
        spec, qw = make_qweight("w8a8", 64, 64, -1)
        p, s, _ = ops.int8_repack(qw)
        ops.int8_gemm(torch.randn(32, 64), p, s, None, "int8", 64, 64, 64, isa="amx")
        return True
    except RuntimeError:
        return False


AMX_CASES = [
    ("w8a8", 192, 576, -1, True, False), ("w8a8", 130, 1024, -1, True, False),
    ("w4a8_ct", 192, 576, 64, True, False), ("gptq", 256, 512, 128, False, False),
    ("gptq", 192, 1024, 128, True, True), ("awq", 192, 512, 64, False, False),
    ("gptq", 64, 1152, -1, True, False),     # one group over K = 1152: int32 tiles carried across K slices
    ("ct_pack", 104, 768, 192, False, False),  # group 192: slices of 384 columns; N not a multiple of 64
    ("w8a8", 72, 1600, -1, True, False),     # K = 1600: a short last slice, carried int32 partials
]


@pytest.mark.skipif(not ops.has_impl("int8_gemm") or not _amx_usable(), reason="AMX-INT8 not available here")
@pytest.mark.parametrize("case", AMX_CASES, ids=lambda c: f"{c[0]}-N{c[1]}-K{c[2]}-g{c[3]}" + ("-gidx" if c[5] else ""))
def test_amx_equals_avx512(case):
    # AMX-INT8 (Intel; auto above a measured M threshold when groups are multiples of 64): the same exact integer
    # dot per group (the zero point folded into the converted weights instead of subtracted as zero * asum) and
    # the same epilogue arithmetic in the same group order as the AVX-512 path, hence bit-identical outputs. M
    # from 1 (a single, mostly padded 16-row block) to several row chunks.
    kind, n, k, gs, sym, gidx = case
    spec, qw = make_qweight(kind, n, k, gs, sym, gidx, seed=k)
    perm = layouts.act_order_perm(qw.g_idx, qw.group_size) if qw.g_idx is not None else None
    p, s, z = ops.int8_repack(qw, perm)
    z = z if z.numel() else None
    for M, dt in ((1, torch.bfloat16), (7, torch.float32), (16, torch.bfloat16), (17, torch.float16),
                  (32, torch.bfloat16), (45, torch.float32), (100, torch.float16), (300, torch.bfloat16)):
        for act in ("int8_token",) + (() if gidx else ("int8_group",)):
            x = torch.randn(M, k).to(dt)
            b = torch.randn(n)
            kw = dict(perm=perm, bias=b, act_group=act == "int8_group")
            y = ops.int8_gemm(x, p, s, z, qw.weight_type, n, k, qw.group_size, isa="amx", **kw)
            assert torch.equal(y, ops.int8_gemm(x, p, s, z, qw.weight_type, n, k, qw.group_size, isa="avx512", **kw))
            check(y, reference(qw, x, act, b), dt, f"amx {kind} M={M} {act}")


@pytest.mark.skipif(not ops.has_impl("int8_gemm") or not _amx_usable(), reason="AMX-INT8 not available here")
@pytest.mark.parametrize("shift", [150.0, -120.0])
def test_amx_zero_points_out_of_int8_range(shift):
    # code - zero must fit int8 to be folded into the AMX weights (zeros in [-112, 128]); panels with other zeros
    # keep the codes and subtract zero * asum in the epilogue. Panel 0 gets out-of-range zeros, panel 1 not.
    import dataclasses
    spec, qw = make_qweight("gptq", 128, 512, 128, False, False, seed=5)
    zeros = qw.zeros.clone()
    zeros[:64] += shift
    qw = dataclasses.replace(qw, zeros=zeros)
    p, s, z = ops.int8_repack(qw)
    for M in (5, 40):
        x = torch.randn(M, 512)
        for act in ("int8_token", "int8_group"):
            kw = dict(act_group=act == "int8_group")
            y = ops.int8_gemm(x, p, s, z, "int4", 128, 512, 128, isa="amx", **kw)
            assert torch.equal(y, ops.int8_gemm(x, p, s, z, "int4", 128, 512, 128, isa="avx512", **kw))
            check(y, reference(qw, x, act), torch.float32, f"amx zeros {shift} M={M} {act}")


@pytest.mark.parametrize("isa", ISAS)
def test_int8_weights_across_k_blocks(isa):
    # int8 weights shared by several row tiles are read in K blocks (4096 k on AVX-512, 512 elsewhere): a channel
    # spanning three blocks (the last one 8 k) and groups that straddle block boundaries (int32 partial sums)
    g = torch.Generator().manual_seed(12)
    for k, gs in ((8200, -1), (6144, 1536), (4608, 576)):
        spec, qw = make_qweight("w8a8", 64, k, gs, seed=k)
        x = torch.randn(13, k, generator=g).bfloat16()
        for act in ("int8_token", "int8_group"):
            check(run_kernel(qw, x, act, isa), reference(qw, x, act), torch.bfloat16, f"K={k} g={gs} {act} {isa}")


@pytest.mark.parametrize("isa", ISAS)
def test_short_activation_tiles(isa):
    # the last activation tile packs only its own rows (1-5 of 6): every short tile, alone (M <= 6) and after full
    # tiles (M = 7-11), with K and groups that are not multiples of 16 (the quantizers' scalar tails)
    g = torch.Generator().manual_seed(11)
    for M in range(1, 12):
        for k, group in ((100, -1), (120, 20), (576, 48), (4100, -1)):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                x = (torch.randn(M, k, generator=g) * 3).to(dtype)
                x[M // 2, : min(17, k)] = torch.arange(min(17, k)).to(dtype) + 0.5  # exact .5 ties once scaled
                x[M // 2, 0] = 127.5                                               # (scale 1)
                q, sc = torch.ops.hf_w4.int8_quant_act(x, group, isa)
                qr, sr = quantize_act_int8(x, None if group == -1 else group)
                assert torch.equal(sc, sr) and torch.equal(q, qr), (isa, M, k, group, dtype)
    for M in (1, 2, 3, 4, 5, 7, 11):
        for kind, gs in (("w8a8", -1), ("gptq", 32)):
            spec, qw = make_qweight(kind, 72, 256, gs, seed=M)
            x = torch.randn(M, 256, generator=g).bfloat16()
            for act in ("int8_token", "int8_group"):
                check(run_kernel(qw, x, act, isa), reference(qw, x, act), torch.bfloat16, f"{kind} M={M} {act} {isa}")


@pytest.mark.parametrize("isa", ISAS)
def test_quant_act_fuzz_bit_exact(isa):
    # the AVX-512 quantizer divides through a reciprocal and redoes near-tie lanes exactly: fuzz it with scales
    # of every magnitude and with values placed on (and one float step around) the .5 boundaries of x / s
    g = torch.Generator().manual_seed(7)
    rows = []
    for e in (-30, -8, -1, 0, 3, 20):
        s = float(torch.rand(1, generator=g)) * 2.0 ** e + 2.0 ** (e - 1)
        r = torch.randn(4, 1024, generator=g) * s * 40
        r[:, 0] = 127.5 * s                                    # sets the scale to ~s
        half = (torch.randint(-127, 127, (4, 256), generator=g).float() + 0.5) * s
        r[:, 1:257] = half
        r[:, 257:513] = torch.nextafter(half, torch.full_like(half, 1e30))
        r[:, 513:769] = torch.nextafter(half, torch.full_like(half, -1e30))
        rows.append(r)
    x = torch.cat(rows)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for group in (-1, 128):
            q, sc = torch.ops.hf_w4.int8_quant_act(xd, group, isa)
            qr, sr = quantize_act_int8(xd, None if group == -1 else group)
            assert torch.equal(sc, sr), (dtype, group)
            assert torch.equal(q, qr), (dtype, group, int((q.int() - qr.int()).abs().max()))


def test_auto_isa_and_env_setting(monkeypatch):
    # HF_W4_ISA names the level, as for the W4A16 ops: the best one by default, a lower one when set; a level the
    # CPU lacks or an unknown name is an error that names the variable
    best = torch.ops.hf_w4.int8_isa("")
    assert best in ("generic", "avx2", "avxvnni", "avx512")   # the variant names ("avx2": AVX2, no VNNI)
    monkeypatch.setenv("HF_W4_ISA", "generic")
    assert torch.ops.hf_w4.int8_isa("") == "generic"
    monkeypatch.setenv("HF_W4_ISA", "avx512")
    if best == "avx512":
        assert torch.ops.hf_w4.int8_isa("") == "avx512"
    else:
        with pytest.raises(RuntimeError, match="HF_W4_ISA='avx512' is not available: this CPU has"):
            torch.ops.hf_w4.int8_isa("")
    monkeypatch.setenv("HF_W4_ISA", "bogus")
    with pytest.raises(RuntimeError, match="HF_W4_ISA='bogus' is not an ISA name"):
        torch.ops.hf_w4.int8_isa("")
    monkeypatch.delenv("HF_W4_ISA")
    with pytest.raises(RuntimeError, match="isa='sse9' is not an ISA name; use auto, avx512, avx2, generic, or one "
                                           "of this kernel's variants avxvnni, avx2novnni, amx"):
        torch.ops.hf_w4.int8_isa("sse9")


def test_errors_are_explained():
    spec, qw = make_qweight("gptq", 64, 256, 64, True, True, seed=0)
    perm = layouts.act_order_perm(qw.g_idx, qw.group_size)
    p, s, z = ops.int8_repack(qw, perm)
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="act-order"):
        ops.int8_gemm(x, p, s, None, "int4", 64, 256, 64, perm=perm, act_group=True)
    with pytest.raises(RuntimeError, match="features"):
        ops.int8_gemm(torch.randn(2, 128), p, s, None, "int4", 64, 256, 64, perm=perm)
    with pytest.raises(RuntimeError, match="not match"):
        ops.int8_gemm(x, p, s, None, "int4", 64, 256, 128, perm=perm)


# ------------------------------------------------------------------------------------------------
# opcheck (schemas, fake impls, dispatch)

def test_opcheck():
    spec, qw = make_qweight("gptq", 64, 256, 64, False, False, seed=0)
    args = (qw.codes, "int4", 0, list(qw.slots), qw.scales, qw.zeros, None, 64, 256, 64)
    torch.library.opcheck(torch.ops.hf_w4.int8_repack, args)
    p, s, z = torch.ops.hf_w4.int8_repack(*args)
    x = torch.randn(3, 256).bfloat16()
    torch.library.opcheck(torch.ops.hf_w4.int8_gemm, (x, p, s, z, None, None, "int4", 64, 256, 64, False, ""))
    torch.library.opcheck(torch.ops.hf_w4.int8_gemm,
                          (x.float(), p, s, z, None, torch.randn(64), "int4", 64, 256, 64, True, "generic"))
    torch.library.opcheck(torch.ops.hf_w4.int8_gemm,  # the registered autograd formula
                          (x.float().requires_grad_(), p, s, z, None, torch.randn(64, requires_grad=True), "int4", 64,
                           256, 64, False, ""))
    spec8, q8 = make_qweight("w8a8", 64, 128, -1, seed=1)
    a8 = (q8.codes, "int8", 0, list(q8.slots), q8.scales, None, None, 64, 128, 128)
    torch.library.opcheck(torch.ops.hf_w4.int8_repack, a8)
    p8, s8, z8 = torch.ops.hf_w4.int8_repack(*a8)
    torch.library.opcheck(torch.ops.hf_w4.int8_gemm, (x[:, :128], p8, s8, None, None, None, "int8", 64, 128, 128,
                                                      False, ""))
    torch.library.opcheck(torch.ops.hf_w4.int8_quant_act, (torch.randn(2, 3, 64), 16, ""))


# ------------------------------------------------------------------------------------------------
# the kernel class and the registry

class _Layer(torch.nn.Module):
    def __init__(self, qw):
        super().__init__()
        self.qw = qw

    def quantized_weight(self):
        return self.qw


def test_kernel_class_prepare_apply():
    from hf_w4.kernels.cpu_int8 import CpuInt8Kernel
    for kind, gs, act in (("w8a8", -1, "int8_token"), ("w4a8_ct", 64, "int8_token"), ("gptq", 64, "int8_group"),
                          ("awq", 64, "int8_token")):
        spec, qw = make_qweight(kind, 128, 256, gs, sym=kind != "awq", seed=2)
        spec = spec.replace(act=act)
        assert CpuInt8Kernel.can_implement(spec, 128, 256, torch.device("cpu"), torch.bfloat16) == (True, "")
        layer = _Layer(qw)
        kern = CpuInt8Kernel(spec, 128, 256)
        kern.prepare(layer, qw)
        assert "int8_packed" not in layer.state_dict()   # non-persistent
        if kind == "w4a8_ct":
            assert layer.int8_packed.numel() == 128 * 256 // 2   # int4-in-int8 stored as nibbles
        x = torch.randn(4, 256).bfloat16()
        b = torch.randn(128)
        check(kern.apply(layer, x, b), reference(qw, x, act, b), torch.bfloat16, f"class {kind}")


def test_registry_selects_and_rejects():
    dev = torch.device("cpu")
    spec, _ = make_qweight("w8a8", 64, 128, -1)
    cls, _ = registry.select(spec, 64, 128, dev, torch.bfloat16, deny=("zentorch_int8", "zentorch_w4a16"))
    assert cls.NAME == "cpu_int8"
    spec4 = W4Spec("gptq", "gptq", "int4", 4, 128, True, act="int8_token")
    cls, _ = registry.select(spec4, 64, 256, dev, torch.float32, deny=("zentorch_int8", "zentorch_w4a16"))
    assert cls.NAME == "cpu_int8"
    from hf_w4.kernels.cpu_int8 import CpuInt8Kernel
    ok, why = CpuInt8Kernel.can_implement(spec4.replace(act="none"), 64, 256, dev, torch.bfloat16)
    assert not ok and "activation" in why
    ok, why = CpuInt8Kernel.can_implement(spec4.replace(act="int8_group", has_g_idx=True, desc_act=True), 64, 256,
                                          dev, torch.bfloat16)
    assert not ok and "act-order" in why
    ok, why = CpuInt8Kernel.can_implement(spec4.replace(act="int8_group", has_g_idx=True), 64, 256, dev,
                                          torch.bfloat16)
    assert ok, why                    # a trivial g_idx (every gptq export writes one) is fine
    ok, why = CpuInt8Kernel.can_implement(spec.replace(group_size=-1), 64, 70000, dev, torch.bfloat16)
    assert not ok and "overflow" in why


# ------------------------------------------------------------------------------------------------
# compressed-tensors' own fake-quant forward (a test-only re-statement of its arithmetic, not its code)

def _ct_fake_quant_forward(x, q, w_scale, dtype):
    """compressed-tensors' forward of an int-quantized Linear with dynamic per-token int8 activations,
    doing each step in ``dtype`` as CT does in a model of that dtype: per-token amax of x, scale =
    amax / 127.5 (then clamped below at fp32 eps), x / scale, clamp to [-128, 127], round half to even,
    times scale; weight = q * scale in ``dtype``; then F.linear in ``dtype``."""
    x = x.to(dtype)
    amax = torch.maximum(x.amax(-1, keepdim=True), torch.zeros((), dtype=dtype)).maximum(
        (-torch.minimum(x.amin(-1, keepdim=True), torch.zeros((), dtype=dtype))))
    s = torch.clamp(amax / 127.5, min=torch.finfo(torch.float32).eps)
    xq = torch.round(torch.clamp(x / s, -128, 127)) * s
    w = q.to(dtype) * w_scale.to(dtype)
    return F.linear(xq, w)


def test_compressed_tensors_fake_quant_reproduced():
    """In fp32, CT's forward and the reference path (hence the kernel) agree bit for bit on the activations
    and exactly on the layer output. In bf16, CT rounds the scale and x/scale to bf16 before rounding to an
    integer, so its codes differ from the fp32 rule (the rule our kernel and quantize_act_int8 implement)
    wherever |x/scale| > 64 falls on a bf16 rounding boundary; we state that difference here."""
    n, k = 64, 256
    g = torch.Generator().manual_seed(7)
    spec, qw = make_qweight("w8a8", n, k, -1, seed=7)
    ws = qw.scales.bfloat16().float()      # CT stores bf16 scales; the QWeight holds them as fp32
    x = torch.randn(9, k, generator=g)
    # fp32: exact
    y_ct = _ct_fake_quant_forward(x, qw.codes, ws, torch.float32)
    xf = fake_quantize_act(x, "int8_token", k)
    y_ref = F.linear(xf, layouts.dequantize(qw))
    assert torch.equal(y_ct, y_ref)
    # activations only (the weight side is q*s either way): CT's fp32 codes == ours
    s_ct = x.abs().amax(-1, keepdim=True) / 127.5
    assert torch.equal(torch.round(torch.clamp(x / s_ct, -128, 127)) * s_ct, xf)
    # bf16 model: CT's weight is q*s rounded to bf16; with that weight, CT's forward with its activation
    # step done in fp32 is exactly the reference path on bf16 inputs
    xb = x.bfloat16()
    w_ct = (qw.codes.bfloat16() * ws.bfloat16()).float()
    xb32 = xb.float()
    s_b = xb32.abs().amax(-1, keepdim=True) / 127.5
    y_ct_fp32_act = F.linear(torch.round(torch.clamp(xb32 / s_b, -128, 127)) * s_b, w_ct)
    assert torch.equal(y_ct_fp32_act, F.linear(fake_quantize_act(xb, "int8_token", k), w_ct))
    # CT's own bf16 activation arithmetic rounds scale and x/scale to bf16: a few codes move by one
    sb16 = torch.clamp(xb.abs().amax(-1, keepdim=True) / 127.5, min=torch.finfo(torch.float32).eps)
    q_ct16 = torch.round(torch.clamp(xb / sb16, -128, 127)).float()
    q_ours, _ = quantize_act_int8(xb)
    moved = (q_ct16 != q_ours.float())
    assert float((q_ct16 - q_ours.float()).abs().max()) <= 1.0 and float(moved.float().mean()) < 0.25
    y_ct16 = _ct_fake_quant_forward(xb, qw.codes, ws, torch.bfloat16).float()
    y_kernel = run_kernel(qw, xb, "int8_token", "").float()
    rel = float((y_ct16 - y_kernel).abs().max() / y_kernel.abs().max())
    assert rel < 0.03, rel


def test_bench_vnni_contenders_match_the_default():
    # the int8 benchmark's *_vnni contenders force the AVX-512 VNNI path (what a CPU without AMX runs); where AMX
    # exists they must give the default op's results bit for bit (same integers, same fp32 order); elsewhere they
    # decline with the reason
    from hf_w4.tools.bench import int8 as bench_int8
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    for base, vnni in ((bench_int8.OursW8A8(), bench_int8.OursW8A8Vnni()),
                       (bench_int8.OursW4A8(), bench_int8.OursW4A8Vnni())):
        ok, why = vnni.available()
        if not ok:
            assert "AMX" in why or "VNNI" in why, why
            continue
        assert torch.equal(vnni.run(vnni.prepare(w, 128), x), base.run(base.prepare(w, 128), x)), vnni.name


def test_bench_int8_prints_only_its_table(capsys):
    # int8 contenders alone: only the int8 table (the W4A16 table would be all dashes); with a W4A16 contender: both
    from hf_w4.tools import bench
    fast = ["--int8", "--shapes", "256x128", "--m", "1", "--cold-mib", "1", "--min-time", "0.001", "--min-runs", "1",
            "--rounds", "1", "--threads", str(torch.get_num_threads())]  # the suite's thread count stays
    assert bench.main(fast + ["--contenders", "bf16,ours_w8a8"]) == 0
    out = capsys.readouterr().out
    assert "w8a8 vs bf16" in out and "int4 vs int4pack" not in out and "ours_w8a8 ms" in out
    assert bench.main(fast + ["--contenders", "bf16,ours_int4,ours_w4a8"]) == 0
    out = capsys.readouterr().out
    assert "w4a8 vs bf16" in out and "int4 vs bf16" in out


def test_bad_perm_is_refused():
    """The int8 kernels index activations with perm's entries: anything but a permutation of K is an error."""
    spec, qw = make_qweight("gptq", 64, 256, 64, False, False, seed=0)
    args = lambda perm: (qw.codes, "int4", 0, list(qw.slots), qw.scales, qw.zeros, perm, 64, 256, 64)
    p, s, z = torch.ops.hf_w4.int8_repack(*args(None))
    ident = torch.arange(256)
    for what, perm in (("out of range", torch.where(ident == 9, -1, ident)), ("repeated", torch.where(ident == 9, 0, ident)),
                       ("K.256", ident[:100])):
        with pytest.raises(RuntimeError, match="perm .*" + what):
            torch.ops.hf_w4.int8_repack(*args(perm))
        with pytest.raises(RuntimeError, match="perm .*" + what):
            torch.ops.hf_w4.int8_gemm(torch.randn(2, 256), p, s, z, perm, None, "int4", 64, 256, 64, False, "")


def test_bad_inputs_are_refused():
    """Inputs the kernels cannot run as given are errors naming the op, the tensor and what was found (they used to be
    accepted and give wrong numbers, or raise torch's IndexError): zero points with int8 weights, nibble slots outside
    0..7, int4 values held in int8 outside -8..7, non-integer zero points, group sizes other than -1 or a positive
    divisor of K, K = 0, a 0-d x."""
    n, k = 64, 128
    spec, qw = make_qweight("w8a8", n, k, -1, seed=3)
    p, s, z = ops.int8_repack(qw)
    x = torch.randn(3, k)
    with pytest.raises(RuntimeError, match=r"hf_w4 int8 gemm: zero points are only supported for int4 weights \(int8 "
                                           r"weights have the implicit zero 128\), got zeros \[1, 1, 64\]"):
        ops.int8_gemm(x, p, s, torch.zeros(1, 1, 64, dtype=torch.int32), "int8", n, k, -1)
    c4 = torch.randint(0, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32)
    rp = lambda codes, wt="int4", slots=tuple(range(8)), zeros=None, gs=-1, kk=k: torch.ops.hf_w4.int8_repack(
        codes, wt, 0, list(slots), torch.ones(n, kk // gs if gs > 0 else 1), zeros, None, n, kk, gs)
    with pytest.raises(RuntimeError, match=r"hf_w4 int8 repack: slots must be in 0..7, got slots\[7\] = 9"):
        rp(c4, slots=(0, 1, 2, 3, 4, 5, 6, 9))
    for lo, hi in ((-8, 100), (-9, 7)):
        w = torch.randint(-8, 8, (n, k), dtype=torch.int8)
        w[5, 7], w[9, 3] = lo, hi
        with pytest.raises(RuntimeError, match=f"hf_w4 int8 repack: int8-held int4 weights must be in -8..7, found "
                                               f"values from {lo} to {hi}"):
            rp(w)
    rp(torch.randint(-8, 8, (n, k), dtype=torch.int8))
    zeros = torch.full((n, 1), 8.0)
    zeros[3, 0] = 7.5
    with pytest.raises(RuntimeError, match=r"hf_w4 int8 repack: zero points must be integers \(code units\) in the "
                                           r"int32 range, got zeros\[3, 0\] = 7.5"):
        rp(c4, zeros=zeros)
    for gs in (-5, 0, 48, 256):
        msg = f"group_size must be -1 \\(channel-wise\\) or a positive divisor of K={k}, got {gs}"
        with pytest.raises(RuntimeError, match="hf_w4 int8 repack: " + msg):
            rp(c4, gs=gs)
        with pytest.raises(RuntimeError, match="hf_w4 int8 gemm: " + msg):
            ops.int8_gemm(x, p, s, None, "int8", n, k, gs)
        with pytest.raises(RuntimeError, match="hf_w4 int8 quant_act: " + msg):
            torch.ops.hf_w4.int8_quant_act(x, gs, "")
    with pytest.raises(RuntimeError, match="hf_w4 int8 repack: K must be positive, got K=0"):
        rp(c4[:, :0], kk=0)
    with pytest.raises(RuntimeError, match="hf_w4 int8 gemm: K must be positive, got K=0"):
        ops.int8_gemm(torch.randn(3, 0), torch.empty(1, 0, dtype=torch.uint8), torch.empty(1, 0, 64), None, "int8",
                      5, 0, -1)
    with pytest.raises(RuntimeError, match="hf_w4 int8 quant_act: K must be positive, got K=0"):
        torch.ops.hf_w4.int8_quant_act(torch.randn(2, 0), -1, "")
    with pytest.raises(RuntimeError, match=f"hf_w4 int8 gemm: x must be \\[..., K\\] with K={k}, got a 0-d tensor"):
        ops.int8_gemm(torch.tensor(1.0), p, s, None, "int8", n, k, -1)
    with pytest.raises(RuntimeError, match=r"hf_w4 int8 quant_act: x must be \[..., K\], got a 0-d tensor"):
        torch.ops.hf_w4.int8_quant_act(torch.tensor(1.0), -1, "")
    # still accepted: -1 and K for channel-wise, empty zeros with int8 weights
    y = ops.int8_gemm(x, p, s, None, "int8", n, k, -1)
    assert torch.equal(y, ops.int8_gemm(x, p, s, torch.empty(0, dtype=torch.int32), "int8", n, k, k))
    check(y, reference(qw, x, "int8_token"), torch.float32, "channel-wise after the checks")
    from hf_w4.kernels.cpu_int8 import CpuInt8Kernel
    ok, why = CpuInt8Kernel.can_implement(spec, n, 0, torch.device("cpu"), torch.float32)
    assert not ok and "K=0" in why
