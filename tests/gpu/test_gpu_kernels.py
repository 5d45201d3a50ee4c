"""cuda_w4a16 on a GPU: the fused kernel, the dequantize kernel + dense GEMM and the layer's automatic choice
against the exact weights, for every layout x group size x fp16 / bf16 x M in {1, 3, 16, 64, 257, 2048}.

Error budget (elementwise; Wk = the weight the kernels multiply by, computed exactly on the host side by
tests/qweight_cases.kernel_dtype_weight, whose arithmetic tests/kernels/test_cuda_w4a16.py checks bit for bit;
u = 2^-11 for fp16, 2^-8 for bf16; A = |x| @ |Wk|^T): the products x * Wk are exact in the mma and summed in fp32, the result is
rounded once to x's dtype, so |y - x @ Wk^T| <= u * |x @ Wk^T| + 1e-5 * A. The dense path's GEMM may reduce in
x's dtype (cuBLAS split-K with reduced-precision reductions): + 4u * A there. Against the fp32 weight of
layouts.dequantize the int4 weights differ by the scale's and the product's rounding (<= 2u relative per weight):
the model tests compare whole models."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): GPU tests need one", allow_module_level=True)

from qweight_cases import GROUPS, LAYOUTS, kernel_dtype_weight, make_qweight  # noqa: E402
from qweight_cases import check_kernel_output  # noqa: E402
from conftest import capture_cuda_graph  # noqa: E402
from hf_w4.kernels import cuda_w4a16 as cw  # noqa: E402

MS = (1, 3, 16, 64, 257, 2048)
SM90 = pytest.mark.skipif(torch.cuda.get_device_capability() != (9, 0),
                          reason="the wgmma kernel is sm_90a code: it runs on compute capability 9.0 only")
LAYOUT_GROUPS = [(c, gs) for c in LAYOUTS for gs in (GROUPS if "nvfp4" not in c[1] else [16])]
U = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
torch.backends.cuda.matmul.allow_tf32 = False


@pytest.fixture(autouse=True, scope="module")
def _library():
    """Load the library before any test: tests call its ops directly, and one picked alone with ``-k`` may run before
    any layer has loaded it (the ops' schemas are Python's, their CUDA implementations the library's)."""
    ok, why = cw.CudaW4A16Kernel.is_supported()
    assert ok, why


def test_library_builds_and_is_selected():
    ok, why = cw.CudaW4A16Kernel.is_supported()
    assert ok, why


def _layer(spec, qw):
    layer = torch.nn.Module()
    kern = cw.CudaW4A16Kernel(spec, qw.n, qw.k)
    kern.prepare(layer, qw)
    return kern, layer


@pytest.mark.parametrize("wide", ["0", "1"], ids=["warp-k", "wide"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case,gs", LAYOUT_GROUPS, ids=[f"{c[0]}-g{gs}" for c, gs in LAYOUT_GROUPS])
def test_kernels_against_exact_weights(case, gs, dtype, wide, monkeypatch):
    monkeypatch.setenv("HF_W4_CUDA_WIDE", wide)
    _, layout, sym, ao, zp1 = case
    u = U[dtype]
    shapes = [(192, 576 if gs != 128 else 640), (200, 1024), (1024, 2048)]
    if gs in (16, -1):  # an odd number of k16 steps: the last two-step chunk of K is short
        shapes.append((136, 592))
    for n, k in shapes:
        spec, qw = make_qweight(layout, n, k, gs, sym, ao, zp1, seed=n + k, device="cuda")
        kern, layer = _layer(spec, qw)
        nv = qw.weight_type == "nvfp4"
        w_fused = kernel_dtype_weight(qw, dtype, global_scale=not nv)   # nvfp4: global scale on the accumulator
        w_dense = kernel_dtype_weight(qw, dtype, global_scale=True)
        g = kern.global_scale if nv else 1.0
        b = layer._buffers
        gen = torch.Generator(device="cuda").manual_seed(k)
        bias = (torch.randn(n, generator=gen, device="cuda") * 0.1).to(dtype) if n == 200 else None
        assert torch.equal(kern.dense_weight(layer, dtype),
                           w_dense[:, b["cuda_w4a16_perm"]] if b["cuda_w4a16_perm"] is not None else w_dense)
        for m in MS:
            what = f"{layout} g{gs} {dtype} N={n} K={k} M={m}"
            x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
            xp = x if b["cuda_w4a16_perm"] is None else x[:, b["cuda_w4a16_perm"]]
            y = torch.ops.hf_w4.cuda_w4a16_gemm(xp, b["cuda_w4a16_q"], kern._scales(b, dtype), b["cuda_w4a16_z"],
                                                bias, n, kern.group_size, kern.weight_type, kern.global_scale)
            check_kernel_output(y, x, w_fused, g, bias, u, False, "fused " + what)
            y2 = torch.ops.hf_w4.cuda_w4a16_gemm(xp, b["cuda_w4a16_q"], kern._scales(b, dtype), b["cuda_w4a16_z"],
                                                 bias, n, kern.group_size, kern.weight_type, kern.global_scale)
            assert torch.equal(y, y2), f"fused {what}: two runs differ (split-K must be deterministic)"
            ya = kern.apply(layer, x.view(1, m, k), bias)
            assert ya.shape == (1, m, n) and ya.dtype == dtype
            dense = m >= kern.large_m
            check_kernel_output(ya[0], x, w_dense if dense else w_fused, 1.0 if dense else g, bias, u, dense,
                                "apply " + what)
        torch.cuda.synchronize()


def test_nvfp4_fp16_large_global_scale_does_not_overflow():
    """e2m1 * e4m3 up to 2688 and a global scale that makes the weights small: the fp16 accumulation path must not
    overflow or flush (the global scale is applied in fp32 at the end)."""
    spec, qw = make_qweight("modelopt_nvfp4", 128, 256, 16, device="cuda")
    qw.scales.fill_(0x7E)  # 448
    qw.global_scale = 1e-4
    kern, layer = _layer(spec, qw)
    x = torch.full((4, 256), 30.0, device="cuda", dtype=torch.float16)
    y = kern.apply(layer, x, None)
    wk = kernel_dtype_weight(qw, torch.float16, global_scale=False)
    check_kernel_output(y, x, wk, 1e-4, None, 2.0 ** -11, False, "nvfp4 big scales")


def test_bf16_small_e4m3_scales_do_not_underflow():
    spec, qw = make_qweight("ct_nvfp4", 64, 64, 16, device="cuda")
    qw.scales.fill_(0x01)  # 2^-9, the smallest E4M3 subnormal
    kern, layer = _layer(spec, qw)
    x = torch.randn(2, 64, device="cuda").to(torch.bfloat16)
    y = kern.apply(layer, x, None)
    wk = kernel_dtype_weight(qw, torch.bfloat16, global_scale=False)
    assert wk.abs().max() > 0
    check_kernel_output(y, x, wk, kern.global_scale, None, 2.0 ** -8, False, "nvfp4 tiny scales")
    assert y.abs().max() > 0


def test_compile_and_cuda_graph_of_the_op():
    spec, qw = make_qweight("gptq", 512, 1024, 128, sym=False, device="cuda")
    kern, layer = _layer(spec, qw)
    x = torch.randn(8, 1024, device="cuda").to(torch.bfloat16)
    eager = kern.apply(layer, x, None)
    compiled = torch.compile(lambda t: kern.apply(layer, t, None))
    assert torch.equal(compiled(x), eager)
    static = x.clone()
    graph, out = capture_cuda_graph(lambda: kern.apply(layer, static, None))
    static.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kern.apply(layer, x * 2, None))


def test_split_k_counters_are_reused_across_calls_and_streams():
    """Split-K tile counters are zeroed once per device and stream and left zero by every launch: calls that split K,
    back to back with different M, on the default and on a side stream, all give the first call's outputs."""
    spec, qw = make_qweight("gptq", 4096, 4096, 128, device="cuda")
    kern, layer = _layer(spec, qw)
    assert cw.CudaW4A16Kernel.is_supported()[0]
    assert torch.ops.hf_w4.cuda_w4a16_plan(1, 4096, 4096, "int4", False, True)[3] > 1  # this call splits K
    xs = [torch.randn(m, 4096, device="cuda").to(torch.bfloat16) for m in (1, 2, 16, 1)]
    first = [kern.apply(layer, x, None) for x in xs]
    for _ in range(3):
        assert all(torch.equal(kern.apply(layer, x, None), y) for x, y in zip(xs, first))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        side = [kern.apply(layer, x, None) for x in xs]
    torch.cuda.current_stream().wait_stream(s)
    assert all(torch.equal(a, b) for a, b in zip(side, first))


def test_split_k_in_cuda_graphs_replayed_side_by_side():
    """Captured calls that split K take counters of their own (zeroed outside capture): two graphs of the same calls,
    replayed many times, alternately and concurrently on two streams, give the eager outputs every time."""
    spec, qw = make_qweight("gptq", 4096, 4096, 128, device="cuda")
    kern, layer = _layer(spec, qw)
    xs = [torch.randn(m, 4096, device="cuda").to(torch.bfloat16) for m in (1, 2, 16, 1)]
    eager = [kern.apply(layer, x, None) for x in xs]
    graphs = [capture_cuda_graph(lambda: [kern.apply(layer, x, None) for x in xs]) for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in graphs]
    for _ in range(20):
        for (graph, _), s in zip(graphs, streams):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                graph.replay()
        for (_, outs), s in zip(graphs, streams):
            torch.cuda.current_stream().wait_stream(s)
            assert all(torch.equal(a, b) for a, b in zip(outs, eager))


def test_captured_split_k_call_is_one_kernel():
    """A replayed graph of split-K calls runs the fused kernel alone per call (no zeroing of its counters)."""
    spec, qw = make_qweight("gptq", 4096, 4096, 128, device="cuda")
    kern, layer = _layer(spec, qw)
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    graph, _ = capture_cuda_graph(lambda: [kern.apply(layer, x, None) for _ in range(3)])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 3 and all("w4a16_gemm_kernel" in k for k in kernels), kernels


@pytest.mark.parametrize("wgmma", ["0", "1"], ids=["mma.sync", "wgmma"])
def test_overlapped_launches_wait_for_their_input(monkeypatch, wgmma):
    """Launches that may overlap the kernel before them (HF_W4_CUDA_PDL; compute capability 9.x / 10.x) read x and
    write anything only after it has completed: a chain of calls each multiplying the previous one's output (split-K, so
    the partials and counters are reused while the next kernel starts), eager and captured in a CUDA graph, gives bit
    for bit what the same chain gives launched one after another."""
    if wgmma == "1" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel is sm_90a code: it runs on compute capability 9.0 only")
    monkeypatch.setenv("HF_W4_CUDA_WGMMA", wgmma)
    spec, qw = make_qweight("gptq", 2048, 2048, 128, device="cuda")
    kern, layer = _layer(spec, qw)
    b = layer._buffers
    x0 = torch.randn(64 if wgmma == "1" else 4, 2048, device="cuda").to(torch.bfloat16)

    def gemm(x, scales):
        return torch.ops.hf_w4.cuda_w4a16_gemm(x, b["cuda_w4a16_q"], scales, b["cuda_w4a16_z"], None, 2048, 128,
                                               "int4", 1.0)

    s = kern._scales(b, torch.bfloat16)
    s = s * (x0.float().abs().amax() / gemm(x0, s).float().abs().amax()).to(s.dtype)  # outputs stay about x0's size

    def chain():  # nothing between the calls: each kernel's input is the output of the kernel before it
        y = x0
        for _ in range(12):
            y = gemm(y, s)
        return y

    monkeypatch.setenv("HF_W4_CUDA_PDL", "0")
    assert torch.ops.hf_w4.cuda_w4a16_plan(x0.shape[0], 2048, 2048, "int4", False, True)[8] == 0
    serial = chain()
    assert torch.isfinite(serial).all() and serial.abs().amax() > 0
    monkeypatch.setenv("HF_W4_CUDA_PDL", "1")
    plan = torch.ops.hf_w4.cuda_w4a16_plan(x0.shape[0], 2048, 2048, "int4", False, True)
    assert plan[3] > 1 and plan[7] == (4 if wgmma == "1" else 0), plan
    assert torch.equal(chain(), serial)
    graph, out = capture_cuda_graph(chain)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, serial)
    monkeypatch.setenv("HF_W4_CUDA_PDL", "2")
    with pytest.raises(RuntimeError, match=r"HF_W4_CUDA_PDL='2': expected 1 \(overlap\) or 0"):
        gemm(x0, s)


def test_autograd_input_gradient():
    spec, qw = make_qweight("ct_pack", 128, 256, 64, device="cuda")
    kern, layer = _layer(spec, qw)
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kern.apply(layer, x, None).float().sum().backward()
    w = kernel_dtype_weight(qw, torch.bfloat16).float()
    torch.testing.assert_close(x.grad.float(), w.sum(0).expand(3, -1), rtol=2 ** -7, atol=1e-3)


def test_opcheck():
    """Schemas, fake implementations and the autograd registration of the CUDA ops agree with the kernels."""
    spec, qw = make_qweight("ct_pack", 64, 256, 64, sym=False, device="cuda")
    kern, layer = _layer(spec, qw)
    b = layer._buffers
    s = kern._scales(b, torch.bfloat16)
    x = torch.randn(3, 256, device="cuda").to(torch.bfloat16)
    torch.library.opcheck(torch.ops.hf_w4.cuda_w4a16_gemm, (x, b["cuda_w4a16_q"], s, b["cuda_w4a16_z"], None, 64, 64,
                                                             "int4", 1.0))
    torch.library.opcheck(torch.ops.hf_w4.cuda_w4a16_dequant, (b["cuda_w4a16_q"], s, b["cuda_w4a16_z"], 64, 256, 64,
                                                               "int4", 1.0, torch.bfloat16))
    spec, qw = make_qweight("modelopt_nvfp4", 64, 256, 16, device="cuda")
    kern, layer = _layer(spec, qw)
    b = layer._buffers
    xg = torch.randn(2, 256, device="cuda", dtype=torch.float16, requires_grad=True)
    bias = torch.randn(64, device="cuda", dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(torch.ops.hf_w4.cuda_w4a16_gemm, (xg, b["cuda_w4a16_q"], b["cuda_w4a16_s"], None, bias, 64,
                                                             16, "nvfp4", 0.5))


def test_plan_reports_a_split_covering_k(monkeypatch):
    """cuda_w4a16_plan (the benchmark's path column) gives the work split the mma.sync kernels run (the wgmma kernel
    off; its plans are the wgmma tests'): every k16 step in exactly one split, enough m-blocks for M rows, one tile
    per 64 columns, at least one resident block per SM."""
    monkeypatch.setenv("HF_W4_CUDA_WGMMA", "0")
    for m, n, k, wt, asym in ((1, 4096, 4096, "int4", False), (64, 28672, 8192, "nvfp4", False),
                              (3, 192, 576, "int4", True), (40, 200, 1024, "int4", False)):
        plan = torch.ops.hf_w4.cuda_w4a16_plan(m, n, k, wt, asym, True)
        mt, mblocks, ntiles, splits, steps, bps, wide, wgmma, overlap = plan
        assert wgmma == 0, "HF_W4_CUDA_WGMMA=0 and the wgmma kernel was taken"
        assert overlap == (torch.cuda.get_device_capability()[0] in (9, 10)), overlap  # programmatic dependent launch
        assert mt in (1, 2) and (mblocks - 1) * 16 * mt < m <= mblocks * 16 * mt, (m, mt, mblocks)
        assert ntiles == -(-n // 64) and bps >= 1, (n, ntiles, bps)
        assert (splits - 1) * steps < k // 16 <= splits * steps, (k, splits, steps)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert wide == (8 < m <= 64 and ntiles >= 3 * sms), (m, n, wide)  # the wide kernel's rule
    with pytest.raises(RuntimeError, match="weight_type 'int8' is not supported"):
        torch.ops.hf_w4.cuda_w4a16_plan(1, 64, 64, "int8", False, True)


@SM90
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["gptq_sym", "gptq_actorder_asym", "awq", "modelopt_nvfp4"])
def test_wgmma_kernel_against_exact_weights(monkeypatch, name, dtype):
    """HF_W4_CUDA_WGMMA=1 on an H100 / H200 (the library is built for sm_90a there): blocks of 4 warpgroups x 64
    columns (N = 136: 3 column tiles, so a warpgroup is past the last) x 64 rows up to M = 64, else 128, and 64 and 128
    rows forced (HF_W4_CUDA_WGMMA_ROWS); K in 4 splits (the plan's on this narrow layer: 12, 12, 12 and 1 k16 steps)
    or 1 (forced); every weight kind, a bias, partial and several m-blocks, a short last chunk (K = 592)."""
    case = next(c for c in LAYOUTS if c[0] == name)
    _, layout, sym, ao, zp1 = case
    gs = 16 if "nvfp4" in layout else -1
    spec, qw = make_qweight(layout, 136, 592, gs, sym, ao, zp1, seed=21, device="cuda")
    kern, layer = _layer(spec, qw)
    b = layer._buffers
    nv = qw.weight_type == "nvfp4"
    w = kernel_dtype_weight(qw, dtype, global_scale=not nv)
    g = kern.global_scale if nv else 1.0
    bias = (torch.randn(136, device="cuda") * 0.1).to(dtype)
    monkeypatch.setenv("HF_W4_CUDA_WGMMA", "1")
    # (M, forced rows, forced splits, rows, splits)
    for m, forced, forced_splits, rows, splits in ((1, "", "", 64, 4), (64, "", "1", 64, 1), (257, "", "", 128, 4),
                                                   (2048, "", "1", 128, 1), (257, "64", "", 64, 4),
                                                   (40, "128", "", 128, 4)):
        monkeypatch.setenv("HF_W4_CUDA_WGMMA_ROWS", forced)
        monkeypatch.setenv("HF_W4_CUDA_SPLITS", forced_splits)
        plan = torch.ops.hf_w4.cuda_w4a16_plan(m, 136, 592, qw.weight_type, b["cuda_w4a16_z"] is not None,
                                               dtype == torch.bfloat16)
        assert plan[7] == 4 and plan[0] * 16 == rows and plan[1] == -(-m // rows), plan
        assert plan[3] == splits and (splits - 1) * plan[4] < 37 <= splits * plan[4], plan
        x = torch.randn(m, 592, device="cuda").to(dtype)
        xp = x if b["cuda_w4a16_perm"] is None else x[:, b["cuda_w4a16_perm"]]
        y = torch.ops.hf_w4.cuda_w4a16_gemm(xp, b["cuda_w4a16_q"], kern._scales(b, dtype), b["cuda_w4a16_z"], bias,
                                            136, kern.group_size, kern.weight_type, kern.global_scale)
        check_kernel_output(y, x, w, g, bias, U[dtype], False,
                            f"wgmma rows={rows} splits={splits} {name} {dtype} M={m}")


@SM90
@pytest.mark.parametrize("name", ["gptq_sym", "modelopt_nvfp4"])
def test_wgmma_kernel_taken_by_the_rule(monkeypatch, name):
    """No setting: on a layer of 2^25 weights (8192 x 4096) the fused path is the mma.sync kernel up to M = 63 and the
    wgmma kernel (4 warpgroups) from M = 64; the layer dequantizes for cuBLAS from M = 320 (its large_m); the layer's
    outputs keep the budget on each side of both switches."""
    for var in ("HF_W4_CUDA_WGMMA", "HF_W4_CUDA_WGMMA_ROWS", "HF_W4_CUDA_MT", "HF_W4_CUDA_WIDE", "HF_W4_CUDA_SPLITS",
                "HF_W4_CUDA_LARGE_M"):
        monkeypatch.delenv(var, raising=False)
    _, layout, sym, ao, zp1 = next(c for c in LAYOUTS if c[0] == name)
    n, k = 8192, 4096
    spec, qw = make_qweight(layout, n, k, 16 if "nvfp4" in layout else 128, sym, ao, zp1, seed=3, device="cuda")
    kern, layer = _layer(spec, qw)
    assert kern.large_m == 320
    nv = qw.weight_type == "nvfp4"
    w_fused = kernel_dtype_weight(qw, torch.bfloat16, global_scale=not nv)
    w_dense = kernel_dtype_weight(qw, torch.bfloat16)
    for m, wg in ((63, 0), (64, 4), (300, 4), (319, 4), (320, None)):
        if wg is not None:
            plan = torch.ops.hf_w4.cuda_w4a16_plan(m, n, k, qw.weight_type, False, True)
            assert plan[7] == wg, (m, plan)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        y = kern.apply(layer, x, None)
        dense = wg is None
        check_kernel_output(y, x, w_dense if dense else w_fused, 1.0 if dense or not nv else kern.global_scale, None,
                            U[torch.bfloat16], dense, f"{name} M={m} wgmma={wg}")


def test_wgmma_setting_is_checked(monkeypatch):
    """HF_W4_CUDA_WGMMA takes 1 or 0 and HF_W4_CUDA_WGMMA_ROWS 64 or 128; forcing the wgmma kernel where this GPU or
    build has none is an error, not a silent fallback (on compute capability 9.0 the JIT build has it)."""
    monkeypatch.setenv("HF_W4_CUDA_WGMMA", "4")
    with pytest.raises(RuntimeError, match=r"HF_W4_CUDA_WGMMA='4': expected 1 \(the sm_90a wgmma kernel\) or 0"):
        torch.ops.hf_w4.cuda_w4a16_plan(1, 200, 592, "int4", False, True)
    monkeypatch.setenv("HF_W4_CUDA_WGMMA", "0")
    assert torch.ops.hf_w4.cuda_w4a16_plan(1, 200, 592, "int4", False, True)[7] == 0
    monkeypatch.setenv("HF_W4_CUDA_WGMMA", "1")
    if torch.cuda.get_device_capability() == (9, 0):
        assert torch.ops.hf_w4.cuda_w4a16_plan(1, 200, 592, "int4", False, True)[7] == 4
        monkeypatch.setenv("HF_W4_CUDA_WGMMA_ROWS", "256")
        with pytest.raises(RuntimeError, match="HF_W4_CUDA_WGMMA_ROWS='256': expected 64 or 128"):
            torch.ops.hf_w4.cuda_w4a16_plan(1, 200, 592, "int4", False, True)
        monkeypatch.setenv("HF_W4_CUDA_WGMMA_ROWS", "128")
        assert torch.ops.hf_w4.cuda_w4a16_plan(1, 200, 592, "int4", False, True)[0] == 8
    else:
        with pytest.raises(RuntimeError, match="the wgmma kernel needs a GPU of compute capability 9.0"):
            torch.ops.hf_w4.cuda_w4a16_plan(1, 200, 592, "int4", False, True)


@SM90
@pytest.mark.parametrize("m", [64, 128])
def test_wgmma_kernel_maps_rows_columns_and_k(monkeypatch, m):
    """One-hot rows of x pick single weight columns, so each output row must equal one column of W exactly: row m
    with its 1 at k(m) gives W[:, k(m)]. A wrong descriptor (k order of B) or fragment layout (A / D) shows here as
    the k or the columns found instead, which says which of them is off. M = 64, 128: one block of that many rows
    (the n64 and n128 wgmma; the block's 4 warpgroups on one column tile: 3 past it)."""
    n, k = 64, 128
    spec, qw = make_qweight("gptq", n, k, -1, True, False, False, seed=5, device="cuda")
    kern, layer = _layer(spec, qw)
    b = layer._buffers
    w = kernel_dtype_weight(qw, torch.float16)  # [n, k]
    ks = [(7 * r + r // 16) % k for r in range(m)]
    x = torch.zeros(m, k, device="cuda", dtype=torch.float16)
    x[torch.arange(m), torch.tensor(ks)] = 1
    monkeypatch.setenv("HF_W4_CUDA_WGMMA", "1")
    monkeypatch.setenv("HF_W4_CUDA_WGMMA_ROWS", str(m))
    y = torch.ops.hf_w4.cuda_w4a16_gemm(x, b["cuda_w4a16_q"], kern._scales(b, torch.float16), None, None, n,
                                        kern.group_size, "int4", 1.0)
    wrong = []
    for r in range(m):
        if not torch.equal(y[r], w[:, ks[r]]):
            found = [j for j in range(k) if torch.equal(y[r], w[:, j])]
            off = (y[r] != w[:, ks[r]]).nonzero().flatten().tolist()
            wrong.append(f"row {r} (k={ks[r]}): equals W[:, k] for k in {found or 'none'}; the columns that differ "
                         f"from W[:, {ks[r]}]: {off[:16]}{' ...' if len(off) > 16 else ''}")
    assert not wrong, f"{len(wrong)} of {m} rows wrong; " + "; ".join(wrong[:6])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_forced_tiling_keeps_the_budget(monkeypatch, dtype):
    """HF_W4_CUDA_MT / HF_W4_CUDA_SPLITS (the benchmark's tiling and split-K comparisons) run the other tiling or
    split correctly; a bad value is an error."""
    spec, qw = make_qweight("gptq", 200, 592, -1, True, False, False, seed=11, device="cuda")
    kern, layer = _layer(spec, qw)
    b = layer._buffers
    w = kernel_dtype_weight(qw, dtype)
    # (M, forced settings, the plan fields they fix: 0 = m16 tiles, 3 = K splits, 6 = wide); 592 = 37 k16 steps:
    # 3 splits of 14, 2 of 20
    cases = [(5, dict(MT="2"), {0: 2}), (40, dict(MT="1"), {0: 1}), (40, dict(MT="2"), {0: 2}),
             (127, dict(MT="1"), {0: 1}), (40, dict(MT="4", WIDE="0"), {0: 4, 6: 0}),
             (127, dict(MT="4", WIDE="0"), {0: 4, 6: 0}), (64, dict(MT="4", WIDE="1"), {0: 4, 6: 1}),
             (127, dict(MT="4", WIDE="1"), {0: 4, 6: 1}), (1, dict(MT="1", SPLITS="1"), {3: 1}),
             (5, dict(MT="1", SPLITS="3"), {3: 3}), (40, dict(MT="2", SPLITS="2"), {3: 2})]
    for m, forced, fields in cases:
        for var in ("HF_W4_CUDA_MT", "HF_W4_CUDA_WIDE", "HF_W4_CUDA_SPLITS"):
            monkeypatch.setenv(var, forced.get(var.rsplit("_", 1)[1], ""))
        plan = torch.ops.hf_w4.cuda_w4a16_plan(m, 200, 592, "int4", False, dtype == torch.bfloat16)
        assert all(plan[i] == v for i, v in fields.items()), (forced, plan)
        x = torch.randn(m, 592, device="cuda").to(dtype)
        y = torch.ops.hf_w4.cuda_w4a16_gemm(x, b["cuda_w4a16_q"], kern._scales(b, dtype), None, None, 200,
                                            kern.group_size, "int4", 1.0)
        check_kernel_output(y, x, w, 1.0, None, U[dtype], False, f"{forced} M={m}")
    monkeypatch.setenv("HF_W4_CUDA_SPLITS", "0")
    with pytest.raises(RuntimeError, match="HF_W4_CUDA_SPLITS='0': expected a positive number of K splits"):
        torch.ops.hf_w4.cuda_w4a16_plan(1, 200, 592, "int4", False, True)
    monkeypatch.setenv("HF_W4_CUDA_SPLITS", "")
    monkeypatch.setenv("HF_W4_CUDA_MT", "3")
    with pytest.raises(RuntimeError, match="HF_W4_CUDA_MT='3': expected 1, 2 or 4"):
        torch.ops.hf_w4.cuda_w4a16_plan(1, 200, 592, "int4", False, True)
    monkeypatch.setenv("HF_W4_CUDA_MT", "1")
    monkeypatch.setenv("HF_W4_CUDA_WIDE", "yes")
    with pytest.raises(RuntimeError, match=r"HF_W4_CUDA_WIDE='yes': expected 1 \(the wide kernel\) or 0 \(not\)"):
        torch.ops.hf_w4.cuda_w4a16_plan(1, 200, 592, "int4", False, True)
