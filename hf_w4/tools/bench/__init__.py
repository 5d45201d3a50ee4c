"""The kernel benchmark: ``hf-w4 bench`` (= ``python -m hf_w4.tools.bench``).

    hf-w4 bench                       # all shapes x M, table in markdown
    hf-w4 bench --quick               # fewer shapes / M, shorter timings
    hf-w4 bench --shapes 4096x4096 --m 1,4 --contenders bf16,ours_int4
    hf-w4 bench --whole-model         # also whole-model greedy decode tokens/s (Llama-shaped, random)
    hf-w4 bench --whole-model-only --moe   # only that, on a Qwen3-MoE-shaped model
    hf-w4 bench --int8 --rounds 5     # the W8A8 / W4A8 kernels against bf16 and zentorch

Load-time memory of multi-GB sharded checkpoints is its own command: ``python -m hf_w4.tools.bench.memory``.

This module composes the harness with the contender modules; the harness knows none of them by name.
"""
from __future__ import annotations

import argparse
from typing import List, Optional, Tuple

import torch

from . import int8, w4a16  # noqa: F401  (their contenders register with the harness)
from ..defaults import HelpFormatter
from .harness import _boost, all_contenders, bench_shapes, l3_mib, tables  # noqa: F401  (the API)
from .model import bench_model, bench_moe

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (2048, 2048)]   # (K, N)
MS = [1, 4, 16, 64, 256, 1024]


def _positive(ap, opt: str, v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        ap.error(f"{opt}: {v.strip()!r} is not a positive integer")
    return n


def _shape(ap, s: str, group_size: int) -> Tuple[int, int]:
    """``KxN`` with K a multiple of the group size (every quantized contender packs whole groups along K)."""
    parts = s.lower().split("x")
    if len(parts) != 2:
        ap.error(f"--shapes: {s.strip()!r} is not KxN (e.g. 4096x4096)")
    k, n = (_positive(ap, "--shapes", v) for v in parts)
    if k % group_size:
        ap.error(f"--shapes: {s.strip()!r}: K={k} is not a multiple of --group-size {group_size}")
    return k, n


# --int8: the int8-activation kernels against dense bf16, cpu_w4a16 and zentorch, on one shape
INT8_SHAPES = "4096x4096"
INT8_CONTENDERS = ",".join(["bf16", "ours_int4"] + [c.name for c in int8.CONTENDERS])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="hf-w4 bench", description=__doc__.split("\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--shapes", default=None, help="comma list of KxN (default: %s; --int8: %s)" %
                    (",".join(f"{k}x{n}" for k, n in SHAPES), INT8_SHAPES))
    ap.add_argument("--m", default=None, help="comma list of M (default: %s)" % ",".join(map(str, MS)))
    ap.add_argument("--contenders", default=None,
                    help="comma list of names (default: all available; --int8: %s)" % INT8_CONTENDERS)
    ap.add_argument("--int8", action="store_true",
                    help="the W8A8 / W4A8 kernels: --shapes and --contenders default to the values above")
    ap.add_argument("--group-size", type=int, default=128, help="weights per scale along K")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--cold-mib", type=float, default=None,
                    help="MiB of weight copies rotated so that weights come from memory (None: max(96, 2 x the L3 "
                         "size in MiB))")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds per timing")
    ap.add_argument("--min-runs", type=int, default=5, help="runs per timing, at least")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the contenders (median)")
    ap.add_argument("--quick", action="store_true", help="4096x4096 and 2048x2048, M=1,16,256, short timings")
    ap.add_argument("--whole-model", action="store_true", help="also run the whole-model decode benchmark")
    ap.add_argument("--whole-model-only", action="store_true", help="only the whole-model decode benchmark")
    ap.add_argument("--moe", action="store_true",
                    help="the whole-model benchmark on a Qwen3-MoE-shaped model (loaded from written checkpoints) instead of the Llama-shaped one")
    ap.add_argument("--experts", type=int, default=32, help="experts per layer for --moe (top-8 routed)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the whole-model benchmark")
    ap.add_argument("--decode-tokens", type=int, default=32, help="greedy tokens timed by the whole-model benchmark")
    ap.add_argument("--model-rounds", type=int, default=5, help="rounds of the whole-model benchmark (median)")
    ap.add_argument("--no-boost", action="store_true", help="do not try nice -20 on this process group")
    a = ap.parse_args(argv)
    if a.int8:
        a.shapes, a.contenders = a.shapes or INT8_SHAPES, a.contenders or INT8_CONTENDERS
    if a.moe and a.experts < 8:
        ap.error(f"--experts {a.experts}: the MoE model routes each token to 8 experts; give at least 8")
    if a.group_size < 1 or a.threads < 1:
        ap.error(f"--group-size {a.group_size} / --threads {a.threads}: must be >= 1")
    shapes = SHAPES if not a.shapes else [_shape(ap, s, a.group_size) for s in a.shapes.split(",")]
    ms = MS if not a.m else [_positive(ap, "--m", v) for v in a.m.split(",")]
    cs = all_contenders()
    if a.contenders:
        want = [w.strip() for w in a.contenders.split(",") if w.strip()]
        unknown = [w for w in want if w not in [c.name for c in cs]]
        if unknown or not want:
            ap.error(f"--contenders {a.contenders}: unknown {', '.join(unknown) or 'empty list'}; "
                     f"known: {', '.join(c.name for c in cs)}")
        cs = [c for c in cs if c.name in want]
    torch.set_num_threads(a.threads)
    if not a.no_boost:
        _boost()
    if a.quick:
        shapes = [(4096, 4096), (2048, 2048)] if not a.shapes else shapes
        ms = [1, 16, 256] if not a.m else ms
        a.min_time, a.rounds, a.min_runs = 0.05, 1, 3
    if a.cold_mib is None:   # rotate over clearly more than the last-level cache: weights come from memory
        a.cold_mib = max(96.0, round(2 * l3_mib()))
    usable = []
    for c in cs:
        ok, why = c.available()
        if ok:
            usable.append(c)
        else:
            print(f"skipping {c.name}: {why}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cold {a.cold_mib} MiB, group {a.group_size}")
    if not a.whole_model_only:
        res = bench_shapes(shapes, ms, usable, a.group_size, a.cold_mib, a.min_time, a.min_runs, a.rounds)
        for t in tables(res, shapes, ms, [c.name for c in usable]):
            print()
            print(t)
    if (a.whole_model or a.whole_model_only) and not a.moe:
        print(f"\nwhole-model greedy decode (Llama-shaped, hidden 4096, {a.layers} layers, random bf16 weights, "
              f"{a.decode_tokens} new tokens, median of {a.model_rounds} interleaved rounds):")
        bench_model(a.layers, a.decode_tokens, group_size=a.group_size, rounds=a.model_rounds)
    if a.moe:
        print(f"\nwhole-model greedy decode (Qwen3-MoE-shaped: hidden 2048, {a.experts} experts of 768, top-8, "
              f"{a.layers} layers, random bf16 weights, {a.decode_tokens} new tokens, median of {a.model_rounds} "
              "interleaved rounds; quantized models written as gptq / modelopt-nvfp4 and loaded with from_pretrained):")
        bench_moe(a.layers, a.decode_tokens, group_size=a.group_size, rounds=a.model_rounds, experts=a.experts)
    return 0
