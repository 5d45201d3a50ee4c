"""The single place that edits transformers' quantizer registry.

transformers refuses to re-register its built-in methods (``register_quantizer("awq")`` raises) and rejects a
user config whose class name differs from the checkpoint's, so hf_w4 takes over by replacing mapping entries —
explicitly (``install()``), reversibly (``uninstall()``), and only for the methods asked for:

* ``AUTO_QUANTIZER_MAPPING[m]`` -> hf_w4's quantizer, ``AUTO_QUANTIZATION_CONFIG_MAPPING[m]`` -> hf_w4's
  same-named config class (parses without compressed-tensors/auto-round/gptqmodel);
* ``modelopt`` (not known to transformers) is added to both, and its config class to
  ``LOADING_ATTRIBUTES_CONFIG_TYPES`` so loading attributes reach it;
* ``quantizers.auto.AutoRoundConfig`` (transformers parses any checkpoint with it when the user passes an
  AutoRoundConfig) -> hf_w4's AutoRoundConfig.

``install()`` also lets PEFT's LoRA wrap ``QuantLinear`` layers (``hf_w4.lora``); ``uninstall()`` leaves that in
place, since it only ever matches layers hf_w4 loaded.

Not thread-safe (it edits module-level dicts); call it once per process — every ``accelerate launch`` rank
runs its own script, so put ``hf_w4.install()`` (or ``import hf_w4.auto``) at the top of it.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterable, Optional

from . import lora

logger = logging.getLogger("hf_w4")
_saved: dict = {}   # method -> (quantizer or None, config or None)
_extra: dict = {}


def installed() -> tuple:
    return tuple(_saved)


def install(methods: Optional[Iterable[str]] = None) -> None:
    """Make transformers load ``methods`` (default: all of gptq, awq, auto-round, compressed-tensors, modelopt)
    through hf_w4. Idempotent."""
    from transformers.quantizers import auto as qauto

    from .quantizers import CONFIGS, QUANTIZERS
    methods = list(CONFIGS) if methods is None else list(methods)
    for m in methods:
        if m not in CONFIGS:
            raise ValueError(f"hf_w4 cannot install {m!r}; supported methods: {list(CONFIGS)}")
        if m in _saved:
            continue
        _saved[m] = (qauto.AUTO_QUANTIZER_MAPPING.get(m), qauto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(m))
        qauto.AUTO_QUANTIZER_MAPPING[m] = QUANTIZERS[m]
        qauto.AUTO_QUANTIZATION_CONFIG_MAPPING[m] = CONFIGS[m]
        if m == "modelopt" and CONFIGS[m] not in qauto.LOADING_ATTRIBUTES_CONFIG_TYPES:
            _extra["loading_types"] = qauto.LOADING_ATTRIBUTES_CONFIG_TYPES
            qauto.LOADING_ATTRIBUTES_CONFIG_TYPES = qauto.LOADING_ATTRIBUTES_CONFIG_TYPES + (CONFIGS[m],)
        if m == "auto-round":
            _extra["AutoRoundConfig"] = qauto.AutoRoundConfig
            qauto.AutoRoundConfig = CONFIGS[m]
    lora.enable()  # PEFT's LoRA takes QuantLinear layers (process-wide; only ever matches hf_w4 layers)
    logger.info("hf_w4: installed for %s", ", ".join(_saved))


def uninstall() -> None:
    """Restore transformers' own entries for every method hf_w4 took over."""
    from transformers.quantizers import auto as qauto
    for m, (q, c) in list(_saved.items()):
        for mapping, orig in ((qauto.AUTO_QUANTIZER_MAPPING, q), (qauto.AUTO_QUANTIZATION_CONFIG_MAPPING, c)):
            if orig is None:
                mapping.pop(m, None)
            else:
                mapping[m] = orig
        del _saved[m]
    if "loading_types" in _extra:
        qauto.LOADING_ATTRIBUTES_CONFIG_TYPES = _extra.pop("loading_types")
    if "AutoRoundConfig" in _extra:
        qauto.AutoRoundConfig = _extra.pop("AutoRoundConfig")


@contextlib.contextmanager
def enabled(methods: Optional[Iterable[str]] = None):
    """``with hf_w4.enabled(): AutoModelForCausalLM.from_pretrained(...)`` — install for the block only
    (methods that were already installed stay installed)."""
    before = set(_saved)
    install(methods)
    try:
        yield
    finally:
        if set(_saved) - before:
            # uninstall everything, then put back what was installed before the block
            uninstall()
            if before:
                install(before)
