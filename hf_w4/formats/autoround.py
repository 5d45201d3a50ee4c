"""``quant_method: auto-round`` (docs/formats.md: auto-round writes GPTQ- or AWQ-packed tensors)."""
from __future__ import annotations

import re

from .spec import FormatConfig, W4Spec
from ._common import blocks_of, check_bits, check_regex, group_of, names_of
from .gptq import dynamic_rules

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
    return W4Spec(method="auto-round", layout=layout, weight_type="int4", bits=4,
                  group_size=group_of(f"auto-round{where}", q), sym=bool(q.get("sym", True)), zero_plus_one=v1)


def _is_regex(key: str) -> bool:
    try:
        re.compile(key)
        return True
    except re.error:
        return False


def parse(q: dict) -> FormatConfig:
    """Module selection follows auto-round's own loader (``auto_round/inference/convert_model.py``,
    ``get_layer_config``), in its order of precedence:

    1. ``modules_to_not_convert``: a block module is dense when an entry matches its name with ``re.search``;
    2. ``modules_in_block_to_quantize`` (GPTQ-style): a block Linear that no entry matches with ``re.search`` stays
       dense; an ``extra_config`` key naming a module exactly configures it (outside the blocks ahead of 1, which
       only covers block modules: a quantized ``lm_head`` stays quantized when ``lm_head`` is also not converted);
    3. gptqmodel-style ``dynamic``, each key searched with ``re.search`` (auto-round's reading of it);
    4. every other ``extra_config`` key is a regular expression searched anywhere in the name, first key first
       (keys that do not compile are skipped, as auto-round skips them);
    5. the default inside ``block_name_to_quantize`` / ``to_quant_block_names``.

    Not modelled: auto-round applies a regex key only to block modules when it matches any, and tries an exact
    key as a regex only when no module has that name (hf_w4 does not know the module names when parsing).
    """
    packing = q.get("packing_format") or "auto_round:auto_gptq"
    default = _spec(q, packing, "")
    blocks = blocks_of(q.get("block_name_to_quantize") or q.get("to_quant_block_names"))
    specs = []
    for name, over in (q.get("extra_config") or {}).items():
        merged = {**q, **over}
        bits = merged.get("bits", 4)
        if bits is None or merged.get("data_type") in ("float", "fp") or (
                isinstance(bits, (int, float)) and not isinstance(bits, bool) and bits >= 16):
            specs.append((name, None))
        else:
            specs.append((name, _spec(merged, merged.get("packing_format", packing), f" extra_config[{name!r}]")))
    rules = [(("name:" + name,), spec) for name, spec in specs if not _in_blocks(name, blocks)]
    skip = names_of("auto-round", "modules_to_not_convert", q.get("modules_to_not_convert"))
    if skip:
        rules.append((tuple("search:" + check_regex("auto-round", "modules_to_not_convert", p) for p in skip), None))
    rules += [(("name:" + name,), spec) for name, spec in specs if _in_blocks(name, blocks)]
    rules += dynamic_rules("auto-round", q.get("dynamic") or {}, default, kind="search:")
    rules += [(("search:" + name,), spec) for name, spec in specs if _is_regex(name)]
    keep = q.get("modules_in_block_to_quantize")
    block_modules = None
    if keep is not None:
        block_modules = tuple("search:" + check_regex("auto-round", "modules_in_block_to_quantize", n)
                              for n in names_of("auto-round", "modules_in_block_to_quantize", keep))
    return FormatConfig("auto-round", default, rules=rules, blocks=blocks,
                        quantize_lm_head=bool(q.get("quant_lm_head", False)), block_modules=block_modules)


def _in_blocks(name: str, blocks) -> bool:
    if blocks is None:   # auto-round then finds the decoder blocks itself; lm_head is never one of them
        return not (name == "lm_head" or name.endswith(".lm_head"))
    return any(name == b or name.startswith(b + ".") for b in blocks)
