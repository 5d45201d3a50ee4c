"""device_map offload next to a GPU: layers mapped to "cpu" and "disk" are offloaded by accelerate (its hooks bring
them to the GPU for each forward), and an offloaded QuantLinear brings its packed tensors to the GPU, repacks them for
the GPU kernel and lets both go, giving the logits of the model loaded whole on the GPU."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): GPU tests need one", allow_module_level=True)

from transformers import AutoModelForCausalLM  # noqa: E402

from hf_w4.nn import QuantLinear  # noqa: E402
from hf_w4.tools import writers  # noqa: E402

pytestmark = pytest.mark.usefixtures("hf_w4_installed")
MAP = {"model.embed_tokens": 0, "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": 0,
       "model.rotary_emb": 0, "lm_head": 0}


@pytest.mark.parametrize("fmt", ["gptq", "ct-nvfp4"])
def test_cpu_and_disk_offload_next_to_a_gpu(tiny_llama, tmp_path, fmt):
    res = writers.write_checkpoint(tiny_llama, str(tmp_path / "c"), fmt)
    x = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(5)).cuda()
    whole = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float16, device_map="cuda")
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float16, device_map=MAP,
                                                 offload_folder=str(tmp_path / "off"))
    off = [m for m in model.modules() if isinstance(m, QuantLinear) and m._offload_source is not None]
    assert {m.name.split(".")[2] for m in off} == {"0", "1"}, "layers 0 (cpu) and 1 (disk) are offloaded"
    assert all(all(b is None or b.is_meta for b in m._buffers.values()) for m in off)
    with torch.no_grad():
        want, got = whole(x).logits, model(x).logits
    assert got.device.type == "cuda" and torch.equal(got, want)
    kernels = {m.name: str(m.kernel) for m in whole.modules() if isinstance(m, QuantLinear)}
    assert {m.name: str(m.kernel) for m in model.modules() if isinstance(m, QuantLinear)} == kernels
