"""The GPU benchmark's A/B comparison (tests/gpu/bench_cuda.py --compare), which judges kernel changes, runs without
a GPU: it reads two JSON files of times. Also: tests/gpu/run.sh parses, and runs a series of baselines (GPU commands
stubbed)."""
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


STUB_PYTHON = r'''#!/usr/bin/env bash
# python for run.sh without a GPU: builds and tests succeed, the benchmark writes times scaled by the file "scale"
# in the tree first on PYTHONPATH (5 for this tree), --compare runs for real
case " $* " in
  *" --compare "*) exec "$REAL_PYTHON" "$@" ;;
  *bench_cuda.py*)
    tree=${PYTHONPATH%%:*}; scale=$(cat "$tree/scale" 2>/dev/null || echo 5)
    case " $* " in *" --quick "*) quick=true ;; *) quick=false ;; esac
    while [ "$1" != --json ]; do shift; done
    cell="\"4096x4096 M=1\": {\"i4 bf16\": $scale}"
    echo "{\"device\": \"quick=$quick\", \"times\": {$cell}, \"tilings\": {}}" > "$2" ;;
  *) echo "stub python $1 in $HF_W4_CUDA_BUILD_DIR" ;;
esac
'''


def test_run_script_compares_a_series_of_baselines(tmp_path):
    """run.sh given three baseline trees (the GPU commands stubbed): each builds in its own folder and is benchmarked,
    the first in full and the others with --quick; the first is compared with this tree, then each step."""
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    bases = []
    for i, scale in enumerate((10, 8, 6)):
        (tmp_path / f"b{i}" / "hf_w4").mkdir(parents=True)
        (tmp_path / f"b{i}" / "scale").write_text(str(scale))
        bases.append(str(tmp_path / f"b{i}"))
    env = {"PATH": f"{stub.parent}:/usr/bin:/bin", "REAL_PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "HF_W4_GPU_BASELINE": " ".join(bases), "HF_W4_GPU_STAGES": "benchmark baseline-benchmark compare"}
    subprocess.run(["bash", str(GPU / "run.sh")], env=env, capture_output=True, text=True, timeout=120)
    log = (tmp_path / "out" / "gpu.log").read_text()
    for i in range(3):
        assert f"stub python -c in /tmp/hf_w4_cuda_baseline{i}" in log  # its own build folder
    ratios = [line.split("|")[1].split()[0] for line in log.splitlines() if line.startswith("     4096x4096 M=1 |")]
    assert ratios == ["0.500", "0.800", "0.750", "0.833"], log   # b0 -> tree, b0 -> b1, b1 -> b2, b2 -> tree
    quick = [json.loads((tmp_path / "out" / f"bench_baseline{i}.json").read_text())["device"] for i in range(3)]
    assert quick == ["quick=false", "quick=true", "quick=true"]


def test_run_script_refuses_a_baseline_that_is_not_a_source_tree(tmp_path):
    (tmp_path / "empty").mkdir()
    r = subprocess.run(["bash", str(GPU / "run.sh")], env={"PATH": "/usr/bin:/bin", "HF_W4_GPU_STAGES": "compare",
                                                           "HF_W4_GPU_BASELINE": str(tmp_path / "empty")},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"HF_W4_GPU_BASELINE: {tmp_path / 'empty'} is not a source tree" in r.stdout, r
