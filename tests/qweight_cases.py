"""Random layers shared by the CPU kernel tests, tests/kernels/test_cuda_*.py and tests/gpu/: one per checkpoint
layout, written with layouts.pack and read back with layouts.to_qweight, as a checkpoint loader would; and the
CUDA kernels' error budget."""
from __future__ import annotations

import torch

from hf_w4 import layouts
from hf_w4.formats.spec import W4Spec

# (id, layout, sym, act_order, zero_plus_one). AutoRound writes the gptq (v1 or v2) and awq layouts.
LAYOUTS = [
    ("gptq_sym", "gptq", True, False, False),
    ("gptq_v1_asym", "gptq", False, False, True),     # GPTQ v1 / auto_round:auto_gptq: the file stores zero-1
    ("gptq_v2_asym", "gptq", False, False, False),    # GPTQ v2 / auto_round:gptqmodel
    ("gptq_actorder_sym", "gptq", True, True, False),
    ("gptq_actorder_asym", "gptq", False, True, False),
    ("awq", "awq", False, False, False),              # AWQ / auto_round:auto_awq
    ("ct_sym", "ct_pack", True, False, False),
    ("ct_asym", "ct_pack", False, False, False),
    ("ct_nvfp4", "ct_nvfp4", True, False, False),
    ("modelopt_nvfp4", "modelopt_nvfp4", True, False, False),
]
GROUPS = [32, 64, 128, -1]


def make_qweight(layout, n, k, gs, sym=True, act_order=False, zp1=False, seed=0, device="cpu"):
    """(spec, QWeight) of a random layer: int4 codes 0..15 with scales ~1e-2 (zero points 0..15, or 1..15 for
    GPTQ v1), NVFP4 codes with E4M3 scales 0.05..3 (small ones included) and a global scale."""
    gen = torch.Generator().manual_seed(seed)
    nv = "nvfp4" in layout
    spec = W4Spec(method="test", layout=layout, weight_type="nvfp4" if nv else "int4", bits=4,
                  group_size=16 if nv else gs, sym=sym, zero_plus_one=zp1, has_g_idx=act_order)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    if nv:
        scales = torch.rand(n, k // 16, generator=gen) * 3 + 0.05
        scales[0, :4] = torch.tensor([2.0 ** -9, 2.0 ** -8, 0.0, 448.0])  # subnormal, tiny, zero, max E4M3
        t = layouts.pack(spec, codes, scales, global_scale=0.37 if layout == "modelopt_nvfp4" else 2.5)
    else:
        g = k // spec.effective_group(k)
        scales = torch.rand(n, g, generator=gen) * 0.02 + 0.001
        zeros = None if sym else torch.randint(0, 16, (n, g), generator=gen)
        if zp1 and zeros is not None:
            zeros = zeros.clamp(min=1)  # keeps v1 files free of the zero-0 borrow (tests/test_layouts.py covers it)
        g_idx = None
        if act_order:
            g_idx = (torch.arange(k) // spec.effective_group(k))[torch.randperm(k, generator=gen)]
        t = layouts.pack(spec, codes, scales, zeros=zeros, g_idx=g_idx, scale_dtype=torch.float32)
    t = {name: v.to(device) for name, v in t.items()}
    return spec, layouts.to_qweight(spec, t, n, k)


def kernel_dtype_weight(qw: layouts.QWeight, dtype: torch.dtype, global_scale: bool = True) -> torch.Tensor:
    """The exact weight the CUDA kernels multiply by, from layouts.dequantize: int4 scales rounded once to
    ``dtype`` and the product (code - zero) * scale rounded once; NVFP4 e2m1 * e4m3 (exact) times the global scale in
    fp32 (``global_scale``; else without it), rounded once. Checkpoint column order, on qw's device."""
    import dataclasses
    if qw.weight_type == "nvfp4":
        q = qw if global_scale else dataclasses.replace(qw, global_scale=1.0)
    else:
        q = dataclasses.replace(qw, scales=qw.scales.to(dtype).float())
    return layouts.dequantize(q).to(dtype)


def check_kernel_output(y, x, wk, scale, bias, u, dense, what):
    """A CUDA kernel's y = x @ Wk^T * scale (+ bias) against the exact product, elementwise (tests/gpu/ and the
    emulated kernels): the products are exact in the mma and summed in fp32, the result rounds once to x's dtype (u =
    2^-11 fp16, 2^-8 bf16), so |y - ref| <= u * |ref| + 1e-5 * |x| @ |Wk|^T; a dense path's GEMM may reduce in x's
    dtype: + 4u * |x| @ |Wk|^T there."""
    ref = (x.float() @ wk.float().t()) * scale
    a = (x.float().abs() @ wk.float().abs().t()) * abs(scale)
    if bias is not None:
        ref = ref + bias.float()
    tol = u * ref.abs() + (1e-5 + (4 * u if dense else 0.0)) * a + 1e-30
    err = (y.float() - ref).abs()
    assert torch.isfinite(y).all(), f"{what}: non-finite output"
    bad = err > tol
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outside the budget; worst err "
                           f"{float((err - tol).max()):.3e} over, at {tuple(int(v) for v in bad.nonzero()[0])}")
