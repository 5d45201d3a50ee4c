"""Shared offline fixtures and helpers: a tiny random Llama (fp32) and its variants, checkpoints written from it in
every format the writers know, and the checkpoint editing the error tests use. Nothing needs network access."""
import ctypes
import json
import os
import platform
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_w4 import _ext
# the op schemas before the library registers kernels for them: a kernel without its schema breaks torch's import of
# inductor (it looks every registered op up by name), which zentorch's import runs
from hf_w4 import ops  # noqa: F401

if os.environ.get("HF_W4_TEST_EMULATED_AVX512") == "1":
    # run by tests/kernels/test_avx512_emulated.py with HF_W4_LIBRARY = the build whose AVX-512 kernels run on AVX2
    # through SIMDe: the tests' CPU-feature checks see the AVX-512 features that build provides (AMX stays absent)
    _host_flags = _ext.cpu_flags()
    _ext.cpu_flags = lambda: _host_flags | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                                            "avx512_vnni", "avx512vbmi"}


def pytest_configure(config):
    # on x86-64 the compiled library must load: without it the kernel tests would skip and the end-to-end tests
    # would pass on the slow reference kernel, hiding a broken build
    if platform.machine().lower() in ("x86_64", "amd64") and os.environ.get("HF_W4_NO_EXT") != "1" and not _ext.load():
        raise pytest.UsageError(
            f"hf_w4's compiled library did not load: {_ext.load_error()}. Build it (python setup.py build_ext "
            "--inplace, or pip install --no-build-isolation -e .), or set HF_W4_NO_EXT=1 to run the suite without "
            "it on purpose (the compiled-kernel tests then skip)")


TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)


def make_tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A seeded random tiny ``LlamaForCausalLM`` in fp32; ``overrides`` change the config (e.g.
    ``tie_word_embeddings=True``, ``attention_bias=True``, ``mlp_bias=True``)."""
    cfg = LlamaConfig(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture
def hf_w4_installed():
    """hf_w4.install() for the test, uninstall() after it."""
    import hf_w4
    hf_w4.install()
    yield
    hf_w4.uninstall()


@pytest.fixture(scope="session")
def cxx_library(tmp_path_factory):
    """cxx_library(source, flags, skip_reason, timeout) -> ctypes.CDLL: ``source`` built by g++ as a shared library
    with ``flags``; skips with ``skip_reason`` where g++ is missing, and a failed build fails with its command and
    errors (the CPU builds of the CUDA sources in tests/kernels)."""
    def build(source: str, flags, skip_reason: str, timeout: int = 600) -> ctypes.CDLL:
        cxx = shutil.which("g++")
        if cxx is None:
            pytest.skip(skip_reason)
        out = tmp_path_factory.mktemp("cxx") / (os.path.splitext(os.path.basename(source))[0] + ".so")
        cmd = [cxx, *flags, "-shared", "-fPIC", source, "-o", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"
        return ctypes.CDLL(str(out))
    return build


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_EMU = os.path.join(REPO, "tests", "kernels", "cuda_emu")
H100_SMS = 132  # the emulated kernels are planned for an H100's SMs: the split-K plans of the GPU


@pytest.fixture(scope="session")
def cuda_emu(cxx_library):
    """The CUDA kernels (the .cu files of csrc/cuda) built by g++ against tests/kernels/cuda_emu, a CPU stand-in for
    CUDA, as a ctypes library (its exports: tests/kernels/cuda_emu/w4a16_emu.cpp)."""
    flags = ["-std=c++20", "-O1", "-Wall", "-Wno-unknown-pragmas", "-Werror", "-fno-extern-tls-init", "-I", CUDA_EMU,
             "-I", os.path.join(REPO, "csrc", "cuda"), "-I", os.path.join(REPO, "csrc", "cpu")]
    lib = cxx_library(os.path.join(CUDA_EMU, "w4a16_emu.cpp"), flags,
                      "g++ not found: the emulated CUDA kernels cannot be built")
    lib.hf_w4_emu_gemm.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_int] * 6 + \
        [ctypes.POINTER(ctypes.c_int)] * 2
    lib.hf_w4_emu_plan.argtypes = [ctypes.c_int] * 10 + [ctypes.POINTER(ctypes.c_int)]
    lib.hf_w4_emu_wgmma_rule.argtypes = [ctypes.c_int] * 3
    lib.hf_w4_emu_error.restype = ctypes.c_char_p
    lib.hf_w4_emu_copies_at_issue.argtypes = [ctypes.c_int]
    lib.hf_w4_emu_dequant.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_float, ctypes.c_int,
                                                                                     ctypes.c_int]
    return lib


@pytest.fixture
def cuda_ops_on_cpu(cuda_emu):
    """For one test, the CUDA ops cuda_w4a16_gemm / cuda_w4a16_dequant on CPU tensors: CPU implementations that check
    the buffers as the CUDA glue does and run the emulated kernels, planned for an H100 (H100_SMS) as the glue plans:
    the settings HF_W4_CUDA_MT / _WIDE / _SPLITS / _WGMMA, else the rules (the wgmma kernel where its rule takes it
    and no mma.sync tiling is forced)."""
    lib = torch.library.Library("hf_w4", "IMPL")

    def gemm(x, qpack, scales, zeros, bias, n, group_size, weight_type, global_scale=1.0):
        m, k = x.shape
        kind = _cuda_layout_kind(qpack, scales, zeros, n, k, group_size, weight_type, x.dtype)
        x = x.contiguous()
        bias = None if bias is None else bias.to(x.dtype).contiguous()
        y = torch.empty(m, n, dtype=x.dtype)
        if m:
            mt, wide = int(os.environ.get("HF_W4_CUDA_MT", 0)), int(os.environ.get("HF_W4_CUDA_WIDE", -1))
            splits, wgmma = int(os.environ.get("HF_W4_CUDA_SPLITS", 0)), int(os.environ.get("HF_W4_CUDA_WGMMA", -1))
            wgmma = wgmma > 0 or (wgmma < 0 and not mt and wide < 0 and cuda_emu.hf_w4_emu_wgmma_rule(m, n, k))
            planned, rows = ctypes.c_int(0), ctypes.c_int(0)
            rc = cuda_emu.hf_w4_emu_gemm(
                x.data_ptr(), qpack.data_ptr(), scales.data_ptr(), zeros.data_ptr() if kind == 1 else None,
                None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k, group_size, kind,
                int(x.dtype == torch.bfloat16), global_scale, H100_SMS, mt, wide, splits, int(wgmma), 0,
                ctypes.byref(planned), ctypes.byref(rows))
            assert rc == 0, f"emulated cuda_w4a16_gemm M={m} N={n} K={k}: {rc} {cuda_emu.hf_w4_emu_error().decode()}"
        return y

    def dequant(qpack, scales, zeros, n, k, group_size, weight_type, global_scale, dtype):
        kind = _cuda_layout_kind(qpack, scales, zeros, n, k, group_size, weight_type, dtype)
        w = torch.empty(n, k, dtype=dtype)
        rc = cuda_emu.hf_w4_emu_dequant(qpack.data_ptr(), scales.data_ptr(), zeros.data_ptr() if kind == 1 else None,
                                        w.data_ptr(), n, k, group_size, global_scale, kind,
                                        int(dtype == torch.bfloat16))
        assert rc == 0, f"emulated cuda_w4a16_dequant N={n} K={k}: {rc} {cuda_emu.hf_w4_emu_error().decode()}"
        return w

    lib.impl("cuda_w4a16_gemm", gemm, "CPU")
    lib.impl("cuda_w4a16_dequant", dequant, "CPU")
    yield
    lib._destroy()


@pytest.fixture
def cuda_kernel_on_cpu(cuda_ops_on_cpu, monkeypatch):
    """hf_w4 installed with cuda_w4a16 forced (HF_W4_KERNEL) and taking CPU layers, its ops running the emulated
    kernels (cuda_ops_on_cpu), for one test."""
    from hf_w4.kernels import cuda_w4a16
    from hf_w4.kernels.base import OK
    monkeypatch.setattr(cuda_w4a16.CudaW4A16Kernel, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(cuda_w4a16.CudaW4A16Kernel, "is_supported", classmethod(lambda cls: OK))
    monkeypatch.setenv("HF_W4_KERNEL", "cuda_w4a16")
    import hf_w4
    hf_w4.install()
    yield
    hf_w4.uninstall()


def _cuda_layout_kind(qpack, scales, zeros, n, k, group_size, weight_type, act) -> int:
    """The CUDA kernel layout's buffers checked as the glue checks them (the emulated kernels read them through raw
    pointers); returns the kernels' weight kind (0 int4 symmetric, 1 asymmetric, 2 NVFP4)."""
    npad = (n + 63) // 64 * 64
    assert qpack.dtype == torch.int32 and qpack.is_contiguous() and qpack.numel() == k * npad // 8
    if weight_type == "nvfp4":
        assert scales.dtype == torch.uint8 and scales.is_contiguous() and scales.numel() == k // 16 * npad
        return 2
    assert weight_type == "int4" and k % group_size == 0 and group_size % 16 == 0
    assert scales.dtype == act and scales.is_contiguous() and scales.numel() == k // group_size * npad
    if zeros is None or not zeros.numel():
        return 0
    assert zeros.dtype == torch.uint8 and zeros.is_contiguous() and zeros.numel() == k // group_size * npad
    return 1


def cosine(a, b) -> float:
    """Cosine similarity of two tensors flattened, in fp32."""
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def rel_err(a, b) -> float:
    """max |a - b| / max |b|, in fp32."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def tiny_llama_tied():
    return make_tiny_llama(seed=1, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_llama_bias():
    return make_tiny_llama(seed=2, attention_bias=True)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_llama):
    """``tiny_llama`` saved as an ordinary dense safetensors checkpoint (fp32)."""
    d = tmp_path_factory.mktemp("tiny_llama_dense")
    tiny_llama.save_pretrained(d)
    return d


# (format, writer options): every variant the loader tests read
WRITER_VARIANTS = [
    ("gptq", dict(sym=True)),
    ("gptq", dict(sym=False, group_size=64)),
    ("gptq", dict(sym=True, desc_act=True)),
    ("gptq", dict(sym=False, checkpoint_format="gptq_v2")),
    ("autoround", dict(sym=True)),
    ("autoround", dict(sym=True, group_size=32, extra_config={"model.layers.0.mlp.down_proj": {"bits": 16}})),
    ("autoround-awq", dict(sym=False)),
    ("awq", dict(sym=False)),
    ("awq", dict(sym=True)),
    ("ct-w4a16", dict(sym=True)),
    ("ct-w4a16", dict(sym=False, group_size=32)),
    ("ct-w4a16", dict(sym=True, group_size=-1)),
    ("ct-w8a8", dict()),
    ("ct-w4a8", dict()),
    ("ct-nvfp4", dict()),
    ("modelopt-w4a16", dict()),
    ("modelopt-nvfp4", dict()),
]
WRITER_IDS = [f"{f}-" + "-".join(f"{k}={v}" for k, v in o.items() if k != "extra_config")
              + ("-extra" if "extra_config" in o else "") for f, o in WRITER_VARIANTS]


def tokens(seed: int = 1):
    """A fixed [2, 12] batch of token ids for the tiny models."""
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_llama):
    """``written(fmt, opts)``: ``tiny_llama`` written in ``fmt`` (a WriteResult), once per module and variant."""
    from hf_w4.tools import writers
    cache = {}

    def get(fmt, opts):
        key = (fmt, json.dumps(opts, sort_keys=True))
        if key not in cache:
            out = tmp_path_factory.mktemp(fmt)
            cache[key] = writers.write_checkpoint(tiny_llama, str(out / "ckpt"), fmt, **opts)
        return cache[key]
    return get


@pytest.fixture
def installed_one_copy(monkeypatch):
    """hf_w4 installed, and the packed weight held once (HF_W4_KEEP_CHECKPOINT_TENSORS unset)."""
    import hf_w4
    monkeypatch.delenv("HF_W4_KEEP_CHECKPOINT_TENSORS", raising=False)
    hf_w4.install()
    yield
    hf_w4.uninstall()


def same_tensor(a, b) -> bool:
    """Equal dtype, shape and bits (1-byte dtypes such as float8 compared as bytes)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8) if b.dtype.itemsize == 1 else b)


def assert_same_checkpoint(a_dir, b_dir) -> None:
    """The two directories' model.safetensors hold the same keys, each tensor the same in dtype, shape and bits."""
    a = load_file(os.path.join(a_dir, "model.safetensors"))
    b = load_file(os.path.join(b_dir, "model.safetensors"))
    assert set(a) == set(b), f"only in {a_dir}: {sorted(set(a) - set(b))[:4]}; only in {b_dir}: {sorted(set(b) - set(a))[:4]}"
    bad = [k for k in a if not same_tensor(a[k], b[k])]
    assert not bad, f"written back differently: {bad[:5]}"


def capture_cuda_graph(fn):
    """(graph, output) of ``fn()`` captured in a CUDA graph, after the warm-up run on a side stream that
    torch.cuda.graph asks for."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def edited_copy(base_dir, tmp_path, tensors=None, config=None) -> str:
    """A copy of checkpoint ``base_dir`` with ``tensors(state_dict)`` / ``config(quantization_config)`` applied."""
    d = tmp_path / "bad"
    shutil.copytree(base_dir, d)
    if tensors is not None:
        sd = load_file(d / "model.safetensors")
        tensors(sd)
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        c = json.load(open(d / "config.json"))
        config(c["quantization_config"])
        json.dump(c, open(d / "config.json", "w"))
    return str(d)


def load_fp32(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)


def subprocess_env() -> dict:
    """This environment, offline, with this checkout first on PYTHONPATH (for ``python -m hf_w4...`` children)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with a trained BPE tokenizer, saved as a dense checkpoint (``models.build_tiny``)."""
    from hf_w4.tools import models
    return models.build_tiny(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture
def hf_w4_caplog(caplog):
    """``caplog`` that sees hf_w4's messages: they go to transformers' library logger, which does not propagate to
    the root logger (where caplog listens) unless asked."""
    from transformers.utils import logging as tlog
    from hf_w4.log import NAME
    tlog.enable_propagation()
    caplog.set_level("INFO", logger=NAME)
    yield caplog
    tlog.disable_propagation()


def w4a16_isa_available(isa: str) -> bool:
    """The W4A16 kernels run at this ISA level here (an op given a level the CPU lacks raises)."""
    from hf_w4 import ops as _ops
    try:
        _ops.cpu_w4a16_path(1, 64, "int4", 64, torch.float32, isa=isa)
        return True
    except RuntimeError:
        return False


def default_model_as(fmt: str, out_dir, max_tokens: int):
    """The embedded default model (SmolLM2-135M) written as ``fmt`` under ``out_dir``, and windows of 512 tokens of
    the default text, at most ``max_tokens`` in all: (checkpoint path, windows)."""
    from hf_w4.tools import evaluate, models, writers
    try:
        src = models.default_model_path(verbose=False)
    except models.ModelNotAvailable as e:
        pytest.skip(str(e))
    res = writers.write_checkpoint(str(src), str(out_dir), fmt)
    tok = evaluate.load_tokenizer(res.path)
    return res.path, evaluate.make_windows(tok, evaluate.default_text(), window=512, max_tokens=max_tokens)
