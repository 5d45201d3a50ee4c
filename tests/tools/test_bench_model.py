"""The whole-model decode benchmark runs end to end on a small Llama and reports, per model, the tokens/s, how
each token's time splits between linear layers and the rest, and the rate the linear layers read their weights at."""
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
        m = re.search(r"linear layers ([\d.]+) ms/token \(([\d.]+) GB/s of their weights\), the rest (-?[\d.]+) "
                      r"ms/token", line)
        assert m, line
        assert float(m.group(1)) > 0 and float(m.group(2)) > 0
    for line in lines[1:]:
        m = re.search(r"([\d.]+)x dense bf16, rounds ([\d.]+)-([\d.]+)x;", line)
        assert m, line
        assert float(m.group(2)) <= float(m.group(3))


def test_linear_bytes_counts_what_a_token_reads():
    from transformers import LlamaConfig, LlamaForCausalLM
    from hf_w4.tools.bench.model import _linear_bytes
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=96)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    # q, k, v, o 64 x 64; gate, up 128 x 64; down 64 x 128; the LM head 96 x 64; no biases; 2 bytes each
    assert _linear_bytes(model) == 2 * (4 * 64 * 64 + 3 * 128 * 64 + 96 * 64)
