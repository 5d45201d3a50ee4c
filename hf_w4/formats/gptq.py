"""``quant_method: gptq`` (docs/formats.md, GPTQ)."""
from __future__ import annotations

from .spec import FormatConfig, W4Spec
from ._common import blocks_of, check_bits, check_group, check_regex, group_of, names_of

# checkpoint_format -> does the file store zero-1 ("v1")?
_FORMATS = {"gptq": True, "gptq_v1": True, "gptq_v2": False}


def parse(q: dict) -> FormatConfig:
    check_bits("gptq", q.get("bits", 4))
    fmt = q.get("checkpoint_format") or q.get("format") or "gptq"
    if fmt not in _FORMATS:
        raise NotImplementedError(f"gptq checkpoint_format {fmt!r} is not supported; supported: {sorted(_FORMATS)}")
    spec = W4Spec(method="gptq", layout="gptq", weight_type="int4", bits=4, group_size=group_of("gptq", q),
                  sym=bool(q.get("sym", True)), zero_plus_one=_FORMATS[fmt], desc_act=bool(q.get("desc_act", False)))
    # transformers' GPTQConfig / optimum ``modules_in_block_to_quantize`` (a list of lists of names relative to the
    # block): optimum quantizes only the block Linears whose full name ends with one of them (a plain
    # ``name.endswith``) and leaves the others dense
    keep = q.get("modules_in_block_to_quantize")
    block_modules = None
    if keep is not None:
        block_modules = tuple("suffix:" + n for n in names_of("gptq", "modules_in_block_to_quantize", keep))
    return FormatConfig("gptq", spec, rules=dynamic_rules("gptq", q.get("dynamic") or {}, spec),
                        blocks=blocks_of(q.get("block_name_to_quantize")),
                        quantize_lm_head=bool(q.get("lm_head", False)), block_modules=block_modules)


def dynamic_rules(method: str, dynamic: dict, spec: W4Spec, kind: str = "re:") -> list:
    """gptqmodel's ``dynamic``: ``"-:<regex>"`` leaves matching modules dense, ``"+:<regex>"`` (or a bare regex)
    overrides group_size / sym for them (other bit widths are not supported). gptqmodel's ``dynamic_get`` tries the
    keys in order and uses ``re.match`` (anchored at the start of the module name): ``kind="re:"``."""
    rules = []
    for key, over in dynamic.items():
        skip, pattern = key.startswith("-:"), key[2:] if key[:2] in ("-:", "+:") else key
        check_regex(method, "dynamic", pattern)
        if skip:
            rules.append(((kind + pattern,), None))
            continue
        over = over or {}
        check_bits(f"{method} dynamic {key!r}", over.get("bits", 4))
        g = check_group(f"{method} dynamic {key!r}", over.get("group_size", spec.group_size))
        rules.append(((kind + pattern,), spec.replace(group_size=g, sym=bool(over.get("sym", spec.sym)))))
    return rules
