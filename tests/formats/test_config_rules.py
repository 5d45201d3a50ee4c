"""Which modules a config quantizes, read the way each producer reads it (AutoAWQ, optimum/gptqmodel, auto-round,
compressed-tensors, ModelOpt), and the config / input errors that must name what was found."""

import pytest
import torch
from torch import nn

import hf_w4
from hf_w4 import formats, layouts
from hf_w4.tools import writers
from hf_w4.formats.spec import W4Spec
from hf_w4.layouts import LayoutError
from hf_w4.nn import QuantLinear

from conftest import edited_copy as copy
from conftest import load_fp32 as load

pytestmark = pytest.mark.usefixtures("hf_w4_installed")

Q = "model.layers.0.self_attn.q_proj"
L0_UP = "model.layers.0.mlp.up_proj"
L1_UP = "model.layers.1.mlp.up_proj"


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama):
    def w(tag, fmt, **kw):
        return writers.write_checkpoint(tiny_llama, str(tmp_path_factory.mktemp(tag) / "c"), fmt, **kw).path
    return {"awq_l0_dense": w("awq", "awq", ignore=[r"re:model\.layers\.0\..*"]),
            "gptq_mlp_dense": w("gptq_mlp", "gptq", ignore=["re:.*mlp.*"]),
            "gptq_desc_act": w("gptq_da", "gptq", desc_act=True),
            "gptq": w("gptq", "gptq")}


def quantized(model):
    return sorted(n for n, m in model.named_modules() if isinstance(m, QuantLinear))


def logits(model):
    with torch.no_grad():
        return model(torch.arange(1, 13).view(2, 6)).logits


# ---------------------------------------------------------------------------------------------- B5: ignore rules


@pytest.mark.parametrize("entries", [["lm_head", "model.layers.0"],   # a module prefix (transformers 5: boundary)
                                     ["lm_head", "layers.0."],        # a substring (AutoAWQ: key in name)
                                     ["lm_head", "layers.0.self_attn", "layers.0.mlp"]])
def test_awq_modules_to_not_convert_prefix_and_substring(base, tmp_path, entries):
    p = copy(base["awq_l0_dense"], tmp_path, config=lambda q: q.update(modules_to_not_convert=entries))
    m = load(p)
    q = quantized(m)
    assert not any(n.startswith("model.layers.0.") for n in q) and len(q) == 7   # layer 1 only
    torch.testing.assert_close(logits(m), logits(load(base["awq_l0_dense"])), rtol=0, atol=0)


def test_awq_substring_rule_is_autoawqs():
    f = formats.parse({"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128,
                       "modules_to_not_convert": ["visual", "mlp.gate"]})
    assert f.spec_for("model.visual.blocks.0.attn.qkv") is None
    assert f.spec_for("model.layers.0.mlp.gate") is None
    assert f.spec_for("model.layers.0.mlp.gate_proj") is None      # AutoAWQ's substring catches it too
    assert f.spec_for(Q) is not None


def test_ct_ignore_and_targets_are_exact_names_regexes_or_classes():
    w = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}
    f = formats.parse({"quant_method": "compressed-tensors", "format": "pack-quantized",
                       "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}},
                       "ignore": ["lm_head", "q_proj", "self_attn.k_proj", "re:.*mlp\\.down_proj$"]})
    # compressed-tensors matches a bare entry against the whole name only: these stay quantized
    assert f.spec_for(Q) is not None and f.spec_for("model.layers.0.self_attn.k_proj") is not None
    assert f.spec_for("model.layers.0.mlp.down_proj") is None and f.spec_for("lm_head") is None
    # "Linear" selects every Linear, whatever its own class (compressed-tensors matches along the MRO)
    assert f.spec_for(Q, "MyLinear") is not None
    t = formats.parse({"quant_method": "compressed-tensors", "format": "pack-quantized",
                       "config_groups": {"group_0": {"targets": ["model.layers.1.mlp.up_proj"], "weights": w}}})
    assert t.spec_for(L1_UP) is not None and t.spec_for("visual.model.layers.1.mlp.up_proj") is None
    with pytest.raises(ValueError, match=r"compressed-tensors: ignore entry '\(' is not a valid regular expression"):
        formats.parse({"quant_method": "compressed-tensors", "format": "pack-quantized",
                       "config_groups": {"group_0": {"targets": ["Linear"], "weights": w}}, "ignore": ["re:("]})


def test_autoround_extra_config_exact_keys_first_then_regex_search():
    f = formats.parse({"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4,
                       "group_size": 128, "sym": True, "block_name_to_quantize": "model.layers",
                       "extra_config": {r".*layers\.0\.mlp.*": {"bits": 16},       # a regex key first...
                                        L0_UP: {"group_size": 32},                  # ...an exact key still wins
                                        r"self_attn\.o_proj$": {"bits": 16},        # re.search: not anchored
                                        "(": {"bits": 16}}})                        # skipped like auto-round does
    assert f.spec_for(L0_UP).group_size == 32
    assert f.spec_for("model.layers.0.mlp.down_proj") is None
    assert f.spec_for("model.layers.1.self_attn.o_proj") is None
    assert f.spec_for(L1_UP).group_size == 128


def test_autoround_modules_to_not_convert_and_modules_in_block_to_quantize():
    f = formats.parse({"quant_method": "auto-round", "packing_format": "auto_round:auto_awq", "bits": 4,
                       "group_size": 128, "sym": False, "to_quant_block_names": "model.layers",
                       "modules_to_not_convert": ["lm_head", r"layers\.1\.self_attn"],
                       "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.o_proj"], ["mlp.up_proj"]],
                       "extra_config": {"lm_head": {"bits": 4}}})
    assert f.spec_for(Q) is not None and f.spec_for(L1_UP) is not None
    assert f.spec_for("model.layers.0.self_attn.k_proj") is None            # not listed
    assert f.spec_for("model.layers.1.self_attn.q_proj") is None            # not converted
    assert f.spec_for("lm_head") is not None      # modules_to_not_convert only covers block modules


def test_modelopt_exclude_modules_wildcards_and_parent_modules():
    f = formats.parse({"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4",
                       "ignore": ["lm_head", "model.layers.1*", "model.layers.0.mlp"]})
    assert f.spec_for(L1_UP) is None and f.spec_for("model.layers.1.self_attn.q_proj") is None
    assert f.spec_for(L0_UP) is None                                       # a parent module, no '*'
    assert f.spec_for(Q) is not None


# ---------------------------------------------------------------------------------------------- B6: GPTQ modules_in_block_to_quantize


def test_gptq_modules_in_block_to_quantize_parse():
    f = formats.parse({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True,
                       "block_name_to_quantize": "model.layers",
                       "modules_in_block_to_quantize": [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"],
                                                        ["self_attn.o_proj"]]})
    assert f.spec_for(Q) is not None and f.spec_for("model.layers.1.self_attn.o_proj") is not None
    assert f.spec_for(L0_UP) is None and f.spec_for("model.layers.1.mlp.down_proj") is None
    assert f.spec_for("lm_head") is not None      # outside the blocks: governed by lm_head
    with pytest.raises(ValueError, match="modules_in_block_to_quantize entry 3 must be a module name"):
        formats.parse({"quant_method": "gptq", "bits": 4, "modules_in_block_to_quantize": [["self_attn.q_proj", 3]]})


def test_gptq_modules_in_block_to_quantize_loads(base, tmp_path):
    def cfg(q):   # optimum's form of the same checkpoint: the unlisted (mlp) modules hold dense weights
        q.pop("dynamic")
        q["block_name_to_quantize"] = "model.layers"
        q["modules_in_block_to_quantize"] = [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"],
                                             ["self_attn.o_proj"]]
    m = load(copy(base["gptq_mlp_dense"], tmp_path, config=cfg))
    assert quantized(m) == sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkvo")
    assert type(m.get_submodule(L0_UP)) is nn.Linear
    torch.testing.assert_close(logits(m), logits(load(base["gptq_mlp_dense"])), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- B7: messages


def test_unequal_g_idx_groups_name_the_tensor(base, tmp_path):
    def bad(sd):
        sd[f"{Q}.g_idx"] = torch.zeros_like(sd[f"{Q}.g_idx"])
    with pytest.raises(NotImplementedError, match=rf"{Q}\.g_idx: assigns groups of unequal size \(group 0 has 256 "
                                                  r"columns; expected groups 0\.\.1 of 128 columns each"):
        load(copy(base["gptq_desc_act"], tmp_path, tensors=bad))


@pytest.mark.parametrize("method", ["gptq", "awq", "auto-round"])
def test_bits_must_be_an_integer(method):
    with pytest.raises(ValueError, match=rf"{method}: bits must be an integer, found '4' \(str\); supported bits: \[4\]"):
        formats.parse({"quant_method": method, "bits": "4", "group_size": 128})


def test_autoround_group_size_is_validated():
    with pytest.raises(ValueError, match=r"auto-round: group_size=-2 is invalid; expected a positive group size or -1"):
        formats.parse({"quant_method": "auto-round", "bits": 4, "group_size": -2})
    with pytest.raises(ValueError, match=r"auto-round extra_config\['lm_head'\]: group_size must be an integer, "
                                         r"found '64'"):
        formats.parse({"quant_method": "auto-round", "bits": 4, "extra_config": {"lm_head": {"group_size": "64"}}})


@pytest.mark.parametrize("activation,kernel", [("none", "cpu_w4a16"), ("int8", "cpu_int8"),
                                               ("none", "torch_reference")])
def test_wrong_input_width_names_the_module(base, activation, kernel):
    m = load(base["gptq"], quantization_config=hf_w4.GPTQConfig(activation=activation,
                                                                kernel="auto" if kernel != "torch_reference" else kernel))
    layer = m.get_submodule(Q)
    assert layer.kernel.NAME == kernel
    with pytest.raises(RuntimeError, match=rf"{Q}: input has 264 features \(shape \[3, 264\]\), expected "
                                           r"in_features K=256"):
        layer(torch.randn(3, 264))


def test_compute_dtype_typo():
    with pytest.raises(ValueError, match=r"compute_dtype='bfloat' is not supported; supported: .*'bfloat16'"):
        hf_w4.GPTQConfig(compute_dtype="bfloat")
    assert hf_w4.GPTQConfig(compute_dtype="torch.bfloat16").compute_dtype is torch.bfloat16


# ---------------------------------------------------------------------------------------------- A4: global scales


def _nvfp4(layout, global_scale):
    spec = W4Spec("x", layout, "nvfp4", 4, 16, True)
    t = layouts.pack(spec, torch.full((1, 16), 7), torch.full((1, 1), 448.0).to(torch.float8_e4m3fn),
                     global_scale=global_scale)
    return spec, t


@pytest.mark.parametrize("layout,tensor,value,match", [
    ("ct_nvfp4", "weight_global_scale", -7488.0, "found -7488.0, expected a positive divisor"),
    ("ct_nvfp4", "weight_global_scale", 0.0, "found 0.0, expected a positive divisor"),
    ("modelopt_nvfp4", "weight_scale_2", -0.5, "found -0.5, expected a multiplier >= 0"),
    ("modelopt_nvfp4", "weight_scale_2", float("inf"), "non-finite")])
def test_degenerate_global_scales_rejected(layout, tensor, value, match):
    spec, t = _nvfp4(layout, value)
    with pytest.raises(LayoutError, match=rf"layer\.{tensor}: .*{match}"):
        layouts.to_qweight(spec, t, 1, 16, "layer")


def test_modelopt_zero_weight_scale_2_is_an_all_zero_layer():
    spec, t = _nvfp4("modelopt_nvfp4", 0.0)
    assert torch.equal(layouts.dequantize(layouts.to_qweight(spec, t, 1, 16, "layer")), torch.zeros(1, 16))
