"""Sharded writing: ``write_checkpoint(..., max_shard_size=...)`` and ``hf-w4 convert --max-shard-size`` write
``model-0000i-of-0000n.safetensors`` files and their index, quantizing one shard at a time, atomically; the sharded
checkpoint loads to the unsharded one's logits."""
import inspect
import json
import os

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

from hf_w4.tools import cli, writers
from hf_w4.tools.writers import write as write_mod
from conftest import make_tiny_llama

SHARD = 200_000   # bytes: the tiny Llama's ~1.2 MB of gptq weights in about 7 files (the 256 KB embedding alone)


def _logits(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.arange(16).reshape(2, 8) * 7 % 500).logits


@pytest.mark.parametrize("fmt, opts", [("gptq", dict(group_size=32, desc_act=True)),
                                       ("ct-nvfp4", dict(quantize_lm_head=True)),
                                       ("modelopt-nvfp4", {})])
def test_sharded_checkpoint_loads_to_the_unsharded_logits(hf_w4_installed, tmp_path, fmt, opts):
    model = make_tiny_llama(attention_bias=True)
    one = writers.write_checkpoint(model, tmp_path / "one", fmt, **opts)
    many = writers.write_checkpoint(model, tmp_path / "many", fmt, max_shard_size=SHARD, **opts)
    side = {n for n in os.listdir(tmp_path / "many") if not n.startswith("model-")} - {"model.safetensors.index.json"}
    assert set(os.listdir(tmp_path / "one")) == side | {"model.safetensors"}
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                           for i in range(1, len(shards) + 1)]
    # every tensor once, in the file the index names, identical to the single file's
    single = safetensors.torch.load_file(tmp_path / "one" / "model.safetensors")
    assert sorted(index["weight_map"]) == sorted(single)
    total = 0
    for name in shards:
        path = tmp_path / "many" / name
        assert path.stat().st_size <= SHARD + 4096 or len(index_of(index, name)) == 1   # a bigger tensor: alone
        with safe_open(path, "pt") as fh:
            assert sorted(fh.keys()) == sorted(index_of(index, name))
            for k in fh.keys():
                v = fh.get_tensor(k)
                bits = (v.reshape(-1).view(torch.uint8), single[k].reshape(-1).view(torch.uint8))
                assert v.dtype == single[k].dtype and torch.equal(*bits), k
                total += v.numel() * v.element_size()
    assert index["metadata"]["total_size"] == total
    assert many.quantized == one.quantized and set(many.dense_weights) == set(one.dense_weights)
    assert torch.equal(_logits(tmp_path / "many"), _logits(tmp_path / "one"))


def index_of(index, name):
    return [k for k, v in index["weight_map"].items() if v == name]


def test_each_shard_is_written_before_the_next_ones_layers_are_quantized(tmp_path, monkeypatch):
    """Layer by layer into the current shard: when a file is saved, exactly the layers with a tensor in it or in an
    earlier file have been quantized (the rest of a layer split over two files waits for the next one)."""
    quantized, saved = [], []
    real_rtn, real_save = write_mod.quantize_rtn, safetensors.torch.save_file
    monkeypatch.setattr(write_mod, "quantize_rtn", lambda w, *a, name, **k:
                        quantized.append(name.split(": ")[1]) or real_rtn(w, *a, name=name, **k))
    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda t, path, **k: saved.append((os.path.basename(path), list(quantized))) or
                        real_save(t, path, **k))
    writers.write_checkpoint(make_tiny_llama(), tmp_path / "q", "gptq", group_size=32, max_shard_size=SHARD,
                             keep_dense_twin=False)
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["weight_map"]
    owner = {k: k.rsplit(".", 1)[0] for k in index if k.rsplit(".", 1)[1] in ("qweight", "qzeros", "scales", "g_idx")}
    assert len(saved) == len(set(index.values())) >= 4
    written = set()
    for name, done in saved:
        written |= {owner[k] for k, v in index.items() if v == name and k in owner}
        assert set(done) == written, (name, sorted(set(done) ^ written))
    assert len(quantized) == len(set(quantized)) == 14          # each layer quantized once


def test_a_failure_mid_write_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "q"
    writers.write_checkpoint(make_tiny_llama(), out, "gptq", group_size=32)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    real_save, calls = safetensors.torch.save_file, []

    def fail_third(t, path, **k):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", path)
        return real_save(t, path, **k)
    monkeypatch.setattr(safetensors.torch, "save_file", fail_third)
    with pytest.raises(OSError, match="No space left"):
        writers.write_checkpoint(make_tiny_llama(seed=3), out, "gptq", group_size=32, max_shard_size=SHARD)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["q"]                 # no temp directory left behind


def test_without_the_dense_twin_the_result_says_so(tmp_path):
    res = writers.write_checkpoint(make_tiny_llama(), tmp_path / "q", "awq", group_size=32, keep_dense_twin=False)
    assert len(res.quantized) == 14 and not res._rtn and not res._other
    with pytest.raises(writers.WriterError, match="keep_dense_twin=False"):
        res.dense_weights


@pytest.mark.parametrize("size, bytes_", [("1MB", 10 ** 6), ("100KB", 100_000), (123456, 123456), ("123456", 123456)])
def test_shard_sizes(size, bytes_):
    assert write_mod.shard_size(size) == bytes_


@pytest.mark.parametrize("size", ["5XB", "", 0, -1, "many"])
def test_bad_shard_sizes_are_refused_before_anything_is_written(tmp_path, size):
    with pytest.raises(writers.WriterError, match=r"max_shard_size=.*expected"):
        writers.write_checkpoint(make_tiny_llama(), tmp_path / "q", "gptq", max_shard_size=size)
    assert not (tmp_path / "q").exists()


def test_default_is_transformers_save_pretrained_default():
    assert writers.MAX_SHARD_SIZE == inspect.signature(PreTrainedModel.save_pretrained).parameters[
        "max_shard_size"].default


def test_cli_max_shard_size(hf_w4_installed, tmp_path, capsys):
    src = tmp_path / "dense"
    make_tiny_llama().save_pretrained(src)
    assert cli.main(["convert", str(src), str(tmp_path / "q"), "--format", "ct-w4a16", "--group-size", "32",
                     "--max-shard-size", "300KB"]) == 0
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert torch.isfinite(_logits(tmp_path / "q")).all()
    assert cli.main(["convert", str(src), str(tmp_path / "r"), "--format", "gptq", "--max-shard-size", "5XB"]) == 2
    assert "max_shard_size='5XB'" in capsys.readouterr().err and not (tmp_path / "r").exists()
