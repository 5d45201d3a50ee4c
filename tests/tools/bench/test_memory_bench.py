"""The load-memory benchmark's machinery on a small checkpoint (its figures are in docs/performance.md): ``write``
stacks and shards a checkpoint that loads, and the measurement, in a fresh process, sees every file unmapped and
the peak within the target."""
import json
import sys

import pytest
from safetensors import safe_open

from hf_w4.tools.bench import memory

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status and /proc/self/maps")


def test_write_then_measure(tmp_path):
    out = memory.write(tmp_path / "ck", formats=("gptq",), layers=3, base_layers=1, intermediate=256,
                       shard_gb=0.02, log=lambda *_: None)
    d = out["gptq"]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert json.loads((d / "config.json").read_text())["num_hidden_layers"] == 3
    with safe_open(str(d / index["weight_map"]["model.layers.2.mlp.up_proj.qweight"]), "pt") as f:
        assert "model.layers.2.mlp.up_proj.qweight" in f.keys()
    r = memory.measure(str(d), threads=1)
    assert r["files"] == len(files) and r["still_mapped"] == []
    assert r["peak_rss_bytes"] <= memory.target_bytes(r)
    row = memory.table([r]).splitlines()[-1]
    assert row.startswith("| gptq | ") and " ok |" in row and row.endswith("| none |")
