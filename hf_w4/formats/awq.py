"""``quant_method: awq`` (docs/formats.md, AWQ): only the GEMM layout exists on disk in a form we read."""
from __future__ import annotations

from .spec import FormatConfig, W4Spec
from ._common import blocks_of, check_bits, group_of, names_of

SUPPORTED_VERSIONS = ("gemm",)


def parse(q: dict) -> FormatConfig:
    check_bits("awq", q.get("bits", q.get("w_bit", 4)))
    version = str(q.get("version") or q.get("format") or "gemm").lower()
    if version not in SUPPORTED_VERSIONS:
        raise NotImplementedError(f"awq version {version!r} is not supported; supported: {list(SUPPORTED_VERSIONS)}")
    spec = W4Spec(method="awq", layout="awq", weight_type="int4", bits=4,
                  group_size=group_of("awq", q, q.get("q_group_size", 128)),
                  sym=not bool(q.get("zero_point", True)))
    # AutoAWQ leaves a Linear dense when any entry is a substring of its name (``exclude_layers_to_not_quantize``:
    # ``any(key in name for key in modules_to_not_convert)``; transformers 4's AWQ integration did the same on the
    # full name). A substring also covers the module prefixes ("model.layers.0", "visual") and suffixes
    # ("mlp.gate") that transformers 5 accepts; its regex entries are not AutoAWQ's and are not read as such.
    skip = tuple("sub:" + n for n in names_of("awq", "modules_to_not_convert", q.get("modules_to_not_convert")))
    return FormatConfig("awq", spec, rules=[(skip, None)] if skip else [],
                        blocks=blocks_of(q.get("to_quant_block_names") or q.get("block_name_to_quantize")))
