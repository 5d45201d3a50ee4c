"""Loads the compiled op libraries once: the CPU library hf_w4/_C.*.so (``load``) and the CUDA library
(``load_cuda``: hf_w4/_C_cuda.*.so when pip built it, else a JIT build of csrc/cuda). Never raises: a failed load is
remembered and reported by kernels through ``load_error()`` / ``cuda_load_error()``. ``cpu_flags()`` says what this
CPU offers the library.

Imports nothing else of hf_w4 but :mod:`hf_w4.env`: the libraries only register implementations (``TORCH_LIBRARY_IMPL``),
which torch accepts before or after :mod:`hf_w4.ops` defines the schemas."""
from __future__ import annotations

import functools
import glob
import os
import time
from typing import FrozenSet, Optional

import torch

from . import env

_state = {"loaded": None, "error": None}


def load() -> bool:
    if _state["loaded"] is not None:
        return _state["loaded"]
    here = os.path.dirname(os.path.abspath(__file__))
    libs = sorted(glob.glob(os.path.join(here, "_C.*so")) + glob.glob(os.path.join(here, "_C.*pyd")))
    if env.text("HF_W4_LIBRARY"):  # another build of the same sources (tests/kernels/test_avx512_emulated.py)
        libs = [env.text("HF_W4_LIBRARY")]
    if env.text("HF_W4_NO_EXT") == "1":
        _state["loaded"], _state["error"] = False, "disabled by HF_W4_NO_EXT=1"
    elif not libs:
        _state["loaded"], _state["error"] = False, (
            "the compiled library hf_w4/_C*.so is not built (pip install --no-build-isolation -e . "
            "or python setup.py build_ext --inplace)")
    else:
        try:
            torch.ops.load_library(libs[0])
            _state["loaded"] = True
        except Exception as e:  # noqa: BLE001 - reported, not raised
            _state["loaded"], _state["error"] = False, f"loading {libs[0]} failed: {e}"
    return _state["loaded"]


def load_error() -> Optional[str]:
    load()
    return _state["error"]


_cuda_state = {"loaded": None, "error": None}


def cuda_build_dir() -> str:
    """Where the JIT build of csrc/cuda goes: $HF_W4_CUDA_BUILD_DIR, else under $TORCH_EXTENSIONS_DIR or
    ~/.cache/hf_w4, one folder per torch / CUDA version (torch.utils.cpp_extension rebuilds when a source or a flag
    changes)."""
    if env.text("HF_W4_CUDA_BUILD_DIR"):
        return env.text("HF_W4_CUDA_BUILD_DIR")
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hf_w4")
    return os.path.join(base, f"cuda_w4a16-torch{torch.__version__}".replace("+", "-"))


def load_cuda() -> bool:
    """Load the CUDA kernels (the ops ``cuda_w4a16_*``): the pip-built hf_w4/_C_cuda.*.so if present, else JIT-build
    csrc/cuda with the CUDA toolkit torch finds (CUDA_HOME / nvcc on PATH) when torch has CUDA and sees a device.
    ``HF_W4_NO_CUDA_EXT=1`` disables both."""
    if _cuda_state["loaded"] is not None:
        return _cuda_state["loaded"]
    here = os.path.dirname(os.path.abspath(__file__))
    libs = sorted(glob.glob(os.path.join(here, "_C_cuda.*so")) + glob.glob(os.path.join(here, "_C_cuda.*pyd")))
    src = os.path.join(os.path.dirname(here), "csrc", "cuda")
    ok, err = False, None
    try:
        if env.text("HF_W4_NO_CUDA_EXT") == "1":
            err = "disabled by HF_W4_NO_CUDA_EXT=1"
        elif libs:
            torch.ops.load_library(libs[0])
            ok = True
        elif not torch.version.cuda:
            err = f"torch {torch.__version__} is built without CUDA"
        elif not torch.cuda.is_available():
            err = "torch sees no CUDA device (torch.cuda.is_available() is False)"
        elif not os.path.isdir(src):
            err = (f"hf_w4/_C_cuda*.so is not built and the sources {src} are not here to JIT-build it "
                   "(pip install --no-build-isolation . on a machine with nvcc)")
        else:
            from torch.utils import cpp_extension
            home = cpp_extension.CUDA_HOME
            if home is None:
                err = "no CUDA toolkit found to JIT-build csrc/cuda (set CUDA_HOME or put nvcc on PATH)"
            elif not any(os.path.isfile(os.path.join(d, "cuda_runtime.h"))  # the include folders torch passes
                         for d in (os.path.join(home, "include"), os.environ.get("CUDA_INC_PATH", "")) if d):
                err = (f"no CUDA toolkit at CUDA_HOME={home} (found by torch: no include/cuda_runtime.h there) to "
                       "JIT-build csrc/cuda; set CUDA_HOME to the toolkit, e.g. /usr/local/cuda")
            else:
                from .log import logger  # here only: a JIT build is rare, and log imports transformers
                build = cuda_build_dir()
                os.makedirs(build, exist_ok=True)
                # on an H100 / H200 the library is built for sm_90a (its wgmma kernel); elsewhere torch picks
                arch = ([] if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.get_device_capability() != (9, 0)
                        else ["-gencode=arch=compute_90a,code=sm_90a"])
                # a first build takes minutes with nothing else on the screen; later loads reuse it unless a source
                # or flag changed
                if not glob.glob(os.path.join(build, "hf_w4_cuda*.so")):
                    logger.warning("hf_w4: compiling the CUDA kernels (csrc/cuda) for this GPU into %s: a minute or "
                                   "two, once per torch version (pip install --no-build-isolation . on a machine "
                                   "with nvcc builds them ahead)", build)
                t0 = time.monotonic()
                cpp_extension.load(
                    name="hf_w4_cuda", sources=sorted(glob.glob(os.path.join(src, "*.cpp")) +
                                                      glob.glob(os.path.join(src, "*.cu"))),
                    # --threads: nvcc compiles the GPU targets (sm_90, its PTX, sm_90a) side by side
                    extra_include_paths=[src], extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "--threads=0"] + arch,
                    build_directory=build, is_python_module=False,
                    verbose=env.text("HF_W4_CUDA_VERBOSE") == "1")
                logger.info("hf_w4: CUDA kernels loaded from %s in %.1f s", build, time.monotonic() - t0)
                ok = True
    except Exception as e:  # noqa: BLE001 - reported through the kernel's is_supported(), not raised
        err = f"building / loading the CUDA library failed: {type(e).__name__}: {e}"
    _cuda_state["loaded"], _cuda_state["error"] = ok, err
    return ok


def cuda_load_error() -> Optional[str]:
    load_cuda()
    return _cuda_state["error"]


@functools.lru_cache(maxsize=None)
def cpu_flags() -> FrozenSet[str]:
    """The CPU feature flags Linux reports (/proc/cpuinfo, e.g. "avx512_vnni", "amx_int8"); empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
