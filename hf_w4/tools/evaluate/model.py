"""Loading the model under test (hf_w4 enabled) and its tokenizer, and describing what it runs."""
from __future__ import annotations

import os
import warnings
from typing import Dict, Optional

import torch

from ...integration import enabled
from ...loading.config import activation_config
from ...nn import QuantLinear
from ...report import layer_table


def load_model(path, dtype: torch.dtype = torch.bfloat16, activation: str = "auto", device: str = "cpu", **kwargs):
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype)`` with hf_w4 enabled (quantized
    checkpoints go through hf_w4, dense ones load as usual), in eval mode. ``activation`` other than ``"auto"``
    (the checkpoint's own scheme) loads a quantized checkpoint with its family's hf_w4 config class and that
    activation mode (:func:`activation_config`), e.g. ``"int8"``: a 4-bit checkpoint runs as W4A8. ``device`` other
    than ``"cpu"`` (e.g. ``"cuda:0"``) is passed as ``device_map``: the quantized layers take that device's kernels."""
    from transformers import AutoModelForCausalLM
    if device != "cpu":
        kwargs["device_map"] = device
    with enabled(), warnings.catch_warnings():
        if activation != "auto":
            kwargs["quantization_config"] = activation_config(path, activation)
            # transformers' notice that the passed config's loading attributes (here: activation) replace the
            # checkpoint's: that is the point
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
    return model.eval()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def has_tokenizer(path) -> bool:
    return any(os.path.isfile(os.path.join(str(path), f)) for f in TOKENIZER_FILES)


def load_tokenizer(path):
    from transformers import AutoTokenizer
    if os.path.isdir(str(path)) and not has_tokenizer(path):
        raise FileNotFoundError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...), e.g. a "
                                "checkpoint saved from a model object; pass the tokenizer of the model it was made "
                                "from (hf-w4 eval --tokenizer PATH)")
    return AutoTokenizer.from_pretrained(str(path))


def quant_format(model) -> str:
    """``quant_method`` of a loaded model's checkpoint ("dense" if none), with its format variant."""
    q = getattr(model.config, "quantization_config", None)
    if q is None:
        return "dense"
    d = q if isinstance(q, dict) else (q.to_dict() if hasattr(q, "to_dict") else vars(q))
    m = d.get("quant_method", "?")
    m = getattr(m, "value", m)
    fmt = d.get("format") or d.get("packing_format") or d.get("version") or d.get("quant_algo")
    label = f"{m}:{fmt}" if fmt and isinstance(fmt, str) else str(m)
    if m == "compressed-tensors":     # the same format name holds W8A8 and W4A8: add the bits of each scheme
        schemes = sorted({_ct_scheme(g) for g in (d.get("config_groups") or {}).values() if isinstance(g, dict)})
        if schemes:
            label += " " + "+".join(schemes)
    return label


def _ct_scheme(group: Dict) -> str:
    """``W4A16``, ``W8A8``, ``W4A8``, ... of one compressed-tensors config group (no input_activations: A16)."""
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    return f"W{w.get('num_bits', '?')}A{a.get('num_bits', 16)}"


# what ran: the QuantLinear spec's activation scheme (``W4Spec.act``)
ACTIVATION_TEXT = {"none": "weight-only, float activations", "int8_token": "dynamic int8, per token",
                   "int8_group": "dynamic int8, per token and weight group"}


def activation_used(model) -> Optional[str]:
    """The activation scheme the quantized layers run (``"none"``, ``"int8_token"``, ``"int8_group"``; several
    joined by ``+``), None for a model without hf_w4 layers."""
    acts = sorted({m.spec.act for m in model.modules() if isinstance(m, QuantLinear)})
    return "+".join(acts) or None


def kernels_used(model) -> Dict[str, int]:
    """kernel name -> number of quantized layers running on it (empty for a dense model)."""
    out: Dict[str, int] = {}
    for r in layer_table(model):
        out[r["kernel"]] = out.get(r["kernel"], 0) + 1
    return out
