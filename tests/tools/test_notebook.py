"""notebooks/evaluate.ipynb: committed with the outputs of a full run, and runs end to end (quick mode:
HF_W4_QUICK=1) on the embedded default model."""
import importlib.util
import os
import re
from pathlib import Path

import pytest

from hf_w4.tools import models

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "evaluate.ipynb"

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")


def test_notebook_is_committed_with_a_full_run():
    """A reader on GitHub sees the results: every code cell ran (in order, full mode, no errors) and the plots are
    saved in the notebook as PNG outputs."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs for c in code), "commit the notebook with the outputs of a full run"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "run it top to bottom, once"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert "quick=False" in "".join(o.get("text", "") for o in code[0].outputs), "the saved run is a full one"
    assert len([o for o in outputs if "image/png" in o.get("data", {})]) >= 2
    src = "\n".join(c.source for c in code)
    # public API only: no private names of hf_w4 in the notebook (dunders such as __version__ are public)
    assert not re.search(r"\b(hf_w4|evaluate|models|bench)\._(?!_)", src)
    reading = [c.source for c in nb.cells if c.cell_type == "markdown" and "Reading the results" in c.source]
    assert reading and len(reading[0].split()) > 60


@pytest.mark.skipif(importlib.util.find_spec(models.MODULE) is None,
                    reason=f"embedded model not installed ({models.PIP_COMMAND})")
def test_notebook_runs_quick(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_W4_QUICK", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)      # the kernel's inline backend makes the PNG outputs
    monkeypatch.setenv("TMPDIR", str(tmp_path))          # the notebook's checkpoint folder (~1 GB) goes with tmp_path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream") + "\n".join(
        o.get("data", {}).get("text/markdown", "") for o in outputs if o.output_type == "display_data")
    assert "dense bfloat16" in text and "| format (RTN)" in text and "prompt:" in text
    assert "round-to-nearest (RTN" in text and "Q4_1 GGUF dequantized" in text      # what is compared with what
    assert "decode       " in text                                                   # the own-checkpoint cell
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) >= 2                              # trade-off plots + the kernel-vs-M plot
