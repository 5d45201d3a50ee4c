"""What a loaded model runs on: per layer format, kernel, why the other kernels were rejected, memory."""
from __future__ import annotations

import re
from typing import Dict, List

from torch import nn

from .kernels import cpu_dense
from .nn import QuantLinear


def layer_table(model: nn.Module) -> List[Dict]:
    rows = []
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            rows.append({"name": name, "format": f"{m.spec.method}:{m.spec.describe()}",
                         "kernel": str(m.kernel), "rejected": dict(m.kernel_reasons),
                         "packed_bytes": m.packed_bytes(), "dense_bytes": m.in_features * m.out_features * 2})
    return rows


def _grouped(items, per_layer: bool) -> List[str]:
    """``name: text`` lines; names that differ only in their numbers and share the text on one line
    (``model.layers.*.mlp.experts.*.up_proj (96 layers): text``) unless ``per_layer``."""
    groups: Dict[tuple, List[str]] = {}
    for name, text in items:
        pattern = name if per_layer else re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)
        groups.setdefault((pattern, text), []).append(name)
    return [f"{names[0] if len(names) == 1 else f'{pattern} ({len(names)} layers)'}: {text}"
            for (pattern, text), names in groups.items()]


def kernel_report(model: nn.Module, per_layer: bool = False) -> str:
    """The kernel each quantized layer runs on and why the others were rejected. Layers that differ only in their
    numbers (``model.layers.3.mlp.experts.17.up_proj``) and agree in format, kernel and reasons share one line,
    ``model.layers.*.mlp.experts.*.up_proj (96 layers): ...`` (an MoE model has thousands); ``per_layer``: one line
    per layer. MoE layers of per-expert QuantLinears (``hf_w4.loading.moe.UnfusedExperts``) add a line each: one
    call per step, or why not; dense layers on the decode GEMV (``hf_w4.kernels.cpu_dense``) too."""
    layers = []
    for r in layer_table(model):
        why = "; ".join(f"{k}: {v}" for k, v in r["rejected"].items()) or "-"
        layers.append((r["name"], f"{r['format']} -> {r['kernel']} (rejected: {why})"))
    moe = [(name, m.one_call_summary()) for name, m in model.named_modules()
           if callable(getattr(m, "one_call_summary", None))]
    lines = _grouped(layers, per_layer) + _grouped(moe, per_layer) + _grouped(cpu_dense.report_lines(model), per_layer)
    return "\n".join(lines) if lines else "no hf_w4 QuantLinear modules"
