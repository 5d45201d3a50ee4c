"""``quant_method: gptq`` (formats.md §1)."""
from __future__ import annotations

from .spec import FormatConfig, W4Spec
from ._common import blocks_of, check_bits, group_of

# checkpoint_format -> does the file store zero-1 ("v1")?
_FORMATS = {"gptq": True, "gptq_v1": True, "gptq_v2": False}


def parse(q: dict) -> FormatConfig:
    check_bits("gptq", q.get("bits", 4))
    fmt = q.get("checkpoint_format") or q.get("format") or "gptq"
    if fmt not in _FORMATS:
        raise NotImplementedError(f"gptq checkpoint_format {fmt!r} is not supported; supported: {sorted(_FORMATS)}")
    spec = W4Spec(method="gptq", layout="gptq", weight_type="int4", bits=4, group_size=group_of("gptq", q),
                  sym=bool(q.get("sym", True)), zero_plus_one=_FORMATS[fmt], desc_act=bool(q.get("desc_act", False)))
    return FormatConfig("gptq", spec, rules=_dynamic_rules(q.get("dynamic") or {}, spec),
                        blocks=blocks_of(q.get("block_name_to_quantize")),
                        quantize_lm_head=bool(q.get("lm_head", False)))


def _dynamic_rules(dynamic: dict, spec: W4Spec) -> list:
    """gptqmodel's ``dynamic``: ``"-:<regex>"`` leaves matching modules dense, ``"+:<regex>"`` (or a bare regex)
    overrides group_size / sym for them (other bit widths are not supported)."""
    rules = []
    for key, over in dynamic.items():
        skip, pattern = key.startswith("-:"), key[2:] if key[:2] in ("-:", "+:") else key
        if skip:
            rules.append((("re:" + pattern,), None))
            continue
        over = over or {}
        check_bits(f"gptq dynamic {key!r}", over.get("bits", 4))
        g = over.get("group_size", spec.group_size)
        rules.append((("re:" + pattern,), spec.replace(group_size=-1 if g in (None, 0, -1) else int(g),
                                                       sym=bool(over.get("sym", spec.sym)))))
    return rules
