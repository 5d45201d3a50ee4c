"""Benchmark of the CPU W4A16 / NVFP4 kernel (cpu_w4a16) against dense bf16 and torch's int4pack.

    python -m hf_w4.bench                      # all shapes x M, table in markdown
    python -m hf_w4.bench --quick              # fewer shapes / M, shorter timings
    python -m hf_w4.bench --shapes 4096x4096 --m 1,4 --contenders bf16,ours_int4
    python -m hf_w4.bench --model              # whole-model greedy decode tokens/s (Llama-shaped, random)
    python -m hf_w4.bench --model-only --moe   # the same on a Qwen3-MoE-shaped model, loaded from checkpoints

Method: 2 threads (torch.set_num_threads), cold weights (each contender rotates over enough weight copies to
exceed --cold-mib, default max(96 MiB, 2 x this CPU's L3)), per (shape, M, contender) the median of >= --min-runs calls
and >= --min-time seconds, rounds interleaved. Contenders follow a small interface (name, available(),
prepare(w_fp32 [N, K], group_size) -> state per weight copy, run(state, x_bf16 [M, K]) -> y); extra contenders
are imported from ``hf_w4.bench_int8.CONTENDERS`` when that module exists.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (2048, 2048)]   # (K, N)
MS = [1, 4, 16, 64, 256, 1024]


# ------------------------------------------------------------------------------------------------ contenders
class Contender:
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


class DenseBF16(Contender):
    name = "bf16"

    def prepare(self, w, group_size):
        return w.to(torch.bfloat16).contiguous()

    def run(self, state, x):
        return F.linear(x, state)


def rtn_int4(w: torch.Tensor, group_size: int):
    """Symmetric round-to-nearest int4: codes 0..15 (zero 8), fp32 scales [N, G]."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    s = (wg.abs().amax(-1) / 7.0).clamp(min=1e-8)
    codes = (torch.round(wg / s.unsqueeze(-1)) + 8).clamp(0, 15).to(torch.int64).reshape(n, k)
    return codes, s


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
            self._cache = (key, rtn_int4(w, group_size))
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
        from . import _ext, ops
        if not ops.has_impl("cpu_w4a16_gemm"):
            return False, f"cpu_w4a16 ops not built ({_ext.load_error()})"
        return True, ""

    def qweight(self, w, group_size):
        from . import layouts
        from .formats.spec import W4Spec
        n, k = w.shape
        codes, s = rtn_int4(w, group_size)
        spec = W4Spec(method="bench", layout="ct_pack", weight_type="int4", bits=4, group_size=group_size, sym=True)
        t = layouts.pack(spec, codes, s, scale_dtype=torch.bfloat16)
        return layouts.to_qweight(spec, t, n, k)

    _cache = (None, None)

    def prepare(self, w, group_size):
        from . import ops
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
        from . import layouts
        from .formats.spec import W4Spec
        n, k = w.shape
        wb = w.float().reshape(n, k // 16, 16)
        glob = float(w.abs().max()) / (6.0 * 448.0)
        bs = (wb.abs().amax(-1) / 6.0 / glob).clamp(min=2.0 ** -9, max=448.0).to(layouts.FP8)
        codes = torch.cat([layouts.e2m1_encode(wb[i:i + 256] / (bs[i:i + 256].float().unsqueeze(-1) * glob))
                           for i in range(0, n, 256)]).reshape(n, k)
        spec = W4Spec(method="bench", layout="modelopt_nvfp4", weight_type="nvfp4", bits=4, group_size=16, sym=True)
        t = layouts.pack(spec, codes, bs, global_scale=glob)
        return layouts.to_qweight(spec, t, n, k)


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


BUILTIN = [DenseBF16(), TorchInt4Pack(), OursInt4(), OursNVFP4(), ReadFloor()]


def all_contenders() -> List[Contender]:
    out = list(BUILTIN)
    try:
        from . import bench_int8  # another engineer's contenders, optional
        out += list(getattr(bench_int8, "CONTENDERS", []))
    except ImportError:
        pass
    return out


# ------------------------------------------------------------------------------------------------ timing
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


# ------------------------------------------------------------------------------------------------ whole model
class _W4Linear(torch.nn.Module):
    """Tiny stand-in for QuantLinear: RTN-quantizes a dense Linear and runs it through CpuW4A16Kernel."""

    def __init__(self, lin: torch.nn.Linear, group_size: int, nvfp4: bool):
        super().__init__()
        from .kernels.cpu_w4a16 import CpuW4A16Kernel
        c = OursNVFP4() if nvfp4 else OursInt4()
        qw = c.qweight(lin.weight.detach().float(), group_size)
        from .formats.spec import W4Spec
        spec = W4Spec(method="bench", layout="modelopt_nvfp4" if nvfp4 else "ct_pack",
                      weight_type=qw.weight_type, bits=4, group_size=16 if nvfp4 else group_size, sym=True)
        self.kernel = CpuW4A16Kernel(spec, lin.out_features, lin.in_features)
        self.kernel.prepare(self, qw)
        self.bias = lin.bias

    def forward(self, x):
        return self.kernel.apply(self, x, self.bias)


def bench_model(layers=2, tokens=32, prompt=8, group_size=128, rounds=5, log=print):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    transformers.logging.set_verbosity_error()
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=2048, max_position_embeddings=512)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, prompt))

    def quantized(nvfp4):
        q = copy.deepcopy(model)
        for blk in q.model.layers:
            for parent in (blk.self_attn, blk.mlp):
                for nm, mod in list(parent.named_children()):
                    if isinstance(mod, torch.nn.Linear):
                        setattr(parent, nm, _W4Linear(mod, group_size, nvfp4))
        return q

    return _decode_rates({"bf16": model, "ours_int4": quantized(False), "ours_nvfp4": quantized(True)}, ids, tokens,
                         rounds, log)


def _decode_rates(models: dict, ids: torch.Tensor, tokens: int, rounds: int, log) -> dict:
    """Median greedy-decode tokens/s of each model (``bf16`` first: the others' ratios are to it)."""
    runs = {k: [] for k in models}
    with torch.inference_mode():
        for mdl in models.values():   # warm-up
            mdl.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        # rounds interleaved (dense, int4, nvfp4, dense, ...): the host's load drifts over a run, and a ratio of
        # medians from interleaved rounds is far steadier than one of back-to-back blocks
        for _ in range(rounds):
            for k, mdl in models.items():
                t0 = time.perf_counter()
                mdl.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
                runs[k].append(tokens / (time.perf_counter() - t0))
    out = {k: statistics.median(v) for k, v in runs.items()}
    log(f"  dense bf16: {out['bf16']:.2f} tok/s")
    for k in [k for k in out if k != "bf16"]:
        log(f"  {k}: {out[k]:.2f} tok/s ({out[k] / out['bf16']:.2f}x dense bf16)")
    return out


MOE_SHAPE = dict(hidden_size=2048, moe_intermediate_size=768, num_experts_per_tok=8, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128)   # Qwen3-30B-A3B's layer widths


def bench_moe(layers=2, tokens=32, prompt=8, group_size=128, rounds=5, experts=32, log=print):
    """Greedy decode of a Qwen3-MoE-shaped model (random bf16 weights) against the same model loaded through the
    real path: written as GPTQ int4 and ModelOpt NVFP4 checkpoints (one Linear per expert, as the producers
    write), loaded with from_pretrained (experts unfused by hf_w4.moe, each projection a QuantLinear)."""
    import tempfile

    import transformers
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from . import integration, writers
    transformers.logging.set_verbosity_error()
    cfg = Qwen3MoeConfig(**MOE_SHAPE, num_experts=experts, num_hidden_layers=layers, vocab_size=2048,
                         intermediate_size=6144, max_position_embeddings=512)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, prompt))
    models = {"bf16": model}
    with tempfile.TemporaryDirectory() as d, integration.enabled():
        for name, fmt in (("ours_int4", "gptq"), ("ours_nvfp4", "modelopt-nvfp4")):
            res = writers.write_checkpoint(model, f"{d}/{fmt}", fmt, group_size=group_size)
            models[name] = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16).eval()
    return _decode_rates(models, ids, tokens, rounds, log)


# ------------------------------------------------------------------------------------------------ CLI
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


def main(argv: Optional[List[str]] = None, prog: str = "python -m hf_w4.bench", description: Optional[str] = None,
         shapes: Optional[str] = None, contenders: Optional[str] = None) -> int:
    """``shapes`` / ``contenders``: other defaults for --shapes / --contenders (hf_w4.bench_int8 passes its own)."""
    ap = argparse.ArgumentParser(prog=prog, description=description or __doc__.split("\n")[0])
    ap.add_argument("--shapes", default=shapes, help="comma list of KxN (default: %s)" %
                    (shapes or ",".join(f"{k}x{n}" for k, n in SHAPES)))
    ap.add_argument("--m", default=None, help="comma list of M (default: %s)" % ",".join(map(str, MS)))
    ap.add_argument("--contenders", default=contenders,
                    help="comma list of names (default: %s)" % (contenders or "all available"))
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold-mib", type=float, default=None, help="default: max(96, 2 x the L3 size in MiB)")
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--min-runs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="4096x4096 and 2048x2048, M=1,16,256, short timings")
    ap.add_argument("--model", action="store_true", help="also run the whole-model decode benchmark")
    ap.add_argument("--model-only", action="store_true")
    ap.add_argument("--moe", action="store_true",
                    help="the whole-model benchmark on a Qwen3-MoE-shaped model (loaded from written checkpoints) instead of the Llama-shaped one")
    ap.add_argument("--experts", type=int, default=32, help="experts per layer for --moe (top-8 routed)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--model-rounds", type=int, default=5)
    ap.add_argument("--no-boost", action="store_true", help="do not try nice -20 on this process group")
    a = ap.parse_args(argv)
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
    if a.cold_mib is None:   # rotate over clearly more than the last-level cache (105 MiB on the AMX Xeon VM)
        a.cold_mib = max(96.0, round(2 * l3_mib()))
    usable = []
    for c in cs:
        ok, why = c.available()
        if ok:
            usable.append(c)
        else:
            print(f"skipping {c.name}: {why}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cold {a.cold_mib} MiB, group {a.group_size}")
    if not a.model_only:
        res = bench_shapes(shapes, ms, usable, a.group_size, a.cold_mib, a.min_time, a.min_runs, a.rounds)
        names = [c.name for c in usable]
        int8 = any(nm.startswith(("ours_w", "zt_")) for nm in names)  # int8 / zentorch contenders: their own ratios
        if not int8 or any(nm in ("int4pack", "ours_int4", "ours_nvfp4") for nm in names):
            print()
            print(table(res, shapes, ms, names))
        if int8:
            from .bench_int8 import table as int8_table
            print()
            print(int8_table(res, shapes, ms, names))
    if (a.model or a.model_only) and not a.moe:
        print(f"\nwhole-model greedy decode (Llama-shaped, hidden 4096, {a.layers} layers, random bf16 weights, "
              f"{a.tokens} new tokens, median of {a.model_rounds} interleaved rounds):")
        bench_model(a.layers, a.tokens, group_size=a.group_size, rounds=a.model_rounds)
    if a.moe:
        print(f"\nwhole-model greedy decode (Qwen3-MoE-shaped: hidden 2048, {a.experts} experts of 768, top-8, "
              f"{a.layers} layers, random bf16 weights, {a.tokens} new tokens, median of {a.model_rounds} interleaved "
              "rounds; quantized models written as gptq / modelopt-nvfp4 and loaded with from_pretrained):")
        bench_moe(a.layers, a.tokens, group_size=a.group_size, rounds=a.model_rounds, experts=a.experts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
