"""Benchmark of the int8-activation kernels (cpu_int8 W8A8 / W4A8) against dense bf16 and zentorch.

    python -m hf_w4.tools.bench --int8                 # 4096x4096, M = 1..1024, table with ratios
    python -m hf_w4.tools.bench --int8 --shapes 4096x4096,4096x11008 --m 1,16 --rounds 5
    python -m hf_w4.tools.bench --contenders bf16,ours_w8a8,zt_w8a8   # the same contenders in the full benchmark

On a CPU with AMX, ours_w8a8_vnni / ours_w4a8_vnni time the same op with the AVX-512 VNNI path forced: the path a
CPU without AMX (AMD Zen 4 / 5) takes at every M.

The contenders register with :mod:`hf_w4.tools.bench.harness` and are timed by its method: cold weights
(rotation over > --cold-mib of weight copies), medians of interleaved rounds. Weights are round-to-nearest quantized from one random fp32 matrix (W8A8: per-channel int8, scale
max|w|/127; W4A8 / W4A16: symmetric int4, group 128).
"""
from __future__ import annotations

import torch

from ... import _ext, ops
from ...formats.spec import W4Spec
from ...kernels import zentorch as zt
from .harness import Contender, register
from ..rtn import quantize_rtn
from .w4a16 import INT4, int4_qweight



def _qw_w8a8(w):
    """Per-channel symmetric int8 (compressed-tensors W8A8)."""
    spec = W4Spec("bench", "ct_int", "int8", 8, -1, True, act="int8_token")
    return quantize_rtn(w, "int8", -1, True, scale_dtype=torch.float32).qweight(spec)


def _qw_int4(w, group_size):
    return int4_qweight(w, group_size, INT4.replace(act="int8_token"))


class _Ours(Contender):
    isa = ""  # automatic: AMX-INT8 from M = 8 where the CPU has it

    def available(self):
        if not ops.has_impl("int8_gemm"):
            return False, f"int8 ops not built ({_ext.load_error()})"
        return True, ""


class OursW8A8(_Ours):
    name = "ours_w8a8"

    def prepare(self, w, group_size):
        qw = _qw_w8a8(w)
        p, s, _ = ops.int8_repack(qw)
        return p, s, qw.n, qw.k

    def run(self, state, x):
        p, s, n, k = state
        return torch.ops.hf_w4.int8_gemm(x, p, s, None, None, None, "int8", n, k, k, False, self.isa)


class OursW4A8(_Ours):
    name = "ours_w4a8"

    def prepare(self, w, group_size):
        qw = _qw_int4(w, group_size)
        p, s, _ = ops.int8_repack(qw)
        return p, s, qw.n, qw.k, qw.group_size

    def run(self, state, x):
        p, s, n, k, gs = state
        return torch.ops.hf_w4.int8_gemm(x, p, s, None, None, None, "int4", n, k, gs, False, self.isa)


class _NoAmx:
    """The same op with the AVX-512 VNNI path forced (isa "avx512"): what a CPU without AMX (AMD Zen 4 / 5, Intel
    before Sapphire Rapids) runs at every M. Benchmarked only where AMX would otherwise take over."""
    isa = "avx512"

    def available(self):
        ok, why = super().available()
        if not ok:
            return ok, why
        flags = _ext.cpu_flags()
        if "avx512_vnni" not in flags:
            return False, "no AVX-512 VNNI on this CPU: the default contender runs the best path it has"
        if "amx_int8" not in flags:
            return False, "no AMX on this CPU: the default contender already runs the AVX-512 VNNI path"
        return True, ""


class OursW8A8Vnni(_NoAmx, OursW8A8):
    name = "ours_w8a8_vnni"


class OursW4A8Vnni(_NoAmx, OursW4A8):
    name = "ours_w4a8_vnni"


class _Zt(Contender):
    # benchmarked wherever zentorch runs (AVX-512; the kernels themselves are only selected on AMD Zen)
    w4a16 = False  # zentorch_woq_linear: AVX512-BF16 too

    def available(self):
        why = zt.zentorch_runnable(self.w4a16)
        return (False, why) if why else (True, "")


class ZtW4A16(_Zt):
    name = "zt_w4a16"
    w4a16 = True

    def prepare(self, w, group_size):
        return zt.prepare_w4a16(_qw_int4(w, group_size))

    def run(self, state, x):
        return zt.run_w4a16(state, x, None)


class ZtW4A8(_Zt):
    name = "zt_w4a8"

    def prepare(self, w, group_size):
        return zt.prepare_w4a8(_qw_int4(w, group_size))

    def run(self, state, x):
        return zt.run_w4a8(state, x, None)


class ZtW8A8(_Zt):
    name = "zt_w8a8"

    def prepare(self, w, group_size):
        return zt.prepare_w8a8(_qw_w8a8(w))

    def run(self, state, x):
        return zt.run_w8a8(state, x, None)


CONTENDERS = [OursW8A8(), OursW4A8(), OursW8A8Vnni(), OursW4A8Vnni(), ZtW4A16(), ZtW4A8(), ZtW8A8()]


def table(results, shapes, ms, names) -> str:
    """One row per (shape, M): ms per contender, then ours vs bf16 and vs the matching zentorch op."""
    head = ["K×N", "M"] + [f"{nm} ms" for nm in names]
    pairs = [("ours_w8a8", "bf16"), ("ours_w8a8", "zt_w8a8"), ("ours_w4a8", "bf16"), ("ours_w4a8", "zt_w4a8"),
             ("ours_w4a8", "zt_w4a16"), ("ours_int4", "zt_w4a16"), ("ours_w8a8_vnni", "zt_w8a8"),
             ("ours_w4a8_vnni", "zt_w4a8")]
    pairs = [(a, b) for a, b in pairs if a in names and b in names]
    head += [f"{a.replace('ours_', '')} vs {b}" for a, b in pairs]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (k, n) in shapes:
        for m in ms:
            g = lambda nm: results.get((k, n, m, nm))  # noqa: E731
            cells = [f"{k}×{n}", str(m)] + [f"{g(nm) * 1e3:.3f}" if g(nm) else "-" for nm in names]
            cells += [f"{g(b) / g(a):.2f}x" if g(a) and g(b) else "-" for a, b in pairs]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\n(ratios: time of the other / time of ours; > 1 = ours faster)"


register(CONTENDERS, table)
