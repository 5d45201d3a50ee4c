"""Kernel selection: an explicit, ordered list; every rejection keeps its reason.

Knobs (strongest first): the config's ``kernel=`` (force one kernel by name) and
``disabled_kernels=``; the environment variables ``HF_W4_KERNEL`` and ``HF_W4_DISABLED_KERNELS``
(comma-separated names). A forced kernel that cannot implement a layer is an error that says why.
The reference kernel is always implementable; when it is chosen because nothing faster can run,
a warning is logged once per reason set.
"""
from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Sequence, Tuple, Type

import torch

from ..formats.spec import W4Spec
from .base import Kernel
from .reference import TorchReferenceKernel

logger = logging.getLogger("hf_w4")

_KERNELS: List[Type[Kernel]] = []
_warned: set = set()


def register(cls: Type[Kernel]) -> Type[Kernel]:
    """Add a kernel class (idempotent); the list stays sorted by PRIORITY, highest first."""
    if cls not in _KERNELS:
        _KERNELS.append(cls)
        _KERNELS.sort(key=lambda c: -c.PRIORITY)
    return cls


def kernels() -> List[Type[Kernel]]:
    _load_builtin()
    return list(_KERNELS)


def by_name(name: str) -> Type[Kernel]:
    for k in kernels():
        if k.NAME == name:
            return k
    raise ValueError(f"unknown kernel {name!r}; available: {[k.NAME for k in kernels()]}")


_loaded = False


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    register(TorchReferenceKernel)
    import importlib
    for mod in ("cpu_w4a16", "cpu_int8", "zentorch"):
        try:
            importlib.import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as e:  # a kernel module not present in this build of hf_w4
            if e.name != f"{__package__}.{mod}":
                raise


def _env_list(var: str) -> List[str]:
    return [s.strip() for s in os.environ.get(var, "").split(",") if s.strip()]


def select(spec: W4Spec, n: int, k: int, device: torch.device, dtype: torch.dtype,
           force: Optional[str] = None, deny: Sequence[str] = (), name: str = "<module>"
           ) -> Tuple[Type[Kernel], Dict[str, str]]:
    """Pick the best kernel for one layer. Returns (kernel class, {rejected kernel: reason})."""
    force = force or os.environ.get("HF_W4_KERNEL") or None
    if force == "auto":
        force = None
    deny = set(deny) | set(_env_list("HF_W4_DISABLED_KERNELS"))
    device = torch.device(device)
    reasons: Dict[str, str] = {}
    if force is not None:
        cls = by_name(force)
        ok, why = cls.can_implement(spec, n, k, device, dtype)
        if not ok:
            raise ValueError(f"{name}: kernel {force!r} was forced (kernel= or HF_W4_KERNEL) but cannot run this "
                             f"layer ({spec.describe()}, N={n}, K={k}, {device.type}, {dtype}): {why}")
        return cls, reasons
    for cls in kernels():
        if cls.NAME in deny:
            reasons[cls.NAME] = "disabled (disabled_kernels= or HF_W4_DISABLED_KERNELS)"
            continue
        ok, why = cls.can_implement(spec, n, k, device, dtype)
        if ok:
            if cls is TorchReferenceKernel and reasons:
                key = (spec.describe(), tuple(sorted(reasons.items())))
                if key not in _warned:
                    _warned.add(key)
                    logger.warning("hf_w4: no fast kernel can run %s (%s); using the slow pure-PyTorch reference. "
                                   "Reasons: %s", name, spec.describe(),
                                   "; ".join(f"{a}: {b}" for a, b in reasons.items()))
            return cls, reasons
        reasons[cls.NAME] = why
    raise ValueError(f"{name}: no kernel can run {spec.describe()} (N={n}, K={k}, {device.type}, {dtype}). Reasons:\n"
                     + "\n".join(f"  {a}: {b}" for a, b in reasons.items()))


def support_matrix() -> str:
    """A markdown table of every kernel's declarations (for the README; generated, not hand-written)."""
    rows = ["| kernel | priority | devices | weight types | layouts | activations | act dtypes | groups | "
            "g_idx | asym | usable here |", "|---" * 11 + "|"]
    for c in kernels():
        ok, why = c.is_supported()
        rows.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            c.NAME, c.PRIORITY, ", ".join(c.DEVICES), ", ".join(sorted(c.WEIGHT_TYPES)),
            "all" if c.LAYOUTS is None else ", ".join(sorted(c.LAYOUTS)), ", ".join(sorted(c.ACTIVATIONS)),
            ", ".join(str(d).replace("torch.", "") for d in c.ACT_DTYPES),
            "any dividing K" if c.GROUP_SIZES is None else ", ".join(map(str, sorted(c.GROUP_SIZES))),
            "yes" if c.SUPPORTS_G_IDX else "no", "yes" if c.SUPPORTS_ASYM else "no",
            "yes" if ok else f"no: {why}"))
    return "\n".join(rows)
