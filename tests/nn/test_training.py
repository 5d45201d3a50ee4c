"""Loaded models stay usable in the ways torch users expect beyond inference: input gradients through the
compiled ops (e.g. adapters trained on a frozen quantized base), ``load_state_dict`` (the kernel follows the
new tensors), ``copy.deepcopy``, and saving after a kernel change."""
import copy
import io

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_w4
from hf_w4.nn import QuantLinear

from conftest import WRITER_IDS as IDS
from conftest import WRITER_VARIANTS as VARIANTS

pytestmark = pytest.mark.usefixtures("installed_one_copy")


def _tokens():
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("fmt", ["gptq", "ct-w8a8"])
def test_no_grad_calls_skip_the_autograd_layer(written, fmt):
    """Under no_grad (generate) or for inputs that need no gradient, the kernels call their op below the autograd
    layer (hf_w4.ops.linear_call): the same numbers, no graph; with a gradient wanted, the graph is there."""
    model = AutoModelForCausalLM.from_pretrained(written(fmt, {}).path, dtype=torch.float32)
    m = next(m for m in model.modules() if isinstance(m, QuantLinear))
    x = torch.randn(2, m.in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        quiet = m(x.requires_grad_())
    plain = m(x.detach())
    traced = m(x)
    assert quiet.grad_fn is None and plain.grad_fn is None and traced.grad_fn is not None
    assert torch.equal(quiet, plain) and torch.equal(traced.detach(), plain)


@pytest.mark.parametrize("fmt,opts", VARIANTS, ids=IDS)
def test_input_gradient_is_grad_y_times_dense_weight(written, fmt, opts):
    """Every layer's input gradient, through the compiled op's registered autograd formula, is grad_y @ W with W
    the exact dense weight (int8 activations: straight through the quantizer). Budget: fp32 summation order."""
    model = AutoModelForCausalLM.from_pretrained(written(fmt, opts).path, dtype=torch.float32)
    qls = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert qls and all(m.kernel.NAME in ("cpu_w4a16", "cpu_int8") for m in qls)
    g = torch.Generator().manual_seed(0)
    for m in qls[:4] + qls[-1:]:
        x = torch.randn(3, 5, m.in_features, generator=g, requires_grad=True)
        y = m(x)
        assert y.requires_grad, f"{m.name}: the output does not require grad"
        gy = torch.randn(y.shape, generator=g)
        y.backward(gy)
        want = gy.reshape(-1, m.out_features) @ m.dequantize_weight()
        err = (x.grad.reshape(-1, m.in_features) - want).abs().max().item()
        assert err <= 1e-4 * want.abs().max().item(), f"{m.name} ({m.kernel}): input gradient off by {err}"


def test_model_gradient_matches_reference_kernel(written, monkeypatch):
    """Whole-model gradient w.r.t. the input embeddings: compiled kernels vs the pure-torch reference kernel."""
    path = written("gptq", dict(sym=False, group_size=64)).path
    grads = {}
    for kernel in ("auto", "torch_reference"):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     quantization_config=hf_w4.GPTQConfig(kernel=kernel))
        emb = model.get_input_embeddings()(_tokens()).detach().requires_grad_(True)
        model(inputs_embeds=emb).logits.float().square().mean().backward()
        grads[kernel] = emb.grad
    assert torch.isfinite(grads["auto"]).all()
    err = (grads["auto"] - grads["torch_reference"]).abs().max().item()
    assert err <= 1e-3 * grads["torch_reference"].abs().max().item(), err


@pytest.mark.parametrize("fmt,opts", [("gptq", dict(sym=False, group_size=64)), ("ct-nvfp4", {}), ("ct-w8a8", {})])
@pytest.mark.parametrize("keep", ["0", "1"])
def test_load_state_dict_updates_the_kernel(written, monkeypatch, fmt, opts, keep):
    """load_state_dict replaces the checkpoint tensors, and the kernel is repacked from them: forward, state_dict
    and dequantize agree afterwards (with or without the dropped code tensor in the state dict)."""
    monkeypatch.setenv("HF_W4_KEEP_CHECKPOINT_TENSORS", keep)
    path = written(fmt, opts).path
    a = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m = next(m for m in a.modules() if isinstance(m, QuantLinear))
    # weights x 2: the group scales doubled, or an NVFP4 layer's fp32 global divisor halved (fp8 block scales kept)
    t, f = ("weight_global_scale", 0.5) if "weight_global_scale" in m.tensor_names else ("scales" if "scales" in
                                                                                          m.tensor_names else "weight_scale", 2.0)
    x = torch.randn(4, m.in_features, generator=torch.Generator().manual_seed(1))
    w0, y0 = m.dequantize_weight(), m(x)
    sd = {t: getattr(m, t).detach() * f}
    m.load_state_dict(sd, strict=False)
    assert torch.allclose(m.dequantize_weight(), w0 * 2, rtol=1e-6, atol=0)
    assert torch.allclose(m(x), y0 * 2, rtol=1e-3, atol=1e-4 * y0.abs().max().item())
    # a full state dict from another model (code tensor included) into this one
    b = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    b.load_state_dict(a.state_dict())
    tok = _tokens()
    with torch.no_grad():
        assert torch.equal(b(tok).logits, a(tok).logits)


@pytest.mark.parametrize("fmt,opts", [("gptq", dict(sym=True)), ("ct-nvfp4", {}), ("ct-w8a8", {})])
def test_deepcopy_pickle_and_reselected_kernel_save(written, tmp_path, fmt, opts):
    path = written(fmt, opts).path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    twin = copy.deepcopy(model)
    tok = _tokens()
    with torch.no_grad():
        y = model(tok).logits
        assert torch.equal(twin(tok).logits, y)
    twin.save_pretrained(tmp_path / "copy")
    buf = io.BytesIO()  # torch.save of a whole model pickles it, quantizer included (plain pickle: torch cannot
    torch.save(model, buf)  # pickle fp8 tensors itself)
    buf.seek(0)
    pickled = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.equal(pickled(tok).logits, y)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.select_kernel(torch.float32, force="torch_reference")
    model.save_pretrained(tmp_path / "reselected")
    for d in ("copy", "reselected"):
        again = AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float32)
        with torch.no_grad():
            assert torch.allclose(again(tok).logits, y, atol=1e-4), d


def test_in_order_g_idx_does_not_count_as_act_order(written):
    """GPTQ stores a g_idx even without act-order; an in-order one must not turn away kernels without act-order."""
    model = AutoModelForCausalLM.from_pretrained(written("gptq", dict(sym=True)).path, dtype=torch.bfloat16)
    qls = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert any("g_idx" in m.tensor_names for m in qls)
    for m in qls:
        assert "act-order" not in m.kernel_reasons.get("zentorch_w4a16", ""), m.kernel_reasons
        m.select_kernel(torch.bfloat16, deny=("cpu_w4a16", "cpu_int8"))
        assert "act-order" not in m.kernel_reasons.get("zentorch_w4a16", ""), m.kernel_reasons
    act = AutoModelForCausalLM.from_pretrained(written("gptq", dict(sym=True, desc_act=True)).path,
                                               dtype=torch.bfloat16)
    m = next(m for m in act.modules() if isinstance(m, QuantLinear))
    m.select_kernel(torch.bfloat16, deny=("cpu_w4a16", "cpu_int8"))
    assert "act-order" in m.kernel_reasons["zentorch_w4a16"], m.kernel_reasons
