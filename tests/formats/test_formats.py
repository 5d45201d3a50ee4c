"""Config dicts (as the producers write them, formats.md §1-§7) -> per-module specs."""
import pytest

from hf_w4 import formats

L0 = "model.layers.0.self_attn.q_proj"


def ct(groups, ignore=("lm_head",), fmt=None, **kw):
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": groups, "ignore": list(ignore), **kw}


def w(bits=4, strategy="group", group_size=128, symmetric=True, typ="int"):
    return {"num_bits": bits, "type": typ, "strategy": strategy, "group_size": group_size, "symmetric": symmetric}


def test_gptq_v1_default_and_v2():
    s = formats.parse({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}).spec_for(L0)
    assert (s.layout, s.zero_plus_one, s.group_size, s.sym) == ("gptq", True, 128, True)
    s2 = formats.parse({"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False,
                        "checkpoint_format": "gptq_v2"}).spec_for(L0)
    assert (s2.zero_plus_one, s2.group_size, s2.sym) == (False, 64, False)


def test_gptq_lm_head_flag_and_errors():
    f = formats.parse({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True})
    assert f.spec_for("lm_head") is not None
    assert formats.parse({"quant_method": "gptq", "bits": 4}).spec_for("lm_head") is None
    with pytest.raises(NotImplementedError, match=r"bits=3 is not supported; supported bits: \[4\]"):
        formats.parse({"quant_method": "gptq", "bits": 3})
    d = formats.parse({"quant_method": "gptq", "bits": 4, "group_size": 128,
                       "dynamic": {"-:.*layers\\.0\\.mlp.*": {}, "+:.*layers\\.1\\.mlp.*": {"group_size": 32}}})
    assert d.spec_for("model.layers.0.mlp.up_proj") is None
    assert d.spec_for("model.layers.1.mlp.up_proj").group_size == 32
    assert d.spec_for(L0).group_size == 128
    with pytest.raises(NotImplementedError, match="checkpoint_format 'marlin'"):
        formats.parse({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"})


@pytest.mark.parametrize("packing,layout,v1", [("auto_round:auto_gptq", "gptq", True), ("auto_round:auto_awq", "awq", False),
                                               ("auto_round", "gptq", False), ("auto_round:gptqmodel", "gptq", False)])
def test_autoround_packing_formats(packing, layout, v1):
    s = formats.parse({"quant_method": "auto-round", "packing_format": packing, "bits": 4, "group_size": 128,
                       "sym": True, "data_type": "int", "block_name_to_quantize": "model.layers"}).spec_for(L0)
    assert (s.method, s.layout, s.zero_plus_one) == ("auto-round", layout, v1)


def test_autoround_extra_config_blocks_and_lm_head():
    f = formats.parse({"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4,
                       "group_size": 128, "sym": True, "data_type": "int", "block_name_to_quantize": "model.layers",
                       "extra_config": {"model.layers.0.mlp.down_proj": {"bits": 16},
                                        "model.layers.1.mlp.up_proj": {"group_size": 32, "sym": False},
                                        "lm_head": {"bits": 4, "group_size": 64}}})
    assert f.spec_for("model.layers.0.mlp.down_proj") is None
    assert f.spec_for("model.layers.1.mlp.up_proj").group_size == 32
    assert not f.spec_for("model.layers.1.mlp.up_proj").sym
    assert f.spec_for("model.layers.1.mlp.down_proj").group_size == 128
    assert f.spec_for("lm_head").group_size == 64
    assert f.spec_for("model.vision.proj") is None        # outside block_name_to_quantize


def test_autoround_unsupported():
    with pytest.raises(NotImplementedError, match="packing_format 'auto_round:llm_compressor'"):
        formats.parse({"quant_method": "auto-round", "packing_format": "auto_round:llm_compressor", "bits": 4})
    with pytest.raises(NotImplementedError, match="data_type 'nv_fp'"):
        formats.parse({"quant_method": "auto-round", "bits": 4, "data_type": "nv_fp"})
    with pytest.raises(NotImplementedError, match=r"bits=2 is not supported; supported bits: \[4\]"):
        formats.parse({"quant_method": "auto-round", "bits": 2})


def test_awq_gemm_zero_point_and_versions():
    f = formats.parse({"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128, "zero_point": False,
                       "modules_to_not_convert": ["lm_head", "visual"]})
    assert f.spec_for(L0).sym is True and f.spec_for(L0).layout == "awq"
    assert f.spec_for("model.visual") is None
    with pytest.raises(NotImplementedError, match=r"awq version 'gemv' is not supported; supported: \['gemm'\]"):
        formats.parse({"quant_method": "awq", "version": "gemv", "bits": 4})


def test_ct_w4a16_group_channel_sym_asym():
    f = formats.parse(ct({"group_0": {"targets": ["Linear"], "weights": w(symmetric=False)}}, fmt="pack-quantized"))
    s = f.spec_for(L0)
    assert (s.layout, s.weight_type, s.group_size, s.sym, s.act) == ("ct_pack", "int4", 128, False, "none")
    assert f.spec_for("lm_head") is None
    c = formats.parse(ct({"group_0": {"targets": ["Linear"], "weights": w(strategy="channel", group_size=None)}},
                         fmt="pack-quantized")).spec_for(L0)
    assert c.group_size == -1


def test_ct_int_quantized_w8a8_and_w4a8():
    act = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    s8 = formats.parse(ct({"group_0": {"targets": ["Linear"], "weights": w(8, "channel", None),
                                       "input_activations": act}}, fmt="int-quantized")).spec_for(L0)
    assert (s8.layout, s8.weight_type, s8.bits, s8.act) == ("ct_int", "int8", 8, "int8_token")
    s4 = formats.parse(ct({"group_0": {"targets": ["Linear"], "weights": w(4, "group", 128),
                                       "input_activations": act}}, fmt="int-quantized")).spec_for(L0)
    assert (s4.weight_type, s4.bits, s4.group_size) == ("int8", 4, 128)
    with pytest.raises(NotImplementedError, match="input_activations"):
        formats.parse(ct({"group_0": {"targets": ["Linear"], "weights": w(8, "channel", None),
                                      "input_activations": {**act, "dynamic": False, "strategy": "tensor"}}},
                         fmt="int-quantized"))


def test_ct_nvfp4_targets_regex_and_ignore():
    g = {"targets": ["re:.*mlp.*"], "format": "nvfp4-pack-quantized",
         "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}}
    f = formats.parse(ct({"group_0": g}, ignore=["lm_head", "re:.*layers.1.*"]))
    assert f.spec_for("model.layers.0.mlp.up_proj").layout == "ct_nvfp4"
    assert f.spec_for("model.layers.1.mlp.up_proj") is None
    assert f.spec_for(L0) is None                       # not targeted


def test_ct_unsupported_formats():
    with pytest.raises(NotImplementedError, match="format 'float-quantized' is not supported"):
        formats.parse(ct({"group_0": {"targets": ["Linear"], "weights": w(8, typ="float")}}, fmt="float-quantized"))
    with pytest.raises(NotImplementedError, match=r"pack-quantized num_bits=8 is not supported; supported: \[4\]"):
        formats.parse(ct({"group_0": {"targets": ["Linear"], "weights": w(8)}}, fmt="pack-quantized"))
    with pytest.raises(NotImplementedError, match="quantization_status 'frozen'"):
        formats.parse({**ct({}), "quantization_status": "frozen"})


@pytest.mark.parametrize("algo,inscale", [("W4A16_NVFP4", False), ("NVFP4", True)])
def test_modelopt_config_json_and_hf_quant_config(algo, inscale):
    f = formats.parse({"quant_method": "modelopt", "quant_algo": algo, "ignore": ["lm_head", "*.mlp.gate"]})
    assert f.spec_for(L0).layout == "modelopt_nvfp4" and f.spec_for(L0).has_input_scale == inscale
    assert f.spec_for("model.layers.3.mlp.gate") is None and f.spec_for("lm_head") is None
    assert formats.parse({"quant_method": "modelopt", "quant_algo": algo, "ignore": []}).spec_for("lm_head")
    f2 = formats.parse({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": algo, "group_size": 16,
                                                                           "exclude_modules": ["lm_head"]}})
    assert f2.spec_for(L0).weight_type == "nvfp4"
    assert f2.spec_for(L0).act == "none"                 # NVFP4 (W4A4) served weight-only


def test_modelopt_and_unknown_methods_unsupported():
    with pytest.raises(NotImplementedError, match=r"quant_algo 'FP8' is not supported; supported: \['NVFP4', 'W4A16_NVFP4'\]"):
        formats.parse({"quant_method": "modelopt", "quant_algo": "FP8"})
    with pytest.raises(NotImplementedError, match="quant_method 'bitsandbytes' is not handled"):
        formats.parse({"quant_method": "bitsandbytes"})
