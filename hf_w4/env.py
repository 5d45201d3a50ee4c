"""Every ``HF_W4_*`` environment variable, in one table.

Python code reads them only through this module (``text`` / ``switch`` / ``names``); the compiled library reads
its own with ``getenv`` (listed here too, marked C++). ``markdown_table()`` renders the list for the README:
``python -m hf_w4.env``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List


@dataclass(frozen=True)
class Variable:
    name: str
    read_by: str     # "Python" or "C++" (the compiled library, read once per process unless noted)
    values: str
    meaning: str


VARIABLES = (
    Variable("HF_W4_KERNEL", "Python", "a kernel name", "force one kernel for every quantized layer (as the config's "
             "`kernel=`; `python -m hf_w4.kernels` lists them); a layer it cannot run is an error"),
    Variable("HF_W4_DISABLED_KERNELS", "Python", "comma-separated kernel names",
             "never use these kernels (added to the config's `disabled_kernels=`)"),
    Variable("HF_W4_KEEP_CHECKPOINT_TENSORS", "Python", "0 / 1 (true / false / yes / no)",
             "keep the checkpoint's packed code tensor next to the kernel's repacked copy (default: held once)"),
    Variable("HF_W4_DENSE_DECODE", "Python", "0 / 1 (true / false / yes / no)", "0: a loaded model's unquantized "
             "bf16 / fp16 Linear layers (the LM head) stay plain `nn.Linear` instead of running the compiled dense "
             "GEMV at decode (default: 1)"),
    Variable("HF_W4_NO_EXT", "Python", "1", "do not load the compiled library: every layer runs on the reference "
             "kernel (the test suite accepts a missing library only with this set)"),
    Variable("HF_W4_LIBRARY", "Python", "a path to a .so", "load this build of the compiled library instead of "
             "hf_w4/_C.*.so (the emulated AVX-512 build in the tests)"),
    Variable("HF_W4_CACHE", "Python", "a directory", "where `hf-w4` converts the embedded default model "
             "(default `~/.cache/hf_w4`)"),
    Variable("HF_W4_DEBUG", "Python", "any non-empty value", "`hf-w4` shows the traceback instead of a one-line "
             "error"),
    Variable("HF_W4_ISA", "C++", "auto / avx512 / avx2 / generic",
             "the instruction-set level of every CPU kernel family (default: the best this CPU has); a level the "
             "CPU lacks, or an unknown name, is an error"),
    Variable("HF_W4_AMX", "C++", "0", "do not use AMX tiles (cpu_w4a16 and cpu_int8)"),
    Variable("HF_W4_AMX_FP16", "C++", "0", "cpu_w4a16 on AMX: decode NVFP4 block scales in fp32 instead of "
             "AVX512-FP16 (bit-identical results)"),
    Variable("HF_W4_HUGE_PAGES", "C++", "0", "allocate packed weights (and checkpoint tensors copied out of their "
             "file maps) from torch's allocator instead of 2 MiB-aligned mappings marked for transparent huge pages"),
    Variable("HF_W4_VBMI", "C++", "0", "cpu_w4a16: look NVFP4 codes up with vpermw instead of AVX512-VBMI vpermb "
             "(bit-identical results)"),
    Variable("HF_W4_LARGE_PATH", "C++", "int16 / bf16 / fp32 / blocked", "cpu_w4a16, bf16 activations at large M without "
             "AMX: use this path instead of the fixed rule for this CPU family (docs/cpu-kernels.md)"),
    Variable("HF_W4_W4A16_CHUNK_MB", "C++", "a size in MiB", "cpu_w4a16's dequantize + GEMM paths: the dequantized "
             "chunk size (default 2 MiB per thread)"),
    Variable("HF_W4_NO_CUDA_EXT", "Python", "1", "do not load or JIT-build the CUDA library: CUDA layers run on "
             "the reference kernel"),
    Variable("HF_W4_CUDA_BUILD_DIR", "Python", "a directory", "where the CUDA library is JIT-built when pip did not "
             "build it (default: $TORCH_EXTENSIONS_DIR or ~/.cache/hf_w4, per torch and CUDA version)"),
    Variable("HF_W4_CUDA_VERBOSE", "Python", "1", "show the compiler commands of the CUDA JIT build"),
    Variable("HF_W4_CUDA_LARGE_M", "Python", "a number of rows", "cuda_w4a16: from this many rows on, dequantize the "
             "layer and run cuBLAS instead of the fused kernel (default 128, 320 where the fused path is the wgmma "
             "kernel; read when a layer is prepared)"),
    Variable("HF_W4_CUDA_MT", "C++", "1 / 2 / 4", "cuda_w4a16's fused kernel: m16 row tiles per block instead of the "
             "rule (1 up to 32 rows or below K = 8192, else 2; 2 at 9-16 rows where one wave of such blocks holds the "
             "layer; 4 only when forced); read on every call"),
    Variable("HF_W4_CUDA_SPLITS", "C++", "a number", "cuda_w4a16's fused kernel: split K this many ways (within 1 .. "
             "K / 128) instead of filling one wave of resident blocks; read on every call"),
    Variable("HF_W4_CUDA_WIDE", "C++", "1 / 0", "cuda_w4a16: the wide fused kernel (4 column tiles per block sharing "
             "the activations) forced on or off, instead of the rule (on at 9-64 rows of layers of at least three "
             "64-column tiles per SM); read on every call"),
    Variable("HF_W4_CUDA_WGMMA", "C++", "1 / 0", "cuda_w4a16: 1 runs the sm_90a wgmma kernel for every call of the "
             "fused path (M below HF_W4_CUDA_LARGE_M), on compute capability 9.0 with the library built for sm_90a "
             "(an error elsewhere); 0: never; unset: the rule (from M = 64 on layers of at least 2^25 weights, where "
             "the device has the kernel and HF_W4_CUDA_MT / HF_W4_CUDA_WIDE are unset); read on every call"),
    Variable("HF_W4_CUDA_WGMMA_ROWS", "C++", "64 / 128", "cuda_w4a16: the wgmma kernel's rows of x per block "
             "instead of the rule (64 up to M = 64, else 128); read on every call"),
    Variable("HF_W4_CUDA_PDL", "C++", "1 / 0", "cuda_w4a16: 0 launches the fused kernels without overlapping the "
             "kernel before them in the stream (programmatic dependent launch; default 1: overlap on "
             "compute capability 9.x / 10.x); read on every call"),
    Variable("HF_W4_BENCH_PEAK_TBS", "tests", "TB/s", "tests/gpu/bench_cuda.py: the memory bandwidth of a GPU it "
             "does not know, for its %-of-bandwidth column"),
    Variable("HF_W4_GPU_BASELINE", "tests", "directories", "tests/gpu/run.sh: other source trees (oldest first) "
             "benchmarked in the same run and compared with this one"),
    Variable("HF_W4_GPU_STAGES", "tests", "stage names", "tests/gpu/run.sh: run only these stages"),
    Variable("HF_W4_NO_CUDA", "build", "1", "`setup.py`: build the CPU library only, even with a CUDA torch"),
    Variable("HF_W4_QUICK", "notebook", "1", "notebooks/evaluate.ipynb: the short run (as CI runs it)"),
    Variable("HF_W4_SIMDE_INCLUDE", "tests", "a directory", "SIMDe's headers for the emulated AVX-512 build "
             "(default: build/simde/include, then /usr/include)"),
    Variable("HF_W4_TEST_EMULATED_AVX512", "tests", "1", "set by the emulated AVX-512 test for the kernel tests it "
             "runs: they see the AVX-512 CPU flags that build provides"),
)
BY_NAME = {v.name: v for v in VARIABLES}
_SWITCH = {"": False, "0": False, "false": False, "no": False, "1": True, "true": True, "yes": True}


def _declared(name: str) -> Variable:
    if name not in BY_NAME:
        raise KeyError(f"{name} is not an hf_w4 environment variable; declared: {sorted(BY_NAME)}")
    return BY_NAME[name]


def text(name: str) -> str:
    """The variable's value, "" when unset."""
    _declared(name)
    return os.environ.get(name, "")


def switch(name: str) -> bool:
    """A yes/no variable: 1 / true / yes or 0 / false / no (unset: no); anything else is an error naming it."""
    v = text(name).strip().lower()
    if v not in _SWITCH:
        raise ValueError(f"{name}={os.environ[name]!r}: expected one of 0/1/true/false/yes/no")
    return _SWITCH[v]


def names(name: str) -> List[str]:
    """A comma-separated list variable, entries stripped, empty ones dropped."""
    return [s.strip() for s in text(name).split(",") if s.strip()]


def markdown_table() -> str:
    rows = ["| variable | read by | values | effect |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.read_by} | {v.values} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
