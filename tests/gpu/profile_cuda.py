"""One shape of the fused cuda_w4a16 kernel, called a few times on cold weights, for a profiler to take apart:

    ncu --clock-control none -k regex:w4a16_gemm_kernel --launch-skip 3 --launch-count 1 \\
        python tests/gpu/profile_cuda.py N K M [int4|nvfp4] [fp16|bf16]

Random codes already in the kernel layout (as tests/gpu/bench_cuda.py builds them), int4 with groups of 128.
"""
from __future__ import annotations

import sys

import torch

from hf_w4.kernels import cuda_w4a16 as cw
from bench_cuda import L2_BYTES, packed


def main(argv) -> int:
    n, k, m = (int(v) for v in argv[:3])
    wt = argv[3] if len(argv) > 3 else "int4"
    dtype = torch.bfloat16 if len(argv) > 4 and argv[4] == "bf16" else torch.float16
    ok, why = cw.CudaW4A16Kernel.is_supported()
    if not ok:
        print(f"cuda_w4a16 is not usable here: {why}")
        return 1
    copies = max(2, -(-4 * L2_BYTES // (n * k // 2)))
    weights = packed(n, k, wt, copies)
    x = torch.randn(m, k, device="cuda").to(dtype)
    gs = 16 if wt == "nvfp4" else 128
    for i in range(8):
        q, s16, sbf = weights[i % copies]
        torch.ops.hf_w4.cuda_w4a16_gemm(x, q, s16 if dtype == torch.float16 else sbf, None, None, n, gs, wt, 1.0)
    torch.cuda.synchronize()
    print(f"{n}x{k} M={m} {wt} {dtype}: plan", torch.ops.hf_w4.cuda_w4a16_plan(m, n, k, wt, False,
                                                                           dtype == torch.bfloat16))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
