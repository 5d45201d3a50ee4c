"""``hf-w4`` behaves like its peers (lm-eval-harness, llama.cpp's tools, optimum-cli): instant --help, --version,
defaults shown, a non-empty output replaced only with --overwrite, format names case-insensitive with "did you
mean", group sizes checked and fitted to the model, -q / -v through transformers' switches, hub ids."""
import json
import subprocess
import sys

import pytest

import hf_w4
from conftest import subprocess_env
from hf_w4.tools import cli


def _run(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "hf_w4.tools.cli", *args], capture_output=True, text=True,
                          env={**subprocess_env(), **(env or {})}, timeout=timeout)


def test_help_is_instant_and_imports_neither_torch_nor_transformers():
    code = ("import sys, time\nt = time.perf_counter()\nfrom hf_w4.tools import cli\np = cli.build_parser()\n"
            "p.format_help()\nfor a in p._subparsers._group_actions[0].choices.values(): a.format_help()\n"
            "print(time.perf_counter() - t, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                         timeout=60)
    assert out.returncode == 0, out.stderr
    seconds, loaded = out.stdout.split(maxsplit=1)
    assert loaded.strip() == "[]"
    assert float(seconds) < 0.5, seconds     # ~0.03 s on an idle machine; torch alone takes ~1.5 s


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hf-w4 {hf_w4.__version__}"
    p = cli.build_parser()
    helps = {name: " ".join(sp.format_help().split())
             for name, sp in p._subparsers._group_actions[0].choices.items()}
    assert "--max-tokens MAX_TOKENS text tokens to score, 0 = the whole text (default: 4096)" in helps["eval"]
    assert "--window WINDOW tokens per window" in helps["eval"] and "(default: 512)" in helps["eval"]
    assert "--dtype {bf16,bfloat16,fp16,float16,fp32,float32} activation dtype (default: bf16)" in helps["info"]
    assert "--max-tokens" in helps["demo"] and "--ppl-tokens" not in helps["demo"]      # one name, as eval
    for name in ("info", "eval", "convert", "demo"):
        assert "-q, --quiet" in helps[name] and "--no-progress" in helps[name], name


def test_bench_help_names_the_command():
    out = _run("bench", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: hf-w4 bench"), out.stdout[:200]
    assert "--whole-model " in out.stdout and "--decode-tokens" in out.stdout and "(default: 128)" in out.stdout


def test_format_names_case_insensitive_with_suggestions(tiny, tmp_path, capsys):
    assert cli.main(["convert", str(tiny), str(tmp_path / "a"), "--format", "GPTQ", "--group-size", "32",
                     "-q"]) == 0
    assert json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    capsys.readouterr()
    assert cli.main(["convert", str(tiny), str(tmp_path / "b"), "--format", "gtpq"]) == 2
    err = capsys.readouterr().err
    assert "unknown format 'gtpq'; did you mean 'gptq'?" in err and "supported: gptq, autoround" in err, err
    assert cli.main(["demo", "--model", str(tiny), "--formats", "AWQ,ct-w4a61"]) == 2
    assert "did you mean 'ct-w4a16'" in capsys.readouterr().err


def test_overwrite(tiny, tmp_path, capsys):
    out = tmp_path / "q"
    assert cli.main(["convert", str(tiny), str(out), "--format", "gptq", "--group-size", "32"]) == 0
    capsys.readouterr()
    assert cli.main(["convert", str(tiny), str(out), "--format", "awq", "--group-size", "32"]) == 2
    err = capsys.readouterr().err
    assert "exists and is not empty (a gptq checkpoint): chat_template.jinja, config.json" in err, err
    assert "pass --overwrite to replace it" in err
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    assert cli.main(["convert", str(tiny), str(out), "--format", "awq", "--group-size", "32", "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    (tmp_path / "empty").mkdir()                              # an empty directory needs no --overwrite
    assert cli.main(["convert", str(tiny), str(tmp_path / "empty"), "--format", "gptq", "--group-size", "32"]) == 0


def test_group_size_is_checked_and_fitted(tiny, tmp_path, capsys):
    for argv, expect in ((["--format", "gptq", "--group-size", "0"], "positive group size or -1"),
                         (["--format", "ct-nvfp4", "--group-size", "32"], "format ct-nvfp4 has group size 16 only"),
                         (["--format", "modelopt-w4a16", "--group-size", "128"], "group size 16 only"),
                         (["--format", "ct-w8a8", "--group-size", "64"], "has group size per channel (-1) only")):
        try:
            rc = cli.main(["convert", str(tiny), str(tmp_path / "x"), *argv])
        except SystemExit as e:                               # argparse's own refusal
            rc = e.code
        assert rc == 2 and expect in capsys.readouterr().err, argv
    assert not (tmp_path / "x").exists()
    # no --group-size: 128 does not divide the tiny model's K = 64, so 64, with a notice; NVFP4 takes 16 silently
    assert cli.main(["convert", str(tiny), str(tmp_path / "g"), "--format", "gptq"]) == 0
    out, err = capsys.readouterr()
    assert "notice: group size 128 does not divide" in err and "input size 64; using 64" in err, err
    assert "group size 64" in out
    assert json.loads((tmp_path / "g" / "config.json").read_text())["quantization_config"]["group_size"] == 64
    assert cli.main(["convert", str(tiny), str(tmp_path / "n"), "--format", "ct-nvfp4"]) == 0
    assert "notice" not in capsys.readouterr().err


def test_quiet_and_verbose_set_transformers_switches(tiny, tmp_path):
    from transformers.utils import logging as tlog
    level, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    try:
        assert cli.main(["convert", str(tiny), str(tmp_path / "a"), "--format", "gptq", "--group-size", "32",
                         "-q"]) == 0
        assert tlog.get_verbosity() == tlog.ERROR and not tlog.is_progress_bar_enabled()
        assert cli.main(["convert", str(tiny), str(tmp_path / "b"), "--format", "gptq", "--group-size", "32",
                         "-v"]) == 0
        assert tlog.get_verbosity() == tlog.INFO and tlog.is_progress_bar_enabled()
    finally:
        tlog.set_verbosity(level)
        (tlog.enable_progress_bar if bars else tlog.disable_progress_bar)()


def test_no_forced_verbosity_and_progress_shown(tiny, tmp_path):
    """Without -q the CLI leaves transformers' switches alone: convert and model loading show progress bars,
    TRANSFORMERS_VERBOSITY=info reaches hf_w4's messages; -q hides both."""
    out = _run("info", str(tiny), env={"TRANSFORMERS_VERBOSITY": "info"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Loading weights" in out.stderr
    q = tmp_path / "q"
    out = _run("convert", str(tiny), str(q), "--format", "gptq", "--group-size", "32", timeout=300)
    assert out.returncode == 0 and "quantizing" in out.stderr, out.stderr[-2000:]
    out = _run("info", str(q), env={"TRANSFORMERS_VERBOSITY": "info"}, timeout=300)
    assert "hf_w4: installed for" in out.stderr, out.stderr[-2000:]
    out = _run("info", str(q), "-q", env={"TRANSFORMERS_VERBOSITY": "info"}, timeout=300)
    assert out.returncode == 0 and "hf_w4: installed for" not in out.stderr and "Loading weights" not in out.stderr


def test_hub_id_offline_message():
    out = _run("info", "someone/not-cached-model", env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2
    assert ("someone/not-cached-model: no such local directory, and not in the Hugging Face cache" in out.stderr
            and "HF_HUB_OFFLINE=1 is set" in out.stderr), out.stderr
