"""``quant_method: auto-round`` (formats.md §1/§2 and the dispatch table §7)."""
from __future__ import annotations

import re

from .spec import FormatConfig, W4Spec
from ._common import blocks_of, check_bits

# packing_format -> (layout, GPTQ v1 zero-1)
PACKING = {
    "auto_round:auto_gptq": ("gptq", True),
    "auto_round:gptq": ("gptq", True),
    "auto_round:auto_awq": ("awq", False),
    "auto_round:awq": ("awq", False),
    "auto_round": ("gptq", False),
    "auto_round:gptqmodel": ("gptq", False),
}


def _spec(q: dict, packing: str, where: str) -> W4Spec:
    if packing not in PACKING:
        raise NotImplementedError(f"auto-round{where}: packing_format {packing!r} is not supported; "
                                  f"supported: {sorted(PACKING)}")
    dt = q.get("data_type", "int")
    if dt not in ("int", "int_sym", "int_asym"):
        raise NotImplementedError(f"auto-round{where}: data_type {dt!r} is not supported; supported: ['int']")
    check_bits(f"auto-round{where}", q.get("bits", 4))
    if q.get("act_bits", 16) not in (None, 16, 32):
        raise NotImplementedError(f"auto-round{where}: act_bits={q.get('act_bits')} (activation quantization) "
                                  "is not supported; supported: 16 (weight-only)")
    layout, v1 = PACKING[packing]
    g = q.get("group_size", 128)
    return W4Spec(method="auto-round", layout=layout, weight_type="int4", bits=4,
                  group_size=-1 if g in (None, 0, -1) else int(g), sym=bool(q.get("sym", True)), zero_plus_one=v1)


def _pattern(name: str) -> str:
    # extra_config keys are module names; auto-round also accepts regular expressions
    return name if re.fullmatch(r"[\w.]+", name) else "re:" + name


def parse(q: dict) -> FormatConfig:
    packing = q.get("packing_format") or "auto_round:auto_gptq"
    default = _spec(q, packing, "")
    rules = []
    lm_head = bool(q.get("quant_lm_head", False))
    for name, over in (q.get("extra_config") or {}).items():
        merged = {**q, **over}
        bits = merged.get("bits", 4)
        if bits is None or bits >= 16 or merged.get("data_type") in ("float", "fp"):
            rules.append(((_pattern(name),), None))
        else:
            rules.append(((_pattern(name),), _spec(merged, merged.get("packing_format", packing), f" ({name})")))
    return FormatConfig("auto-round", default, rules=rules,
                        blocks=blocks_of(q.get("block_name_to_quantize") or q.get("to_quant_block_names")),
                        quantize_lm_head=lm_head)
