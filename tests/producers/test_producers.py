"""Golden checkpoints written by the real producer libraries, read by hf_w4.

Each folder under tests/data/producers/ was written by a producer (llm-compressor, auto-round, AutoAWQ, GPTQModel,
NVIDIA ModelOpt) from the same tiny seeded Llama, with reference.safetensors holding a probe input and the
producer's own fp32 logits for it (its dequantized model; its metadata says how each was made). hf_w4 must load
the folder through from_pretrained, with every Linear of the decoder a QuantLinear of the expected format, and
reproduce those logits. tests/producers/regenerate.py rebuilds the folders in side venvs; it is not run here.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hf_w4

DATA = Path(__file__).resolve().parent.parent / "data" / "producers"

# folder -> what hf_w4 must make of it: W4Spec fields that every decoder Linear shares
_CT4 = dict(method="compressed-tensors", layout="ct_pack", weight_type="int4", act="none")
_GPTQ = dict(layout="gptq", weight_type="int4", group_size=32, zero_plus_one=True)  # GPTQ v1: zero - 1
_AWQ = dict(layout="awq", weight_type="int4", group_size=32, zero_plus_one=False)
_MO = dict(method="modelopt", layout="modelopt_nvfp4", weight_type="nvfp4", group_size=16, act="none")
EXPECT = {
    "llmcompressor-w4a16-sym": dict(_CT4, group_size=32, sym=True),
    "llmcompressor-w4a16-asym": dict(_CT4, group_size=32, sym=False),
    "llmcompressor-w4a16-channel": dict(_CT4, group_size=-1, sym=True),
    "llmcompressor-w8a8": dict(method="compressed-tensors", layout="ct_int", weight_type="int8", bits=8,
                               group_size=-1, sym=True, act="int8_token"),
    "llmcompressor-w4a8": dict(method="compressed-tensors", layout="ct_int", weight_type="int8", bits=4,
                               group_size=128, sym=True, act="int8_token"),
    "llmcompressor-nvfp4a16": dict(method="compressed-tensors", layout="ct_nvfp4", weight_type="nvfp4",
                                   group_size=16, act="none"),
    "autoround-autogptq-sym": dict(_GPTQ, method="gptq", sym=True),
    "autoround-autogptq-asym": dict(_GPTQ, method="gptq", sym=False),
    "autoround-autoawq-sym": dict(_AWQ, method="awq", sym=True),
    "autoround-autoawq-asym": dict(_AWQ, method="awq", sym=False),
    # auto-round's own format packs symmetric checkpoints the GPTQ way and asymmetric ones the AWQ way
    "autoround-autoround-sym": dict(_GPTQ, method="auto-round", sym=True),
    "autoround-autoround-asym": dict(_AWQ, method="auto-round", sym=False),
    "autoawq-gemm-asym": dict(_AWQ, method="awq", sym=False),
    "gptqmodel-gptq-sym": dict(_GPTQ, method="gptq", sym=True),
    "gptqmodel-gptq-asym": dict(_GPTQ, method="gptq", sym=False),
    "gptqmodel-gptqv2-asym": dict(_GPTQ, method="gptq", sym=False, zero_plus_one=False),  # v2 stores the zero
    "modelopt-nvfp4": dict(_MO, has_input_scale=True),
    "modelopt-w4a16-nvfp4": dict(_MO, has_input_scale=False),
}
DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

COSINE_MIN = 0.9999
# Budget on max |hf_w4 - producer| over the logits, relative to max |producer|, by activation scheme.
# Weight-only: hf_w4 dequantizes exactly in fp32, while compressed-tensors' NVFP4 and auto-round's fake export (the
# AWQ-layout references) round the dequantized weights to bf16 first. That rounding alone makes the difference
# (0.9% on llmcompressor-nvfp4a16, nothing left once hf_w4's weights are rounded the same way); the other
# references dequantize in fp32 and match to rounding noise. A wrong nibble order, zero or scale convention costs
# tens of percent.
# int8 activations: per-token rounding to steps of max|x|/127.5 turns fp32 reassociation noise into whole steps;
# nudging the embeddings by 1e-6 (relative) moves the producer's own W8A8 / W4A8 logits by 1.6% / 1.5% of max,
# the same as the difference to hf_w4, so 3%.
MAX_ABS_REL = {"none": 0.02, "int8_token": 0.03}


def folders():
    return sorted(p.name for p in DATA.iterdir() if (p / "reference.safetensors").is_file())


def test_every_folder_has_an_expectation():
    """A new golden folder needs its expected format here, and each expected folder must exist."""
    assert set(folders()) == set(EXPECT), (
        f"tests/data/producers has {sorted(set(folders()) - set(EXPECT))} without an EXPECT entry and is missing "
        f"{sorted(set(EXPECT) - set(folders()))}")


@pytest.mark.parametrize("name", folders())
def test_producer_checkpoint(name, hf_w4_installed):
    path = DATA / name
    with safe_open(str(path / "reference.safetensors"), "pt") as f:
        ids, ref = f.get_tensor("input_ids"), f.get_tensor("logits")
        meta = f.metadata()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    n_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    expect = EXPECT[name]
    for i in range(n_layers):
        for lin in DECODER_LINEARS:
            mod = model.get_submodule(f"model.layers.{i}.{lin}")
            assert isinstance(mod, hf_w4.QuantLinear), f"{name}: model.layers.{i}.{lin} is {type(mod).__name__}"
            got = {k: getattr(mod.spec, k) for k in expect}
            assert got == expect, f"{name}: model.layers.{i}.{lin} read as {mod.spec.describe()}"
            assert mod.kernel is not None, f"{name}: model.layers.{i}.{lin} has no kernel"
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, hf_w4.QuantLinear)

    with torch.no_grad():
        out = model(input_ids=ids).logits.float()
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    where = f"{name} (written by {json.loads(meta['reference'])['versions']})"
    assert cos >= COSINE_MIN, f"{where}: logits cosine {cos:.6f} < {COSINE_MIN} against the producer's reference"
    budget = MAX_ABS_REL[expect.get("act", "none")]
    assert rel <= budget, f"{where}: max |diff| / max |ref| = {rel:.4f} > {budget}"
