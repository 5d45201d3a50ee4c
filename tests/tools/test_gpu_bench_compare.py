"""The GPU benchmark's A/B comparison (tests/gpu/bench_cuda.py --compare), which judges kernel changes, runs without
a GPU: it reads two JSON files of times. Also: tests/gpu/run.sh parses."""
import json
import subprocess
import sys
from pathlib import Path

GPU = Path(__file__).resolve().parents[1] / "gpu"


def _record(scale: float, tiling: float) -> dict:
    cols = ("fp16", "bf16", "i4 fp16", "i4 bf16", "f4 fp16", "f4 bf16")
    return {"device": "test", "times": {"4096x4096 M=1": {c: 10.0 * (1 if c in ("fp16", "bf16") else scale)
                                                          for c in cols},
                                         "4096x4096 M=4": {c: 12.0 for c in cols}},
            "tilings": {"4096x4096 M=16 mt2": tiling}}


def test_compare_prints_new_over_base_per_cell(tmp_path):
    base, new = tmp_path / "base.json", tmp_path / "new.json"
    base.write_text(json.dumps(_record(1.0, 20.0)))
    rec = _record(0.8, 15.0)
    del rec["times"]["4096x4096 M=4"]  # a cell only the baseline has is left out
    new.write_text(json.dumps(rec))
    out = subprocess.run([sys.executable, str(GPU / "bench_cuda.py"), "--compare", str(base), str(new)],
                         capture_output=True, text=True, check=True).stdout
    row = next(line for line in out.splitlines() if "4096x4096 M=1 |" in line)
    assert row.split("|")[1].split() == ["1.000", "1.000", "0.800", "0.800", "0.800", "0.800"]
    assert "M=4" not in out
    assert "4096x4096 M=16 mt2 0.750" in out


def test_run_script_parses():
    subprocess.run(["bash", "-n", str(GPU / "run.sh")], check=True)
