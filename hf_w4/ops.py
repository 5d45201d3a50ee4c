"""THE op list of hf_w4: schemas (torch.library), fake implementations for torch.compile, and
typed wrappers. C++ sources only hold TORCH_LIBRARY_IMPL(hf_w4, CPU/CUDA, m) blocks."""
from __future__ import annotations

import torch

lib = torch.library.Library("hf_w4", "DEF")


def has_impl(op: str, device: str = "CPU") -> bool:
    """Does ``torch.ops.hf_w4.<op>`` have a kernel for the dispatch key ``device`` (e.g. "CPU")?"""
    from . import _ext
    _ext.load()
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"hf_w4::{op}", device)
    except RuntimeError:
        return False
