"""One copy of the packed weight: after the repack for a compiled CPU kernel a QuantLinear drops the checkpoint's code tensor and
rebuilds it, bit-exact, from the kernel's copy whenever it is asked for (state_dict, save_pretrained, attribute
access, dequantize, another kernel)."""
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_w4
from hf_w4 import layouts
from hf_w4.nn import QuantLinear

from conftest import WRITER_IDS as IDS
from conftest import WRITER_VARIANTS as VARIANTS
from conftest import same_tensor as _same

pytestmark = pytest.mark.usefixtures("installed_one_copy")


def _tokens():
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))


def _held_bytes(model):
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


@pytest.mark.parametrize("fmt,opts", VARIANTS, ids=IDS)
def test_code_tensor_dropped_and_rebuilt_bit_exact(written, tmp_path, fmt, opts):
    res = written(fmt, opts)
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    qls = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert qls and all(m.kernel.NAME in ("cpu_w4a16", "cpu_int8") for m in qls)
    assert not [m.name for m in qls if layouts.CODE_TENSOR[m.spec.layout] in dict(m.named_buffers(recurse=False))]
    for m in qls:
        code = layouts.CODE_TENSOR[m.spec.layout]
        own = dict(m.named_parameters(recurse=False)) | dict(m.named_buffers(recurse=False))
        assert code not in own, f"{m.name}: {code} is still held next to the kernel's copy"
    # the state dict is the checkpoint, byte for byte (code tensors rebuilt from the kernel layout)
    disk = load_file(os.path.join(res.path, "model.safetensors"))
    sd = model.state_dict()
    assert set(sd) == set(disk)
    bad = [k for k in disk if not _same(sd[k], disk[k])]
    assert not bad, f"rebuilt tensors differ from the checkpoint: {bad[:5]}"
    # attribute access rebuilds too (e.g. ``module.weight`` of a ModelOpt layer)
    m = qls[0]
    code = layouts.CODE_TENSOR[m.spec.layout]
    assert _same(getattr(m, code), disk[f"{m.name}.{code}"])
    # save -> reload -> same logits
    x = _tokens()
    with torch.no_grad():
        y = model(x).logits
    model.save_pretrained(tmp_path / "re")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "re", dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(again(x).logits, y)


@pytest.mark.parametrize("fmt,opts", [("gptq", dict(sym=False, desc_act=True)), ("awq", dict(sym=False))])
def test_w4a8_opt_in_rebuilds_bit_exact(written, fmt, opts):
    """activation="int8" runs 4-bit layers on cpu_int8 (int4 panels): its copy stands in for the codes too."""
    res = written(fmt, opts)
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16,
                                                 quantization_config=hf_w4.GPTQConfig(activation="int8")
                                                 if fmt == "gptq" else hf_w4.AwqConfig(activation="int8"))
    qls = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert qls and all(m.kernel.NAME == "cpu_int8" and "qweight" not in dict(m.named_buffers()) for m in qls)
    disk = load_file(os.path.join(res.path, "model.safetensors"))
    sd = model.state_dict()
    assert all(_same(sd[k], disk[k]) for k in disk)


def test_memory_is_one_copy(written, monkeypatch):
    res = written("gptq", dict(sym=True))
    lean = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    monkeypatch.setenv("HF_W4_KEEP_CHECKPOINT_TENSORS", "1")
    both = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    code_bytes = sum(m.qweight.numel() * 4 for m in both.modules() if isinstance(m, QuantLinear))
    assert all("qweight" in dict(m.named_buffers()) for m in both.modules() if isinstance(m, QuantLinear))
    assert _held_bytes(both) - _held_bytes(lean) == code_bytes
    x = _tokens()
    with torch.no_grad():
        assert torch.equal(lean(x).logits, both(x).logits)
    q = next(m for m in lean.modules() if isinstance(m, QuantLinear))
    assert q.packed_bytes() < next(m for m in both.modules() if isinstance(m, QuantLinear)).packed_bytes()


@pytest.mark.parametrize("fmt,opts", [("gptq", dict(sym=False, desc_act=True)), ("modelopt-nvfp4", {})])
def test_other_kernel_gets_the_codes_back(written, fmt, opts):
    res = written(fmt, opts)
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    x = _tokens()
    with torch.no_grad():
        y = model(x).logits
    disk = load_file(os.path.join(res.path, "model.safetensors"))
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.select_kernel(torch.float32, force="torch_reference")
            code = layouts.CODE_TENSOR[m.spec.layout]
            assert code in dict(m.named_buffers(recurse=False)), "the reference kernel needs the checkpoint tensor"
            assert _same(getattr(m, code), disk[f"{m.name}.{code}"])
    with torch.no_grad():
        y2 = model(x).logits
    assert ((y2 - y).abs().max() / y.abs().max()).item() < 1e-5
    for m in model.modules():   # and back: dropped again, still exact
        if isinstance(m, QuantLinear):
            m.select_kernel(torch.float32)
            assert layouts.CODE_TENSOR[m.spec.layout] not in dict(m.named_buffers(recurse=False))
    sd = model.state_dict()
    qkeys = [f"{m.name}.{t}" for m in model.modules() if isinstance(m, QuantLinear) for t in m.tensor_names]
    assert qkeys and all(_same(sd[k], disk[k]) for k in qkeys)
