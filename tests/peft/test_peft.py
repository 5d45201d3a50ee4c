"""PEFT LoRA on a quantized base (hf_w4.lora): get_peft_model / add_adapter wrap QuantLinear layers, the adapter's
output adds to the compiled kernel's, training touches only the adapter, adapters save and load, and what cannot
work (merging into packed weights, variants and inits that read the dense weight) is refused with a reason."""
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_w4
from conftest import cosine
from hf_w4.nn import QuantLinear

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'peft>=0.21,<0.22')")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("installed_one_copy")

TARGETS = ["q_proj", "v_proj", "down_proj"]
# weight-only formats (the dense twin then computes the same function); ct-w4a16 layers carry no bias and no
# float tensor PEFT could take a device from
FORMATS = [("gptq", dict(sym=False, group_size=64)), ("awq", dict(sym=False)), ("ct-w4a16", dict(sym=True)),
           ("ct-nvfp4", {}), ("modelopt-w4a16", {}), ("autoround", dict(sym=True))]


def _tokens():
    return torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(5))


def _lora(**kw):
    # init_lora_weights=False: A and B both random, so the adapter changes the output from the start
    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, **kw)


def _quant_lora_layers(model):
    return [m for m in model.modules() if type(m).__name__ == "QuantLoraLinear"]


@pytest.mark.parametrize("fmt,opts", FORMATS, ids=[f for f, _ in FORMATS])
def test_lora_on_quantized_base_matches_lora_on_dense_twin(written, fmt, opts):
    """The same adapter on the quantized model and on its dense twin (PEFT's own nn.Linear LoRA, exact dequantized
    weights) gives the same fp32 logits (budget 1e-5 of the logits' scale, as the base models' own test)."""
    res = written(fmt, opts)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32), _lora())
    layers = _quant_lora_layers(model)
    assert len(layers) == 3 * 2, [type(m).__name__ for m in model.modules()][:40]  # 3 targets x 2 layers
    assert all(isinstance(m.base_layer, QuantLinear) for m in layers)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)[:5]
    twin = get_peft_model(res.dense_model().float().eval(), _lora())
    twin.load_state_dict({k: v for k, v in model.state_dict().items() if ".lora_" in k}, strict=False)
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora.keys() == {n for n, p in twin.named_parameters() if p.requires_grad}
    assert all(torch.equal(p, twin.get_parameter(n)) for n, p in lora.items())
    x = _tokens()
    with torch.no_grad():
        y, want, base = model(x).logits, twin(x).logits, None
        with model.disable_adapter():
            base = model(x).logits
    scale = want.abs().max().item()
    assert (y - want).abs().max().item() <= 1e-5 * scale
    assert (y - base).abs().max().item() > 1e-3 * scale, "the adapter did not change the output"


@pytest.mark.parametrize("fmt,opts", [("gptq", dict(sym=True)), ("ct-w8a8", {}), ("ct-nvfp4", {})])
def test_training_step_save_and_reload(written, tmp_path, fmt, opts):
    """A training step moves only the adapter (the quantized base's tensors stay byte-identical); the saved adapter
    loads onto a fresh quantized base, through PeftModel and through transformers' load_adapter, and gives the
    same logits; unload() gives back the plain QuantLinear model."""
    path = written(fmt, opts).path
    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))  # default init: B = 0
    base_before = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    x = _tokens()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for _ in range(3):
        loss = model(x, labels=x).loss
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0], losses
    b = next(m for m in _quant_lora_layers(model))
    assert b.lora_B["default"].weight.abs().sum() > 0, "lora_B never moved"
    after = {k: v for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    assert base_before.keys() == after.keys()
    assert all(torch.equal(base_before[k], after[k]) for k in after), "the quantized base changed"

    model.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        y = model(x).logits
        again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                          tmp_path / "adapter")
        assert torch.equal(again(x).logits, y)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf.load_adapter(tmp_path / "adapter")
        assert _quant_lora_layers(hf)
        assert torch.equal(hf(x).logits, y)
        plain = model.unload()
        assert not _quant_lora_layers(plain) and any(isinstance(m, QuantLinear) for m in plain.modules())
        fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert torch.equal(plain(x).logits, fresh(x).logits)


def test_add_adapter_and_bf16_base(written):
    """transformers' own entry point (model.add_adapter) on a bf16 model: the adapter stays fp32, the output bf16."""
    model = AutoModelForCausalLM.from_pretrained(written("awq", dict(sym=True)).path, dtype=torch.bfloat16)
    model.add_adapter(LoraConfig(r=2, target_modules=["o_proj"], init_lora_weights="gaussian"))
    layers = _quant_lora_layers(model)
    assert len(layers) == 2 and all(m.lora_A["default"].weight.dtype == torch.float32 for m in layers)
    out = model(_tokens(), labels=_tokens())
    assert out.logits.dtype == torch.bfloat16
    out.loss.backward()
    assert all(m.lora_A["default"].weight.grad is not None for m in layers)


def test_refusals_name_the_layer_and_the_way_out(written, tmp_path):
    path = written("ct-nvfp4", {}).path
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), _lora())
    with pytest.raises(NotImplementedError, match=r"q_proj .*re-quantization.*CompressedTensorsConfig\(dequantize=True\)"):
        model.merge_and_unload()
    # the way out the message gives: the adapter merged into the dequantized base, saved as a dense model
    model.save_pretrained(tmp_path / "adapter")
    dense = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=hf_w4.CompressedTensorsConfig(dequantize=True))
    merged = PeftModel.from_pretrained(dense, tmp_path / "adapter").merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any(isinstance(m, QuantLinear) for m in again.modules())
    x = _tokens()
    with torch.no_grad():
        y = model(x).logits
        assert (again(x).logits - y).abs().max().item() <= 1e-5 * y.abs().max().item()
    for cfg, what in ((_lora(use_dora=True), "only plain LoRA"),
                      (LoraConfig(r=2, target_modules=TARGETS, init_lora_weights="pissa"), "init_lora_weights='pissa'")):
        with pytest.raises(NotImplementedError, match=what):
            get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), cfg)


def test_peft_imported_before_or_after_install():
    """PEFT imported before hf_w4.install() is patched at once, imported after it by the import hook; a plain
    nn.Linear still gets PEFT's own LoRA layer."""
    code = r"""
import sys, torch, hf_w4
first = sys.argv[1]
if first == "peft":
    import peft
hf_w4.install()
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear
from peft.tuners.lora.model import LoraModel
assert LoraModel._hf_w4_patched
m = get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8)), LoraConfig(r=2, target_modules=["0"]))
assert type(m.base_model.model[0]) is Linear, type(m.base_model.model[0])
from peft.utils import transformers_weight_conversion as conv   # MoE retargeting: skipped for unfused experts
import transformers.integrations.peft as tpeft
assert conv._hf_w4_patched and hasattr(conv.get_model_conversion_mapping, "_hf_w4_wraps")
assert hasattr(tpeft.get_model_conversion_mapping, "_hf_w4_wraps")
print("ok", first)
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for first in ("peft", "hf_w4"):
        r = subprocess.run([sys.executable, "-c", code, first], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0 and f"ok {first}" in r.stdout, r.stderr[-2000:]


def test_all_linear_with_quantized_lm_head_and_trainer(written, tmp_path):
    """target_modules="all-linear" takes every QuantLinear but the (quantized) lm_head, and a second adapter does
    not nest into the first's wrapper; transformers' Trainer then trains with gradient checkpointing after
    prepare_model_for_kbit_training."""
    from peft import prepare_model_for_kbit_training
    from transformers import Trainer, TrainingArguments
    path = written("autoround", dict(sym=True, quantize_lm_head=True)).path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    quant = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert "lm_head" in quant
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules()
               if type(m).__name__ == "QuantLoraLinear"}
    assert wrapped == quant - {"lm_head"}
    model.add_adapter("second", LoraConfig(r=2, target_modules="all-linear"))
    assert len(_quant_lora_layers(model)) == len(wrapped)
    assert all(set(m.lora_A) == {"default", "second"} for m in _quant_lora_layers(model))

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            t = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": t, "labels": t}
    args = TrainingArguments(str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to=[], save_strategy="no", use_cpu=True, gradient_checkpointing=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    out = Trainer(model=model, args=args, train_dataset=Data()).train()
    assert out.global_step == 2 and torch.isfinite(torch.tensor(out.training_loss))
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved and all(".default." in n for n in moved)


def test_mixed_batches_weighted_adapters_and_pickle(written):
    """Per-row adapters (adapter_names=), add_weighted_adapter (svd needs get_delta_weight) and torch.save of the PEFT
    model, each against the dense twin / the original."""
    import io
    res = written("gptq", dict(sym=False, group_size=64))
    x = _tokens()
    outs = []
    for make in (lambda: AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32),
                 lambda: res.dense_model().float().eval()):
        torch.manual_seed(2)
        model = get_peft_model(make(), _lora(), adapter_name="a")
        model.add_adapter("b", _lora())
        if not outs:
            twin_state = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
        else:
            model.load_state_dict(twin_state, strict=False)
        model.add_weighted_adapter(["a", "b"], [0.7, 0.3], "w", combination_type="svd")
        model.eval()
        with torch.no_grad():
            mixed = model(x, adapter_names=["a", "b"]).logits
            model.set_adapter("w")
            outs.append((mixed, model(x).logits))
        if len(outs) == 1:
            buf = io.BytesIO()
            torch.save(model, buf)
            buf.seek(0)
            with torch.no_grad():
                assert torch.equal(torch.load(buf, weights_only=False)(x).logits, outs[0][1])
            with torch.no_grad():
                model.set_adapter("a")  # row 0 ran adapter a (batch size changes the kernel's row blocking)
                one = model(x[:1]).logits
                assert (mixed[:1] - one).abs().max().item() <= 1e-5 * one.abs().max().item()
    for q, d in zip(outs[0], outs[1]):
        assert (q - d).abs().max().item() <= 1e-5 * d.abs().max().item()


def test_merge_refused_before_anything_changes_and_allowed_after_dequantize(written):
    """A model with dense and quantized LoRA targets: the merge refusal comes before PEFT merges the dense ones
    (GPTQ included, whose own PEFT check names no layer); after model.dequantize() the merge runs."""
    res = written("autoround", dict(sym=True, group_size=32,
                                    extra_config={"model.layers.0.mlp.down_proj": {"bits": 16}}))
    torch.manual_seed(3)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32), _lora())
    dense_target = model.base_model.model.model.layers[0].mlp.down_proj
    assert type(dense_target).__name__ == "Linear" and not isinstance(dense_target.base_layer, QuantLinear)
    x = _tokens()
    with torch.no_grad():
        y = model(x).logits
    for call in (model.merge_and_unload, model.merge_adapter):
        with pytest.raises(NotImplementedError, match="nothing was merged"):
            call()
        assert not dense_target.merged and type(model.base_model.model.model.layers[0].mlp.down_proj) is type(dense_target)
    with torch.no_grad():
        assert torch.equal(model(x).logits, y)
    gptq = get_peft_model(AutoModelForCausalLM.from_pretrained(written("gptq", dict(sym=True)).path), _lora())
    with pytest.raises(NotImplementedError, match=r"GPTQConfig\(dequantize=True\)"):
        gptq.merge_and_unload()
    model.get_base_model().dequantize()
    merged = model.merge_and_unload()
    assert not any(isinstance(m, QuantLinear) for m in merged.modules())
    with torch.no_grad():
        assert (merged(x).logits - y).abs().max().item() <= 1e-5 * y.abs().max().item()


def test_modules_to_save_on_a_quantized_module_is_refused(written):
    model = AutoModelForCausalLM.from_pretrained(written("autoround", dict(sym=True, quantize_lm_head=True)).path)
    with pytest.raises(NotImplementedError, match=r"modules_to_save=\['lm_head'\] selects hf_w4 QuantLinear"):
        get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))


def test_peft_without_the_expected_internals_is_left_alone(hf_w4_caplog):
    """A PEFT whose LoraModel lacks the methods hf_w4.lora replaces: a warning naming them, and nothing patched."""
    import types
    from hf_w4.peft import lora

    class LoraModel:  # a stand-in without _replace_module / _check_merge_allowed / _check_new_adapter_config
        prefix = "lora_"

        @staticmethod
        def _create_new_module(*a, **k):
            return None
    lora._patch(types.SimpleNamespace(LoraModel=LoraModel))
    assert "LoRA on QuantLinear layers is unavailable with peft" in hf_w4_caplog.text
    assert "LoraModel._replace_module" in hf_w4_caplog.text and not getattr(LoraModel, "_hf_w4_patched", False)
    assert LoraModel._create_new_module() is None


def test_lora_training_step_on_the_cuda_kernel(written, cuda_kernel_on_cpu, monkeypatch):
    """LoRA on layers that run cuda_w4a16 (its kernels emulated on the CPU, tests/conftest.py), bf16 base: the loss
    and the adapter's gradients, which flow back through the op's registered input gradient, agree with the same
    adapter on the reference kernel."""
    path = written("gptq", dict(sym=False, group_size=64)).path

    def step(kernel):
        monkeypatch.setenv("HF_W4_KERNEL", kernel)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        assert {m.kernel.NAME for m in base.modules() if isinstance(m, QuantLinear)} == {kernel}
        torch.manual_seed(0)
        model = get_peft_model(base, _lora())
        loss = model(_tokens(), labels=_tokens()).loss
        loss.backward()
        return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}

    loss, grads = step("cuda_w4a16")
    ref_loss, ref_grads = step("torch_reference")
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 3 * 2
    assert abs(loss - ref_loss) <= 1e-2 * abs(ref_loss), (loss, ref_loss)
    for n, g in grads.items():
        cos = cosine(g, ref_grads[n])
        assert cos >= 0.999, f"{n}: gradient cosine {cos:.5f} to the reference kernel's"
