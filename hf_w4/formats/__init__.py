"""Checkpoint configs -> :class:`~hf_w4.formats.spec.FormatConfig` (pure Python, no ops)."""
from __future__ import annotations

from . import autoround, awq, compressed_tensors, gptq, modelopt
from .spec import FormatConfig, W4Spec

PARSERS = {
    "gptq": gptq.parse,
    "awq": awq.parse,
    "auto-round": autoround.parse,
    "compressed-tensors": compressed_tensors.parse,
    "modelopt": modelopt.parse,
}
METHODS = tuple(PARSERS)


def parse(q: dict) -> FormatConfig:
    """Parse a ``quantization_config`` dict (or a ModelOpt ``hf_quant_config.json``)."""
    method = q.get("quant_method") or ("modelopt" if "quantization" in q else None)
    method = getattr(method, "value", method)
    if method not in PARSERS:
        raise NotImplementedError(f"quant_method {method!r} is not handled by hf_w4; supported: {list(METHODS)}")
    return PARSERS[method](q)


__all__ = ["FormatConfig", "W4Spec", "METHODS", "parse"]
