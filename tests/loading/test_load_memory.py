"""After ``from_pretrained`` no checkpoint file stays memory-mapped: every tensor transformers left as a view of a
file's map got memory of its own (read with pread), so the process holds the model once, not the model plus the
file's pages. The copies are the stored bytes, and a sharded checkpoint is unmapped file by file."""
import json
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_w4.loading import memory
from hf_w4.nn import QuantLinear
from hf_w4.tools import writers

pytestmark = [pytest.mark.usefixtures("hf_w4_installed"),
              pytest.mark.skipif(sys.platform != "linux", reason="finds the maps in /proc/self/maps")]


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("fmt", ["gptq", "ct-w4a16", "modelopt-nvfp4", "ct-w8a8"])
def test_no_checkpoint_file_stays_mapped(tiny_llama, tmp_path, fmt):
    res = writers.write_checkpoint(tiny_llama, str(tmp_path / "ckpt"), fmt)
    src = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    # sharded as producers ship big models, so several files are mapped while loading
    src.save_pretrained(tmp_path / "sharded", max_shard_size="300KB")
    files = sorted(str(p) for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 2
    # bf16 as on disk: nothing is cast on the way in, so without the copies every tensor would be a view of a map
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sharded", dtype=torch.bfloat16)
    assert memory.mapped(files) == []
    disk = {}
    for f in files:
        disk.update(load_file(f))
    sd = model.state_dict()
    assert set(sd) == set(disk)
    bad = [k for k in disk if not _same(sd[k], disk[k])]
    assert not bad, f"copied out differently: {bad[:5]}"
    assert all(m.kernel is not None for m in model.modules() if isinstance(m, QuantLinear))


def test_tied_parameters_stay_tied(tiny_llama_tied, tmp_path):
    """Copying a view out keeps the Parameter object, so tied embeddings stay one tensor."""
    res = writers.write_checkpoint(tiny_llama_tied, str(tmp_path / "ckpt"), "gptq")
    assert json.load(open(f"{res.path}/config.json"))["tie_word_embeddings"]
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    assert memory.mapped([f"{res.path}/model.safetensors"]) == []
    assert model.lm_head.weight is model.model.embed_tokens.weight
