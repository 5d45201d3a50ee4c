"""The AVX-512 kernels on CPUs without AVX-512: the library is built a second time with HF_W4_EMULATE_AVX512
(csrc/cpu/common/simd512.h: every AVX-512 intrinsic through SIMDe on AVX2, the few SIMDe lacks or rounds differently from
the hardware written out after Intel's pseudocode; the inline-asm loops replaced by their C++ twins), and the kernel
test files run against that build in a subprocess, with the AVX-512 features reported present (tests/conftest.py).
So a change to the AVX-512 code is tested on every CI machine, not only on the AVX-512 ones. It checks logic, not
speed (the emulation is 10-100x slower), and not the asm loops or AMX (native AVX-512 / AMX hosts run those).

Skipped on a CPU with the AVX-512 features (test_cpu_w4a16 / test_cpu_int8 run the real kernels there), without
AVX2 / FMA / F16C / BMI2, or without SIMDe's headers (.ci/setup fetches them: python .ci/fetch_simde.py build/simde).
"""
import os
import subprocess
import sys

import pytest

from hf_w4 import _ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = _ext.cpu_flags()
NATIVE = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"} <= FLAGS
# the kernel tests: every ISA-parametrized test gains an "avx512" case, and auto choices take the AVX-512 kernels
TEST_FILES = ("tests/kernels/test_cpu_w4a16.py", "tests/kernels/test_cpu_int8.py", "tests/kernels/test_cpu_dense.py",
              "tests/nn/test_training.py")


def simde_include():
    for d in (os.environ.get("HF_W4_SIMDE_INCLUDE"), os.path.join(ROOT, "build", "simde", "include"), "/usr/include"):
        if d and os.path.isfile(os.path.join(d, "simde", "x86", "avx512.h")):
            return d
    return None


pytestmark = [
    pytest.mark.skipif(NATIVE, reason="this CPU has AVX-512: the kernel tests run the real AVX-512 kernels"),
    pytest.mark.skipif(not {"avx2", "fma", "f16c", "bmi2"} <= FLAGS, reason="the emulated build needs AVX2/FMA/F16C"),
    pytest.mark.skipif(simde_include() is None, reason="SIMDe headers not found (python .ci/fetch_simde.py build/simde "
                                                       "or HF_W4_SIMDE_INCLUDE=DIR)"),
]

BUILD = r"""
import glob, os, sys
from torch.utils.cpp_extension import load
root, inc, out = sys.argv[1:4]
os.makedirs(out, exist_ok=True)
print(load(name="hf_w4_avx512_emulated", sources=sorted(glob.glob(os.path.join(root, "csrc", "cpu", "*.cpp"))),
           extra_cflags=["-O2", "-std=c++20", "-fopenmp", "-Wno-unused-function", "-mavx2", "-mfma", "-mf16c", "-mbmi",
                         "-mbmi2", "-DHF_W4_EMULATE_AVX512", "-I" + inc, "-I" + os.path.join(root, "csrc")],
           extra_ldflags=["-fopenmp"], build_directory=out, is_python_module=False))
"""


@pytest.fixture(scope="module")
def emulated_library():
    """The emulated build (build/avx512_emulated, rebuilt by ninja when a source changes; ~2-3 min from scratch
    on 2 cores), made in a subprocess so that this process keeps the real library."""
    out = os.path.join(ROOT, "build", "avx512_emulated")
    env = dict(os.environ, MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    r = subprocess.run([sys.executable, "-c", BUILD, ROOT, simde_include(), out], capture_output=True, text=True,
                       env=env, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    lib = r.stdout.strip().splitlines()[-1]
    assert os.path.isfile(lib), r.stdout
    return lib


def test_kernel_tests_pass_on_the_emulated_avx512_build(emulated_library):
    env = dict(os.environ, HF_W4_LIBRARY=emulated_library, HF_W4_TEST_EMULATED_AVX512="1")
    env.pop("HF_W4_ISA", None)
    probe = ("import torch, hf_w4.ops, hf_w4._ext as e; assert e.load(), e.load_error(); "
             "print(torch.ops.hf_w4.int8_isa(''))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["avx512"], r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-x", *TEST_FILES],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=3600)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    ran = [line for line in r.stdout.splitlines() if line.startswith("PASSED") and "avx512" in line]
    assert len(ran) >= 20, r.stdout[-8000:]  # the AVX-512 cases ran (not skipped)
