"""compressed-tensors W8A8 on a real model (SmolLM2-135M, the embedded default): the compiled int8 kernel
(exact integer dot products, compressed-tensors' per-token activation rule) reproduces the reference path's
perplexity, while a weight-only forward of the same checkpoint is visibly off — so the test tells them apart."""
import pytest
import torch

import hf_w4
from conftest import default_model_as
from hf_w4.nn import QuantLinear
from hf_w4.tools import evaluate


@pytest.fixture(scope="module")
def w8a8(tmp_path_factory):
    return default_model_as("ct-w8a8", tmp_path_factory.mktemp("w8a8") / "c", max_tokens=4088)


def _ppl(path, windows, **cfg):
    with hf_w4.enabled():
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     quantization_config=hf_w4.CompressedTensorsConfig(**cfg))
    kernels = {str(m.kernel) for m in model.modules() if isinstance(m, QuantLinear)}
    with torch.no_grad():
        return evaluate.perplexity(model.eval(), windows, progress=False).ppl, kernels


def test_int8_kernel_matches_reference_and_weight_only_is_off(w8a8):
    path, windows = w8a8
    ppl_kernel, k1 = _ppl(path, windows)
    ppl_ref, k2 = _ppl(path, windows, kernel="torch_reference")
    ppl_wo, k3 = _ppl(path, windows, activation="none", kernel="torch_reference")
    assert k1 == {"cpu_int8"} and k2 == {"torch_reference"}, (k1, k2)
    d_kernel = abs(ppl_kernel - ppl_ref) / ppl_ref
    d_wo = abs(ppl_wo - ppl_ref) / ppl_ref
    print(f"ppl: int8 kernel {ppl_kernel:.4f}, reference {ppl_ref:.4f}, weight-only {ppl_wo:.4f}")
    print(f"d_kernel {d_kernel:.4%} d_wo {d_wo:.4%}")
    assert d_kernel <= 0.005, f"int8 kernel perplexity {ppl_kernel:.4f} vs reference {ppl_ref:.4f} ({d_kernel:.2%})"
    assert d_wo >= 0.01, f"weight-only forward should be visibly off, got {d_wo:.2%}"
    assert d_wo > 3 * d_kernel
