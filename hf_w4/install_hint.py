"""What ``import hf_w4`` changes: only error messages, so that forgetting ``hf_w4.install()`` is a clear error.

Without ``install()``, transformers handles the quant methods hf_w4 takes over with its own quantizers, which ask for
the producer's library ("requires gptqmodel", "pip install optimum", "compressed-tensors>=0.15.0 is required",
...). Once transformers' model code is imported (not before: ``import hf_w4`` stays cheap and imports neither torch
nor transformers), ``transformers.modeling_utils.get_hf_quantizer`` (where ``from_pretrained`` parses the
quantization config, builds the quantizer and checks its environment) is wrapped: an ImportError or RuntimeError it
raises for one of hf_w4's methods that hf_w4 is not installed for gets one more sentence naming the fix. Arguments,
results and exception types stay the same; nothing else changes.
"""
from __future__ import annotations

import functools
import sys

from .import_hook import when_imported

# the quant_method values hf_w4 loads (hf_w4.loading.CONFIGS; listed here so that this module imports nothing heavy)
METHODS = ("gptq", "awq", "auto-round", "compressed-tensors", "modelopt")


def enable() -> None:
    when_imported("transformers.modeling_utils", _wrap)


def _wrap(module) -> None:
    original = module.get_hf_quantizer
    if getattr(original, "_hf_w4_install_hint", False):
        return

    @functools.wraps(original)
    def get_hf_quantizer(config, quantization_config, *args, **kwargs):
        try:
            return original(config, quantization_config, *args, **kwargs)
        except (ImportError, RuntimeError) as e:
            method = _quant_method(config, quantization_config)
            if method not in METHODS or method in _installed():
                raise
            cls = ImportError if isinstance(e, ImportError) else RuntimeError
            raise cls(f"{e}\nhf_w4 is imported but not installed, so transformers handled this {method} checkpoint "
                      "itself. To load it with hf_w4 (no producer library needed), call hf_w4.install() before "
                      "from_pretrained, or import hf_w4.auto") from e

    get_hf_quantizer._hf_w4_install_hint = True
    module.get_hf_quantizer = get_hf_quantizer


def _quant_method(config, quantization_config):
    q = quantization_config
    if q is None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        q = getattr(config, "quantization_config", None) or getattr(text, "quantization_config", None)
    method = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
    return getattr(method, "value", method)


def _installed() -> tuple:
    integration = sys.modules.get("hf_w4.integration")
    return integration.installed() if integration is not None else ()
