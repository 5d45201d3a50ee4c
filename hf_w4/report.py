"""What a loaded model runs on: per layer format, kernel, why the other kernels were rejected, memory."""
from __future__ import annotations

import re
from typing import Dict, List

from torch import nn

from .nn import QuantLinear


def layer_table(model: nn.Module) -> List[Dict]:
    rows = []
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            rows.append({"name": name, "format": f"{m.spec.method}:{m.spec.describe()}",
                         "kernel": str(m.kernel), "rejected": dict(m.kernel_reasons),
                         "packed_bytes": m.packed_bytes(), "dense_bytes": m.in_features * m.out_features * 2})
    return rows


def kernel_report(model: nn.Module, per_layer: bool = False) -> str:
    """The kernel each quantized layer runs on and why the others were rejected. Layers that differ only in their
    numbers (``model.layers.3.mlp.experts.17.up_proj``) and agree in format, kernel and reasons share one line,
    ``model.layers.*.mlp.experts.*.up_proj (96 layers): ...`` (an MoE model has thousands); ``per_layer``: one line
    per layer."""
    groups: Dict[tuple, List[str]] = {}
    for r in layer_table(model):
        why = "; ".join(f"{k}: {v}" for k, v in r["rejected"].items()) or "-"
        pattern = r["name"] if per_layer else re.sub(r"(?<=\.)\d+(?=\.|$)", "*", r["name"])
        groups.setdefault((pattern, r["format"], r["kernel"], why), []).append(r["name"])
    lines = []
    for (pattern, fmt, kernel, why), names in groups.items():
        label = names[0] if len(names) == 1 else f"{pattern} ({len(names)} layers)"
        lines.append(f"{label}: {fmt} -> {kernel} (rejected: {why})")
    # MoE layers of per-expert QuantLinears (hf_w4.loading.moe.UnfusedExperts): one call per step, or why not
    moe: Dict[tuple, List[str]] = {}
    for name, m in model.named_modules():
        if callable(getattr(m, "one_call_summary", None)):
            pattern = name if per_layer else re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)
            moe.setdefault((pattern, m.one_call_summary()), []).append(name)
    for (pattern, summary), names in moe.items():
        label = names[0] if len(names) == 1 else f"{pattern} ({len(names)} layers)"
        lines.append(f"{label}: {summary}")
    return "\n".join(lines) if lines else "no hf_w4 QuantLinear modules"
