"""Small helpers shared by the format parsers."""
from __future__ import annotations

from typing import Optional, Tuple

SUPPORTED_BITS = (4,)


def check_bits(method: str, bits, supported=SUPPORTED_BITS) -> int:
    if bits not in supported:
        raise NotImplementedError(f"{method}: bits={bits} is not supported; supported bits: {list(supported)}")
    return bits


def group_of(method: str, q: dict, default: int = 128) -> int:
    g = q.get("group_size", default)
    g = -1 if g in (None, 0) else int(g)
    if g != -1 and g <= 0:
        raise ValueError(f"{method}: group_size={g} is invalid; expected a positive group size or -1 (per channel)")
    return g


def blocks_of(value) -> Optional[Tuple[str, ...]]:
    if not value:
        return None
    if isinstance(value, str):
        value = value.split(",")
    return tuple(v.strip() for v in value if v and v.strip())
