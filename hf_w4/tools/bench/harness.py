"""The benchmark harness: the contender interface, the registry contender modules add themselves to, cold-weight
timing and the result tables.

Method: cold weights (each contender rotates over enough weight copies to exceed ``cold_mib``), per (shape, M,
contender) the median of >= ``min_runs`` calls and >= ``min_time`` seconds, rounds interleaved. The harness never
names a contender: modules such as :mod:`hf_w4.tools.bench.w4a16` call :func:`register`.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Iterable, List, Tuple

import torch


class Contender:
    """One way to compute ``y = x @ W^T``: ``prepare(w_fp32 [N, K], group_size)`` builds the state for one weight
    copy, ``run(state, x_bf16 [M, K])`` computes y; ``available()`` says whether it runs here and why not."""
    name = ""

    def available(self) -> Tuple[bool, str]:
        return True, ""

    def prepare(self, w: torch.Tensor, group_size: int):
        raise NotImplementedError

    def run(self, state, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def nbytes(self, state) -> int:
        return sum(t.numel() * t.element_size() for t in (state if isinstance(state, (tuple, list)) else [state])
                   if isinstance(t, torch.Tensor))


_CONTENDERS: List[Contender] = []
_TABLES: List[Tuple[frozenset, Callable]] = []


def register(contenders: Iterable[Contender], table: Callable = None) -> None:
    """Add contenders (in order) and, optionally, the table that reports them: ``table(results, shapes, ms,
    names) -> str``, printed when a run includes one of these contenders."""
    contenders = list(contenders)
    _CONTENDERS.extend(c for c in contenders if c.name not in [d.name for d in _CONTENDERS])
    if table is not None:
        _TABLES.append((frozenset(c.name for c in contenders), table))


def all_contenders() -> List[Contender]:
    return list(_CONTENDERS)


def tables(results, shapes, ms, names: List[str]) -> List[str]:
    """The registered tables whose contenders took part in the run (the first one if none did)."""
    hit = [t for own, t in _TABLES if own & set(names)] or [t for _, t in _TABLES[:1]]
    return [t(results, shapes, ms, names) for t in hit]


def _boost():
    """Best effort: raise this process group's scheduling weight (the box is shared; 2-thread calls otherwise
    stretch to scheduler ticks). Silently ignored without permission."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("-20")
    except OSError:
        pass


def time_calls(fn: Callable[[int], object], ncopies: int, min_time: float, min_runs: int) -> float:
    """Median seconds per call of fn(copy_index), rotating copies."""
    for i in range(min(2, ncopies)):
        fn(i)
    ts = []
    t_end = time.perf_counter() + min_time
    i = 0
    while len(ts) < min_runs or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn(i % ncopies)
        ts.append(time.perf_counter() - t0)
        i += 1
        if len(ts) > 2000:
            break
    return statistics.median(ts)


def l3_mib() -> float:
    """This CPU's last-level cache in MiB from sysfs (0 if unknown)."""
    try:
        txt = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
    except OSError:
        return 0.0
    mult = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}.get(txt[-1:], 1 / 2 ** 20)
    return float(txt.rstrip("KMG")) * mult


def bench_shapes(shapes, ms, contenders, group_size=128, cold_mib=96, min_time=0.2, min_runs=5, rounds=3,
                 log=print):
    torch.manual_seed(0)
    results = {}  # (K, N, M, name) -> seconds
    for (k, n) in shapes:
        w = torch.randn(n, k) * 0.02
        states = {}
        for c in contenders:
            s0 = c.prepare(w, group_size)
            nb = max(c.nbytes(s0), 1)
            copies = max(2, math.ceil(cold_mib * 2 ** 20 / nb)) if cold_mib > 0 else 1
            states[c.name] = [s0] + [c.prepare(w, group_size) for _ in range(copies - 1)]
        for m in ms:
            x = torch.randn(m, k).to(torch.bfloat16)
            per = {c.name: [] for c in contenders}
            for _ in range(rounds):
                for c in contenders:
                    st = states[c.name]
                    per[c.name].append(time_calls(lambda i: c.run(st[i], x), len(st), min_time, min_runs))
            for c in contenders:
                results[(k, n, m, c.name)] = statistics.median(per[c.name])
            # each contender's spread over the rounds, ± half of (max - min) as a share of the median: the host's
            # load comes in bursts (one vCPU taken away for a second or more doubles a call's time), so a ratio
            # is only as good as this
            log(f"  K={k} N={n} M={m}: " + ", ".join(
                f"{c.name} {results[(k, n, m, c.name)] * 1e3:.3f} ms"
                f" (±{(max(per[c.name]) - min(per[c.name])) / results[(k, n, m, c.name)] * 50:.0f}%)"
                for c in contenders))
        del states
    return results
