"""Speed of the cuda_w4a16 kernels against dense F.linear on one GPU (run by tests/gpu/run.sh).

Per Llama-3 layer shape (N x K: 1024x4096, without speed targets, then 4096x4096, 14336x4096, 4096x14336,
28672x8192) and M: dense F.linear in fp16 and
bf16, int4 (group 128, symmetric) and NVFP4 in fp16 and bf16 through the layer's own choice (fused kernels below
the layer's large M: HF_W4_CUDA_LARGE_M, default 128, or 320 where the fused path is the sm_90a wgmma kernel;
dequantize + cuBLAS from there), both paths separately (the crossover), and
torch._weight_int4pack_mm where it runs. Cold weights: every call reads the next of enough weight copies to exceed
the L2 several times. Each measurement replays a CUDA graph of 20 (M <= 64) or 5 calls; CUDA events, median of 7
replays. On compute capability 9.x / 10.x the fused kernels' launches overlap the call before them (programmatic
dependent launch, as for a decoder layer's q, k and v projections); the tiling table also times them without
(HF_W4_CUDA_PDL=0). Columns: microseconds per call, speed-up over dense in the same
dtype, achieved GB/s of weight bytes read (packed codes + scales) and that as a fraction of the memory bandwidth;
last, the path the layer takes at this M (bf16): "deq+mm", "fused" (the mma.sync kernels) or "wgmma" (warpgroups x
rows per block) with the k splits and resident blocks per SM for int4 / NVFP4. Then the fused kernel's tilings and the
wgmma kernel's variants against the main table.

    python tests/gpu/bench_cuda.py [--json FILE]        # the table (and its times as JSON)
    python tests/gpu/bench_cuda.py --quick [--json FILE]  # the table at M = 1, 16, 64, 256, 1024 only
    python tests/gpu/bench_cuda.py --compare BASE NEW   # two JSON files of one run: NEW's time / BASE's per cell

The comparison is how a kernel change is judged: run.sh benchmarks a baseline source tree in the same run (on the
same GPU) when HF_W4_GPU_BASELINE names one (docs/cuda-kernels.md, "GPU check").
"""
from __future__ import annotations

import argparse
import json
import os
import contextlib
import statistics
import sys
from typing import Optional

import torch
import torch.nn.functional as F

from hf_w4.kernels import cuda_w4a16 as cw

TARGET_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)]   # (N, K), with speed targets
# and Llama-3 8B's k / v projections (grouped-query attention: N = 1024), the smallest call of a decode step
SHAPES = [(1024, 4096)] + TARGET_SHAPES
MS = [1, 4, 16, 64, 256, 512, 1024, 2048]
# --quick: an M per path (the fused kernel by 8 and by 16 rows, the wgmma kernel, forced at 1024 in "i4 fused", and
# dequantize + cuBLAS), for timing several baselines of one change in one GPU run
QUICK_MS = [1, 16, 64, 256, 1024]
ROUNDS = 7
L2_BYTES = 50 << 20


def peak_bandwidth() -> float:
    name = torch.cuda.get_device_name()
    for key, tbs in (("H200", 4.8), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100", 2.0), ("L40", 0.864)):
        if key in name:
            return tbs * 1e12
    return float(os.environ.get("HF_W4_BENCH_PEAK_TBS", "3.35")) * 1e12


ERRORS = []


def timed(fn, copies: int, calls: int) -> float:
    """Median microseconds per call, GPU time: ``calls`` calls (call i on weight copy i % copies) captured in one
    CUDA graph and replayed (eager launches would measure the CPU's launch rate at small M, not the kernels).
    A failure is recorded in ERRORS and gives NaN: the table goes on."""
    try:
        return _timed(fn, copies, calls)
    except Exception as e:  # noqa: BLE001 - reported at the end
        ERRORS.append(f"{type(e).__name__}: {str(e)[:300]}")
        torch.cuda.synchronize()
        return float("nan")


def _timed(fn, copies: int, calls: int) -> float:
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for i in range(min(copies, 3)):
            fn(i)
    cur.wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(ROUNDS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del graph
    return statistics.median(times)


def packed(n: int, k: int, wt: str, copies: int):
    """Random weights already in the kernel layout (every bit pattern is a valid code): (qpack, scales) copies."""
    out = []
    for _ in range(copies):
        q = torch.randint(-2 ** 31, 2 ** 31 - 1, (n // 64, k // 16, 32, 4), dtype=torch.int32, device="cuda")
        if wt == "nvfp4":
            s = torch.randint(0x20, 0x48, (n // 64, k // 16, 8, 8), dtype=torch.uint8, device="cuda")
            out.append((q, s, s))
        else:
            s = torch.rand(n // 64, k // 128, 8, 8, device="cuda") * 0.01 + 0.001
            out.append((q, s.half(), s.bfloat16()))
    return out


def _wgmma(plan: list) -> int:
    """The plan's wgmma warpgroups (0: an mma.sync kernel; a baseline tree's plan may not have the field)."""
    return plan[7] if len(plan) > 7 else 0


def layer_large_m(n: int, k: int) -> int:
    """The rows from which a layer of N x K dequantizes for cuBLAS (as CudaW4A16Kernel.prepare decides it)."""
    return cw.large_m(_wgmma(torch.ops.hf_w4.cuda_w4a16_plan(256, n, k, "int4", False, True)) > 0)


def path(m: int, n: int, k: int, large: int) -> str:
    """The layer's path at M rows (bf16): dequantize + cuBLAS, or the fused kernel (wgmma: its warpgroups and rows
    per block) with its splits and blocks per SM."""
    if m >= large:
        return "deq+mm"
    try:
        i4 = torch.ops.hf_w4.cuda_w4a16_plan(m, n, k, "int4", False, True)
        f4 = torch.ops.hf_w4.cuda_w4a16_plan(m, n, k, "nvfp4", False, True)
    except Exception as e:  # noqa: BLE001 - a report column only
        return f"fused (plan n/a: {type(e).__name__})"
    kind = f"wgmma {_wgmma(i4)}x{16 * i4[0]}" if _wgmma(i4) else f"fused{' wide' if i4[6] else ''} mt{i4[0]}"
    return f"{kind} splits {i4[3]}/{f4[3]} blk/SM {i4[5]}/{f4[5]}"


@contextlib.contextmanager
def _setting(env: dict):
    """The plan's variables of ``env`` set (the library reads them per call), and removed again after."""
    os.environ.update(env)
    try:
        yield
    finally:
        for var in env:
            del os.environ[var]


def _honoured(var: str, value: int, field: int, also: Optional[dict] = None, expect: Optional[int] = None) -> bool:
    """Whether the library's plan takes var=value (with the variables ``also`` set: field ``field`` of
    cuda_w4a16_plan at M = 1 on 4096 x 4096 then equals ``expect``, by default the value): a baseline tree may refuse
    the value or ignore the variable."""
    with _setting({**(also or {}), var: str(value)}):
        try:
            return torch.ops.hf_w4.cuda_w4a16_plan(1, 4096, 4096, "int4", False, True)[field] == (
                value if expect is None else expect)
        except (RuntimeError, IndexError):  # refused, or a plan without that field
            return False


def _fused_us(env: dict, x, i4, n: int, copies: int, calls: int) -> float:
    """Microseconds per call of the fused kernel (int4, bf16) with the variables of ``env`` set around it."""
    with _setting(env):
        return timed(lambda i: torch.ops.hf_w4.cuda_w4a16_gemm(x, i4[i][0], i4[i][2], None, None, n, 128, "int4", 1.0),
                     copies, calls)


# m16 tiles per block compared at each M of the tiling table (four tiles only from 32 rows, one not past 64)
TILING_MS = {1: (1, 2), 16: (1, 2), 32: (1, 2, 4), 64: (1, 2, 4), 128: (2, 4), 256: (2, 4)}
# the fused path with the sm_90a wgmma kernel off (0) and forced (1), against the main table's dense and dequantize +
# cuBLAS times: (HF_W4_CUDA_WGMMA, HF_W4_CUDA_WGMMA_ROWS = rows per block, "" = the rule)
WGMMA_MS = (32, 64, 256, 512, 1024, 2048)
WGMMA_VARIANTS = ((0, ""), (1, ""), (1, "64"), (1, "128"))


def _wgmma_lines(record: dict) -> list:
    """The fused path (int4 bf16) in each of WGMMA_VARIANTS at WGMMA_MS on every shape, where this GPU and build have
    the wgmma kernel (blocks of 4 warpgroups): microseconds, the rows per block its plan took and, in
    brackets, the time of dense bf16 and of dequantize + cuBLAS (both from the main table) / its own; also into
    ``record``. Run last: a kernel that faults must not cost the other results."""
    if not _honoured("HF_W4_CUDA_WGMMA", 1, 7, expect=4):  # (a baseline tree may count warpgroups in the setting)
        return ["wgmma kernel: not available here (needs compute capability 9.0 and an sm_90a build)"]
    variants = [(g, r) for g, r in WGMMA_VARIANTS
                if not r or _honoured("HF_W4_CUDA_WGMMA_ROWS", int(r), 0, {"HF_W4_CUDA_WGMMA": "1"}, int(r) // 16)]
    lines = []
    for n, k in SHAPES:
        cq = max(2, -(-4 * L2_BYTES // (n * k // 2)))
        i4 = packed(n, k, "int4", cq)
        xs = {m: torch.randn(m, k, device="cuda").bfloat16() for m in WGMMA_MS}
        for g, r in variants:
            env = {"HF_W4_CUDA_WGMMA": str(g), "HF_W4_CUDA_WGMMA_ROWS": r}
            cells = []
            for m in WGMMA_MS:
                with _setting(env):
                    rows = 16 * torch.ops.hf_w4.cuda_w4a16_plan(m, n, k, "int4", False, True)[0]
                us = _fused_us(env, xs[m], i4, n, cq, 20 if m <= 64 else 5)
                main = record["times"].get(f"{n}x{k} M={m}", {})
                cells.append(f"M={m} {us:7.1f} r{rows}" + (f" ({main['bf16'] / us:.2f}x, {main['i4 deq'] / us:.2f}x)"
                                                            if "bf16" in main and "i4 deq" in main else ""))
                record["tilings"][f"{n}x{k} M={m} wgmma={g} rows={r or 'rule'}"] = us
            lines.append(f"{f'{n}x{k}':>12} wgmma={g} rows={r or 'rule':>4} | " + " | ".join(cells))
        i4 = xs = None
        torch.cuda.empty_cache()
    return lines


def _tilings(n: int, k: int, i4, copies: int, record: dict) -> str:
    """The fused kernel at M = 1-256 with each tiling forced (MT 1 / 2 / 4, warp-interleaved / wide), at M = 1 and 16
    with a half and a quarter of the plan's K splits, and at M = 1, 16 and 64 by the rule without overlapping
    launches where they overlap; the times also go into ``record`` by cell name."""
    cells = []
    split_k = _honoured("HF_W4_CUDA_SPLITS", 1, 3)
    overlap = _honoured("HF_W4_CUDA_PDL", 1, 8)  # this tree's launches overlap the call before
    for m, mts in TILING_MS.items():
        x = torch.randn(m, k, device="cuda").bfloat16()
        plan = torch.ops.hf_w4.cuda_w4a16_plan(m, n, k, "int4", False, True)
        rule = (plan[0], str(plan[6])) if not _wgmma(plan) else None
        for mt in (mt for mt in mts if _honoured("HF_W4_CUDA_MT", mt, 0)):
            for wide in ("0", "1"):
                us = _fused_us({"HF_W4_CUDA_MT": str(mt), "HF_W4_CUDA_WIDE": wide}, x, i4, n, copies,
                               20 if m <= 64 else 5)
                cells.append(f"M={m} mt{mt}{'w' if wide == '1' else ' '}{'*' if (mt, wide) == rule else ' '} {us:6.1f}")
                record[f"{n}x{k} M={m} mt{mt}{'w' if wide == '1' else ''}"] = us
        # fewer K splits than the plan's one wave of blocks (longer runs per warp, fewer fix-ups), the rule's tiling
        for s in sorted({max(1, plan[3] // 4), max(1, plan[3] // 2)} - {plan[3]}) if m <= 16 and split_k else ():
            us = _fused_us({"HF_W4_CUDA_SPLITS": str(s)}, x, i4, n, copies, 20)
            cells.append(f"M={m} splits {s}/{plan[3]} {us:6.1f}")
            record[f"{n}x{k} M={m} splits{s}"] = us
        if overlap and m in (1, 16, 64):
            us = _fused_us({"HF_W4_CUDA_PDL": "0"}, x, i4, n, copies, 20)
            cells.append(f"M={m} no overlap {us:6.1f}")
            record[f"{n}x{k} M={m} pdl0"] = us
    return f"{f'{n}x{k}':>12} | " + " | ".join(cells)


COMPARED = ("fp16", "bf16", "i4 fp16", "i4 bf16", "f4 fp16", "f4 bf16")  # dense, int4, NVFP4 per dtype


def compare(base: dict, new: dict) -> list:
    """Lines of NEW's time / BASE's (< 1: NEW is faster) for every cell both hold; dense F.linear is the control
    (the same code in both: its ratios show the run's noise)."""
    lines = [f"{'':>18} | " + " ".join(f"{c:>8}" for c in COMPARED)]
    for key, t in new["times"].items():
        b = base["times"].get(key)
        if b:
            lines.append(f"{key:>18} | " + " ".join(f"{t[c] / b[c]:8.3f}" if b.get(c) and t.get(c) else f"{'':>8}"
                                                    for c in COMPARED))
    tiles = [f"{key} {new['tilings'][key] / base['tilings'][key]:.3f}" for key in new["tilings"]
             if base["tilings"].get(key)]
    if tiles:
        lines.append("fused kernel tilings, int4 bf16: " + ", ".join(tiles))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the times to this file")
    ap.add_argument("--quick", action="store_true", help="the main table at M = 1, 16, 64, 256, 1024 only: no "
                    "torch int4 GEMM, no tilings, no wgmma table")
    ap.add_argument("--compare", nargs=2, metavar=("BASE", "NEW"), help="compare two --json files and exit")
    a = ap.parse_args(argv)
    if a.compare:
        with open(a.compare[0]) as f0, open(a.compare[1]) as f1:
            base, new = json.load(f0), json.load(f1)
        print(f"time of {a.compare[1]} / time of {a.compare[0]} ({new.get('device')}; < 1: faster)")
        print("\n".join(compare(base, new)))
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    ok, why = cw.CudaW4A16Kernel.is_supported()  # loads (or JIT-builds) the CUDA library
    if not ok:
        print(f"cuda_w4a16 is not usable here: {why}")
        return 1
    peak = peak_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"bandwidth {peak / 1e12:.2f} TB/s; fused kernels below M={cw.large_m()} ({cw.large_m(True)} on layers "
          "whose fused path is the wgmma kernel), dequantize + cuBLAS from there")
    hdr = (f"{'N x K':>12} {'M':>5} | {'fp16':>8} {'bf16':>8} | {'i4 fp16':>8} {'x':>5} {'i4 bf16':>8} {'x':>5} "
           f"{'GB/s':>6} {'%bw':>4} | {'fp4 fp16':>8} {'x':>5} {'fp4 bf16':>8} {'x':>5} {'GB/s':>6} {'%bw':>4} | "
           f"{'i4 fused':>8} {'i4 deq':>8} | {'int4pack':>8} {'x':>5} | path")
    targets = []
    tilings = []
    record = {"device": torch.cuda.get_device_name(), "times": {}, "tilings": {}}
    int4pack_note = None
    for n, k in SHAPES:
        print(hdr)
        large = layer_large_m(n, k)
        dense_bytes = n * k * 2
        cd = max(2, -(-4 * L2_BYTES // dense_bytes))
        dense = {dt: [torch.randn(n, k, device="cuda").mul_(0.02).to(dt) for _ in range(cd)]
                 for dt in (torch.float16, torch.bfloat16)}
        i4_bytes = n * k // 2 + (k // 128) * n * 2
        f4_bytes = n * k // 2 + (k // 16) * n
        cq = max(2, -(-4 * L2_BYTES // i4_bytes))
        i4 = packed(n, k, "int4", cq)
        f4 = packed(n, k, "nvfp4", cq)
        i4pack = None
        if not a.quick:  # torch's own int4 GEMM (bf16, tinygemm layout) where this build has it on CUDA
            try:
                codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
                wq = torch._convert_weight_to_int4pack(codes, 8)
                sz = torch.rand(k // 128, n, 2, device="cuda").to(torch.bfloat16)
                i4pack = [(wq.clone(), sz) for _ in range(cq)]
                torch._weight_int4pack_mm(torch.randn(1, k, device="cuda").bfloat16(), i4pack[0][0], 128, sz)
            except Exception as e:  # noqa: BLE001 - reported once
                i4pack = None
                int4pack_note = int4pack_note or (f"torch._weight_int4pack_mm on CUDA: n/a ({type(e).__name__}: "
                                                  f"{str(e)[:120]})")
        for m in QUICK_MS if a.quick else MS:
            x = {dt: torch.randn(m, k, device="cuda").to(dt) for dt in (torch.float16, torch.bfloat16)}
            calls = 20 if m <= 64 else 5
            t = {}
            for dt, tag in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
                t[tag] = timed(lambda i, dt=dt: F.linear(x[dt], dense[dt][i]), cd, calls)

                def run(i, w, wt, path, dt=dt):
                    q, s16, sbf = w[i]
                    s = s16 if dt == torch.float16 else sbf
                    gs = 16 if wt == "nvfp4" else 128
                    if path == "fused" or (path == "auto" and m < large):
                        return torch.ops.hf_w4.cuda_w4a16_gemm(x[dt], q, s, None, None, n, gs, wt, 1.0)
                    return F.linear(x[dt], torch.ops.hf_w4.cuda_w4a16_dequant(q, s, None, n, k, gs, wt, 1.0, dt))
                t["i4 " + tag] = timed(lambda i, r=run: r(i, i4, "int4", "auto"), cq, calls)
                t["f4 " + tag] = timed(lambda i, r=run: r(i, f4, "nvfp4", "auto"), cq, calls)
                if dt == torch.bfloat16:
                    t["i4 fused"] = timed(lambda i, r=run: r(i, i4, "int4", "fused"), cq, calls)
                    t["i4 deq"] = timed(lambda i, r=run: r(i, i4, "int4", "dense"), cq, calls)
            tp = None
            if i4pack is not None:
                try:
                    tp = timed(lambda i: torch._weight_int4pack_mm(x[torch.bfloat16], i4pack[i][0], 128,
                                                                   i4pack[i][1]), cq, calls)
                except Exception as e:  # noqa: BLE001 - reported once, the table goes on
                    int4pack_note = f"torch._weight_int4pack_mm timing failed: {type(e).__name__}: {str(e)[:120]}"
                    i4pack = None
            record["times"][f"{n}x{k} M={m}"] = t
            sp = {key: t[key[3:]] / t[key] for key in ("i4 fp16", "i4 bf16", "f4 fp16", "f4 bf16")}
            gb_i4 = i4_bytes / (t["i4 bf16"] * 1e-6) / 1e9
            gb_f4 = f4_bytes / (t["f4 bf16"] * 1e-6) / 1e9
            print(f"{f'{n}x{k}':>12} {m:>5} | {t['fp16']:8.1f} {t['bf16']:8.1f} | {t['i4 fp16']:8.1f} "
                  f"{sp['i4 fp16']:5.2f} {t['i4 bf16']:8.1f} {sp['i4 bf16']:5.2f} {gb_i4:6.0f} "
                  f"{gb_i4 * 1e9 / peak * 100:4.0f} | {t['f4 fp16']:8.1f} {sp['f4 fp16']:5.2f} {t['f4 bf16']:8.1f} "
                  f"{sp['f4 bf16']:5.2f} {gb_f4:6.0f} {gb_f4 * 1e9 / peak * 100:4.0f} | {t['i4 fused']:8.1f} "
                  f"{t['i4 deq']:8.1f} | " + (f"{tp:8.1f} {t['bf16'] / tp:5.2f}" if tp else f"{'n/a':>8} {'':>5}")
                  + f" | {path(m, n, k, large)}")
            worst_i4, worst_f4 = min(sp["i4 fp16"], sp["i4 bf16"]), min(sp["f4 fp16"], sp["f4 bf16"])
            if (n, k) not in TARGET_SHAPES:
                continue
            if m <= 16:
                targets.append((f"{n}x{k} M={m} int4 >= 3.0x", worst_i4 >= 3.0, worst_i4))
                targets.append((f"{n}x{k} M={m} nvfp4 >= 2.8x", worst_f4 >= 2.8, worst_f4))
            elif m == 64:
                targets.append((f"{n}x{k} M=64 int4 >= 2x", worst_i4 >= 2.0, worst_i4))
                targets.append((f"{n}x{k} M=64 nvfp4 >= 2x", worst_f4 >= 2.0, worst_f4))
            elif m >= 1024:
                targets.append((f"{n}x{k} M={m} int4 within 1.15x of dense", worst_i4 >= 1 / 1.15, worst_i4))
                targets.append((f"{n}x{k} M={m} nvfp4 within 1.15x of dense", worst_f4 >= 1 / 1.15, worst_f4))
        if not a.quick:
            tilings.append(_tilings(n, k, i4, cq, record["tilings"]))
        dense = i4 = f4 = i4pack = None  # free this shape's weights (rebound, not deleted: closures read them)
        torch.cuda.empty_cache()
    if tilings:
        print("fused kernel, int4 bf16, microseconds per call by m16 tiles per block (HF_W4_CUDA_MT; * = the rule):")
        for line in tilings:
            print(line)
    if int4pack_note:
        print(int4pack_note)
    for err in dict.fromkeys(ERRORS):
        print("ERROR while timing:", err)
    met = sum(ok for _, ok, _ in targets)
    print(f"speed targets (worst of fp16 / bf16): {met} of {len(targets)} met")
    for what, ok, v in targets:
        print(f"  {'MET   ' if ok else 'MISSED'} {what}: {v:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=1)
    if a.quick:
        return 1 if ERRORS else 0
    print("fused path with the wgmma kernel off and forced (HF_W4_CUDA_WGMMA = 0 / 1, HF_W4_CUDA_WGMMA_ROWS = rows), "
          "int4 bf16, microseconds per call, rN = the rows per block taken "
          "(dense bf16 / it, dequantize + cuBLAS / it):", flush=True)
    for line in _wgmma_lines(record):
        print(line, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=1)
    return 1 if ERRORS else 0


if __name__ == "__main__":
    sys.exit(main())
