"""Loads the compiled op library (hf_w4/_C*.so) once. Never raises: a failed load is remembered
and reported by kernels through ``load_error()``. ``cpu_flags()`` says what this CPU offers the library.

Imports nothing else of hf_w4: the library only registers implementations (``TORCH_LIBRARY_IMPL``), which torch
accepts before or after :mod:`hf_w4.ops` defines the schemas."""
from __future__ import annotations

import functools
import glob
import os
from typing import FrozenSet, Optional

import torch

from . import env

_state = {"loaded": None, "error": None}


def load() -> bool:
    if _state["loaded"] is not None:
        return _state["loaded"]
    here = os.path.dirname(os.path.abspath(__file__))
    libs = sorted(glob.glob(os.path.join(here, "_C*.so")) + glob.glob(os.path.join(here, "_C*.pyd")))
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
