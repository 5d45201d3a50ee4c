"""Declares the compiled op library (setup.cfg holds everything else).

CPU sources (csrc/cpu/*.cpp) are always built; CUDA sources (csrc/cuda/*.cu) only when the installed
torch has CUDA. The library exposes no Python module: hf_w4/_ext.py loads it with torch.ops.load_library.
"""
import glob
import os

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError as e:  # pragma: no cover
    raise SystemExit("hf_w4 builds against an installed torch: pip install torch==2.13.0 first, "
                     "then pip install --no-build-isolation .") from e

cxx = ["-O3", "-std=c++20", "-fopenmp", "-Wno-unused-function"]
sources = sorted(glob.glob("csrc/cpu/*.cpp"))
cuda = sorted(glob.glob("csrc/cuda/*.cu")) if torch.version.cuda and os.environ.get("HF_W4_NO_CUDA") != "1" else []
Ext = CUDAExtension if cuda else CppExtension
ext = Ext("hf_w4._C", sources + cuda, include_dirs=[os.path.abspath("csrc")],
          extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++20"]} if cuda else cxx,
          extra_link_args=["-fopenmp"], py_limited_api=False)

setup(ext_modules=[ext] if sources else [], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
