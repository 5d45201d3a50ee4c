"""Bad input gets a clear error naming module, tensor, what was found and what is supported — never garbage."""
import os

import pytest
import torch

import hf_w4
from conftest import edited_copy as copy
from conftest import load_fp32 as load
from hf_w4.layouts import LayoutError
from hf_w4.loading.checkpoint import CheckpointError
from hf_w4.tools import writers

Q = "model.layers.0.self_attn.q_proj"


pytestmark = pytest.mark.usefixtures("hf_w4_installed")


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama):
    out = {}
    for fmt in ("gptq", "ct-w4a16", "modelopt-w4a16"):
        out[fmt] = writers.write_checkpoint(tiny_llama, str(tmp_path_factory.mktemp(fmt) / "c"), fmt).path
    return out


def test_missing_tensor(base, tmp_path):
    p = copy(base["gptq"], tmp_path, tensors=lambda sd: sd.pop(f"{Q}.scales"))
    with pytest.raises(CheckpointError, match=rf"{Q}\.scales: missing from the checkpoint; gptq .* expects shape \[2, 256\] dtype float16"):
        load(p)


def test_missing_g_idx_with_desc_act(base, tmp_path):
    def cfg(q):
        q["desc_act"] = True
    p = copy(base["gptq"], tmp_path, tensors=lambda sd: sd.pop(f"{Q}.g_idx"), config=cfg)
    with pytest.raises(CheckpointError, match=rf"{Q}\.g_idx: missing .* desc_act: true"):
        load(p)


def test_unexpected_tensor(base, tmp_path):
    def add(sd):
        sd[f"{Q}.weight_global_scale"] = torch.ones(1)
    with pytest.raises(CheckpointError, match=rf"{Q}: unexpected tensor\(s\) \['weight_global_scale'\]"):
        load(copy(base["ct-w4a16"], tmp_path, tensors=add))


def test_wrong_shape(base, tmp_path):
    def bad(sd):
        sd[f"{Q}.qweight"] = sd[f"{Q}.qweight"][:16].contiguous()
    with pytest.raises(CheckpointError, match=rf"{Q}\.qweight: shape \[16, 256\] does not match .* expected \[32, 256\]"):
        load(copy(base["gptq"], tmp_path, tensors=bad))


def test_wrong_dtype(base, tmp_path):
    def bad(sd):
        sd[f"{Q}.weight_scale"] = sd[f"{Q}.weight_scale"].float()
    with pytest.raises(CheckpointError, match=rf"{Q}\.weight_scale: dtype F32 is not supported .* \['float8_e4m3fn'\]"):
        load(copy(base["modelopt-w4a16"], tmp_path, tensors=bad))


def test_nan_scale(base, tmp_path):
    def bad(sd):
        s = sd[f"{Q}.weight_scale"].clone()
        s[5, 0] = float("inf")
        sd[f"{Q}.weight_scale"] = s
    with pytest.raises(LayoutError, match=rf"{Q}\.weight_scale: 1 non-finite value\(s\) \(first at index \(5, 0\): inf\)"):
        load(copy(base["ct-w4a16"], tmp_path, tensors=bad))


def test_truncated_file(base, tmp_path):
    p = copy(base["gptq"], tmp_path)
    f = os.path.join(p, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        load(p)


def test_config_contradicts_tensors(base, tmp_path):
    def cfg(q):
        q["group_size"] = 64          # files hold group-128 scales
    with pytest.raises(CheckpointError, match=rf"{Q}\.qzeros: shape \[2, 32\] does not match .* expected \[4, 32\]"):
        load(copy(base["gptq"], tmp_path, config=cfg))


def test_config_says_dense_but_tensors_are_quantized(base, tmp_path):
    def cfg(q):
        q["ignore"] = ["lm_head", "re:.*layers.0.self_attn.q_proj"]
    with pytest.raises(CheckpointError, match=rf"{Q}: the config leaves this module dense, but the checkpoint holds quantized"):
        load(copy(base["ct-w4a16"], tmp_path, config=cfg))


def test_group_not_dividing_k(base, tmp_path):
    def cfg(q):
        q["group_size"] = 96
    with pytest.raises(LayoutError, match=r"K=256 is not divisible by group_size=96"):
        load(copy(base["gptq"], tmp_path, config=cfg))


@pytest.mark.parametrize("key,value,msg", [("bits", 3, r"bits=3 is not supported; supported bits: \[4\]"),
                                           ("checkpoint_format", "marlin", "checkpoint_format 'marlin' is not supported")])
def test_unsupported_config(base, tmp_path, key, value, msg):
    def cfg(q):
        q[key] = value
    with pytest.raises(NotImplementedError, match=msg):
        load(copy(base["gptq"], tmp_path, config=cfg))


def test_uninitialised_memory_never_reaches_forward(base, tmp_path, monkeypatch):
    # without the header check (e.g. a loader path that gives no checkpoint files), the post-load guard still
    # refuses the tensor transformers filled with torch.empty_like
    from hf_w4.loading import checkpoint
    p = copy(base["gptq"], tmp_path, tensors=lambda sd: sd.pop(f"{Q}.qzeros"))
    monkeypatch.setattr(checkpoint, "read_headers", lambda files: None)
    with pytest.raises(LayoutError, match=rf"{Q}\.qzeros: missing from the checkpoint .* uninitialised memory"):
        load(p)


def test_forced_kernel_that_cannot_run(base):
    with pytest.raises(ValueError, match="kernel 'nope'"):
        load(base["gptq"], quantization_config=hf_w4.GPTQConfig(kernel="nope"))


def test_bad_loading_attribute():
    with pytest.raises(ValueError, match="activation='int4' is not supported"):
        hf_w4.AwqConfig(activation="int4")
    with pytest.raises(TypeError, match="unknown argument"):
        hf_w4.AwqConfig(backend_x=1)

