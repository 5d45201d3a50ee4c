"""What the checkpoint files hold, read from their safetensors headers (no tensor data is read).

Used before loading to declare exactly the tensors that exist (bias, g_idx, input_scale, ...) and to
turn every mismatch between config and files into an error that names module, tensor, found and expected
— instead of letting transformers fill a missing tensor with ``torch.empty_like`` garbage. The names are
the ones transformers loads each tensor under (:func:`loading_names`), not always the ones on disk.
"""
from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass
from typing import Dict, Iterable, Optional

import torch
from torch import nn

from .. import layouts
from ..formats.spec import LAYOUTS, W4Spec
from ..nn import plain_linear

logger = logging.getLogger("hf_w4")

# safetensors dtype names -> torch dtypes
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """The checkpoint files do not hold what the config says."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: Optional[torch.dtype]
    dtype_name: str
    shape: tuple
    file: str


def read_header(path: str) -> Dict[str, TensorInfo]:
    """Header of one .safetensors file; raises CheckpointError for a truncated or corrupt file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated safetensors file: header declares {n} bytes, file has {size}")
        try:
            meta = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    out, end = {}, 0
    for name, d in meta.items():
        if name == "__metadata__":
            continue
        try:
            b, e = d["data_offsets"]
            out[name] = TensorInfo(DTYPES.get(d["dtype"]), d["dtype"], tuple(d["shape"]), path)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name!r}: {d}") from None
        end = max(end, e)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file: header declares {8 + n + end} bytes of data, "
                              f"file has {size}")
    return out


def read_torch_file(path: str) -> Optional[Dict[str, TensorInfo]]:
    """Names, shapes and dtypes of a ``torch.save`` file (``pytorch_model.bin``), or None if it cannot be read so.

    Reading the .bin (rather than skipping the header check for it) keeps the early errors and the exact
    declaration of optional tensors (g_idx, input_scale, bias) the same as for safetensors. With mmap and
    ``map_location="meta"`` (transformers reads a .bin on meta too, for its dtype) only the pickled records are
    read, no tensor data. Legacy (non-zip) files cannot be mapped, and pickles weights_only refuses are for
    transformers' own reader to judge: None for those, i.e. no header check (the post-load guard still refuses
    tensors that were not loaded).
    """
    try:
        sd = torch.load(path, mmap=True, weights_only=True, map_location="meta")
    except Exception as e:  # noqa: BLE001 - any failure here only turns the early check off
        logger.info("hf_w4: %s: cannot read its tensor names without loading it (%s); header check skipped", path, e)
        return None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        return None
    return {k: TensorInfo(v.dtype, DTYPE_NAMES.get(v.dtype, str(v.dtype).replace("torch.", "")), tuple(v.shape), path)
            for k, v in sd.items()}


def read_headers(files: Iterable[str]) -> Optional[Dict[str, TensorInfo]]:
    """All tensors of the weight files by name; None when some file's contents cannot be known before loading
    (then nothing is claimed about the checkpoint: {} would say every tensor is missing)."""
    out: Dict[str, TensorInfo] = {}
    for f in files or ():
        if str(f).endswith(".safetensors"):
            out.update(read_header(str(f)))
            continue
        h = read_torch_file(str(f))
        if h is None:
            return None
        out.update(h)
    return out


def module_tensors(headers: Dict[str, TensorInfo], module: str) -> Dict[str, TensorInfo]:
    """Tensors stored directly under ``module.`` (not deeper)."""
    p = module + "."
    return {k[len(p):]: v for k, v in headers.items() if k.startswith(p) and "." not in k[len(p):]}


def loading_names(headers: Dict[str, TensorInfo], model: nn.Module, key_mapping: Optional[dict] = None,
                  hf_quantizer=None, stored: Optional[Dict[str, str]] = None) -> Dict[str, TensorInfo]:
    """``headers`` keyed by the names transformers will load each tensor as.

    transformers renames checkpoint keys while loading (a model's legacy layouts, e.g. Llava's
    ``language_model.model.*`` -> ``model.language_model.*``; ``from_pretrained(key_mapping=...)``; an added or
    stripped base-model prefix), but only after the quantizer has swapped the modules, so the header names are
    renamed here the same way, with transformers' own functions. Where those are missing (another transformers
    version) the names stay as stored, and ``replace_linear`` leaves the modules it cannot find to the post-load
    guard. transformers 5.23 does not pass ``key_mapping`` to quantizers: the same holds for it. ``stored``, if
    given, gets each renamed module's name on disk (loading name -> stored name, for renamed modules only).
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        transforms = get_model_conversion_mapping(model, key_mapping, hf_quantizer)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
    except (ImportError, AttributeError, TypeError) as e:
        logger.info("hf_w4: cannot apply transformers' checkpoint key renaming (%s); matching names as stored", e)
        rename_source_key = None
    modules = {n for n, _ in model.named_modules()}
    prefix = getattr(model, "base_model_prefix", "") or ""

    def with_prefix(key: str) -> str:
        # transformers adds or strips the base-model prefix where that gives a name the model has; decided by
        # module here, as the quantized tensors have no names in the model before the swap
        mod = key.rpartition(".")[0]
        if not prefix or not mod:
            return key
        if mod.startswith(prefix + ".") and mod[len(prefix) + 1:] in modules:
            return key[len(prefix) + 1:]
        if f"{prefix}.{mod}" in modules:
            return f"{prefix}.{key}"
        return key

    out = {}
    for key, info in headers.items():
        new = with_prefix(rename_source_key(key, renamings, converters)[0] if rename_source_key else key)
        if new.rpartition(".")[0] not in modules and key.rpartition(".")[0] in modules:
            new = with_prefix(key)  # as transformers does: a name the model has is not renamed away
        out[new] = info
        if stored is not None and new != key:
            stored[new.rpartition(".")[0]] = key.rpartition(".")[0]
    return out


def _quantized_weight_tensors() -> frozenset:
    """Names that hold (part of) a quantized weight in some layout, from the layouts' own declarations (every
    optional one included). Not in it: ``weight`` (also every dense module's weight; the scales next to it
    identify a quantized one) and the activation scales (``input_scale``, ``input_global_scale``): those are no
    weight, and a checkpoint may carry such scales where hf_w4 loads no weight (like ModelOpt's KV-cache
    ``k_scale`` / ``v_scale``, which no layout declares)."""
    names = set()
    for layout in LAYOUTS:
        spec = W4Spec("any", layout, "int4", 4, 16, sym=False, has_g_idx=True, has_input_scale=False)
        names |= set(layouts.declare(spec, 128, 128))
    return frozenset(names - {"weight"})


QUANTIZED_WEIGHT_TENSORS = _quantized_weight_tensors()
# KV-cache scales ModelOpt writes on k_proj / v_proj (kv_cache_quant_algo FP8). hf_w4 keeps the KV cache in the
# model dtype (the config parsers warn), so they are not loaded (transformers lists them as unexpected keys) and
# are no reason to refuse the checkpoint
KV_CACHE_SCALES = frozenset({"k_scale", "v_scale"})


def check_unclaimed(headers: Dict[str, TensorInfo], model: nn.Module) -> None:
    """Raise when the checkpoint holds quantized weights that nothing in the (swapped) model would load.

    That happens where a module exists with parameters of its own but is not a plain ``nn.Linear``, e.g. a
    quantized MoE router, or fused MoE experts that :mod:`hf_w4.loading.moe` did not unfuse while the checkpoint stores one
    quantized Linear per expert: transformers would report the tensors as unexpected and leave the module's
    parameters randomly initialised. Tensors whose names are nowhere in the model are left alone: they come from a
    renaming not known here or from layers the model does not have (e.g. a DeepSeek MTP layer), which transformers
    reports as unexpected keys, as for dense checkpoints.
    """
    own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    modules = dict(model.named_modules())
    found: Dict[str, tuple] = {}   # module path in the checkpoint -> (the model module it falls in, tensor names)
    for key in headers:
        path, _, t = key.rpartition(".")
        if t not in QUANTIZED_WEIGHT_TENSORS or key in own:
            continue
        owner = path
        while owner and owner not in modules:
            owner = owner.rpartition(".")[0]
        m = modules.get(owner)
        if not owner or plain_linear(m) or next(m.parameters(recurse=False), None) is None:
            continue
        found.setdefault(path, (owner, []))[1].append(t)
    if not found:
        return
    paths = sorted(found)
    shown = "; ".join(f"{p} ({', '.join(sorted(found[p][1]))})" for p in paths[:3])
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    fused = sorted({type(modules[o]).__name__ for p, (o, _) in found.items() if o != p})
    other = sorted({type(modules[o]).__name__ for p, (o, _) in found.items() if o == p})
    owners = sorted({f"{o} ({type(modules[o]).__name__})" for o, _ in found.values()})
    unsupported = ([f"fused MoE expert modules like {', '.join(fused)}"] if fused else []) + \
                  ([f"{', '.join(other)} modules"] if other else [])
    raise CheckpointError(
        f"the checkpoint holds quantized weights for {len(paths)} module(s) this model does not have as nn.Linear, "
        f"so they would not be loaded and the model's own parameters there would stay random: {shown}{more}; "
        f"they fall in {', '.join(owners[:3])}{' ...' if len(owners) > 3 else ''}. hf_w4 quantizes nn.Linear "
        f"modules; {' and '.join(unsupported)} are not supported")
