"""Forgetting hf_w4.install() is a clear error; with it, a checkpoint of packed weights never loads as random dense."""
import json
import re
import shutil
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

import hf_w4
from hf_w4.loading.checkpoint import CheckpointError
from hf_w4.tools import writers

FIX = r"hf_w4 is imported but not installed.*hf_w4\.install\(\).*import hf_w4\.auto"


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_llama):
    out = {}
    for fmt in ("gptq", "awq", "autoround", "ct-w4a16"):
        out[fmt] = writers.write_checkpoint(tiny_llama, str(tmp_path_factory.mktemp(fmt) / "c"), fmt).path
    return out


@pytest.mark.parametrize("fmt,says", [("gptq", "optimum|gptqmodel|GPU is required"), ("awq", "gptqmodel"),
                                      ("autoround", "auto-round"), ("ct-w4a16", "compressed-tensors")])
def test_forgotten_install_names_the_fix(written, fmt, says):
    hf_w4.uninstall()
    with pytest.raises((ImportError, RuntimeError)) as e:
        AutoModelForCausalLM.from_pretrained(written[fmt])
    assert re.search(says, str(e.value)), str(e.value)          # transformers' own words stay
    assert re.search(FIX, str(e.value), flags=re.S), str(e.value)


def test_installed_method_keeps_transformers_message(written):
    """The hint is only for methods hf_w4 is not installed for."""
    hf_w4.uninstall()
    with hf_w4.enabled(["awq"]):
        with pytest.raises((ImportError, RuntimeError)) as e:
            AutoModelForCausalLM.from_pretrained(written["gptq"])
        assert "hf_w4.install()" in str(e.value)
        AutoModelForCausalLM.from_pretrained(written["awq"])                 # installed: loads


def test_import_hf_w4_is_cheap_and_wraps_only_on_transformers_import():
    code = ("import sys, hf_w4\n"
            "print(sorted(m for m in ('torch', 'transformers', 'transformers.modeling_utils') if m in sys.modules))\n"
            "import transformers.modeling_utils as mu\n"
            "print(getattr(mu.get_hf_quantizer, '_hf_w4_install_hint', False))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "True"], out.stdout


def _with_config(src, tmp_path, edit):
    d = tmp_path / "c"
    shutil.copytree(src, d)
    c = json.load(open(d / "config.json"))
    edit(c)
    json.dump(c, open(d / "config.json", "w"))
    return str(d)


@pytest.mark.parametrize("edit,why", [
    (lambda c: c["quantization_config"].update(quant_method="my-quant"),
     r"quant_method 'my-quant' is known neither to transformers nor to hf_w4"),
    (lambda c: c.pop("quantization_config"), "config.json has no quantization_config"),
])
def test_packed_weights_without_a_loader_are_refused(written, tmp_path, hf_w4_installed, edit, why):
    path = _with_config(written["gptq"], tmp_path, edit)
    with pytest.raises(CheckpointError, match=why) as e:
        AutoModelForCausalLM.from_pretrained(path)
    msg = str(e.value)
    assert "packed quantized weights for 14 layer(s)" in msg and "random" in msg
    assert "model.layers.0.mlp.down_proj (g_idx, qweight, qzeros, scales)" in msg


def test_modelopt_needs_its_install(tmp_path, tiny_llama):
    path = writers.write_checkpoint(tiny_llama, str(tmp_path / "m"), "modelopt-w4a16").path
    hf_w4.uninstall()
    with hf_w4.enabled(["gptq"]):
        with pytest.raises(CheckpointError, match=r"'modelopt' is one hf_w4 loads, but hf_w4 is installed only "
                                                  r"for gptq.*hf_w4\.install\(\)"):
            AutoModelForCausalLM.from_pretrained(path)


def test_dense_checkpoint_still_loads(tmp_path, tiny_llama, hf_w4_installed):
    tiny_llama.save_pretrained(tmp_path / "d")
    AutoModelForCausalLM.from_pretrained(tmp_path / "d")
