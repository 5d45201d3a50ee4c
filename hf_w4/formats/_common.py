"""Small helpers shared by the format parsers."""
from __future__ import annotations

import re
from typing import Optional, Tuple

SUPPORTED_BITS = (4,)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_bits(method: str, bits, supported=SUPPORTED_BITS) -> int:
    # a string is refused, not converted: the producers' own loaders (transformers' GPTQConfig / AwqConfig,
    # gptqmodel, auto-round) compare bits with integers and reject "4" too
    if not _is_number(bits):
        raise ValueError(f"{method}: bits must be an integer, found {bits!r} ({type(bits).__name__}); "
                         f"supported bits: {list(supported)}")
    if bits not in supported:
        raise NotImplementedError(f"{method}: bits={bits!r} is not supported; supported bits: {list(supported)}")
    return bits


def check_group(method: str, g) -> int:
    """A group size as the producers write it: a positive integer, or -1 / 0 / None for one group per channel."""
    if g is not None and (not _is_number(g) or g != int(g)):
        raise ValueError(f"{method}: group_size must be an integer, found {g!r} ({type(g).__name__}); "
                         "expected a positive group size or -1 (per channel)")
    g = -1 if g in (None, 0) else int(g)
    if g != -1 and g <= 0:
        raise ValueError(f"{method}: group_size={g} is invalid; expected a positive group size or -1 (per channel)")
    return g


def group_of(method: str, q: dict, default: int = 128) -> int:
    return check_group(method, q.get("group_size", default))


def check_regex(method: str, key: str, pattern) -> str:
    """A config entry the producer reads as a regular expression: refuse a broken one here, naming it, rather than
    with a bare re.error when the first module name is matched."""
    if not isinstance(pattern, str):
        raise ValueError(f"{method}: {key} entry {pattern!r} must be a string (a module name or regular expression)")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{method}: {key} entry {pattern!r} is not a valid regular expression ({e})") from None
    return pattern


def names_of(method: str, key: str, value) -> Tuple[str, ...]:
    """A list of module names / patterns (nested lists flattened, as in ``modules_in_block_to_quantize``)."""
    if isinstance(value, str):
        return (value,)
    out = []
    for v in value or ():
        if isinstance(v, (list, tuple)):
            out.extend(names_of(method, key, v))
        elif isinstance(v, str):
            out.append(v)
        else:
            raise ValueError(f"{method}: {key} entry {v!r} must be a module name (string)")
    return tuple(out)


def blocks_of(value) -> Optional[Tuple[str, ...]]:
    if not value:
        return None
    if isinstance(value, str):
        value = value.split(",")
    return tuple(v.strip() for v in value if v and v.strip())
