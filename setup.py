"""Declares the compiled op libraries (setup.cfg holds everything else).

CPU sources (csrc/cpu/*.cpp) are always built into hf_w4._C. Where torch has CUDA and a CUDA toolkit is found, the
CUDA kernels (csrc/cuda: *.cu device code + one .cpp of torch glue) are built into hf_w4._C_cuda for sm_80 and sm_90a
(Hopper's wgmma) with sm_90 PTX for newer GPUs (TORCH_CUDA_ARCH_LIST overrides; HF_W4_NO_CUDA=1 skips them). Neither
library is a Python module: hf_w4/_ext.py loads them with torch.ops.load_library (and JIT-builds csrc/cuda when
_C_cuda is missing).
"""
import glob
import os
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError as e:  # pragma: no cover
    raise SystemExit("hf_w4 builds against an installed torch: pip install torch==2.13.0 first, "
                     "then pip install --no-build-isolation .") from e

cxx = ["-O3", "-std=c++20", "-fopenmp", "-Wno-unused-function"]
sources = sorted(glob.glob("csrc/cpu/*.cpp"))
exts = [CppExtension("hf_w4._C", sources, include_dirs=[os.path.abspath("csrc")], extra_compile_args=cxx,
                     extra_link_args=["-fopenmp"], py_limited_api=False)] if sources else []

cuda_sources = sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
build_cuda = bool(cuda_sources and torch.version.cuda and CUDA_HOME is not None
                  and os.environ.get("HF_W4_NO_CUDA") != "1")
# the include folders torch's build passes for CUDA: $CUDA_HOME/include and $CUDA_INC_PATH
cuda_includes = [os.path.join(CUDA_HOME or "", "include"), os.environ.get("CUDA_INC_PATH", "")]
if build_cuda and not any(os.path.isfile(os.path.join(d, "cuda_runtime.h")) for d in cuda_includes if d):
    # torch takes the folder above the first nvcc on PATH: a wrapper script there names no toolkit. The CPU library
    # is still worth installing; loading the CUDA kernels later reports the same reason.
    print(f"hf_w4: building the CPU library only: CUDA_HOME={CUDA_HOME} (found by torch) has no "
          "include/cuda_runtime.h; set CUDA_HOME to the CUDA toolkit (e.g. /usr/local/cuda) to build the CUDA kernels "
          "too", file=sys.stderr)
    build_cuda = False
if build_cuda:
    # explicit -gencode flags replace torch's; one SASS per GPU generation, so an H100 runs the sm_90a code
    arch = [] if os.environ.get("TORCH_CUDA_ARCH_LIST") else [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_90,code=compute_90"]
    # --threads: nvcc compiles the GPU targets side by side
    exts.append(CUDAExtension("hf_w4._C_cuda", cuda_sources, include_dirs=[os.path.abspath("csrc/cuda")],
                              extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--threads=0"] + arch},
                              py_limited_api=False))

setup(ext_modules=exts, cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
