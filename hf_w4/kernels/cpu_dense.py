"""cpu_dense: the unquantized bf16 / fp16 ``nn.Linear`` layers of a model hf_w4 loaded (the LM head above all) at
decode.

Producers leave the LM head (often tied to the embedding) and any layers on their ignore list dense. At decode
such a layer is bound by its weight stream like a 4-bit one, but at::linear's small-M bf16 GEMM streams at about
half the rate of the 4-bit kernels, so a dense LM head can take a third of a small model's decode time.
``DenseDecodeLinear`` runs ``hf_w4::cpu_dense_gemv`` (csrc/cpu/dense_gemv*.cpp) for CPU calls of at most
``MAX_ROWS`` rows without autograd, and ``F.linear`` for everything else. It is an ``nn.Linear`` subclass that only
changes ``forward``: the parameters (shared with a tied embedding), the state dict, hooks and ``save_pretrained``
stay as they are. ``HF_W4_DENSE_DECODE=0`` keeps plain ``nn.Linear``. Measurements: docs/cpu-kernels.md ("Dense
layers at decode").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import env, ops

MAX_ROWS = 4   # the op's limit (kDenseMaxM in csrc/cpu/dense_gemv.h); above it at::linear's GEMM is the better one
_DTYPES = (torch.bfloat16, torch.float16)


class DenseDecodeLinear(nn.Linear):
    """``nn.Linear`` whose small-M CPU calls run the compiled dense GEMV."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
        if (0 < rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == w.dtype and w.device.type == "cpu"
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            y = torch.ops.hf_w4.cpu_dense_gemv(x.reshape(rows, x.shape[-1]), w, self.bias)
            return y.reshape(*x.shape[:-1], w.shape[0])
        return F.linear(x, w, self.bias)


def available() -> bool:
    return ops.has_impl("cpu_dense_gemv")


def adopt(model: nn.Module) -> int:
    """Turn every plain bf16 / fp16 ``nn.Linear`` of ``model`` into a ``DenseDecodeLinear`` in place; the count."""
    if env.text("HF_W4_DENSE_DECODE").strip() and not env.switch("HF_W4_DENSE_DECODE"):
        return 0
    if not available():
        return 0
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype in _DTYPES:
            m.__class__ = DenseDecodeLinear
            n += 1
    return n


def report_lines(model: nn.Module):
    """``(name, text)`` for every ``DenseDecodeLinear`` (hf_w4.report.kernel_report)."""
    return [(name, f"dense {str(m.weight.dtype).removeprefix('torch.')} -> cpu_dense at M <= {MAX_ROWS} on CPU, "
                   "F.linear otherwise")
            for name, m in model.named_modules() if isinstance(m, DenseDecodeLinear)]
