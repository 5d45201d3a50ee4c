"""The whole-model decode benchmark runs end to end on a small Llama and reports, per model, the tokens/s and how
each token's time splits between linear layers and the rest."""
import re

import torch

from hf_w4.tools.bench.model import bench_model


def test_whole_model_benchmark_reports_rates_and_split():
    lines = []
    torch.set_num_threads(1)
    out = bench_model(layers=1, tokens=3, rounds=1, hidden=256, intermediate=512, log=lines.append)
    assert set(out) == {"bf16", "ours_int4", "ours_nvfp4"} and all(v > 0 for v in out.values())
    assert len(lines) == 3
    for line in lines:
        m = re.search(r"linear layers ([\d.]+) ms/token, the rest (-?[\d.]+) ms/token", line)
        assert m, line
        assert float(m.group(1)) > 0
    assert "x dense bf16" in lines[1] and "x dense bf16" in lines[2]
