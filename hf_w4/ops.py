"""THE op list of hf_w4: schemas (torch.library), fake implementations for torch.compile, and
typed wrappers. C++ sources only hold TORCH_LIBRARY_IMPL(hf_w4, CPU/CUDA, m) blocks."""
from __future__ import annotations

import torch

from . import _ext

lib = torch.library.Library("hf_w4", "DEF")


def has_impl(op: str, device: str = "CPU") -> bool:
    """Does ``torch.ops.hf_w4.<op>`` have a kernel for the dispatch key ``device`` (e.g. "CPU")?"""
    _ext.load()
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"hf_w4::{op}", device)
    except RuntimeError:
        return False


def linear_call(op, *args):
    """``op(*args)`` for a gemm op with a registered input gradient (below): under the autograd layer when no
    argument needs a gradient. torch.library's Python autograd wrapper costs ~3.5 us per call even under ``no_grad``,
    as much as the op's own overhead, and a small model's decode step makes hundreds of calls; torch.compile traces
    the op as it is."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


# ---- W4A16 (cpu_w4a16). Layouts, paths, ISA dispatch and the M crossovers: docs/cpu-kernels.md.
# Kernel layout (csrc/cpu/w4a16.h): qpack uint8 [P, K/2, 32] (P = ceil(N/32) panels of 32 columns), scales fp32
# [P, G, 32] (nvfp4: fp8-e4m3 bytes uint8 [P, K/16, 32]; the repack refuses the NaN bytes 0x7f / 0xff), zs fp32
# [P, G, 32] = zero*scale (asymmetric int4 only, else an empty tensor). group_size: an even divisor of K > 0
# (channel-wise: K, not -1). gemm: isa "" = auto (else HF_W4_ISA), "avx512" | "avx2" | "generic" (an error if the
# CPU lacks it); path -1 = auto (fixed rules, csrc/cpu/w4a16_path.h), 0 = fused small-M kernel, 1 = dequantize +
# at::linear (bf16 x: a bf16 GEMM), 2 = AMX-BF16 tiles, 3 = int16 activations x raw codes (inf / nan in x fall back
# to path 0), 4 = dequantize to fp32 + fp32 GEMM, 5 = blocked (bf16 x, AVX512-BF16: each panel decoded once to bf16,
# vdpbf16ps); a path the call cannot take falls back to auto.
lib.define("cpu_w4a16_repack(Tensor codes, str pack_dim, int[] slots, Tensor scales, Tensor? zeros, "
           "Tensor? perm, int n, int k, int group_size, str weight_type) -> (Tensor, Tensor, Tensor)")
lib.define("cpu_w4a16_gemm(Tensor x, Tensor qpack, Tensor scales, Tensor zs, Tensor? perm, Tensor? bias, "
           "int n, int group_size, str weight_type, float global_scale=1.0, str isa=\"\", int path=-1) -> Tensor")
# cpu_w4a16_info: the ISA, whether AMX is used, whether at::linear's bf16 GEMM runs on bf16 instructions, and per
# weight type the large-M bf16 path by M (from M = 17; int4_no_i16: int4 group sizes without an int16 block), e.g.
# "isa=avx2 amx=no bf16_gemm=no large_m_bf16 int4=[int16 M<=80, fp32] int4_no_i16=[fp32] nvfp4=[int16 M<=32, fp32]
# (fixed rules for avx2 without AMX; cpu: avx2)".
lib.define("cpu_w4a16_info(str isa=\"\") -> str")
# cpu_w4a16_path: the path the automatic choice of cpu_w4a16_gemm takes for a call with M rows of K columns, this
# weight type / group size / asymmetry and activation dtype on this machine: "fused", "bf16", "amx", "int16", "fp32"
# or "blocked" (the names of paths 0..5).
lib.define("cpu_w4a16_path(int m, int k, str weight_type, int group_size, bool asym, ScalarType dtype, "
           "str isa=\"\") -> str")
# cpu_w4a16_quant_x16: the int16 path's activation quantizer alone (tests): x [M, K] -> (xq int16 [M, K], xs fp32
# [M, K / block] = the power-of-two scale, xd int32 [M, K / block] = the sum of the block's xq); l1max > 0 (at least
# 2 * block) also bounds each block's sum of |xq| (the folded NVFP4 kernel); an error on inf / nan. isa as for
# cpu_w4a16_gemm.
lib.define("cpu_w4a16_quant_x16(Tensor x, int block, int l1max=0, str isa=\"\") -> (Tensor, Tensor, Tensor)")

# cpu_w4a16_moe: one MoE layer's routed experts in one call, y [T, H] in x's dtype = per token the sum over its slots
# (expert_ids [T, k], ids >= E skipped) of weight * down_e(silu(gate_e(x)) * up_e(x)), summed in ascending expert
# order with the rounding of transformers' eager experts. The experts' weights are cpu_w4a16 layouts stacked per
# layer: gate_up_qpack uint8 [E, 2, ceil(I/32), H/2, 32] (gate then up), its scales [E, 2, ceil(I/32), H/gs, 32]
# and zs (asymmetric int4, else empty); down_qpack [E, ceil(H/32), I/2, 32] and its scales / zs likewise;
# global_scales fp32 [E, 3] (gate, up, down: NVFP4's global scales, 1 for int4). Each projection runs the small-M
# kernel cpu_w4a16_gemm takes for its rows (bit-identical to it there); csrc/cpu/w4a16_moe.cpp.
lib.define("cpu_w4a16_moe(Tensor x, Tensor expert_ids, Tensor expert_weights, Tensor gate_up_qpack, "
           "Tensor gate_up_scales, Tensor gate_up_zs, Tensor down_qpack, Tensor down_scales, Tensor down_zs, "
           "Tensor global_scales, int intermediate, int gate_up_group_size, int down_group_size, str weight_type, "
           "str act=\"silu\", str isa=\"\") -> Tensor")


def _w4a16_panels(n: int) -> int:
    return (n + 31) // 32


@torch.library.register_fake("hf_w4::cpu_w4a16_repack")
def _cpu_w4a16_repack_fake(codes, pack_dim, slots, scales, zeros, perm, n, k, group_size, weight_type):
    gs = 16 if weight_type == "nvfp4" else group_size
    p, g = _w4a16_panels(n), k // gs
    q = codes.new_empty((p, k // 2, 32), dtype=torch.uint8)
    s = codes.new_empty((p, g, 32), dtype=torch.uint8 if weight_type == "nvfp4" else torch.float32)
    z = codes.new_empty((p if (zeros is not None and weight_type != "nvfp4") else 0, g, 32), dtype=torch.float32)
    return q, s, z


@torch.library.register_fake("hf_w4::cpu_w4a16_quant_x16")
def _cpu_w4a16_quant_x16_fake(x, block, l1max=0, isa=""):
    m, k = x.shape
    return (x.new_empty((m, k), dtype=torch.int16), x.new_empty((m, k // block), dtype=torch.float32),
            x.new_empty((m, k // block), dtype=torch.int32))


@torch.library.register_fake("hf_w4::cpu_w4a16_gemm")
def _cpu_w4a16_gemm_fake(x, qpack, scales, zs, perm, bias, n, group_size, weight_type, global_scale=1.0,
                         isa="", path=-1):
    torch._check(x.dim() == 2, lambda: "cpu_w4a16_gemm: x must be 2-D")
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake("hf_w4::cpu_w4a16_moe")
def _cpu_w4a16_moe_fake(x, expert_ids, expert_weights, gate_up_qpack, gate_up_scales, gate_up_zs, down_qpack,
                        down_scales, down_zs, global_scales, intermediate, gate_up_group_size, down_group_size,
                        weight_type, act="silu", isa=""):
    torch._check(x.dim() == 2, lambda: "cpu_w4a16_moe: x must be 2-D")
    return x.new_empty(x.shape)


def cpu_w4a16_repack(qw, perm=None):
    """QWeight -> (qpack, scales, zs) in the cpu_w4a16 kernel layout (one layer; streams, no dense copy)."""
    _ext.load()
    return torch.ops.hf_w4.cpu_w4a16_repack(
        qw.codes, qw.pack_dim, list(qw.slots), qw.scales, qw.zeros, perm, qw.n, qw.k, qw.group_size,
        qw.weight_type)


def cpu_w4a16_gemm(x, qpack, scales, zs, n, group_size, weight_type, perm=None, bias=None, global_scale=1.0,
                   isa="", path=-1):
    """y = x @ W^T (+ bias) in x.dtype for 2-D x; W given in the cpu_w4a16 layout."""
    _ext.load()
    return torch.ops.hf_w4.cpu_w4a16_gemm(x, qpack, scales, zs, perm, bias, n, group_size, weight_type,
                                          float(global_scale), isa, path)


# cpu_empty_weight: an uninitialised CPU tensor for packed weights, from 2 MiB on in transparent huge pages where
# Linux offers them (csrc/cpu/common/weight_alloc.h; the repack ops allocate their outputs the same way).
lib.define("cpu_empty_weight(int[] size, ScalarType dtype) -> Tensor")


def empty_weight(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)`` for packed weights: on the CPU in huge pages where the OS
    offers them (one core streams them 10-20 % faster at decode)."""
    on_cpu = device is None or torch.device(device).type == "cpu"
    if on_cpu and has_impl("cpu_empty_weight", "CompositeImplicitAutograd"):   # (its CatchAll kernel)
        return torch.ops.hf_w4.cpu_empty_weight(list(shape), dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def cpu_w4a16_info(isa=""):
    """One line: the ISA, whether AMX is used, and per weight type the large-M bf16 path by M."""
    _ext.load()
    return torch.ops.hf_w4.cpu_w4a16_info(isa)



def cpu_w4a16_path(m, k, weight_type, group_size, dtype, asym=False, isa=""):
    """The path ("fused", "bf16", "amx", "int16", "fp32" or "blocked") cpu_w4a16_gemm's automatic choice takes for M x K
    activations of ``dtype`` on this machine."""
    _ext.load()
    return torch.ops.hf_w4.cpu_w4a16_path(m, k, weight_type, group_size, asym, dtype, isa)

# ---- int8 (cpu_int8)
# W8A8 / W4A8 with dynamic int8 activations (vpdpbusd). Kernel layout (see csrc/cpu/int8_gemm.h):
# packed uint8 [P, panel_bytes] (P = ceil(N/64) panels of 64 columns; K permuted by act-order, each group
# padded to a multiple of 8; int8: u8 = w + 128 in VNNI-4 quads, int4: nibble pairs of quads), scales fp32
# [P, G, 64], zeros int32 [P, G, 64] (asymmetric int4, else an empty tensor). isa: as for cpu_w4a16_gemm ("" =
# auto, else HF_W4_ISA; avx512 | avx2 | generic, an error if the CPU lacks it), or a variant of this kernel:
# "avxvnni" | "avx2novnni" | "amx". Auto also uses AMX-INT8 where available from M = 8 (HF_W4_AMX=0 disables).
lib.define("int8_isa(str isa=\"\") -> str")
lib.define("int8_repack(Tensor codes, str weight_type, int pack_dim, int[] slots, Tensor scales, Tensor? zeros, "
           "Tensor? perm, int n, int k, int group_size) -> (Tensor, Tensor, Tensor)")
lib.define("int8_quant_act(Tensor x, int group_size=-1, str isa=\"\") -> (Tensor, Tensor)")
lib.define("int8_gemm(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, Tensor? perm, Tensor? bias, "
           "str weight_type, int n, int k, int group_size, bool act_group=False, str isa=\"\") -> Tensor")


def _int8_geometry(n: int, k: int, group_size: int, weight_type: str):
    gs = k if group_size <= 0 else group_size
    g = k // gs
    kp = g * ((gs + 7) // 8 * 8)
    p = (n + 63) // 64
    return p, g, kp * 64 if weight_type == "int8" else kp * 32


@torch.library.register_fake("hf_w4::int8_repack")
def _int8_repack_fake(codes, weight_type, pack_dim, slots, scales, zeros, perm, n, k, group_size):
    p, g, pb = _int8_geometry(n, k, group_size, weight_type)
    return (codes.new_empty((p, pb), dtype=torch.uint8), codes.new_empty((p, g, 64), dtype=torch.float32),
            codes.new_empty((p, g, 64) if zeros is not None else (0,), dtype=torch.int32))


@torch.library.register_fake("hf_w4::int8_quant_act")
def _int8_quant_act_fake(x, group_size=-1, isa=""):
    k = x.shape[-1]
    ng = 1 if group_size <= 0 or group_size == k else k // group_size
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((*x.shape[:-1], ng), dtype=torch.float32)


@torch.library.register_fake("hf_w4::int8_gemm")
def _int8_gemm_fake(x, packed, scales, zeros, perm, bias, weight_type, n, k, group_size, act_group=False, isa=""):
    torch._check(x.shape[-1] == k, lambda: f"int8_gemm: x has {x.shape[-1]} features, expected K={k}")
    return x.new_empty((*x.shape[:-1], n))


def int8_repack(qw, perm=None, as_int4=False):
    """QWeight (weight_type "int8" or "int4") -> (packed, scales, zeros) in the int8 kernel layout; ``perm``
    (int64 [K], from ``layouts.act_order_perm``) makes act-order groups contiguous. ``as_int4``: an int8
    QWeight holding int4 values (-8..7, compressed-tensors W4A8) is packed as int4 (half the bytes; run the
    gemm with weight_type "int4")."""
    _ext.load()
    pack_dim = {"k": 0, "n": 1, "none": 0}[qw.pack_dim]
    wt = "int4" if as_int4 else qw.weight_type
    return torch.ops.hf_w4.int8_repack(qw.codes, wt, pack_dim, list(qw.slots), qw.scales, qw.zeros,
                                       perm, qw.n, qw.k, qw.group_size)


def int8_gemm(x, packed, scales, zeros, weight_type, n, k, group_size, perm=None, bias=None, act_group=False,
              isa=""):
    """y = fq(x) @ W^T (+ bias) in x.dtype; fq = dynamic symmetric int8 per token (or per token and K-group
    when ``act_group``), exactly as compressed-tensors quantizes activations."""
    _ext.load()
    return torch.ops.hf_w4.int8_gemm(x, packed, scales, zeros, perm, bias, weight_type, n, k, group_size,
                                     act_group, isa)


# ---- dense layers at decode (cpu_dense; csrc/cpu/dense_gemv*.cpp): y = x @ weight^T (+ bias) for a model's
# unquantized bf16 / fp16 Linear layers, x [M, K] with M = 1..4, weight [N, K] (rows may be strided), both bf16 or
# both fp16; fp32 sums, one rounding. isa as for cpu_w4a16_gemm ("generic": at::linear).
lib.define("cpu_dense_gemv(Tensor x, Tensor weight, Tensor? bias, str isa=\"\") -> Tensor")


@torch.library.register_fake("hf_w4::cpu_dense_gemv")
def _cpu_dense_gemv_fake(x, weight, bias, isa=""):
    return x.new_empty((x.shape[0], weight.shape[0]))


# ---- the kernel layouts read back in torch (the kernels' unpack_codes and the ops' input gradients)
def w4a16_codes(qpack: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """cpu_w4a16 layout -> codes [N, K] (uint8 0..15) in the kernel's column order. qpack [P, K/2, 32]: byte i of
    k-pair j holds code(32p + i/2, 2j + i%2) in its low nibble and code(32p + 16 + i/2, 2j + i%2) in its high one."""
    out = torch.empty(qpack.shape[0] * 32, k, dtype=torch.uint8, device=qpack.device)

    def half(h):  # [p, j, c, parity] -> [p, c, j, parity] = [p, 16 columns, K]
        return h.view(-1, k // 2, 16, 2).permute(0, 2, 1, 3).reshape(-1, 16, k)
    for p0 in range(0, qpack.shape[0], 64):  # 64 panels (2048 rows) at a time
        b = qpack[p0:p0 + 64]
        out[p0 * 32:(p0 + b.shape[0]) * 32] = torch.cat([half(b & 15), half(b >> 4)], 1).reshape(-1, k)
    return out[:n]


def int8_codes(packed: torch.Tensor, weight_type: str, n: int, k: int, group_size: int) -> torch.Tensor:
    """int8 kernel layout -> [N, K] in the kernel's column order: int8 values (int16) or int4 codes 0..15 (uint8).
    Panels of 64 columns; each group padded to Gp = roundup(gs, 8) packed columns; int8: quads of 256 bytes, byte
    4n + kk of quad q = w[64p + n][4q + kk] + 128; int4: byte i of quad pair q2 holds byte i of quads 2q2 (low
    nibble) and 2q2 + 1 (high)."""
    gs = group_size if group_size and group_size > 0 else k
    G, Gp = k // gs, (gs + 7) // 8 * 8
    P, Kp = packed.shape[0], G * Gp
    if weight_type == "int8":
        quads = packed.view(P, Kp // 4, 64, 4).to(torch.int16) - 128
    else:
        pairs = packed.view(P, Kp // 8, 256)
        quads = torch.stack([pairs & 15, pairs >> 4], 2).view(P, Kp // 4, 64, 4)
    return quads.permute(0, 2, 1, 3).reshape(P * 64, Kp)[:n].view(n, G, Gp)[:, :, :gs].reshape(n, k)


def unpermute(w: torch.Tensor, perm) -> torch.Tensor:  # kernel column k' is the checkpoint's column perm[k']
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


def _per_column(t: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Per-panel group tensors [P, G, panel width] -> [N, K] (each group's value repeated over its columns)."""
    return t.permute(0, 2, 1).reshape(-1, t.shape[1])[:n].repeat_interleave(k // t.shape[1], 1)


def w4a16_dense(qpack, scales, zs, perm, n: int, group_size: int, weight_type: str,
                global_scale: float = 1.0) -> torch.Tensor:
    """The dense fp32 weight [N, K] (checkpoint column order) that cpu_w4a16_gemm multiplies by."""
    k = qpack.shape[1] * 2
    c = w4a16_codes(qpack, n, k)
    if weight_type == "nvfp4":
        from .layouts import e2m1_decode, fp8_decode
        w = e2m1_decode(c) * _per_column(fp8_decode(scales), n, k) * global_scale
    elif zs.numel():
        w = c.float() * _per_column(scales, n, k) - _per_column(zs, n, k)
    else:
        w = (c.float() - 8.0) * _per_column(scales, n, k)
    return unpermute(w, perm)


def int8_dense(packed, scales, zeros, perm, weight_type: str, n: int, k: int, group_size: int) -> torch.Tensor:
    """The dense fp32 weight [N, K] (checkpoint column order) that int8_gemm multiplies the quantized x by."""
    c = int8_codes(packed, weight_type, n, k, group_size).float()
    if weight_type == "int4":
        c = c - (_per_column(zeros, n, k).float() if zeros is not None and zeros.numel() else 8.0)
    return unpermute(c * _per_column(scales, n, k), perm)


# ---- input gradients: grad_x = grad_y @ W with W dequantized from the kernel layout for the backward (the
# weights themselves are frozen: integer codes). The int8 ops pass the gradient straight through the activation
# quantization (a straight-through estimator). Both gemm ops take (x, the four layout tensors, bias, scalars...): one
# setup serves both, and each backward rebuilds W from the saved tensors and the op's own scalars.
def _linear_setup(ctx, inputs, output):
    x, bias = inputs[0], inputs[5]
    ctx.save_for_backward(*inputs[1:5])
    ctx.scalars = inputs[6:]
    ctx.x_dtype, ctx.x_shape = x.dtype, x.shape
    ctx.needs_bias_grad = bias is not None and ctx.needs_input_grad[5]
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _linear_backward(dense):
    def backward(ctx, grad):
        gx = gb = None
        g2 = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[0]:
            w = dense(*ctx.saved_tensors, *ctx.scalars)
            gx = (g2.float() @ w).to(ctx.x_dtype).reshape(ctx.x_shape)
        if ctx.needs_bias_grad:
            gb = g2.sum(0).to(ctx.bias_dtype)
        return (gx, None, None, None, None, gb) + (None,) * len(ctx.scalars)
    return backward


# scalars: cpu_w4a16_gemm (n, group_size, weight_type, global_scale, isa, path); int8_gemm (weight_type, n, k,
# group_size, act_group, isa)
torch.library.register_autograd(
    "hf_w4::cpu_w4a16_gemm", _linear_backward(lambda q, s, z, perm, n, gs, wt, gscale, *_:
                                              w4a16_dense(q, s, z, perm, n, gs, wt, gscale)),
    setup_context=_linear_setup)
torch.library.register_autograd(
    "hf_w4::int8_gemm", _linear_backward(lambda p, s, z, perm, wt, n, k, gs, *_:
                                         int8_dense(p, s, z, perm, wt, n, k, gs)),
    setup_context=_linear_setup)


# ---- W4A16 on CUDA (cuda_w4a16; csrc/cuda, built as hf_w4/_C_cuda*.so or JIT-built by hf_w4._ext.load_cuda)
# Kernel layout (csrc/cuda/w4a16_math.cuh; packed and read back in hf_w4/kernels/cuda_w4a16.py): qpack int32
# [Npad/64, K/16, 32, 4] (Npad = N rounded up to 64, padding columns hold code 0; each 64-column strip's K steps
# contiguous), the mma.sync B fragments of each k16 x n64 tile in lane order; int4 scales in x's dtype and zero points
# uint8 [Npad/64, G, 8, 8] (zeros None = symmetric, 8), nvfp4 scales E4M3 bytes uint8 [Npad/64, K/16, 8, 8]. K
# columns in act-order (the caller permutes x). gemm: x [M, K] fp16 / bf16 -> [M, N] in x's dtype, fused
# dequantization (meant for small M; any M runs); nvfp4 multiplies by global_scale in fp32 before the output cast.
# dequant: the dense [N, K] weight in ``dtype`` (nvfp4: global scale applied in fp32, then one rounding), for the
# large-M path and for tests.
lib.define("cuda_w4a16_gemm(Tensor x, Tensor qpack, Tensor scales, Tensor? zeros, Tensor? bias, int n, "
           "int group_size, str weight_type, float global_scale=1.0) -> Tensor")
lib.define("cuda_w4a16_dequant(Tensor qpack, Tensor scales, Tensor? zeros, int n, int k, int group_size, "
           "str weight_type, float global_scale, ScalarType dtype) -> Tensor")
# cuda_w4a16_plan: the fused kernel's work split for an M x N x K call on the current device (benchmark report):
# [mt, m-blocks, 64-column tiles, k splits, k16 steps per split, resident blocks per SM, wide kernel (1 / 0), wgmma
# kernel's warpgroups per block (0: an mma.sync kernel; its mt is then its rows / 16), launches overlapping the kernel
# before them in the stream (1 / 0)].
lib.define("cuda_w4a16_plan(int m, int n, int k, str weight_type, bool asym, bool bf16) -> int[]")


@torch.library.register_fake("hf_w4::cuda_w4a16_gemm")
def _cuda_w4a16_gemm_fake(x, qpack, scales, zeros, bias, n, group_size, weight_type, global_scale=1.0):
    torch._check(x.dim() == 2, lambda: "cuda_w4a16_gemm: x must be 2-D")
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake("hf_w4::cuda_w4a16_dequant")
def _cuda_w4a16_dequant_fake(qpack, scales, zeros, n, k, group_size, weight_type, global_scale, dtype):
    return qpack.new_empty((n, k), dtype=dtype)


def _cuda_w4a16_setup(ctx, inputs, output):
    x, qpack, scales, zeros, bias, n, group_size, weight_type, global_scale = inputs
    ctx.save_for_backward(qpack, scales, zeros)
    ctx.scalars = (n, x.shape[1], group_size, weight_type, global_scale, x.dtype)
    ctx.needs_bias_grad = bias is not None and ctx.needs_input_grad[4]
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _cuda_w4a16_backward(ctx, grad):
    qpack, scales, zeros = ctx.saved_tensors
    n, k, group_size, weight_type, global_scale, dtype = ctx.scalars
    gx = gb = None
    if ctx.needs_input_grad[0]:
        w = torch.ops.hf_w4.cuda_w4a16_dequant(qpack, scales, zeros, n, k, group_size, weight_type, global_scale,
                                               dtype)
        gx = (grad.float() @ w.float()).to(dtype)
    if ctx.needs_bias_grad:
        gb = grad.sum(0).to(ctx.bias_dtype)
    return gx, None, None, None, gb, None, None, None, None


torch.library.register_autograd("hf_w4::cuda_w4a16_gemm", _cuda_w4a16_backward, setup_context=_cuda_w4a16_setup)
