"""hf_w4.env declares every HF_W4_* environment variable the code reads, and Python reads them only through it."""
import re
from pathlib import Path

import pytest

from hf_w4 import env

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"""["'](HF_W4_[A-Z0-9_]*[A-Z0-9])""")   # a quoted name: getenv("...") / env.text("...")


def _quoted_names(paths):
    return {(str(p.relative_to(ROOT)), m) for p in paths for m in NAME.findall(p.read_text(errors="replace"))}


def test_every_variable_read_anywhere_is_declared():
    sources = [*ROOT.glob("hf_w4/**/*.py"), *ROOT.glob("csrc/**/*.[ch]*"), *ROOT.glob("csrc/**/*.cu"),
               ROOT / "setup.py", *ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("tests/**/*.py")]
    found = _quoted_names(p for p in sources if p.is_file() and p != Path(__file__).resolve())
    assert {n for _, n in found} >= {"HF_W4_ISA", "HF_W4_KERNEL", "HF_W4_AMX"}     # the scan sees both languages
    missing = sorted(f"{f}: {n}" for f, n in found if n not in env.BY_NAME)
    assert not missing, "HF_W4_* variables read but not declared in hf_w4/env.py: " + ", ".join(missing)


def test_python_reads_them_only_through_env():
    direct = re.compile(r"os\.(environ|getenv)[^\n]*HF_W4_")
    bad = [str(p.relative_to(ROOT)) for p in ROOT.glob("hf_w4/**/*.py") if p.name != "env.py"
           and direct.search(p.read_text())]
    assert not bad, f"read HF_W4_* through hf_w4.env, not os.environ: {bad}"


def test_accessors(monkeypatch):
    monkeypatch.setenv("HF_W4_DISABLED_KERNELS", " cpu_int8, ,zentorch_int8 ")
    assert env.names("HF_W4_DISABLED_KERNELS") == ["cpu_int8", "zentorch_int8"]
    monkeypatch.setenv("HF_W4_KEEP_CHECKPOINT_TENSORS", "Yes")
    assert env.switch("HF_W4_KEEP_CHECKPOINT_TENSORS") is True
    monkeypatch.setenv("HF_W4_KEEP_CHECKPOINT_TENSORS", "maybe")
    with pytest.raises(ValueError, match=r"HF_W4_KEEP_CHECKPOINT_TENSORS='maybe': expected one of 0/1"):
        env.switch("HF_W4_KEEP_CHECKPOINT_TENSORS")
    monkeypatch.delenv("HF_W4_KEEP_CHECKPOINT_TENSORS")
    assert env.switch("HF_W4_KEEP_CHECKPOINT_TENSORS") is False
    with pytest.raises(KeyError, match="HF_W4_NOPE is not an hf_w4 environment variable"):
        env.text("HF_W4_NOPE")


def test_markdown_table_lists_every_variable():
    table = env.markdown_table().splitlines()
    assert table[0].startswith("| variable |") and len(table) == 2 + len(env.VARIABLES)
    assert all(f"`{v.name}`" in row for v, row in zip(env.VARIABLES, table[2:]))
