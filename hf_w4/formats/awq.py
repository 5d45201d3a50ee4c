"""``quant_method: awq`` (formats.md §2): only the GEMM layout exists on disk in a form we read."""
from __future__ import annotations

from .spec import FormatConfig, W4Spec
from ._common import blocks_of, check_bits, group_of

SUPPORTED_VERSIONS = ("gemm",)


def parse(q: dict) -> FormatConfig:
    check_bits("awq", q.get("bits", q.get("w_bit", 4)))
    version = str(q.get("version") or q.get("format") or "gemm").lower()
    if version not in SUPPORTED_VERSIONS:
        raise NotImplementedError(f"awq version {version!r} is not supported; supported: {list(SUPPORTED_VERSIONS)}")
    spec = W4Spec(method="awq", layout="awq", weight_type="int4", bits=4,
                  group_size=group_of("awq", q, q.get("q_group_size", 128)),
                  sym=not bool(q.get("zero_point", True)))
    skip = tuple(q.get("modules_to_not_convert") or ())
    return FormatConfig("awq", spec, rules=[(skip, None)] if skip else [],
                        blocks=blocks_of(q.get("to_quant_block_names") or q.get("block_name_to_quantize")))
