"""Rebuild tests/data/producers/ with the real producer libraries, each in its own venv from PyPI.

Not run in CI: it installs several GB and takes minutes. Run it by hand after changing tiny.py or a make_*.py,
or to move to a new producer release (change the pins below, then commit the new folders with the test).

    python tests/producers/regenerate.py [--venvs DIR] [--only llmcompressor,autoround,modelopt]

Each producer runs its make_<producer>.py inside its venv; the venv is created once and reused. The folders are
deterministic: a rerun with the same pins rewrites the same bytes.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "producers"

# producer -> (torch, then the pinned producer requirements). torch goes in first so that the producer's own torch
# requirement does not pull another build; GPTQModel 7.7 needs torch>=2.14.1, whose wheel is the CUDA build (it
# runs on CPU).
PRODUCERS = {
    "llmcompressor": ("torch==2.13.0", ["llmcompressor==0.14.0.1", "compressed-tensors==0.19.0",
                                        "transformers==5.17.0"]),
    "autoround": ("torch==2.13.0", ["auto-round==0.16.1", "transformers==5.24.0"]),
    "modelopt": ("torch==2.13.0", ["nvidia-modelopt[hf]==0.47.0", "transformers==5.14.1"]),
    "autoawq": ("torch==2.13.0", ["autoawq==0.2.9", "transformers==5.24.0"]),
    "gptqmodel": ("torch==2.14.1", ["gptqmodel==7.7.0", "transformers==5.24.0"]),
}


def venv_python(venvs: Path, producer: str) -> Path:
    env = venvs / producer
    py = env / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        torch, reqs = PRODUCERS[producer]
        subprocess.run([str(py), "-m", "pip", "install", "-q", torch], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", torch, *reqs], check=True)
    return py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venvs", type=Path, default=Path(tempfile.gettempdir()) / "hf_w4_producer_venvs",
                    help="where the producer venvs live (outside the repository)")
    ap.add_argument("--only", default=",".join(PRODUCERS), help="comma-separated producers to rebuild")
    args = ap.parse_args()
    only = args.only.split(",")
    unknown = set(only) - set(PRODUCERS)
    if unknown:
        sys.exit(f"unknown producer(s) {sorted(unknown)}; known: {sorted(PRODUCERS)}")

    for producer in only:
        py = venv_python(args.venvs, producer)
        # build into a scratch folder and swap each producer's folders in only when its script succeeded
        with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as work:
            # GPTQMODEL_CPU_WORKERS: GPTQModel's CPU pool must have room for its two loader workers on any machine
            env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                       GPTQMODEL_CPU_WORKERS="2")
            # run elsewhere: some producers leave work files (logs, caches) in the current directory
            subprocess.run([str(py), str(HERE / f"make_{producer}.py"), out], check=True, env=env, cwd=work)
            DATA.mkdir(parents=True, exist_ok=True)
            for old in DATA.glob(f"{producer}-*"):
                shutil.rmtree(old)
            for new in sorted(Path(out).iterdir()):
                shutil.copytree(new, DATA / new.name)
                print(f"wrote {DATA / new.name}")


if __name__ == "__main__":
    main()
