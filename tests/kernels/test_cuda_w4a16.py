"""cuda_w4a16 on a machine without a GPU: the device sources compile (nvcc, sm_80 + sm_90, warnings as errors), the
shared host/device arithmetic (csrc/cuda/w4a16_math.cuh, built with g++ as a ctypes library) reproduces
layouts.dequantize bit for bit for every layout, the repack's index maps invert, and the kernel class declines CPU
layers with its reasons. The GPU itself is tested in tests/gpu/.
"""
from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
import shutil
import subprocess

import pytest
import torch

from qweight_cases import GROUPS, LAYOUTS, kernel_dtype_weight, make_qweight
from hf_w4 import _ext, layouts
from hf_w4.kernels import cuda_w4a16 as cw
from hf_w4.kernels import registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA_SRC = os.path.join(ROOT, "csrc", "cuda")
NVCC = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                if os.environ.get("CUDA_HOME") else None)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH or CUDA_HOME): the CUDA sources cannot be compiled")
def test_nvcc_compiles_sm80_sm90_werror(tmp_path):
    # every .cu (one translation unit per kernel family), side by side as a build compiles them, with the defines
    # torch's extension builds pass (no implicit half / bfloat16 operators or conversions); sm_90a holds the wgmma
    # kernels; each file's three targets compile side by side too (--threads)
    sources = sorted(glob.glob(os.path.join(CUDA_SRC, "*.cu")))
    assert sources, CUDA_SRC
    cmds = [[NVCC, "-std=c++20", "-O3", "--threads=0", "-gencode", "arch=compute_80,code=sm_80", "-gencode",
             "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90a,code=sm_90a", "-Werror", "all-warnings",
             "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
             "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr", "-I", CUDA_SRC, "-c", src, "-o",
             str(tmp_path / (os.path.basename(src) + ".o"))] for src in sources]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd in cmds]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for cmd, p, out in zip(cmds, procs, outs):
        assert p.returncode == 0, f"{' '.join(cmd)}\n{out}"


@pytest.fixture(scope="module")
def host(cxx_library):
    lib = cxx_library(os.path.join(ROOT, "tests", "kernels", "cuda_host", "w4a16_host.cpp"),
                      ["-std=c++17", "-O2", "-Wall", "-Werror", "-I", CUDA_SRC],
                      "g++ not found: the host build of w4a16_math.cuh cannot be compiled", timeout=300)
    lib.hf_w4_host_dequant.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_void_p]
    lib.hf_w4_host_check_plan.argtypes = [ctypes.c_int] * 4 + [ctypes.POINTER(ctypes.c_int)]
    for f in ("hf_w4_host_e2m1", "hf_w4_host_e4m3", "hf_w4_host_int4", "hf_w4_host_f16_round"):
        getattr(lib, f).restype = ctypes.c_uint32
    lib.hf_w4_host_f16_round.argtypes = [ctypes.c_float]
    return lib


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


@pytest.mark.parametrize("npad,k", [(64, 16), (192, 576), (128, 4096)])
def test_fragment_maps_invert_and_cover(host, npad, k):
    assert host.hf_w4_host_check_maps(npad, k) == 0


@pytest.mark.parametrize("m", [1, 3, 16, 17, 33, 64, 100, 257, 2048])
@pytest.mark.parametrize("npad,k", [(192, 576), (4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192),
                                    (64, 16), (64, 144)])
@pytest.mark.parametrize("slots", [132 * 4, 108 * 2, 1])
def test_work_split_covers_k_once(host, m, npad, k, slots):
    splits = ctypes.c_int()
    assert host.hf_w4_host_check_plan(m, npad, k, slots, ctypes.byref(splits)) == 0
    assert splits.value >= 1
    if (m, npad, k, slots) == (1, 4096, 4096, 528):  # 64 column tiles x 8 splits: one full wave on an H100
        assert splits.value == 8


def _half_bits(bits, dtype):
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(dtype).float().item()


def test_host_fp16_rounding_matches_torch(host):
    """The host emulation's float -> fp16 rounding (ties, subnormals, overflow) is torch's."""
    gen = torch.Generator().manual_seed(0)
    vals = torch.cat([torch.randn(4000, generator=gen) * 10.0 ** torch.randint(-9, 6, (4000,), generator=gen),
                      torch.tensor([65504.0, 65519.0, 65520.0, 1e6, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 0.0,
                                    -0.0, 2049.0, 2051.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11])])
    got = torch.tensor([host.hf_w4_host_f16_round(float(v)) for v in vals], dtype=torch.int32)
    assert torch.equal(got.to(torch.int16), vals.to(torch.float16).view(torch.int16).to(torch.int16))


def test_bit_tricks_exhaustive(host):
    # NVFP4: E2M1 bits are the code's value * 2^-14 (fp16) / 2^-126 (bf16), the prepared E4M3 scale the byte's value
    # * 2^6 / 2^118: their product is the weight * 2^-8 in both types
    for dt, bf, e2m1_pow, e4m3_pow in ((torch.float16, 0, -14, 6), (torch.bfloat16, 1, -126, 118)):
        for code in range(16):
            assert _half_bits(host.hf_w4_host_e2m1(code, bf), dt) == layouts.E2M1_VALUES[code] * 2.0 ** e2m1_pow
        for b in range(256):  # every finite byte decodes exactly, subnormals included
            if b & 0x7F == 0x7F:
                continue
            want = torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()
            assert _half_bits(host.hf_w4_host_e4m3(b, bf), dt) == want * 2.0 ** e4m3_pow, (dt, hex(b))
    assert host.hf_w4_host_check_zero_pair() == 0  # the PRMT form of the zero-point pair
    for dt, bf in ((torch.float16, 0), (torch.bfloat16, 1)):  # magic numbers: (bias + v) - (bias + z) = v - z
        for v in range(16):
            for z in range(128):
                assert _half_bits(host.hf_w4_host_int4(v, z, bf), dt) == v - z, (dt, v, z)


def _prepared(spec, qw):
    layer = torch.nn.Module()
    kern = cw.CudaW4A16Kernel(spec, qw.n, qw.k)
    kern.prepare(layer, qw)
    return kern, layer


def _host_weight(host, kern, layer, dtype, apply_global):
    n, k = kern.n, kern.k
    b = layer._buffers
    kind = 2 if kern.weight_type == "nvfp4" else (1 if b["cuda_w4a16_z"] is not None else 0)
    scales = kern._scales(b, dtype)
    out = torch.empty(n, k, dtype=torch.int16)
    host.hf_w4_host_dequant(_ptr(b["cuda_w4a16_q"]), _ptr(scales), _ptr(b["cuda_w4a16_z"]), n, cw._npad(n), k,
                            kern.group_size, kind, int(dtype == torch.bfloat16), int(apply_global),
                            kern.global_scale, _ptr(out))
    w = out.view(dtype)
    perm = b["cuda_w4a16_perm"]
    if perm is not None:  # the kernel's column k' is the checkpoint's column perm[k']
        w = torch.empty_like(w).index_copy_(1, perm, w)
    return w


# every int4 layout with every group size; NVFP4 has one (16)
LAYOUT_GROUPS = [(c, gs) for c in LAYOUTS for gs in (GROUPS if "nvfp4" not in c[1] else [16])]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case,gs", LAYOUT_GROUPS, ids=[f"{c[0]}-g{gs}" for c, gs in LAYOUT_GROUPS])
def test_host_arithmetic_matches_layouts_dequantize(host, case, gs, dtype):
    """The kernels' weights (the fused kernel's mma operands and the dequantize kernel's output), computed by the
    shared header on the host, equal layouts.dequantize rounded as the kernels round it - bit for bit."""
    _, layout, sym, ao, zp1 = case
    n, k = 192, 576 if gs in (16, 32, 64, -1) else 640
    spec, qw = make_qweight(layout, n, k, gs, sym, ao, zp1, seed=hash((layout, gs)) % 1000)
    kern, layer = _prepared(spec, qw)
    for apply_global in (False, True):
        got = _host_weight(host, kern, layer, dtype, apply_global)
        if qw.weight_type == "nvfp4" and not apply_global:  # the mma operands: the weights * 2^-8
            want = kernel_dtype_weight(dataclasses.replace(qw, global_scale=2.0 ** -8), dtype)
        else:
            want = kernel_dtype_weight(qw, dtype)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (layout, gs, dtype, apply_global)


@pytest.mark.parametrize("n,k", [(192, 576), (72, 32), (8, 16), (4096, 64)])
def test_repack_maps_invert(n, k):
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    q = cw.pack_fragments(codes, chunk=3)
    assert q.shape == (cw._npad(n) // 64, k // 16, 32, 4) and q.dtype == torch.int32
    assert torch.equal(cw.unpack_fragments(q, n, k).long(), codes)
    # the word / nibble of element (n, k) is where the map in w4a16_math.cuh says (its frag_pos, written out)
    nn, kk = n - 1, k - 3
    nt, sub, g, kt, r = nn // 64, (nn % 64) // 8, nn % 8, kk // 16, kk % 16
    word = q[nt, kt, 4 * g + (r % 8) // 2, sub // 2].item() & 0xFFFFFFFF
    assert (word >> 4 * (4 * (r % 2) + 2 * (sub % 2) + r // 8)) & 15 == codes[nn, kk]
    s = torch.randn(n, 5, generator=gen)
    sp = cw.pack_groups(s)
    assert sp.shape == (cw._npad(n) // 64, 5, 8, 8)
    assert torch.equal(cw.unpack_groups(sp, n), s)
    assert sp[nn // 64, 2, nn % 8, (nn % 64) // 8] == s[nn, 2]


@pytest.mark.parametrize("case", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_unpack_codes_gives_the_checkpoint_tensor_back(case):
    _, layout, sym, ao, zp1 = case
    spec, qw = make_qweight(layout, 192, 256, 64, sym, ao, zp1, seed=3)
    kern, layer = _prepared(spec, qw)
    code = layouts.CODE_TENSOR[layout]
    want = layouts.pack_codes(spec, layouts.unpack_codes(qw))
    assert torch.equal(layouts.pack_codes(spec, kern.unpack_codes(layer)), want)
    assert want.dtype == {"gptq": torch.int32, "awq": torch.int32, "ct_pack": torch.int32}.get(layout, torch.uint8)
    assert code


def test_prepare_rejects_zero_points_out_of_range():
    spec, qw = make_qweight("ct_pack", 64, 64, 32, sym=False)
    qw.zeros[3, 1] = 200.0
    with pytest.raises(NotImplementedError, match=r"zero point 200.0 .*\[3, 1\].*0\.\.127"):
        _prepared(spec, qw)


def test_kernel_declines_cpu_and_odd_groups():
    spec, _ = make_qweight("gptq", 64, 64, 32)
    ok, why = cw.CudaW4A16Kernel.can_implement(spec, 64, 64, torch.device("cpu"), torch.bfloat16)
    assert not ok and "device cpu" in why
    odd = spec.replace(group_size=24)
    ok, why = cw.CudaW4A16Kernel.can_implement(odd, 64, 96, torch.device("cuda"), torch.bfloat16)
    assert not ok and "multiple of 16" in why
    ok, why = cw.CudaW4A16Kernel.can_implement(spec, 64, 40, torch.device("cuda"), torch.bfloat16)
    assert not ok and "K=40" in why
    ok, why = cw.CudaW4A16Kernel.can_implement(spec, 64, 64, torch.device("cuda"), torch.float32)
    assert not ok and "float32" in why
    assert "cuda_w4a16" in [c.NAME for c in registry.kernels()]
    if not torch.cuda.is_available():
        ok, why = cw.CudaW4A16Kernel.is_supported()
        if _ext.load_cuda():  # the library pip built beside a CUDA build of torch loads without a device
            assert ok and torch.version.cuda, why
        else:
            assert not ok and "CUDA" in why
            ok, why = cw.CudaW4A16Kernel.can_implement(spec, 64, 64, torch.device("cuda"), torch.bfloat16)
            assert not ok and "CUDA library" in why


def test_large_m_default_and_setting(monkeypatch):
    """Layers dequantize for cuBLAS from 128 rows, or from 320 where their fused path is the wgmma kernel (read when a
    layer is prepared); HF_W4_CUDA_LARGE_M replaces both, and a value that is not a number is an error naming it."""
    monkeypatch.delenv("HF_W4_CUDA_LARGE_M", raising=False)
    assert (cw.large_m(), cw.large_m(True)) == (128, 320)
    monkeypatch.setenv("HF_W4_CUDA_LARGE_M", "64")
    assert (cw.large_m(), cw.large_m(True)) == (64, 64)
    monkeypatch.setenv("HF_W4_CUDA_LARGE_M", "many")
    with pytest.raises(ValueError, match="HF_W4_CUDA_LARGE_M='many': expected an integer number of rows"):
        cw.large_m()


def test_jit_route_builds_csrc_cuda_and_says_so(monkeypatch, tmp_path, hf_w4_caplog):
    """Without a pip-built library, a CUDA build of torch that sees a GPU JIT-builds csrc/cuda (torch's builder is
    replaced here by a recorder): the sources, the sm_90a target on compute capability 9.0, the build folder, and a
    warning before a first build (it takes minutes); a toolkit folder without the CUDA headers (neither there nor in
    $CUDA_INC_PATH) is an error that names it, not a failed compile."""
    from torch.utils import cpp_extension
    calls = []
    monkeypatch.setattr(_ext, "_cuda_state", {"loaded": None, "error": None})
    monkeypatch.setattr(_ext.glob, "glob", lambda p, _g=glob.glob: [] if "_C_cuda" in p else _g(p))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setenv("HF_W4_CUDA_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("CUDA_INC_PATH", raising=False)
    assert not _ext.load_cuda() and not calls
    assert f"CUDA_HOME={tmp_path}" in _ext.cuda_load_error() and "cuda_runtime.h" in _ext.cuda_load_error()
    (tmp_path / "headers").mkdir()  # the headers elsewhere, named by CUDA_INC_PATH, which torch's build passes too
    (tmp_path / "headers" / "cuda_runtime.h").write_text("")
    monkeypatch.setenv("CUDA_INC_PATH", str(tmp_path / "headers"))
    monkeypatch.setattr(_ext, "_cuda_state", {"loaded": None, "error": None})
    assert _ext.load_cuda(), _ext.cuda_load_error()
    (kw,) = calls
    assert sorted(os.path.basename(f) for f in kw["sources"]) == [  # the kernel families compile side by side
        "w4a16_gemm.cu", "w4a16_mma.cu", "w4a16_torch.cpp", "w4a16_wgmma.cu", "w4a16_wide.cu"]
    assert "-gencode=arch=compute_90a,code=sm_90a" in kw["extra_cuda_cflags"]
    assert kw["build_directory"] == str(tmp_path / "build") and kw["is_python_module"] is False
    assert "compiling the CUDA kernels" in hf_w4_caplog.text and "CUDA kernels loaded" in hf_w4_caplog.text
