"""The CUDA kernels of csrc/cuda run on the CPU: g++ builds its .cu files against tests/kernels/cuda_emu (a
stand-in for the CUDA runtime, the intrinsics and the kernels' PTX: one fiber per thread, mma.sync and shuffles as
warp collectives, barriers that wait for every live thread) and the fused and dequantize kernels run on buffers the
layer's own repack wrote. What this checks on machines without a GPU: the kernels' indexing, work split, ring of
chunks, split-K fix-up, masking of rows past M and of the short last chunk, and the dequantization in place, for every
layout and group size, fp16 and bf16. The kernels get copies of their buffers that end at an inaccessible page, so
a read or write past a buffer's end stops the test process with a segmentation fault. Not what a GPU adds (timing,
memory ordering, the hardware's rounding of special values, sm_89's E4M3 conversion): tests/gpu/ runs the same
kernels there.

Error budget as on a GPU (tests/qweight_cases.check_kernel_output): |y - x @ Wk^T| <= u * |x @ Wk^T| + 1e-5 *
|x| @ |Wk|^T (u = 2^-11 fp16, 2^-8 bf16), Wk the weight the kernels multiply by (kernel_dtype_weight). The dequantize
kernel's weight equals Wk (with NVFP4's global scale) bit for bit.
"""
from __future__ import annotations

import ctypes
import os

import pytest
import torch

from conftest import CUDA_EMU, H100_SMS as SMS, REPO
from qweight_cases import GROUPS, LAYOUTS, check_kernel_output, kernel_dtype_weight, make_qweight
from hf_w4.kernels import cuda_w4a16 as cw

U = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
LAYOUT_GROUPS = [(c, gs) for c in LAYOUTS for gs in (GROUPS if "nvfp4" not in c[1] else [16])]


def _ptr(t):
    return None if t is None else t.data_ptr()


class Layer:
    """A layer's CUDA buffers, prepared on the CPU by the kernel class's own repack."""

    def __init__(self, case, gs, n, k, seed):
        _, layout, sym, ao, zp1 = case
        self.spec, self.qw = make_qweight(layout, n, k, gs, sym, ao, zp1, seed=seed)
        self.module = torch.nn.Module()
        self.kern = cw.CudaW4A16Kernel(self.spec, n, k)
        self.kern.prepare(self.module, self.qw)
        b = self.module._buffers
        self.q, self.z, self.perm = b["cuda_w4a16_q"], b["cuda_w4a16_z"], b["cuda_w4a16_perm"]
        self.nv = self.qw.weight_type == "nvfp4"
        self.kind = 2 if self.nv else (1 if self.z is not None else 0)
        self.n, self.k = n, k

    def scales(self, dtype):
        return self.kern._scales(self.module._buffers, dtype)

    def gemm(self, lib, x, dtype, bias=None, mt=0, wide=False, sms=None, splits=0, wgmma=0, wgmma_rows=0):
        """The fused kernel; wide: True / False force it on / off, None leaves it to the plan's rule; splits: K
        splits forced (0: the plan's); wgmma = 1: the sm_90a wgmma kernel instead, with wgmma_rows rows per block
        (0: the plan's). Returns y and the plan's splits; its rows per block
        in self.rows."""
        xp = (x if self.perm is None else x[:, self.perm]).contiguous()
        y = torch.full((x.shape[0], self.n), float("nan"), dtype=dtype)
        nsplits, rows = ctypes.c_int(0), ctypes.c_int(0)
        rc = lib.hf_w4_emu_gemm(_ptr(xp), _ptr(self.q), _ptr(self.scales(dtype)), _ptr(self.z), _ptr(bias), _ptr(y),
                                x.shape[0], self.n, self.k, self.kern.group_size, self.kind,
                                int(dtype == torch.bfloat16), self.kern.global_scale, sms or SMS, mt,
                                -1 if wide is None else int(wide), splits, wgmma, wgmma_rows,
                                ctypes.byref(nsplits), ctypes.byref(rows))
        assert rc == 0, (f"hf_w4_emu_gemm returned {rc} (-2: a split-K counter left nonzero; -3: "
                         f"{lib.hf_w4_emu_error().decode()})")
        self.rows = rows.value
        return y, nsplits.value


@pytest.mark.parametrize("wide", [False, True], ids=["warps", "wide"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case,gs", LAYOUT_GROUPS, ids=[f"{c[0]}-g{gs}" for c, gs in LAYOUT_GROUPS])
def test_fused_kernel_emulated(cuda_emu, case, gs, dtype, wide):
    """Every layout and group size, both fused kernels: M across the tilings (MR = 8 rings up to 8 rows, one and two
    m16 tiles per block, several m-blocks), split-K and not, a bias, and K with an odd number of k16 steps."""
    u = U[dtype]
    shapes = [(192, 576 if gs != 128 else 640)]
    if gs in (16, -1):
        shapes.append((136, 592))  # 37 k16 steps: the last two-step chunk is short
    for n, k in shapes:
        layer = Layer(case, gs, n, k, seed=n + k)
        wk = kernel_dtype_weight(layer.qw, dtype, global_scale=not layer.nv)
        g = layer.kern.global_scale if layer.nv else 1.0
        gen = torch.Generator().manual_seed(k)
        bias = (torch.randn(n, generator=gen) * 0.1).to(dtype) if n == 136 else None
        for m in (1, 3, 9, 33):
            x = torch.randn(m, k, generator=gen).to(dtype)
            y, splits = layer.gemm(cuda_emu, x, dtype, bias, wide=wide)
            check_kernel_output(y, x, wk, g, bias, u, False,
                                f"{case[0]} g{gs} {dtype} wide={wide} N={n} K={k} M={m} splits={splits}")


@pytest.mark.parametrize("wide", [False, True], ids=["warps", "wide"])
@pytest.mark.parametrize("mt", [1, 2, 4])
def test_fused_kernel_tilings_and_split_k_emulated(cuda_emu, mt, wide):
    """Each m16 tiling forced at M = 1-40 (four tiles: up to 70) over several m-blocks; with and without split-K
    (K = 2048 splits, the wide N does not) and with a short last chunk (K = 592: 37 k16 steps); the same inputs give
    the same bits twice."""
    case = next(c for c in LAYOUTS if c[1] == "gptq")
    for n, k, gs in ((128, 2048, 128), (1024, 256, 128), (136, 592, -1)):
        layer = Layer(case, gs, n, k, seed=7)
        wk = kernel_dtype_weight(layer.qw, torch.bfloat16)
        x = torch.randn(70, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        for m in (1, 17, 40) + ((64, 70) if mt == 4 else ()):
            plan = _plan(cuda_emu, m, n, k, SMS, mt=mt, wide=int(wide))
            assert (plan["mt"], plan["wide"], plan["mblocks"]) == (mt, int(wide), -(-m // (16 * mt))), plan
            y, splits = layer.gemm(cuda_emu, x[:m], torch.bfloat16, mt=mt, wide=wide)
            check_kernel_output(y, x[:m], wk, 1.0, None, U[torch.bfloat16], False,
                                f"mt={mt} wide={wide} N={n} K={k} M={m} splits={splits}")
            assert torch.equal(y, layer.gemm(cuda_emu, x[:m], torch.bfloat16, mt=mt, wide=wide)[0]), "two runs differ"


def _layer_and_bias(name, gs, n, k, dtype, seed):
    """The layout ``name``'s layer, the weight the kernels multiply by (NVFP4: without its global scale ``g``, which
    they apply to the sums), a generator for the inputs and a bias."""
    layer = Layer(next(c for c in LAYOUTS if c[0] == name), gs, n, k, seed=seed)
    wk = kernel_dtype_weight(layer.qw, dtype, global_scale=not layer.nv)
    gen = torch.Generator().manual_seed(seed)
    return layer, wk, layer.kern.global_scale if layer.nv else 1.0, gen, (torch.randn(n, generator=gen) * 0.1).to(dtype)


@pytest.mark.parametrize("wide", [False, True], ids=["warps", "wide"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["gptq_actorder_asym", "awq", "ct_nvfp4"])
def test_four_tile_blocks_every_kind_emulated(cuda_emu, name, dtype, wide):
    """Four m16 tiles per block (forced) for the other weight kinds (zero points, act-order, NVFP4), both dtypes, a
    bias, a full and a partial block of 64 rows, K split or not."""
    n, k = 136, 512
    layer, wk, g, gen, bias = _layer_and_bias(name, 16 if "nvfp4" in name else 64, n, k, dtype, seed=9)
    for m, sms in ((64, SMS), (50, 2)):
        x = torch.randn(m, k, generator=gen).to(dtype)
        y, splits = layer.gemm(cuda_emu, x, dtype, bias, mt=4, wide=wide, sms=sms)
        check_kernel_output(y, x, wk, g, bias, U[dtype], False,
                            f"{name} {dtype} mt=4 wide={wide} M={m} splits={splits}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["gptq_sym", "gptq_actorder_asym", "awq", "ct_nvfp4"])
def test_wgmma_kernel_emulated(cuda_emu, name, dtype):
    """The sm_90a wgmma kernel (forced; blocks of 4 warpgroups x 64 columns, 64 or 128 rows): every weight kind, both
    dtypes, a bias, full and partial blocks of rows and several m-blocks, three column tiles (a warpgroup past the last
    tile), K with a short last chunk (37 k16 steps), K split (the plan fills 132 SMs: 4 splits of 12 steps, whole
    chunks, the last one short) and not."""
    n, k = 136, 592
    layer, wk, g, gen, bias = _layer_and_bias(name, 16 if "nvfp4" in name else -1, n, k, dtype, seed=12)
    # (M, forced rows, forced splits, rows)
    for m, forced, splits, rows in ((1, 0, 0, 64), (64, 0, 1, 64), (128, 0, 0, 128), (150, 0, 1, 128),
                                    (150, 64, 0, 64), (40, 128, 0, 128)):
        x = torch.randn(m, k, generator=gen).to(dtype)
        y, planned = layer.gemm(cuda_emu, x, dtype, bias, splits=splits, wgmma=1, wgmma_rows=forced)
        assert (layer.rows, planned) == (rows, splits or 4), (m, forced, layer.rows, planned)
        check_kernel_output(y, x, wk, g, bias, U[dtype], False, f"{name} {dtype} wgmma rows={rows} M={m} "
                            f"splits={planned}")


@pytest.mark.parametrize("name", ["gptq_sym", "awq"])
@pytest.mark.parametrize("gs", [16, 32, 48, 128])
def test_wgmma_kernel_group_sizes_emulated(cuda_emu, name, gs):
    """The wgmma kernel's scale rows per k16 step of its 4-step chunks: groups of 1, 2 and 8 steps and of 3 (groups
    straddle chunks and splits; the group index by division); 128 and 64 rows per block; K in the plan's 6 splits of
    8 steps, in 4 of 12 and in 1."""
    n, k = 136, 768
    layer, wk, g, gen, bias = _layer_and_bias(name, gs, n, k, torch.float16, seed=gs)
    for m, splits, planned_splits in ((70, 0, 6), (33, 5, 4), (33, 1, 1)):
        x = torch.randn(m, k, generator=gen).to(torch.float16)
        y, planned = layer.gemm(cuda_emu, x, torch.float16, bias, splits=splits, wgmma=1)
        assert planned == planned_splits, (m, splits, planned)
        check_kernel_output(y, x, wk, g, bias, U[torch.float16], False, f"{name} g{gs} wgmma M={m} splits={planned}")


@pytest.mark.parametrize("name", ["gptq_sym", "ct_asym", "modelopt_nvfp4"])
def test_opcheck_emulated(cuda_ops_on_cpu, name):
    """torch.library.opcheck of cuda_w4a16_gemm and cuda_w4a16_dequant, run by the emulated kernels on CPU tensors:
    the schemas, the fake implementations torch.compile traces with, and the registered input gradient."""
    layer = Layer(next(c for c in LAYOUTS if c[0] == name), 64, 192, 256, seed=5)
    gs, wt, g = layer.kern.group_size, layer.qw.weight_type, layer.kern.global_scale
    for dtype in (torch.float16, torch.bfloat16):
        s = layer.scales(dtype)
        x = torch.randn(5, 256).to(dtype)
        bias = torch.randn(192).to(dtype)
        torch.library.opcheck(torch.ops.hf_w4.cuda_w4a16_gemm, (x, layer.q, s, layer.z, None, 192, gs, wt, g))
        torch.library.opcheck(torch.ops.hf_w4.cuda_w4a16_gemm,  # the gradient of x and of the bias
                              (x.requires_grad_(), layer.q, s, layer.z, bias.requires_grad_(), 192, gs, wt, g))
        torch.library.opcheck(torch.ops.hf_w4.cuda_w4a16_dequant, (layer.q, s, layer.z, 192, 256, gs, wt, g, dtype))


@pytest.fixture(scope="module")
def faults(cxx_library):
    flags = ["-std=c++20", "-O1", "-Wall", "-Werror", "-fno-extern-tls-init", "-I", CUDA_EMU, "-I",
             os.path.join(REPO, "csrc", "cpu")]
    lib = cxx_library(os.path.join(CUDA_EMU, "emu_faults.cpp"), flags,
                      "g++ not found: the CUDA stand-in cannot be built")
    lib.hf_w4_emu_fault_error.restype = ctypes.c_char_p
    return lib


def test_copies_landing_at_issue_expose_a_refill_race(faults):
    """A kernel whose threads refill shared memory that a neighbour reads before any barrier: with the copies landing
    at the wait (the default) every read sees the old bytes, landing when issued some see the new ones; so a kernel
    of csrc/cuda with such a race would give other bits in the test below."""
    assert faults.hf_w4_emu_refill_race(0) == 0
    assert 0 < faults.hf_w4_emu_refill_race(1) < 32


@pytest.mark.parametrize("case,error", [(0, None), (1, "that an issued wgmma may still read"),
                                        (2, "exited with wgmma in flight"), (3, "deadlocked at a barrier"),
                                        (4, "wgmma descriptor 4000001000080000 not supported"),
                                        (5, "233488 bytes of dynamic shared memory"),
                                        (6, "A registers of a wgmma in flight were overwritten"),
                                        (7, "before griddepcontrol.wait, in a kernel launched to overlap"),
                                        (8, "cp.async.bulk.prefetch.L2 of 8 bytes"), (9, None),
                                        (10, "with a cp.async into them by thread")])
def test_emulation_reports_faults(faults, case, error):
    """The stand-in's own checks, on kernels built to break them: a copy into the shared memory an issued wgmma reads,
    a thread exiting with a wgmma in flight, a barrier half the block never reaches, a swizzled descriptor, a launch
    asking for more shared memory than an SM has, A's registers rewritten before the wgmma's wait, a copy before
    griddepcontrol.wait in a launch that overlaps the kernel before it, a prefetch of 8 bytes and a wgmma issued on
    bytes a copy has yet to fill come back as errors the tests see (not a crash, not silence); the same kernels without
    the fault come back clean."""
    rc = faults.hf_w4_emu_fault(case)
    message = faults.hf_w4_emu_fault_error().decode()
    if error is None:
        assert rc == 0 and message == "", message
    else:
        assert rc == -3 and error in message, (rc, message)


def test_wgmma_rule_emulated(cuda_emu):
    """Where the device has the wgmma kernel the fused path takes it from M = 64 on layers of at least 2^25 weights
    (14336 x 4096 and larger; not 4096 x 4096 or 1024 x 4096), with 64 rows per block up to M = 64, else 128."""
    for m, n, k, taken in ((64, 14336, 4096, 1), (63, 14336, 4096, 0), (2048, 4096, 14336, 1), (64, 28672, 8192, 1),
                           (300, 4096, 8192, 1), (300, 4096, 4096, 0), (1024, 1024, 4096, 0), (64, 8192, 4096, 1)):
        assert cuda_emu.hf_w4_emu_wgmma_rule(m, n, k) == taken, (m, n, k)
    for m, n, rows in ((1, 64, 64), (64, 64, 64), (65, 64, 128), (129, 28672, 128), (2048, 4096, 128)):
        assert _plan(cuda_emu, m, n, 4096, SMS, wgmma=1)["mt"] * 16 == rows, (m, n)


@pytest.mark.parametrize("wide", [False, True], ids=["warps", "wide"])
def test_forced_splits_emulated(cuda_emu, wide):
    """A forced number of K splits (HF_W4_CUDA_SPLITS on a GPU) is the plan's within 1 .. K / 128 (K = 1024: up to 8;
    3 -> steps of 22, still 3 splits); the result keeps the budget and the split-K counters end at zero."""
    case = next(c for c in LAYOUTS if c[1] == "gptq")
    n, k = 192, 1024
    layer = Layer(case, 128, n, k, seed=5)
    wk = kernel_dtype_weight(layer.qw, torch.bfloat16)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    for forced, planned in ((1, 1), (3, 3), (7, 7), (8, 8), (50, 8)):
        assert _plan(cuda_emu, 5, n, k, SMS, wide=int(wide), splits=forced)["splits"] == planned, forced
        y, splits = layer.gemm(cuda_emu, x, torch.bfloat16, wide=wide, splits=forced)
        assert splits == planned
        check_kernel_output(y, x, wk, 1.0, None, U[torch.bfloat16], False, f"wide={wide} splits={forced}")


def _plan(lib, m, n, k, sms, mt=0, wide=-1, splits=0, wgmma=0):
    out = (ctypes.c_int * 6)()
    lib.hf_w4_emu_plan(m, n, k, 1, 0, sms, mt, wide, splits, wgmma, out)
    return dict(zip(("mt", "mr", "mblocks", "ntiles", "splits", "wide"), out))


def test_plan_rules_emulated(cuda_emu):
    """The tiling rules on a small GPU (4 SMs; this stand-in's occupancy: 3 two-tile blocks per SM, as on an H100):
    the wide kernel at 9-64 rows where there are three column tiles per SM (one m16 tile up to 16 rows, two above),
    two tiles at 9-16 rows where one wave of them holds every column tile, forced choices kept; and a call the rule
    sends to the wide kernel gives the bits of the forced wide kernel."""
    wide_n, narrow_n = 64 * 12, 64 * 11
    assert _plan(cuda_emu, 16, wide_n, 256, 4) | {"splits": 0} == dict(mt=1, mr=16, mblocks=1, ntiles=12, splits=0,
                                                                       wide=1)
    assert _plan(cuda_emu, 40, wide_n, 256, 4)["mt"] == 2 and _plan(cuda_emu, 40, wide_n, 256, 4)["wide"] == 1
    for m in (8, 65):
        assert _plan(cuda_emu, m, wide_n, 256, 4)["wide"] == 0, m
    narrow = _plan(cuda_emu, 16, narrow_n, 256, 4)
    assert narrow["wide"] == 0 and narrow["mt"] == 2  # 11 <= 12
    assert _plan(cuda_emu, 16, 64 * 13, 256, 4, wide=0)["mt"] == 1  # 13 tiles: a second wave of two-tile blocks
    assert _plan(cuda_emu, 16, wide_n, 256, 4, mt=2)["wide"] == 0
    assert _plan(cuda_emu, 16, wide_n, 256, 4, wide=0)["wide"] == 0
    case = next(c for c in LAYOUTS if c[1] == "gptq")
    layer = Layer(case, 128, wide_n, 256, seed=3)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    y, _ = layer.gemm(cuda_emu, x, torch.bfloat16, wide=None, sms=4)
    check_kernel_output(y, x, kernel_dtype_weight(layer.qw, torch.bfloat16), 1.0, None, U[torch.bfloat16], False,
                        "the plan's rule at M=16")
    assert torch.equal(y, layer.gemm(cuda_emu, x, torch.bfloat16, mt=1, wide=True, sms=4)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case,gs", LAYOUT_GROUPS[::3] + [c for c in LAYOUT_GROUPS if "nvfp4" in c[0][1]],
                         ids=lambda v: str(v[0]) if isinstance(v, tuple) else str(v))
def test_dequantize_kernel_emulated(cuda_emu, case, gs, dtype):
    """The large-M path's dense weight is the kernels' weight (NVFP4 with its global scale) bit for bit."""
    n, k = 136, 576 if gs != 128 else 640
    layer = Layer(case, gs, n, k, seed=3)
    w = torch.empty(n, k, dtype=dtype)
    assert cuda_emu.hf_w4_emu_dequant(_ptr(layer.q), _ptr(layer.scales(dtype)), _ptr(layer.z), _ptr(w), n, k,
                                 layer.kern.group_size, layer.kern.global_scale, layer.kind,
                                 int(dtype == torch.bfloat16)) == 0
    want = kernel_dtype_weight(layer.qw, dtype)
    if layer.perm is not None:  # the kernel's column k' is the checkpoint's column perm[k']
        want = want[:, layer.perm]
    assert torch.equal(w.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("name,gs,k", [("gptq_actorder_asym", 16, 592), ("ct_nvfp4", 16, 592), ("gptq_sym", 48, 576)])
def test_copies_landing_at_issue_give_the_same_bits_emulated(cuda_emu, name, gs, k):
    """Every kernel with its cp.async copies landing as early as the GPU may deliver them (when issued) gives the bits
    of the default run, where they land as late as it may (at the wait): no thread reads shared memory that another
    thread's copy may refill before the kernel has ordered that read before the refill (per-warp rings, the wide and
    wgmma kernels' block-wide rings; one, two and four m16 tiles, 8 or 16 staged rows, split K and not; zero points,
    NVFP4 scales, and groups of three k16 steps, which straddle chunks)."""
    n = 136
    layer, wk, g, gen, bias = _layer_and_bias(name, gs, n, k, torch.bfloat16, seed=4)
    runs = [dict(m=3), dict(m=16), dict(m=40, mt=2), dict(m=50, mt=4, sms=2), dict(m=16, wide=True),
            dict(m=40, wide=True), dict(m=64, wgmma=1), dict(m=150, wgmma=1, splits=1)]
    for run in runs:
        m = run.pop("m")
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        y, splits = layer.gemm(cuda_emu, x, torch.bfloat16, bias, **run)
        cuda_emu.hf_w4_emu_copies_at_issue(1)
        try:
            early, _ = layer.gemm(cuda_emu, x, torch.bfloat16, bias, **run)
        finally:
            cuda_emu.hf_w4_emu_copies_at_issue(0)
        where = f"{name} M={m} {run} splits={splits}"
        check_kernel_output(y, x, wk, g, bias, U[torch.bfloat16], False, where)
        assert torch.equal(y, early), f"{where}: other bits with the copies landing when issued"
