"""Shared offline fixtures: a tiny random Llama (fp32) and its variants, built without network access."""
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_w4 import _ext

if os.environ.get("HF_W4_TEST_EMULATED_AVX512") == "1":
    # run by tests/test_avx512_emulated.py with HF_W4_LIBRARY = the build whose AVX-512 kernels run on AVX2 through
    # SIMDe: the tests' CPU-feature checks see the AVX-512 features that build provides (AMX stays absent)
    _host_flags = _ext.cpu_flags()
    _ext.cpu_flags = lambda: _host_flags | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                                            "avx512_vnni", "avx512vbmi"}

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
