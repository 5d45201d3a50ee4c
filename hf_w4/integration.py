"""The single place that edits transformers' quantizer registry.

transformers refuses to re-register its built-in methods (``register_quantizer("awq")`` raises) and rejects a
user config whose class name differs from the checkpoint's, so hf_w4 takes over by replacing mapping entries —
explicitly (``install()``), reversibly (``uninstall()``), and only for the methods asked for:

* ``AUTO_QUANTIZER_MAPPING[m]`` -> hf_w4's quantizer, ``AUTO_QUANTIZATION_CONFIG_MAPPING[m]`` -> hf_w4's
  same-named config class (parses without compressed-tensors/auto-round/gptqmodel);
* ``modelopt`` (not known to transformers) is added to both, and its config class to
  ``LOADING_ATTRIBUTES_CONFIG_TYPES`` so loading attributes reach it;
* ``quantizers.auto.AutoRoundConfig`` (transformers parses any checkpoint with it when the user passes an
  AutoRoundConfig) -> hf_w4's AutoRoundConfig;
* ``modeling_utils.get_hf_quantizer`` is wrapped (with ``modelopt``): a local checkpoint whose config.json has no
  quantization_config but which carries ModelOpt's ``hf_quant_config.json`` with a ``quant_algo`` (older ModelOpt
  exports; vLLM reads them the same way) loads as if ``quantization_config=ModelOptConfig()`` had been passed —
  without it transformers builds a dense model and fails on the packed tensors' shapes. (transformers does not pass
  ``subfolder`` on, so a checkpoint in a subfolder needs the explicit ``ModelOptConfig()``.)

``PreTrainedModel.resize_token_embeddings`` is wrapped too: with a quantized output embedding it raises before
anything changes (transformers resizes the input embeddings first, then fails on the packed head, leaving the model
half resized).

``install()`` also lets PEFT's LoRA wrap ``QuantLinear`` layers (``hf_w4.lora``); ``uninstall()`` leaves that in
place, since it only ever matches layers hf_w4 loaded.

Not thread-safe (it edits module-level dicts); call it once per process — every ``accelerate launch`` rank
runs its own script, so put ``hf_w4.install()`` (or ``import hf_w4.auto``) at the top of it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
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
        if m == "modelopt":
            from transformers import modeling_utils
            _extra["get_hf_quantizer"] = modeling_utils.get_hf_quantizer
            modeling_utils.get_hf_quantizer = _get_hf_quantizer
    if "resize_token_embeddings" not in _extra:
        from transformers import PreTrainedModel
        _extra["resize_token_embeddings"] = PreTrainedModel.resize_token_embeddings
        PreTrainedModel.resize_token_embeddings = _resize_token_embeddings
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
    if "get_hf_quantizer" in _extra:
        from transformers import modeling_utils
        modeling_utils.get_hf_quantizer = _extra.pop("get_hf_quantizer")
    if "resize_token_embeddings" in _extra:
        from transformers import PreTrainedModel
        PreTrainedModel.resize_token_embeddings = _extra.pop("resize_token_embeddings")


def _resize_token_embeddings(self, *args, **kwargs):
    from .nn import QuantLinear
    head = self.get_output_embeddings()
    if isinstance(head, QuantLinear):
        raise AttributeError(
            f"resize_token_embeddings: {head.name} is an hf_w4 QuantLinear ({head.spec.method}, "
            f"{head.spec.describe()}) that cannot be resized; nothing was changed. It works after model.dequantize(), "
            "or with a checkpoint that leaves this module dense")
    return _extra["resize_token_embeddings"](self, *args, **kwargs)


def modelopt_sidecar_algo(config) -> Optional[str]:
    """The ``quant_algo`` of a local ModelOpt export whose config.json has no quantization_config but which carries
    ``hf_quant_config.json`` (``config``: the loaded config), else None. A file that is not ModelOpt's JSON object is
    an error naming it (the checkpoint next to it is most likely packed: loading it dense would fail obscurely)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    quantized = getattr(config, "quantization_config", None) is not None or \
        getattr(text, "quantization_config", None) is not None
    path = str(getattr(config, "_name_or_path", "") or "")
    side = os.path.join(path, "hf_quant_config.json")
    if quantized or not path or not os.path.isfile(side):
        return None
    try:
        with open(side) as f:
            q = json.load(f)
        algo = (q.get("quantization") or {}).get("quant_algo")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{side}: cannot read ModelOpt's quantization from it ({type(e).__name__}: {e}); config.json "
                         "has no quantization_config, so hf_w4 looked there") from None
    return algo or None  # a KV-cache-only export (quant_algo null) stays a dense model


def _get_hf_quantizer(config, quantization_config, *args, **kwargs):
    algo = None
    if quantization_config is None and kwargs.get("gguf_file") is None:
        algo = modelopt_sidecar_algo(config)
    if algo:
        from .formats.modelopt import ALGOS
        from .quantizers.config import ModelOptConfig
        if algo not in ALGOS:
            raise NotImplementedError(
                f"{os.path.join(str(config._name_or_path), 'hf_quant_config.json')}: ModelOpt quant_algo {algo!r} is "
                f"not supported (supported: {sorted(ALGOS)}); hf_w4 read this file because config.json has no "
                "quantization_config. To load the directory without it: hf_w4.install() without 'modelopt', or "
                "remove the file")
        quantization_config = ModelOptConfig()
    return _extra["get_hf_quantizer"](config, quantization_config, *args, **kwargs)


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
