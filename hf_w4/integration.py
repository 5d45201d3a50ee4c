"""Every change hf_w4 makes to transformers or PEFT, made here (or by a module this one calls) and only on request.

transformers refuses to re-register its built-in quant methods and rejects a user config whose class name differs
from the checkpoint's, so hf_w4 takes over by replacing entries, explicitly (``install()``), reversibly
(``uninstall()``) and only for the methods asked for. The complete list:

transformers (``install()`` sets, ``uninstall()`` restores):

* ``quantizers.auto.AUTO_QUANTIZER_MAPPING[m]`` / ``AUTO_QUANTIZATION_CONFIG_MAPPING[m]``: hf_w4's quantizer and
  its same-named config class (parses without the producer libraries); ``modelopt`` is added to both;
* ``quantizers.auto.LOADING_ATTRIBUTES_CONFIG_TYPES`` gains ``ModelOptConfig``, so loading attributes reach it;
* ``quantizers.auto.AutoRoundConfig``: transformers parses any checkpoint with it when the user passes one;
* ``modeling_utils.get_hf_quantizer`` (with ``modelopt``): a local ModelOpt export that has only
  ``hf_quant_config.json`` loads as if ``quantization_config=ModelOptConfig()`` had been passed;
* ``PreTrainedModel.resize_token_embeddings``: refuses a quantized output embedding before anything changes
  (transformers would resize the input embeddings first, then fail on the packed head);
* ``distributed.tensor_parallel.ALL_PARALLEL_STYLES`` gains ``hf_w4_<style>`` for each column- and row-parallel
  style: the same style, also splitting a QuantLinear's packed tensors (``hf_w4.loading.tensor_parallel``; the
  quantizer points a tp_plan's entries for quantized layers at them).

PEFT (``hf_w4.peft.lora.enable()``, at ``install()``; stays for the process, acts on ``QuantLinear`` layers only):

* ``peft.tuners.lora.model.LoraModel``: ``_create_new_module``, ``_replace_module``, ``_check_merge_allowed``,
  ``_check_new_adapter_config``, and ``peft.tuners.tuners_utils._maybe_include_all_linear_layers``;
* ``get_model_conversion_mapping`` in ``peft.utils.transformers_weight_conversion`` and
  ``transformers.integrations.peft``, and ``_convert_peft_config_moe``: MoE experts hf_w4 unfused keep per-expert
  LoRA targets.

Not thread-safe (it edits module-level dicts): call it once per process, e.g. at the top of each
``accelerate launch`` rank's script (``hf_w4.install()`` or ``import hf_w4.auto``).
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterable, Optional

from .formats.modelopt import ALGOS, sidecar_algo
from .loading import CONFIGS, QUANTIZERS
from .loading import tensor_parallel
from .loading.config import ModelOptConfig
from .nn import QuantLinear
from .peft import lora

logger = logging.getLogger("hf_w4")
_saved: dict = {}   # method -> (quantizer or None, config or None)
_extra: dict = {}


def installed() -> tuple:
    return tuple(_saved)


def install(methods: Optional[Iterable[str]] = None) -> None:
    """Make transformers load ``methods`` (default: all of gptq, awq, auto-round, compressed-tensors, modelopt)
    through hf_w4. Idempotent."""
    from transformers.quantizers import auto as qauto

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
    if "tp_styles" not in _extra:
        _extra["tp_styles"] = list(tensor_parallel.register_styles())
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
    if "tp_styles" in _extra:
        tensor_parallel.unregister_styles(_extra.pop("tp_styles"))
    if "resize_token_embeddings" in _extra:
        from transformers import PreTrainedModel
        PreTrainedModel.resize_token_embeddings = _extra.pop("resize_token_embeddings")


def _resize_token_embeddings(self, *args, **kwargs):
    head = self.get_output_embeddings()
    if isinstance(head, QuantLinear):
        raise AttributeError(
            f"resize_token_embeddings: {head.name} is an hf_w4 QuantLinear ({head.spec.method}, "
            f"{head.spec.describe()}) that cannot be resized; nothing was changed. It works after model.dequantize(), "
            "or with a checkpoint that leaves this module dense")
    return _extra["resize_token_embeddings"](self, *args, **kwargs)


def _get_hf_quantizer(config, quantization_config, *args, **kwargs):
    algo = None
    if quantization_config is None and kwargs.get("gguf_file") is None:
        algo = sidecar_algo(config)
    if algo:
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
