"""``write_checkpoint`` / ``hf-w4 convert`` never destroy what is not theirs: the output may not be the source,
a directory holding other files is not replaced, symlinks are followed, SIGTERM leaves no temp dir, the written
modes follow the umask; and the options fail loudly (ignore typos, --lm-head vs --ignore, unwritable output)."""
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_w4.tools import cli, writers  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _convert(*args) -> int:
    return cli.main(["convert", *map(str, args)])


def test_only_a_checkpoint_is_replaced(tiny, tmp_path, capsys):
    out = tmp_path / "userdir"
    (out / "runs").mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    (out / "runs" / "step1000.pt").write_text("x")
    assert _convert(tiny, out, "--format", "gptq", "--group-size", "32") == 2
    err = capsys.readouterr().err
    assert "notes.txt" in err and "runs/" in err and "config.json" not in err.split("files:")[-1]
    assert (out / "notes.txt").read_text() == "mine" and (out / "runs" / "step1000.pt").exists()
    assert (out / "config.json").read_text() == "{}" and sorted(os.listdir(tmp_path)) == ["userdir"]
    shutil.rmtree(out)
    # what may be replaced: a checkpoint, including the side files its source gave it
    src = _copy(tiny, tmp_path / "src")
    (src / "USE_POLICY.md").write_text("policy")            # an unusual side file: copied, and replaceable later
    out = tmp_path / "ckpt"
    writers.write_checkpoint(str(src), out, "ct-w4a16", group_size=32)
    writers.write_checkpoint(str(src), out, "gptq", group_size=32)
    assert (out / "USE_POLICY.md").read_text() == "policy"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    assert not (out / "recipe.yaml").exists() and sorted(os.listdir(tmp_path)) == ["ckpt", "src"]


def test_output_may_not_be_the_source_or_overlap_it(tiny, tmp_path):
    src = _copy(tiny, tmp_path / "models" / "tiny")
    before = {f: (src / f).read_bytes() for f in os.listdir(src)}
    for out, what in [(src, "is the source"), (tmp_path / "models" / "tiny" / ".", "is the source"),
                      (src / "q4", "inside the source"), (tmp_path / "models", "contains the source")]:
        with pytest.raises(writers.WriterError, match=what):
            writers.write_checkpoint(str(src), out, "gptq", group_size=32)
    link = tmp_path / "link"
    link.symlink_to(src)
    with pytest.raises(writers.WriterError, match="is the source"):
        writers.write_checkpoint(str(src), link, "gptq", group_size=32)
    assert {f: (src / f).read_bytes() for f in os.listdir(src)} == before
    assert os.listdir(tmp_path / "models") == ["tiny"]


def test_cache_marker_is_not_copied_and_protects_the_cache(tiny, tmp_path, monkeypatch):
    src = _copy(tiny, tmp_path / "cache" / "smollm2")
    (src / "hf_w4_converted.json").write_text('{"format_version": 1, "dtype": "float32"}')
    out = tmp_path / "q"
    writers.write_checkpoint(str(src), out, "gptq", group_size=32)
    assert not (out / "hf_w4_converted.json").exists() and (out / "tokenizer.json").exists()
    other = _copy(tiny, tmp_path / "other")                 # converting something else into the cache dir
    with pytest.raises(writers.WriterError, match="hf_w4_converted.json"):
        writers.write_checkpoint(str(other), src, "gptq", group_size=32)
    assert (src / "hf_w4_converted.json").exists() and "quantization_config" not in (src / "config.json").read_text()


def test_symlinked_output_is_written_through(tiny, tmp_path):
    real = tmp_path / "real" / "ck"
    writers.write_checkpoint(str(tiny), real, "ct-w4a16", group_size=32)
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "latest"
    link.symlink_to(real)
    res = writers.write_checkpoint(str(tiny), link, "gptq", group_size=32)
    assert link.is_symlink() and os.path.realpath(link) == str(real) and res.path == str(real)
    assert json.loads((real / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    assert os.listdir(tmp_path / "links") == ["latest"] and os.listdir(tmp_path / "real") == ["ck"]


def test_modes_follow_the_umask(tiny, tmp_path):
    old = os.umask(0o022)
    try:
        out = Path(writers.write_checkpoint(str(tiny), tmp_path / "c", "gptq", group_size=32).path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    for f in ("model.safetensors", "config.json", "quantize_config.json"):
        assert stat.S_IMODE((out / f).stat().st_mode) == 0o644, f


SIGTERM_CHILD = """
import os, signal, sys, time
import safetensors.torch as st
from hf_w4.tools import writers
real = st.save_file
def save_then_sigterm(*a, **k):
    real(*a, **k)
    os.kill(os.getpid(), signal.SIGTERM)      # as if the user stopped the job while the files were written
    time.sleep(30)
    print("not interrupted", flush=True)
st.save_file = save_then_sigterm
writers.write_checkpoint(sys.argv[1], sys.argv[2], "gptq", group_size=32)
print("returned", flush=True)
"""


def test_sigterm_while_writing_leaves_no_temp_dir(tiny, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    out = tmp_path / "outs" / "ck"
    p = subprocess.run([sys.executable, "-c", SIGTERM_CHILD, str(tiny), str(out)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == -signal.SIGTERM, p.stdout + p.stderr[-2000:]     # still dies of the signal
    assert os.listdir(tmp_path / "outs") == [], "temp dir left behind"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_ignore_typos_and_lm_head_contradiction(tiny, tmp_path, capsys):
    out = tmp_path / "c"
    assert _convert(tiny, out, "--format", "gptq", "--group-size", "32", "--ignore", "q_proj", "down_porj") == 2
    err = capsys.readouterr().err
    assert "['down_porj']" in err and "model.layers.0.self_attn.q_proj" in err and "lm_head" in err
    assert _convert(tiny, out, "--format", "ct-w4a16", "--group-size", "32", "--lm-head", "--ignore", "lm_head") == 2
    assert "lm_head" in capsys.readouterr().err
    assert not out.exists()
    assert _convert(tiny, out, "--format", "ct-w4a16", "--group-size", "32", "--ignore", "lm_head", "q_proj") == 0
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["ignore"] == ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]


def test_skip_incompatible_flag(tiny, tmp_path, capsys):
    # build_tiny: hidden 64, intermediate 128 -> only down_proj (K=128) fits group size 128
    assert _convert(tiny, tmp_path / "a", "--format", "gptq", "--group-size", "128") == 2
    assert "--skip-incompatible" in capsys.readouterr().err
    assert _convert(tiny, tmp_path / "b", "--format", "gptq", "--group-size", "128", "--skip-incompatible") == 0
    text = capsys.readouterr().out
    assert "12 layer(s) left dense" in text and "incompatible shape" in text
    dyn = json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]["dynamic"]
    assert len(dyn) == 12 and not any("down_proj" in k for k in dyn)


def test_unwritable_output_is_a_one_line_error(tiny, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert _convert(tiny, tmp_path / "afile" / "sub" / "out", "--format", "gptq", "--group-size", "32") == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-w4 convert: error: ") and err.count("\n") == 1 and "afile" in err, err
