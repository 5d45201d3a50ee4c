"""``hf-w4`` usage errors are one line on stderr (exit status 2), found before the long part of a run, on tiny offline
models: mismatched reference / tokenizer, BOS without a BOS token, unwritable --json, a file as model path, a
checkpoint without tokenizer files or a --tokenizer that is none, a directory as --text, a checkpoint without weights or
with a broken config.json, bad bench arguments, out-of-range counts, a bad or absent --device, a closed stdout."""
import json
import os
import subprocess
import sys
import types

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_w4.tools import bench, cli, models  # noqa: E402
from hf_w4.tools import evaluate as E  # noqa: E402

from conftest import subprocess_env as _env  # noqa: E402

FAST = ["--max-tokens", "128", "--window", "64", "--decode-tokens", "0", "--dtype", "fp32", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_600(tmp_path_factory):
    """Another vocabulary size."""
    return models.build_tiny(tmp_path_factory.mktemp("errs") / "tiny600", vocab_size=600)


@pytest.fixture(scope="module")
def tiny_other_tok(tmp_path_factory):
    """The same vocabulary size (512), a tokenizer trained on other text."""
    text = "\n".join(f"line {i}: the quick brown fox {i * 7} jumps over {i % 13} lazy dogs" for i in range(3000))
    return models.build_tiny(tmp_path_factory.mktemp("errs") / "other", text=text)


def _run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------------------ --reference
def test_reference_with_other_vocab_size(tiny, tiny_600, capsys):
    for model, ref in ((tiny, tiny_600), (tiny_600, tiny)):    # meaningless numbers / IndexError before
        rc, out, err = _run(capsys, "eval", model, "--reference", ref, *FAST)
        assert rc == 2 and out == "", err
        assert "512" in err and "600" in err and "vocabulary" in err and len(err.strip().splitlines()) == 1


def test_reference_with_other_tokenizer(tiny, tiny_other_tok, capsys):
    rc, out, err = _run(capsys, "eval", tiny, "--reference", tiny_other_tok, *FAST)
    assert rc == 2 and "tokenizers" in err and "differ" in err, err


# ------------------------------------------------------------------------------------------ BOS
def test_bos_yes_without_bos_token(tiny, tmp_path, capsys):
    nobos = tmp_path / "nobos"
    nobos.mkdir()
    for f in tiny.iterdir():
        (nobos / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((nobos / "tokenizer_config.json").read_text())
    cfg["bos_token"] = None
    (nobos / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert E.load_tokenizer(nobos).bos_token_id is None
    rc, _, err = _run(capsys, "eval", nobos, "--bos", "yes", *FAST)
    assert rc == 2 and "no bos_token" in err, err


# ------------------------------------------------------------------------------------------ --json
def test_json_path_checked_before_the_run(tiny, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for bad, why in ((tmp_path / "missing" / "r.json", "does not exist"), (afile / "r.json", "is not a directory"),
                     (tmp_path, "is a directory")):
        for argv in (["eval", tiny, *FAST], ["info", tiny], ["demo", "--model", tiny, "--formats", "gptq",
                                                              "--quick", "--no-progress"]):
            rc, out, err = _run(capsys, *argv, "--json", bad)
            assert rc == 2 and out == "" and why in err and "--json" in err, (argv, err)


def test_json_write_error_keeps_printed_results(tiny, tmp_path, capsys, monkeypatch):
    """A --json path that fails only at the end (here: the check skipped) still leaves the printed results."""
    monkeypatch.setattr(cli, "_check_json", lambda path: None)
    bad = tmp_path / "gone" / "r.json"
    rc, out, err = _run(capsys, "eval", tiny, *FAST, "--json", bad)
    assert rc == 2 and "perplexity" in out and "cannot write --json" in err, err
    rc, out, err = _run(capsys, "info", tiny, "--json", bad)
    assert rc == 2 and "format   dense" in out and "cannot write --json" in err, err


# ------------------------------------------------------------------------------------------ model paths, tokenizer
def test_model_path_that_is_a_file(tiny, capsys):
    rc, _, err = _run(capsys, "info", tiny / "config.json")
    assert rc == 2 and "not a model directory" in err, err
    with pytest.raises(NotADirectoryError):
        models.resolve(tiny / "config.json")


def test_checkpoint_without_tokenizer_files(tiny, tmp_path, capsys):
    notok = tmp_path / "notok"
    E.load_model(tiny, torch.float32).save_pretrained(notok)      # written from a model object: no tokenizer
    rc, _, err = _run(capsys, "eval", notok, *FAST)
    assert rc == 2 and "no tokenizer files" in err and "--tokenizer" in err, err
    # a bad --tokenizer: the message names the option, not a "model directory", and does not advise passing it
    for bad, why in ((tmp_path / "nope", "no such directory"), (notok, "no tokenizer files"),
                     (tiny / "config.json", "is a file")):
        rc, _, err = _run(capsys, "eval", tiny, "--tokenizer", bad, *FAST)
        assert rc == 2 and f"--tokenizer {bad}: {why}" in err, err
        assert "model directory" not in err and "--tokenizer PATH" not in err and len(err.splitlines()) == 1, err
    out_json = tmp_path / "r.json"
    rc, out, err = _run(capsys, "eval", notok, "--tokenizer", tiny, "--reference", tiny, *FAST, "--json", out_json)
    assert rc == 0, err
    r = json.loads(out_json.read_text())
    assert r["tokenizer"] == str(tiny) and r["top1_agreement"] == 1.0 and "perplexity" in out


def test_other_os_errors_are_one_line(tiny, tmp_path, capsys):
    """Not only FileNotFoundError / NotADirectoryError: any OSError (a directory as --text, transformers' "no weight
    files" and "not a valid JSON file") is one line naming the path, exit 2, not a traceback."""
    noweights, badcfg = tmp_path / "noweights", tmp_path / "badcfg"
    noweights.mkdir()
    badcfg.mkdir()
    for f in tiny.iterdir():
        if not f.name.endswith(".safetensors"):
            (noweights / f.name).write_bytes(f.read_bytes())
    (badcfg / "config.json").write_text("{")
    for argv, expect in ((["eval", tiny, "--text", tmp_path, *FAST], f"--text {tmp_path}: Is a directory"),
                         (["eval", noweights, *FAST], str(noweights)),
                         (["info", badcfg], str(badcfg / "config.json"))):
        rc, out, err = _run(capsys, *argv)
        assert rc == 2 and out == "" and len(err.splitlines()) == 1, err
        assert err.startswith(f"hf-w4 {argv[0]}: error: ") and expect in err, err


# ------------------------------------------------------------------------------------------ counts
def test_counts_out_of_range(tiny, capsys):
    for argv, expect in ((["--threads", "-1"], ">= 1"), (["--threads", "0"], ">= 1"), (["--window", "1"], ">= 2"),
                         (["--max-tokens", "-1"], ">= 0"), (["--decode-tokens", "1"], "0 (skip decoding) or >= 2"),
                         (["--decode-tokens", "-3"], ">= 2")):
        with pytest.raises(SystemExit) as e:                        # argparse: before any model is loaded
            cli.main(["eval", str(tiny), *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert argv[0] in err and expect in err, err
    assert cli.build_parser().parse_args(["eval", "x"]).threads is None              # absent: torch's choice
    assert cli.build_parser().parse_args(["eval", "x", "--threads", "3"]).threads == 3
    with pytest.raises(SystemExit):
        cli.main(["demo", "--decode-tokens", "1"])
    tok = E.load_tokenizer(tiny)
    with pytest.raises(ValueError):
        E.make_windows(tok, "some text " * 50, window=16, max_tokens=-1)
    with pytest.raises(ValueError, match="decode_tokens"):                # before the perplexity pass
        E.evaluate(tiny, max_tokens=64, window=32, decode_tokens=1, model=torch.nn.Module(), progress=False)


def test_device(tiny, capsys, tmp_path):
    """--device: a bad name is an argparse error; cuda without a CUDA device is one line naming the way out; cpu runs
    as the default does and says so in the JSON."""
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", str(tiny), "--device", "gpu"])
    assert e.value.code == 2 and "'gpu': expected cpu, cuda or cuda:N" in capsys.readouterr().err
    if not torch.cuda.is_available():
        rc, _, err = _run(capsys, "eval", tiny, "--device", "cuda:0", *FAST)
        assert rc == 2 and "--device cuda:0: torch sees no CUDA device here" in err and "--device cpu" in err, err
    out = tmp_path / "r.json"
    rc, text, _ = _run(capsys, "eval", tiny, "--device", "cpu", "--json", out, *FAST)
    assert rc == 0 and json.loads(out.read_text())["device"] == "cpu" and " on cpu" not in text
    with pytest.raises(SystemExit) as e:                            # the demo and info take the same option
        cli.main(["info", str(tiny), "--device", "tpu"])
    assert e.value.code == 2 and "'tpu': expected cpu, cuda or cuda:N" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--device", "cuda:x"])
    assert e.value.code == 2 and "expected cpu, cuda or cuda:N" in capsys.readouterr().err
    if not torch.cuda.is_available():
        rc, _, err = _run(capsys, "demo", "--model", tiny, "--device", "cuda", "--quick")
        assert rc == 2 and "--device cuda: torch sees no CUDA device here" in err, err


def test_device_resolution_with_gpus(monkeypatch):
    """With CUDA (faked here): cuda:N past the device count is an error naming the count; plain cuda is cuda:0, or
    the process's LOCAL_RANK GPU under a launcher."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\)"):
        cli._resolve_device("cuda:2", E.Dist())
    assert cli._resolve_device("cuda:1", E.Dist()) == "cuda:1"
    assert cli._resolve_device("cuda", E.Dist()) == "cuda:0"
    assert cli._resolve_device("cuda", E.Dist(rank=1, world=2)) == "cuda:1"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cli._resolve_device("cuda", E.Dist()) == "cuda:1"
    assert cli._resolve_device("cpu", E.Dist()) == "cpu"


def test_window_longer_than_context(tiny, capsys):
    rc, _, err = _run(capsys, "eval", tiny, "--max-tokens", "4096", "--window", "4096", "--decode-tokens", "0",
                      "--no-progress")
    assert rc == 2 and "context of 2048" in err, err


# ------------------------------------------------------------------------------------------ bench
@pytest.mark.parametrize("argv, expect", [
    (["--shapes", "4096"], "'4096' is not KxN"),
    (["--shapes", "100x256"], "K=100 is not a multiple of --group-size 128"),
    (["--shapes", "256x0"], "not a positive integer"),
    (["--m", "1,x"], "--m: 'x'"),
    (["--contenders", "nope,bf16"], "unknown nope; known: bf16"),
    (["--moe", "--experts", "4"], "--experts 4: the MoE model routes each token to 8 experts; give at least 8"),
])
def test_bench_arguments(argv, expect, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--shapes", "256x256", "--m", "1", "--min-time", "0.01", "--min-runs", "1", "--rounds", "1",
                    "--cold-mib", "1", "--no-boost"] + argv)        # short, should it run at all
    assert e.value.code == 2
    assert expect in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ output
def test_info_modelopt_shows_quant_algo():
    for algo in ("NVFP4", "W4A16_NVFP4"):
        m = types.SimpleNamespace(config=types.SimpleNamespace(
            quantization_config={"quant_method": "modelopt", "quant_algo": algo}))
        assert E.quant_format(m) == f"modelopt:{algo}"


def test_compressed_tensors_label_has_the_bits():
    """W8A8 and W4A8 are both compressed-tensors "int-quantized": the label tells them apart (and W4A16)."""
    def ct(fmt, w_bits, a_bits):
        group = {"targets": ["Linear"], "weights": {"num_bits": w_bits, "type": "int"}, "format": fmt,
                 "input_activations": {"num_bits": a_bits, "type": "int", "dynamic": True} if a_bits else None}
        return types.SimpleNamespace(config=types.SimpleNamespace(quantization_config={
            "quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}}))
    assert E.quant_format(ct("int-quantized", 8, 8)) == "compressed-tensors:int-quantized W8A8"
    assert E.quant_format(ct("int-quantized", 4, 8)) == "compressed-tensors:int-quantized W4A8"
    assert E.quant_format(ct("pack-quantized", 4, None)) == "compressed-tensors:pack-quantized W4A16"


def test_closed_stdout_exits_quietly():
    code = ("import sys\nfrom hf_w4.tools import cli\n"
            "def flood(a):\n    for _ in range(100000):\n        print('x' * 100)\n"
            "cli.cmd_info = flood\nsys.exit(cli.main(['info', 'x']))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    p.stdout.close()                                              # like `| head` that has stopped reading
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
