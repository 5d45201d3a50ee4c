"""hf_w4's quantization config classes.

Each subclasses the transformers class of the same name (so transformers' class-name check and its
``LOADING_ATTRIBUTES_CONFIG_TYPES`` isinstance check accept it; ModelOptConfig, which transformers lacks,
subclasses ``QuantizationConfigMixin``), never imports a producer library, keeps
the checkpoint's ``quantization_config`` dict verbatim (``to_dict`` returns it, so ``save_pretrained``
writes the producer's own config back), and carries hf_w4's loading attributes:

* ``kernel``: ``"auto"`` or a kernel name (``python -m hf_w4.kernels`` lists them) to force;
* ``disabled_kernels``: kernel names never to use;
* ``activation``: ``"auto"`` (what the checkpoint says), ``"none"`` (weight-only), ``"int8"`` (dynamic
  per-token int8 activations, W4A8/W8A8), ``"int8_group"`` (per token and weight group);
* ``compute_dtype``: dtype of activations and dense parts (default: the ``dtype`` given to from_pretrained);
* ``dequantize``: load, then replace every quantized Linear by a dense ``nn.Linear``.

Constructing one changes nothing global: ``from_pretrained`` refuses a config whose method hf_w4 has not taken
over (``hf_w4.install()``), since transformers would otherwise load the checkpoint with its own quantizer.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import torch
import transformers
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..formats.modelopt import sidecar_algo

LOADING_ATTRIBUTES: Dict[str, Any] = {"kernel": "auto", "disabled_kernels": (), "activation": "auto",
                                      "compute_dtype": None, "dequantize": False}
ACTIVATION_MODES = {"auto": None, "none": "none", "int8": "int8_token", "int8_token": "int8_token",
                    "int8_group": "int8_group"}
# the activation dtypes the kernels run, by every name hf_w4 accepts (torch's, its aliases, the short ones)
DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def float_dtype(value, what: str = "dtype") -> torch.dtype:
    """``value`` (a torch dtype, or a name of :data:`DTYPE_NAMES`, optionally ``"torch."``-prefixed) as a torch
    dtype; anything else is a ValueError naming ``what``."""
    if isinstance(value, str) and value.replace("torch.", "", 1) in DTYPE_NAMES:
        return DTYPE_NAMES[value.replace("torch.", "", 1)]
    if isinstance(value, torch.dtype) and value in DTYPE_NAMES.values():
        return value
    raise ValueError(f"{what}={value!r} is not supported; supported: torch.float32 / torch.bfloat16 / torch.float16 "
                     f"or their names {sorted(DTYPE_NAMES)}")


def _compute_dtype(value):
    if value is None:   # the dtype given to from_pretrained
        return None
    return float_dtype(value, "compute_dtype")


def _check(name: str, value):
    if name == "activation" and value not in ACTIVATION_MODES:
        raise ValueError(f"activation={value!r} is not supported; supported: {sorted(ACTIVATION_MODES)}")
    if name == "compute_dtype":
        value = _compute_dtype(value)
    if name == "disabled_kernels":
        value = tuple([value] if isinstance(value, str) else value or ())
    return value


class HfW4ConfigMixin:
    METHOD: str = ""
    _raw: Optional[dict] = None

    def __init__(self, **loading):
        unknown = set(loading) - set(LOADING_ATTRIBUTES)
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown argument(s) {sorted(unknown)}; "
                            f"loading attributes: {sorted(LOADING_ATTRIBUTES)}")
        self._raw = None
        self.quant_method = self.METHOD
        for k, d in LOADING_ATTRIBUTES.items():
            setattr(self, k, _check(k, loading.get(k, d)))

    @classmethod
    def from_dict(cls, config_dict, return_unused_kwargs=False, **kwargs):
        obj = cls.__new__(cls)
        raw = copy.deepcopy(dict(config_dict))
        for k, v in raw.items():   # expose the checkpoint keys as attributes, like transformers' classes do
            if isinstance(k, str) and k.isidentifier() and k not in LOADING_ATTRIBUTES:
                obj.__dict__[k] = v
        obj._raw = raw
        obj.quant_method = cls.METHOD
        for k, d in LOADING_ATTRIBUTES.items():
            setattr(obj, k, _check(k, kwargs.pop(k, d)))
        return (obj, kwargs) if return_unused_kwargs else obj

    @classmethod
    def from_config(cls, cfg) -> "HfW4ConfigMixin":
        """Wrap a config parsed by another class (e.g. transformers' AutoRoundConfig), keeping loading attributes."""
        d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
        d = {k: getattr(v, "value", v) for k, v in d.items() if k not in LOADING_ATTRIBUTES}
        return cls.from_dict(d, **{k: getattr(cfg, k) for k in LOADING_ATTRIBUTES if hasattr(cfg, k)})

    def checkpoint_dict(self) -> dict:
        return copy.deepcopy(self._raw) if self._raw is not None else {"quant_method": self.METHOD}

    def to_dict(self) -> Dict[str, Any]:
        return self.checkpoint_dict()

    def to_diff_dict(self) -> Dict[str, Any]:
        return self.to_dict()

    def loading_attributes(self) -> Dict[str, Any]:
        return {k: getattr(self, k, d) for k, d in LOADING_ATTRIBUTES.items()}

    def get_loading_attributes(self) -> Dict[str, Any]:
        # transformers' from_pretrained calls this (merging a passed config into the checkpoint's): without the
        # takeover its own quantizer, not hf_w4's, would load the checkpoint and fail on a missing producer library
        from transformers.quantizers import auto as qauto
        if qauto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(self.METHOD) is not CONFIGS[self.METHOD]:
            raise RuntimeError(
                f"hf_w4.{type(self).__name__} was passed to from_pretrained, but hf_w4's takeover of {self.METHOD!r} "
                "is not installed, so transformers would load the checkpoint with its own quantizer: call "
                "hf_w4.install() (or import hf_w4.auto) first, or load inside `with hf_w4.enabled():`")
        return self.loading_attributes()

    def __setattr__(self, name, value):
        if name in LOADING_ATTRIBUTES:
            value = _check(name, value)
        object.__setattr__(self, name, value)

    def __repr__(self):
        return f"{type(self).__module__}.{type(self).__name__}({self.to_dict()}, loading={self.loading_attributes()})"


class GPTQConfig(HfW4ConfigMixin, transformers.GPTQConfig):
    METHOD = "gptq"


class AwqConfig(HfW4ConfigMixin, transformers.AwqConfig):
    METHOD = "awq"


class AutoRoundConfig(HfW4ConfigMixin, transformers.AutoRoundConfig):
    METHOD = "auto-round"


class CompressedTensorsConfig(HfW4ConfigMixin, transformers.CompressedTensorsConfig):
    METHOD = "compressed-tensors"


class ModelOptConfig(HfW4ConfigMixin, QuantizationConfigMixin):  # transformers has no ModelOptConfig
    METHOD = "modelopt"


CONFIGS = {c.METHOD: c for c in (GPTQConfig, AwqConfig, AutoRoundConfig, CompressedTensorsConfig, ModelOptConfig)}


def checkpoint_quant_method(path) -> Optional[str]:
    """The ``quant_method`` of a checkpoint directory (its config.json's quantization_config; ``"modelopt"`` for
    an older ModelOpt export that has only ``hf_quant_config.json``), None for a dense checkpoint. Reads the
    config only, not the weights."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(str(path))
    for c in (cfg, cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg):
        q = getattr(c, "quantization_config", None)
        if q is not None:
            m = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
            return str(getattr(m, "value", m))
    return "modelopt" if sidecar_algo(cfg) else None


def activation_config(path, activation: str):
    """The hf_w4 config object (``CONFIGS[quant_method]``) that loads the quantized
    checkpoint ``path`` with ``activation`` (``"none"``, ``"int8"``, ``"int8_group"``). A dense checkpoint, or one
    hf_w4 does not load, is a ValueError."""
    if activation not in ACTIVATION_MODES:
        raise ValueError(f"activation {activation!r} is not supported; supported: {sorted(ACTIVATION_MODES)}")
    method = checkpoint_quant_method(path)
    if method is None:
        raise ValueError(f"activation {activation!r}: {path} is a dense checkpoint (no quantization_config); an "
                         "activation mode applies to quantized checkpoints only (use 'auto' for a dense one)")
    if method not in CONFIGS:
        raise ValueError(f"activation {activation!r}: {path} is a {method!r} checkpoint, which hf_w4 does not load; "
                         f"supported quant_methods: {list(CONFIGS)}")
    return CONFIGS[method](activation=activation)
