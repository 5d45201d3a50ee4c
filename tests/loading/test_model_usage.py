"""A loaded model behaves as transformers users expect of a quantized (and a dequantized) model: dequantize gives
trainable Linears in the model's current dtype, ``requires_grad_(True)`` works (checkpoint tensors are buffers),
and misuse gets errors that say what to do."""
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_w4
from hf_w4 import layouts
from hf_w4.loading.checkpoint import CheckpointError
from hf_w4.nn import QuantLinear

from conftest import same_tensor as _same
from conftest import tokens as _tokens

pytestmark = pytest.mark.usefixtures("installed_one_copy")


def _qls(model):
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


@pytest.mark.parametrize("how", ["dequantize()", "dequantize=True"])
def test_dequantized_linears_are_trainable(written, how):
    path = written("awq", dict(sym=False)).path
    if how == "dequantize()":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).dequantize()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     quantization_config=hf_w4.AwqConfig(dequantize=True))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert not frozen, f"frozen after dequantize: {frozen[:3]}"
    q = model.model.layers[0].self_attn.q_proj
    before = q.weight.detach().clone()
    x = _tokens()
    model(x, labels=x).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    assert not torch.equal(q.weight, before)


@pytest.mark.parametrize("fmt,load,to", [("awq", torch.float32, torch.bfloat16),
                                         ("ct-w4a16", torch.bfloat16, torch.float16)])
def test_dequantize_after_to_dtype_takes_the_current_dtype(written, fmt, load, to):
    model = AutoModelForCausalLM.from_pretrained(written(fmt, {}).path, dtype=load).to(to)
    model.dequantize()
    assert {p.dtype for p in model.parameters()} == {to}
    with torch.no_grad():
        assert model(_tokens()).logits.dtype == to


@pytest.mark.parametrize("fmt,opts", [("gptq", dict(sym=False, desc_act=True)), ("awq", dict(sym=False)),
                                      ("ct-w4a16", dict(sym=False, group_size=32)), ("ct-w8a8", {}),
                                      ("modelopt-nvfp4", {})])
def test_requires_grad_true_and_kbit_style_upcast(written, fmt, opts):
    """Checkpoint tensors are buffers (as in transformers' GPTQ / AWQ): ``requires_grad_(True)`` works, and the
    QLoRA recipe's upcast of every 16-bit parameter to fp32 leaves them, so the save stays byte-identical."""
    res = written(fmt, opts)
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    model.requires_grad_(True)
    for p in model.parameters():
        p.requires_grad = True
        if p.dtype in (torch.float16, torch.bfloat16):   # what peft.prepare_model_for_kbit_training does
            p.data = p.data.float()
    for m in _qls(model):
        assert set(m.tensor_names) - set(m._dropped) <= set(dict(m.named_buffers(recurse=False)))
    disk = load_file(os.path.join(res.path, "model.safetensors"))
    sd = model.state_dict()
    qkeys = [f"{m.name}.{t}" for m in _qls(model) for t in m.tensor_names]
    assert qkeys and not [k for k in qkeys if not _same(sd[k], disk[k])]
    x = _tokens()
    model(x, labels=x).loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_in_place_edit_of_a_rebuilt_code_tensor_raises(written):
    res = written("gptq", dict(sym=True))
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    m = _qls(model)[0]
    with pytest.raises(RuntimeError, match="[Ii]nplace"):
        m.qweight.zero_()
    assert _same(model.state_dict()[f"{m.name}.qweight"], load_file(os.path.join(res.path, "model.safetensors"))[
        f"{m.name}.qweight"])


def test_keep_checkpoint_tensors_env(written, monkeypatch):
    m = _qls(AutoModelForCausalLM.from_pretrained(written("gptq", dict(sym=True)).path, dtype=torch.float32))[0]
    code = layouts.CODE_TENSOR[m.spec.layout]
    for value, kept in [("false", False), ("No", False), ("0", False), ("", False), ("true", True), ("1", True),
                        ("yes", True)]:
        monkeypatch.setenv("HF_W4_KEEP_CHECKPOINT_TENSORS", value)
        m.select_kernel(torch.float32)
        assert (code in dict(m.named_buffers(recurse=False))) == kept, value
    monkeypatch.setenv("HF_W4_KEEP_CHECKPOINT_TENSORS", "off-ish")
    with pytest.raises(ValueError, match="HF_W4_KEEP_CHECKPOINT_TENSORS='off-ish'.*0/1/true/false/yes/no"):
        m.select_kernel(torch.float32)


@pytest.mark.parametrize("fmt", ["autoround", "modelopt-nvfp4"])
def test_resize_token_embeddings_with_quantized_lm_head(tmp_path, tiny_llama, fmt):
    # refused before anything changes (transformers itself resizes the input embeddings, then fails on the head)
    from hf_w4.tools import writers
    res = writers.write_checkpoint(tiny_llama, str(tmp_path / "c"), fmt, quantize_lm_head=True)
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    emb = model.get_input_embeddings()
    with pytest.raises(AttributeError, match=r"lm_head is an hf_w4 QuantLinear .*nothing was changed.*"
                                             r"model\.dequantize\(\)"):
        model.resize_token_embeddings(600)
    assert model.get_input_embeddings() is emb and emb.weight.shape[0] == tiny_llama.config.vocab_size
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32).dequantize()
    model.resize_token_embeddings(600)
    assert model.lm_head.weight.shape == (600, tiny_llama.config.hidden_size)


def test_config_built_in_enabled_block_used_after_it(written):
    path = written("gptq", dict(sym=True)).path
    hf_w4.uninstall()
    with hf_w4.enabled():
        cfg = hf_w4.GPTQConfig(kernel="torch_reference")
        assert _qls(AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg))
    with pytest.raises(RuntimeError, match="takeover of 'gptq' is not installed.*hf_w4.install"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg)


@pytest.mark.parametrize("cfg", [hf_w4.GPTQConfig, hf_w4.AwqConfig, hf_w4.CompressedTensorsConfig])
def test_hf_w4_config_for_a_dense_checkpoint(tiny_llama_dir, cfg):
    with pytest.raises(CheckpointError, match="no quantization_config.*pre-quantized checkpoints only"):
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=cfg())
