"""Data-parallel evaluation under ``accelerate launch`` on CPU (2 gloo ranks) gives the 1-process result.

The command under test is the documented one:

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no -m hf_w4.tools.cli eval PATH ...

(``--cpu`` would start only one process; ``--multi_gpu`` on a CPU-only host gives MULTI_CPU/gloo.)
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_w4.tools import models, writers

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("OMP_NUM_THREADS", None)          # let accelerate give each rank its share of the cores
    # one fixed large-M path for bf16 prefill: with 2 threads in one process and 1 per rank a GEMM library may
    # split its sums differently (perplexity 513.35218 vs 513.35210 on an AVX2 EPYC, where the rule ends in a GEMM);
    # the fp32 path makes "the same numbers, bit for bit" a claim
    env["HF_W4_LARGE_PATH"] = "fp32"
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _eval_args(path, out, ref):
    return ["eval", str(path), "--max-tokens", "1400", "--window", "100", "--reference", str(ref),
            "--decode-tokens", "4", "--json", str(out), "--no-progress"]


def _run(cmd):
    p = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-4000:]}"
    return p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model under test, dense reference): a GPTQ checkpoint written from a tiny random Llama, so every
    rank loads it through hf_w4's quantizer and kernels (each process must enable hf_w4 itself), and the
    dense Llama it came from."""
    d = tmp_path_factory.mktemp("acc")
    dense = models.build_tiny(d / "dense", seed=0)
    writers.write_checkpoint(str(dense), str(d / "gptq"), "gptq", group_size=32)
    return d / "gptq", dense


def test_accelerate_two_ranks_equal_one_process(tiny, tmp_path):
    model, ref = tiny
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    _run([sys.executable, "-m", "hf_w4.tools.cli"] + _eval_args(model, one, ref))
    p = _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(_free_port()), "-m", "hf_w4.tools.cli"] + _eval_args(model, two, ref))
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert a["world"] == 1 and b["world"] == 2
    assert len(b["peak_rss_bytes_per_rank"]) == 2 and all(x > 0 for x in b["peak_rss_bytes_per_rank"])
    assert p.stdout.count("\nperplexity ") == 1                # only rank 0 prints
    # 14 windows of 100 tokens, split 7/7 between the ranks: same numbers, bit for bit
    assert a["windows"] == b["windows"] == 14 and a["tokens"] == b["tokens"] == 14 * 99
    for k in ("perplexity", "nll", "top1_agreement", "reference_perplexity", "answer", "bos"):
        assert a[k] == b[k], (k, a[k], b[k])
    assert 0 <= a["top1_agreement"] < 1                       # two different random models
