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
    if q.get("dynamic"):
        raise NotImplementedError("gptq 'dynamic' per-module overrides are not supported")
    spec = W4Spec(method="gptq", layout="gptq", weight_type="int4", bits=4, group_size=group_of("gptq", q),
                  sym=bool(q.get("sym", True)), zero_plus_one=_FORMATS[fmt], desc_act=bool(q.get("desc_act", False)))
    return FormatConfig("gptq", spec, blocks=blocks_of(q.get("block_name_to_quantize")),
                        quantize_lm_head=bool(q.get("lm_head", False)))
