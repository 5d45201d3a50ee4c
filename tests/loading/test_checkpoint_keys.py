"""The header check sees the checkpoint's tensors under the names transformers loads them as: .bin files are
read too, keys transformers renames are renamed first, and quantized tensors no quantized Linear takes are an
error instead of silently random weights."""
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                          LlavaForConditionalGeneration, Qwen3MoeConfig, Qwen3MoeForCausalLM)

import hf_w4
from hf_w4 import layouts
from hf_w4.loading import moe
from hf_w4.tools import writers
from hf_w4.loading.checkpoint import CheckpointError
from hf_w4.formats.spec import W4Spec

Q = "model.layers.0.self_attn.q_proj"
IDS = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(1))


pytestmark = pytest.mark.usefixtures("hf_w4_installed")


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def rewrite(src, dst, tensors, name="model.safetensors"):
    """Copy checkpoint ``src`` to ``dst`` with its tensors passed through ``tensors(sd) -> sd`` and saved as ``name``."""
    shutil.copytree(src, dst)
    sd = tensors(load_file(os.path.join(dst, "model.safetensors")))
    os.remove(os.path.join(dst, "model.safetensors"))
    if name.endswith(".bin"):
        torch.save(sd, os.path.join(dst, name))
    else:
        save_file(sd, os.path.join(dst, name), metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("fmt", ["gptq", "ct-nvfp4", "modelopt-nvfp4"])
def test_bin_checkpoint(tmp_path, tiny_llama, fmt):
    src = writers.write_checkpoint(tiny_llama, str(tmp_path / "st"), fmt).path
    b = rewrite(src, tmp_path / "bin", lambda sd: sd, "pytorch_model.bin")
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    assert torch.equal(logits(load(b)), logits(load(src)))
    if fmt == "gptq":  # the .bin's names, shapes and dtypes are read: a missing tensor is the same early error
        bad = rewrite(src, tmp_path / "bad", lambda sd: {k: v for k, v in sd.items() if k != f"{Q}.scales"},
                      "pytorch_model.bin")
        with pytest.raises(CheckpointError, match=rf"{Q}\.scales: missing from the checkpoint; gptq"):
            load(bad)


def _tiny_llava():
    cfg = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=32, patch_size=16),
                      text_config=LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
                      image_token_index=500)
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(cfg).eval()


def test_keys_transformers_renames(tmp_path):
    # a Llava checkpoint in the legacy layout (language_model.model.layers.*) transformers 5 renames at load time
    src = writers.write_checkpoint(_tiny_llava(), str(tmp_path / "new"), "gptq",
                                   block_name_to_quantize="model.language_model.layers").path
    legacy = {"model.language_model.": "language_model.model.", "lm_head.": "language_model.lm_head.",
              "model.vision_tower.": "vision_tower.", "model.multi_modal_projector.": "multi_modal_projector."}

    def to_legacy(sd):
        out = {}
        for k, v in sd.items():
            old = next((o + k[len(n):] for n, o in legacy.items() if k.startswith(n)), k)
            out[old] = v
        return out
    old = rewrite(src, tmp_path / "old", to_legacy)
    assert any(k.startswith("language_model.model.layers.0.self_attn.q_proj.") for k in load_file(
        os.path.join(old, "model.safetensors")))
    load = lambda p: LlavaForConditionalGeneration.from_pretrained(p, dtype=torch.float32)
    m = load(old)
    assert type(m.model.language_model.layers[0].self_attn.q_proj).__name__ == "QuantLinear"
    assert torch.equal(logits(m), logits(load(src)))


@pytest.mark.parametrize("fmt", ["autoround", "ct-w4a16"])
def test_config_naming_modules_as_stored_on_disk(tmp_path, fmt):
    # transformers 5 saves Llava under its old names (language_model.model.*), as producers on transformers 4 also
    # named the modules in their configs; producers on transformers 5 name them as the model does. Both load.
    src = writers.write_checkpoint(_tiny_llava(), str(tmp_path / "new"), fmt,
                                   block_name_to_quantize="model.language_model.layers",
                                   ignore=["model.language_model.layers.0.mlp.down_proj"] + (
                                       ["re:model[.](vision_tower|multi_modal_projector)[.].*"] if fmt == "ct-w4a16"
                                       else [])).path
    keys = load_file(os.path.join(src, "model.safetensors"))
    assert "language_model.model.layers.0.self_attn.q_proj.qweight" in keys or \
        "language_model.model.layers.0.self_attn.q_proj.weight_packed" in keys
    assert keys["language_model.model.layers.0.mlp.down_proj.weight"].is_floating_point()
    old = str(tmp_path / "old")
    shutil.copytree(src, old)
    with open(os.path.join(old, "config.json")) as f:
        text = f.read()
    assert "model.language_model.layers" in text
    with open(os.path.join(old, "config.json"), "w") as f:
        # the language model's names as on disk; the vision tower's stay as the model names them (on disk:
        # vision_tower.vision_model.*): a config may mix both
        f.write(text.replace("model.language_model.layers", "language_model.model.layers"))
    load = lambda p: LlavaForConditionalGeneration.from_pretrained(p, dtype=torch.float32)
    for path in (src, old):
        m = load(path)
        lm = m.model.language_model.layers[0]
        assert type(lm.self_attn.q_proj).__name__ == "QuantLinear", path
        assert type(lm.mlp.down_proj) is torch.nn.Linear, path
    assert torch.equal(logits(load(old)), logits(load(src)))


def test_key_mapping(tmp_path, tiny_llama):
    # from_pretrained(key_mapping=...) renames keys too; transformers 5.23 does not pass it to quantizers, so the
    # header check leaves the modules it cannot find under their own names to the post-load guard
    src = writers.write_checkpoint(tiny_llama, str(tmp_path / "q"), "gptq").path
    mapped = rewrite(src, tmp_path / "mapped", lambda sd: {k.replace("model.layers.", "transformer.h."): v
                                                          for k, v in sd.items()})
    load = lambda p, **kw: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, **kw)
    m = load(mapped, key_mapping={r"^transformer\.h\.": "model.layers."})
    assert type(m.get_submodule(Q)).__name__ == "QuantLinear"
    assert torch.equal(logits(m), logits(load(src)))


GPTQ_G128 = W4Spec("gptq", "gptq", "int4", 4, 128, True, zero_plus_one=True)


def _qwen3_moe_gptq(tmp_path, num_experts):
    """A one-layer Qwen3-MoE, written as GPTQ int4 g128 (one Linear per expert)."""
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=num_experts,
                         num_experts_per_tok=2, head_dim=64, mlp_only_layers=[])
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    return cfg, model, writers.write_checkpoint(model, str(tmp_path / "q"), "gptq").path


def test_hand_written_per_expert_checkpoint_loads(tmp_path):
    # GPTQ / auto-round write one quantized Linear per expert; transformers 5 fuses the experts into one module with
    # 3-D parameters: hf_w4.loading.moe unfuses it. The per-expert tensors here are packed by hand (not by the writer's MoE
    # path), each projection must dequantize to exactly its RTN weight
    cfg, model, src = _qwen3_moe_gptq(tmp_path, num_experts=4)
    experts = model.model.layers[0].mlp.experts
    dense = {}

    def per_expert(sd):
        sd = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
        p = "model.layers.0.mlp.experts"
        for e in range(cfg.num_experts):
            gate, up = experts.gate_up_proj[e].detach().chunk(2, dim=0)
            for proj, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", experts.down_proj[e].detach())):
                r = writers.quantize_rtn(w.float(), "int4", 128, True)
                dense[(e, proj)] = r.dense()
                for t, x in layouts.pack(GPTQ_G128, r.codes, r.scales, r.zeros).items():
                    sd[f"{p}.{e}.{proj}.{t}"] = x.contiguous()
        return sd
    m = AutoModelForCausalLM.from_pretrained(rewrite(src, tmp_path / "moe", per_expert), dtype=torch.float32)
    unfused = m.model.layers[0].mlp.experts
    assert isinstance(unfused, moe.UnfusedExperts) and len(unfused) == cfg.num_experts
    for (e, proj), w in dense.items():
        assert torch.equal(getattr(unfused[e], proj).dequantize_weight(), w), (e, proj)


def test_quantized_tensors_under_a_module_that_is_no_linear_are_an_error(tmp_path):
    # e.g. a router quantized by the producer (an nn.Linear before transformers 5, a TopKRouter module with a
    # 'weight' parameter now): nothing would load them, the router's own weight would stay random
    _, _, src = _qwen3_moe_gptq(tmp_path, num_experts=32)

    def quantized_router(sd):
        w = sd.pop("model.layers.0.mlp.gate.weight").float()
        r = writers.quantize_rtn(w, "int4", 128, True)
        for t, x in layouts.pack(GPTQ_G128, r.codes, r.scales, r.zeros).items():
            sd[f"model.layers.0.mlp.gate.{t}"] = x.contiguous()
        return sd
    bad = rewrite(src, tmp_path / "router", quantized_router)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate \(qweight, qzeros, scales\).*"
                                              r"Qwen3MoeTopKRouter modules are not supported"):
        AutoModelForCausalLM.from_pretrained(bad, dtype=torch.float32)


def test_kv_cache_scales_are_not_an_error(tmp_path, tiny_llama):
    # ModelOpt's FP8 KV-cache scales on k_proj / v_proj: hf_w4 keeps the KV cache in the model dtype (warned),
    # so they are left unloaded, not a reason to refuse the checkpoint
    src = writers.write_checkpoint(tiny_llama, str(tmp_path / "q"), "modelopt-nvfp4").path

    def add(sd):
        for i in range(tiny_llama.config.num_hidden_layers):
            sd[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.01)
            sd[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(0.01)
        return sd
    kv = rewrite(src, tmp_path / "kv", add)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    assert torch.equal(logits(load(kv)), logits(load(src)))
