"""install()/uninstall()/enabled() and the hf_w4 config classes."""
import pytest
import transformers
from transformers.quantizers import auto as qauto

import hf_w4
from hf_w4.loading import CONFIGS, QUANTIZERS


def test_install_uninstall_restores_transformers():
    hf_w4.uninstall()
    before_q, before_c = dict(qauto.AUTO_QUANTIZER_MAPPING), dict(qauto.AUTO_QUANTIZATION_CONFIG_MAPPING)
    before_types, before_ar = qauto.LOADING_ATTRIBUTES_CONFIG_TYPES, qauto.AutoRoundConfig
    from transformers import PreTrainedModel, modeling_utils
    before_resize, before_ghq = PreTrainedModel.resize_token_embeddings, modeling_utils.get_hf_quantizer
    hf_w4.install()
    assert PreTrainedModel.resize_token_embeddings is not before_resize
    for m in CONFIGS:
        assert qauto.AUTO_QUANTIZER_MAPPING[m] is QUANTIZERS[m]
        assert qauto.AUTO_QUANTIZATION_CONFIG_MAPPING[m] is CONFIGS[m]
    assert hf_w4.ModelOptConfig in qauto.LOADING_ATTRIBUTES_CONFIG_TYPES
    hf_w4.uninstall()
    assert qauto.AUTO_QUANTIZER_MAPPING == before_q and qauto.AUTO_QUANTIZATION_CONFIG_MAPPING == before_c
    assert qauto.LOADING_ATTRIBUTES_CONFIG_TYPES is before_types and qauto.AutoRoundConfig is before_ar
    assert "modelopt" not in qauto.AUTO_QUANTIZER_MAPPING
    assert PreTrainedModel.resize_token_embeddings is before_resize and modeling_utils.get_hf_quantizer is before_ghq


def test_enabled_context_manager():
    hf_w4.uninstall()
    with hf_w4.enabled(["awq"]):
        assert qauto.AUTO_QUANTIZER_MAPPING["awq"] is QUANTIZERS["awq"]
        assert qauto.AUTO_QUANTIZER_MAPPING["gptq"] is not QUANTIZERS["gptq"]
    assert qauto.AUTO_QUANTIZER_MAPPING["awq"] is not QUANTIZERS["awq"]
    hf_w4.install(["gptq"])
    with hf_w4.enabled():
        pass
    assert hf_w4.installed() == ("gptq",)
    hf_w4.uninstall()


def test_constructing_a_config_changes_nothing_global():
    hf_w4.uninstall()
    before = dict(qauto.AUTO_QUANTIZER_MAPPING)
    c = hf_w4.AwqConfig(kernel="torch_reference")
    assert qauto.AUTO_QUANTIZER_MAPPING == before and hf_w4.installed() == ()
    with pytest.raises(RuntimeError, match=r"takeover of 'awq' is not installed.*call hf_w4.install\(\)"):
        c.get_loading_attributes()         # what from_pretrained calls with a passed config
    with hf_w4.enabled(["awq"]):
        assert c.get_loading_attributes()["kernel"] == "torch_reference"


def test_config_classes_keep_names_and_strip_loading_attributes():
    hf_w4.install(["awq"])
    c = hf_w4.AwqConfig(kernel="torch_reference", activation="int8")
    assert type(c).__name__ == "AwqConfig" and isinstance(c, transformers.AwqConfig)
    assert c.get_loading_attributes()["activation"] == "int8"
    raw = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128, "zero_point": True}
    parsed = CONFIGS["awq"].from_dict(raw)
    for k, v in c.get_loading_attributes().items():      # what transformers' merge does
        setattr(parsed, k, v)
    assert parsed.to_dict() == raw                       # config.json gets the producer's dict back
    assert parsed.kernel == "torch_reference"
    assert isinstance(hf_w4.CompressedTensorsConfig(), transformers.CompressedTensorsConfig)
    hf_w4.uninstall()
