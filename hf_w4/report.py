"""What a loaded model runs on: per layer format, kernel, why the other kernels were rejected, memory."""
from __future__ import annotations

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


def kernel_report(model: nn.Module) -> str:
    """One line per quantized layer: kernel used and why the others were rejected."""
    lines = []
    for r in layer_table(model):
        why = "; ".join(f"{k}: {v}" for k, v in r["rejected"].items()) or "-"
        lines.append(f"{r['name']}: {r['format']} -> {r['kernel']} (rejected: {why})")
    return "\n".join(lines) if lines else "no hf_w4 QuantLinear modules"
