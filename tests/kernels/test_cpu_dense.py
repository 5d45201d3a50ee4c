"""The dense decode GEMV (``hf_w4::cpu_dense_gemv``, csrc/cpu/dense_gemv*.cpp) against an fp64 reference at every
ISA level this CPU runs, its argument errors, and ``DenseDecodeLinear`` on the dense layers of a loaded model.

Error budget: a bf16 x bf16 product has at most 16 significant bits and an fp16 x fp16 one 22, so every product is
exact in fp32; the sum of K of them (and the bias) in fp32 is off by at most (K + 1) * 2^-24 * sum |terms|, and the
one rounding into the output dtype by half an ulp (2^-8 relative for bf16, 2^-11 for fp16)."""
import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

from hf_w4 import _ext, env
from hf_w4.kernels import cpu_dense
from hf_w4.report import kernel_report
from hf_w4.tools import writers

from conftest import tokens, w4a16_isa_available

_ext.load()
ISAS = [i for i in ("avx512", "avx2", "generic") if w4a16_isa_available(i)]
U_OUT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _check(y, x, w, b):
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T + (b.double() if b is not None else 0)
    terms = xd.abs() @ wd.abs().T + (b.double().abs() if b is not None else 0)
    budget = U_OUT[x.dtype] * ref.abs() + (x.shape[1] + 1) * 2.0 ** -24 * terms * (1 + U_OUT[x.dtype]) + 1e-30
    err = (y.double() - ref).abs()
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert bool((err <= budget).all()), f"max err / budget {(err / budget).max().item():.3f}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(1, 1), (37, 21), (64, 576), (19, 1000), (40, 4096 + 48)])
def test_matches_reference(isa, dtype, n, k):
    g = torch.Generator().manual_seed(n * 7919 + k)
    for m in range(1, cpu_dense.MAX_ROWS + 1):
        x = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        for bias in (None, b):
            _check(torch.ops.hf_w4.cpu_dense_gemv(x, w, bias, isa), x, w, bias)


@pytest.mark.parametrize("isa", ISAS)
def test_strided_rows_and_thread_count(isa):
    # rows of a wider matrix (weight.stride(0) > K) give what the same rows contiguous give, and so do 1 and 2 threads
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300, 520, generator=g).to(torch.bfloat16)
    w, x = big[:, 8:520 - 3], torch.randn(3, 509, generator=g).to(torch.bfloat16)
    assert w.stride(0) == 520
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.hf_w4.cpu_dense_gemv(x, w, None, isa)
        torch.set_num_threads(2)
        two = torch.ops.hf_w4.cpu_dense_gemv(x, w.contiguous(), None, isa)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    _check(one, x, w, None)


@pytest.mark.parametrize("args,match", [
    (lambda: (torch.zeros(1, 1, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)), r"x must be \[M, K\] and weight \[N, K\], got \[1, 1, 8\]"),
    (lambda: (torch.zeros(5, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)), r"M=5 rows; supported: 1\.\.4"),
    (lambda: (torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 9, dtype=torch.bfloat16)), r"x has K=8 columns"),
    (lambda: (torch.zeros(1, 8), torch.zeros(4, 8)), r"must both be bfloat16 or both float16, got Float"),
    (lambda: (torch.zeros(1, 8, dtype=torch.float16), torch.zeros(4, 8, dtype=torch.bfloat16)), r"got Half and BFloat16"),
])
def test_bad_arguments(args, match):
    x, w = args()
    with pytest.raises(RuntimeError, match=match):
        torch.ops.hf_w4.cpu_dense_gemv(x, w, None)
    with pytest.raises(RuntimeError, match=r"bias must be \[N=4\]"):
        torch.ops.hf_w4.cpu_dense_gemv(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16),
                                       torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="not an ISA name"):
        torch.ops.hf_w4.cpu_dense_gemv(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16),
                                       None, "sse9")


def test_module_calls_the_op_only_at_decode(monkeypatch):
    lin = nn.Linear(64, 48, dtype=torch.bfloat16)
    lin.__class__ = cpu_dense.DenseDecodeLinear
    calls = []
    real = torch.ops.hf_w4.cpu_dense_gemv
    monkeypatch.setattr(cpu_dense.torch.ops.hf_w4, "cpu_dense_gemv", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(2, 1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = lin(x)                                         # 2 rows: the op
        _check(y.reshape(2, 48), x.reshape(2, 64), lin.weight, lin.bias)
        lin(torch.randn(1, 5, 64, dtype=torch.bfloat16))   # 5 rows: F.linear
        with pytest.raises(RuntimeError, match="same dtype"):
            lin(torch.randn(3, 64))                        # fp32 x: F.linear and its own error, as nn.Linear gives
    assert calls == [(2, 64)]
    # with autograd (training a model with a dense LM head): F.linear, so gradients flow
    xg = torch.randn(1, 64, dtype=torch.bfloat16, requires_grad=True)
    lin(xg).sum().backward()
    assert xg.grad is not None and calls == [(2, 64)]


@pytest.mark.usefixtures("hf_w4_installed")
@pytest.mark.parametrize("off", [False, True])
def test_loaded_model_dense_layers(tmp_path, tiny_llama_tied, monkeypatch, off):
    if off:
        monkeypatch.setenv("HF_W4_DENSE_DECODE", "0")
    res = writers.write_checkpoint(tiny_llama_tied, str(tmp_path / "ckpt"), "gptq")
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    head = model.get_output_embeddings()
    assert type(head) is (nn.Linear if off else cpu_dense.DenseDecodeLinear)
    assert head.weight is model.get_input_embeddings().weight            # still tied
    assert ("lm_head: dense bfloat16 -> cpu_dense" in kernel_report(model)) is not off
    ids = tokens()[:1]
    with torch.no_grad():
        h = model.model(ids).last_hidden_state[:, -1:]
        _check(head(h)[0], h[0], head.weight, None)
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3)
    model.save_pretrained(tmp_path / "again")                            # the same tensors: only forward changed
    assert set(load_file(tmp_path / "again" / "model.safetensors")) == set(load_file(tmp_path / "ckpt" / "model.safetensors"))


def test_switch_is_declared():
    assert any(v.name == "HF_W4_DENSE_DECODE" for v in env.VARIABLES)


def test_torch_compile_fullgraph():
    lin = nn.Linear(96, 40, dtype=torch.bfloat16)
    lin.__class__ = cpu_dense.DenseDecodeLinear
    x = torch.randn(1, 1, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(torch.compile(lin, fullgraph=True)(x), lin(x))
