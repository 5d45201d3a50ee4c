"""notebooks/evaluate.ipynb runs end to end (quick mode: HF_W4_QUICK=1) on the embedded default model."""
import importlib.util
import os
from pathlib import Path

import pytest

from hf_w4.tools import models

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "evaluate.ipynb"

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")


def test_notebook_is_committed_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    src = "\n".join(c.source for c in code)
    # public API only: no private names of hf_w4 in the notebook
    assert "hf_w4._" not in src and "evaluate._" not in src and "models._" not in src


@pytest.mark.skipif(importlib.util.find_spec(models.MODULE) is None,
                    reason=f"embedded model not installed ({models.PIP_COMMAND})")
def test_notebook_runs_quick(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_W4_QUICK", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)      # the kernel's inline backend makes the PNG outputs
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
    assert "dense bfloat16" in text and "| format" in text and "prompt:" in text
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) >= 2                              # format plots + the kernel-vs-M plot
