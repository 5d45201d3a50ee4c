"""Load-time memory of multi-GB checkpoints: ``python -m hf_w4.tools.bench.memory``.

    python -m hf_w4.tools.bench.memory write DIR        # DIR/{gptq,ct-w4a16,modelopt-nvfp4}: Llama-shaped, 32 layers
    python -m hf_w4.tools.bench.memory DIR/gptq DIR/ct-w4a16 DIR/modelopt-nvfp4

``write`` quantizes a dense Llama-shaped model of ``--base-layers`` decoder layers with the writers, then stacks
those layers to ``--layers`` (layer i is a copy of base layer i mod base) and shards the tensors into files of at
most ``--shard-gb`` GB with a ``model.safetensors.index.json``, as real producers ship them. Only the base model is
ever dense in memory, so a 3-4 GB int4 checkpoint is written with a few GB of RAM.

Measuring loads each checkpoint with ``from_pretrained(dtype=bfloat16)`` in a fresh process and reports, from
``/proc/self/status``: the peak RSS (``VmHWM``, file pages included), the RSS after loading, split into anonymous
and file pages, next to ``get_memory_footprint()``, with the wall time and throughput (checkpoint bytes / s) of
``from_pretrained``, and whether any checkpoint file is still mapped. The target (:func:`target_bytes`) is peak and
after-load RSS <= the RSS before loading (the interpreter, torch, transformers: ~0.35 GB with the CPU build of torch,
~0.7 GB with the CUDA build) + 1.15 x footprint + 256 MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

FORMATS = ("gptq", "ct-w4a16", "modelopt-nvfp4")
MIB = 1 << 20


def write(out: Path, formats=FORMATS, layers: int = 32, base_layers: int = 2, intermediate: int = 11008,
          shard_gb: float = 1.0, log=print) -> Dict[str, Path]:
    """Write ``out/<fmt>`` for each format (see the module docstring); returns {fmt: directory}."""
    import torch
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    from .. import writers
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=intermediate, num_hidden_layers=base_layers,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=4096, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    dense = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    done = {}
    for fmt in formats:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
            base = Path(writers.write_checkpoint(dense, Path(tmp) / "base", fmt).path)
            dst = out / fmt
            if dst.exists():
                shutil.rmtree(dst)
            dst.mkdir(parents=True)
            with safe_open(str(base / "model.safetensors"), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            _write_stacked(tensors, dst, layers, base_layers, int(shard_gb * 1e9))
            for side in base.iterdir():
                if side.suffix != ".safetensors":
                    shutil.copy(side, dst / side.name)
            cj = json.loads((dst / "config.json").read_text())
            cj["num_hidden_layers"] = layers
            (dst / "config.json").write_text(json.dumps(cj, indent=2) + "\n")
        size = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
        log(f"{fmt}: {dst} ({size / 1e9:.2f} GB in {len(list(dst.glob('*.safetensors')))} files, "
            f"{time.perf_counter() - t0:.0f} s)")
        done[fmt] = dst
    return done


def _write_stacked(tensors, dst: Path, layers: int, base_layers: int, shard_bytes: int) -> None:
    """The base checkpoint's tensors with its decoder layers repeated to ``layers``, in shards of <= shard_bytes."""
    from safetensors.torch import save_file
    import re
    rx = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
    per_layer = {i: {} for i in range(base_layers)}
    rest = {}
    for k, v in tensors.items():
        m = rx.match(k)
        if m:
            per_layer[int(m.group(1))][m.group(2)] = v
        else:
            rest[k] = v
    # in the order a model's modules come: embeddings, layers, norm and head (so shards fill in load order)
    names = [k for k in rest if "embed" in k]
    names += [(i, k) for i in range(layers) for k in per_layer[i % base_layers]]
    names += [k for k in rest if "embed" not in k]
    shards: List[List] = [[]]   # the names in each shard; the tensors are copied when their shard is written
    used = 0
    for n in names:
        v = per_layer[n[0] % base_layers][n[1]] if isinstance(n, tuple) else rest[n]
        nb = v.numel() * v.element_size()
        if used and used + nb > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(n)
        used += nb
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        out = {}
        for n in shard:   # copies: the repeated layers share the base layer's storage
            key, v = ((f"model.layers.{n[0]}.{n[1]}", per_layer[n[0] % base_layers][n[1]]) if isinstance(n, tuple)
                      else (n, rest[n]))
            out[key] = v.clone()
        save_file(out, str(dst / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, name))
        total += sum(v.numel() * v.element_size() for v in out.values())
        del out
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------------ measuring
def _status() -> Dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile from /proc/self/status, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


def mapped_files(paths) -> List[str]:
    """Those of ``paths`` that this process still has mapped (/proc/self/maps)."""
    want = {os.path.realpath(p) for p in paths}
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[5].strip() for line in f
                       if len(line.split(None, 5)) == 6 and line.split(None, 5)[5].strip() in want})


def measure_here(path: str) -> dict:
    """Load ``path`` in this process and measure (run it in a fresh one: see :func:`measure`)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from ... import integration
    transformers.logging.set_verbosity_error()
    integration.install()
    files = sorted(str(p) for p in Path(path).glob("*.safetensors"))
    before = _status()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    wall = time.perf_counter() - t0
    after = _status()
    return {"path": path, "checkpoint_bytes": sum(os.path.getsize(p) for p in files), "files": len(files),
            "footprint_bytes": model.get_memory_footprint(), "wall_s": wall, "rss_before_bytes": before["VmRSS"],
            "peak_rss_bytes": after["VmHWM"], "rss_after_bytes": after["VmRSS"], "anon_after_bytes": after["RssAnon"],
            "file_after_bytes": after["RssFile"], "still_mapped": mapped_files(files)}


def measure(path: str, threads: Optional[int] = None) -> dict:
    """:func:`measure_here` in a fresh interpreter (the peak RSS of this one says nothing about the load)."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    p = subprocess.run([sys.executable, "-m", "hf_w4.tools.bench.memory", "--one", path], env=env,
                       capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"measuring {path} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def target_bytes(r: dict) -> float:
    """What the load may add to the process's RSS before it: the model once, 15 % of it and 256 MiB for the modules
    the load imports and its transient buffers."""
    return r["rss_before_bytes"] + 1.15 * r["footprint_bytes"] + 256 * MIB


def table(results: List[dict]) -> str:
    rows = ["| checkpoint | size | footprint | RSS before | peak RSS | RSS after (anon + file) | target | load | GB/s "
            "| mapped |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        target = target_bytes(r)
        ok = r["peak_rss_bytes"] <= target and r["rss_after_bytes"] <= target
        rows.append(
            f"| {Path(r['path']).name} | {r['checkpoint_bytes'] / 1e9:.2f} GB ({r['files']} files) "
            f"| {r['footprint_bytes'] / MIB:.0f} MiB | {r['rss_before_bytes'] / MIB:.0f} MiB "
            f"| {r['peak_rss_bytes'] / MIB:.0f} MiB "
            f"| {r['rss_after_bytes'] / MIB:.0f} MiB ({r['anon_after_bytes'] / MIB:.0f} + "
            f"{r['file_after_bytes'] / MIB:.0f}) | {target / MIB:.0f} MiB {'ok' if ok else 'MISSED'} "
            f"| {r['wall_s']:.1f} s | {r['checkpoint_bytes'] / 1e9 / r['wall_s']:.2f} "
            f"| {len(r['still_mapped']) or 'none'} |")
    return "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--one"]:          # the child process of measure()
        print(json.dumps(measure_here(argv[1])))
        return 0
    if argv[:1] == ["write"]:
        ap = argparse.ArgumentParser(prog="python -m hf_w4.tools.bench.memory write",
                                     description="write Llama-shaped sharded int4 checkpoints for the measurement")
        ap.add_argument("out", type=Path)
        ap.add_argument("--formats", default=",".join(FORMATS))
        ap.add_argument("--layers", type=int, default=32)
        ap.add_argument("--base-layers", type=int, default=2, help="decoder layers quantized (the rest are copies)")
        ap.add_argument("--intermediate", type=int, default=11008)
        ap.add_argument("--shard-gb", type=float, default=1.0)
        a = ap.parse_args(argv[1:])
        if a.layers < 1 or a.base_layers < 1 or a.shard_gb <= 0:
            ap.error("--layers, --base-layers and --shard-gb must be positive")
        write(a.out, [f.strip() for f in a.formats.split(",") if f.strip()], a.layers, a.base_layers,
              a.intermediate, a.shard_gb)
        return 0
    ap = argparse.ArgumentParser(prog="python -m hf_w4.tools.bench.memory", description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+", help="checkpoint directories (e.g. written by the 'write' command)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the loading process")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args(argv)
    if sys.platform != "linux":
        ap.error("the measurement reads /proc/self/status and /proc/self/maps: Linux only")
    results = [measure(p, a.threads) for p in a.paths]
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
