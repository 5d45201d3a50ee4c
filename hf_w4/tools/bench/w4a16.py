"""Contenders for W4A16 / NVFP4 weights (the cpu_w4a16 kernel) against dense bf16 and torch's int4pack, and their
table."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import _ext, ops
from ...formats.spec import W4Spec
from ..rtn import quantize_rtn
from .harness import Contender, register

# the quantized contenders' weights: symmetric round-to-nearest, as the writers quantize them
INT4 = W4Spec("bench", "ct_pack", "int4", 4, 128, True)
NVFP4 = W4Spec("bench", "modelopt_nvfp4", "nvfp4", 4, 16, True)


def int4_qweight(w: torch.Tensor, group_size: int, spec: W4Spec = INT4):
    """``w`` [N, K] as symmetric int4 (scale amax / 7, zero 8, bf16 scales) in ``spec``'s layout."""
    r = quantize_rtn(w, "int4", group_size, True, scale_dtype=torch.bfloat16)
    return r.qweight(spec.replace(group_size=group_size))


class DenseBF16(Contender):
    name = "bf16"

    def prepare(self, w, group_size):
        return w.to(torch.bfloat16).contiguous()

    def run(self, state, x):
        return F.linear(x, state)


class TorchInt4Pack(Contender):
    name = "int4pack"

    def available(self):
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return False, "torch has no _weight_int4pack_mm_for_cpu"
        return True, ""

    _cache = (None, None)

    def prepare(self, w, group_size):
        key = (id(w), tuple(w.shape), group_size)
        if self._cache[0] != key:   # quantize once per weight; every copy is a fresh pack of the same codes
            r = quantize_rtn(w, "int4", group_size, True, scale_dtype=torch.float32)
            self._cache = (key, (r.codes, r.scales))
        codes, s = self._cache[1]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        # dequant = (q - 8) * scale + zero with zero = 0
        sz = torch.stack([s.t(), torch.zeros_like(s.t())], -1).to(torch.bfloat16).contiguous()
        return packed, sz, group_size

    def run(self, state, x):
        packed, sz, gs = state
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, gs, sz)


class OursInt4(Contender):
    name = "ours_int4"
    path = -1

    def available(self):
        if not ops.has_impl("cpu_w4a16_gemm"):
            return False, f"cpu_w4a16 ops not built ({_ext.load_error()})"
        return True, ""

    def qweight(self, w, group_size):
        return int4_qweight(w, group_size)

    _cache = (None, None)

    def prepare(self, w, group_size):
        key = (id(w), tuple(w.shape), group_size)
        if self._cache[0] != key:   # quantize once per weight; every copy is a fresh repack
            self._cache = (key, self.qweight(w, group_size))
        qw = self._cache[1]
        q, s, z = ops.cpu_w4a16_repack(qw)
        return q, s, z, qw.n, qw.group_size, qw.weight_type, float(qw.global_scale or 1.0)

    def run(self, state, x):
        q, s, z, n, gs, wt, glob = state
        return torch.ops.hf_w4.cpu_w4a16_gemm(x, q, s, z, None, None, n, gs, wt, glob, "", self.path)


class OursNVFP4(OursInt4):
    name = "ours_nvfp4"

    def qweight(self, w, group_size):
        return quantize_rtn(w, "nvfp4-modelopt").qweight(NVFP4)


class ReadFloor(Contender):
    """Not a GEMM: one reduction over the bytes our int4 layer holds (packed codes + scales), i.e. the time just
    to stream the weights from memory - the floor for small M on cold weights."""
    name = "read_floor"
    _src = OursInt4()

    def prepare(self, w, group_size):
        q, s, z, *_ = self._src.prepare(w, group_size)
        return torch.cat([q.reshape(-1), s.view(torch.uint8).reshape(-1)]).view(torch.int64)

    def run(self, state, x):
        return state.sum()


def table(results, shapes, ms, names) -> str:
    def r(a, b):
        return f"{a / b:.2f}x" if a and b else "-"
    extra = [nm for nm in names if nm not in ("bf16", "int4pack", "ours_int4", "ours_nvfp4")]
    head = ["K×N", "M", "bf16 ms", "int4pack ms", "ours int4 ms", "ours nvfp4 ms"] + [f"{e} ms" for e in extra] + \
           ["int4 vs int4pack", "int4 vs bf16", "nvfp4 vs bf16", "nvfp4/int4 time"] + \
           (["int4/read floor time"] if "read_floor" in names else [])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (k, n) in shapes:
        for m in ms:
            g = lambda nm: results.get((k, n, m, nm))  # noqa: E731
            cells = [f"{k}×{n}", str(m)] + [f"{g(nm) * 1e3:.3f}" if g(nm) else "-" for nm in
                                            ["bf16", "int4pack", "ours_int4", "ours_nvfp4"] + extra]
            cells += [r(g("int4pack"), g("ours_int4")), r(g("bf16"), g("ours_int4")), r(g("bf16"), g("ours_nvfp4")),
                      f"{g('ours_nvfp4') / g('ours_int4'):.2f}" if g("ours_nvfp4") and g("ours_int4") else "-"]
            if "read_floor" in names:
                cells.append(f"{g('ours_int4') / g('read_floor'):.2f}" if g("ours_int4") and g("read_floor") else "-")
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


register([DenseBF16()])   # the baseline of every table: it selects none of them
register([TorchInt4Pack(), OursInt4(), OursNVFP4(), ReadFloor()], table)
