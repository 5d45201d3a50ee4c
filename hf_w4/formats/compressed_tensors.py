"""``quant_method: compressed-tensors`` (docs/formats.md, compressed-tensors), parsed without the compressed-tensors library."""
from __future__ import annotations

import logging

from .spec import FormatConfig, W4Spec
from ._common import check_regex, names_of

logger = logging.getLogger("hf_w4")
SUPPORTED_FORMATS = ("pack-quantized", "int-quantized", "nvfp4-pack-quantized")


def _act(group: str, a) -> tuple:
    """-> (activation scheme, has input_global_scale)"""
    if not a:
        return "none", False
    if (a.get("type", "int") == "int" and a.get("num_bits") == 8 and a.get("strategy") == "token"
            and a.get("dynamic") is True and a.get("symmetric", True)):
        return "int8_token", False
    if a.get("type") == "float" and a.get("num_bits") == 4 and a.get("strategy") == "tensor_group":
        logger.info("hf_w4: %s: NVFP4 activations (W4A4) are served weight-only; input_global_scale is kept", group)
        return "none", True
    raise NotImplementedError(
        f"compressed-tensors {group}: input_activations {a} are not supported; supported: null (weight-only) or "
        "{num_bits: 8, type: int, strategy: token, dynamic: true, symmetric: true}")


def _spec(group: str, g: dict, top_format) -> W4Spec:
    fmt = g.get("format") or top_format
    w = g.get("weights") or {}
    if fmt not in SUPPORTED_FORMATS:
        raise NotImplementedError(f"compressed-tensors {group}: format {fmt!r} is not supported; "
                                  f"supported: {list(SUPPORTED_FORMATS)}")
    bits, typ, strat, sym = w.get("num_bits"), w.get("type", "int"), w.get("strategy"), w.get("symmetric", True)
    act, in_scale = _act(group, g.get("input_activations"))
    if fmt == "nvfp4-pack-quantized":
        if typ != "float" or bits != 4 or strat != "tensor_group" or w.get("group_size", 16) != 16:
            raise NotImplementedError(f"compressed-tensors {group}: nvfp4-pack-quantized weights {w} are not supported; "
                                      "supported: float 4-bit, strategy tensor_group, group_size 16")
        return W4Spec("compressed-tensors", "ct_nvfp4", "nvfp4", 4, 16, True, act=act, has_input_scale=in_scale)
    if typ != "int":
        raise NotImplementedError(f"compressed-tensors {group}: weight type {typ!r} with format {fmt} is not supported; "
                                  "supported: int")
    if strat == "group":
        gs = int(w.get("group_size") or 0)
        if gs <= 0:
            raise ValueError(f"compressed-tensors {group}: strategy group needs a positive group_size, got {w.get('group_size')}")
    elif strat == "channel":
        gs = -1
    else:
        raise NotImplementedError(f"compressed-tensors {group}: weight strategy {strat!r} is not supported; "
                                  "supported: group, channel")
    if fmt == "pack-quantized":
        if bits != 4:
            raise NotImplementedError(f"compressed-tensors {group}: pack-quantized num_bits={bits} is not supported; "
                                      "supported: [4]")
        return W4Spec("compressed-tensors", "ct_pack", "int4", 4, gs, bool(sym), act=act)
    if bits not in (4, 8):
        raise NotImplementedError(f"compressed-tensors {group}: int-quantized num_bits={bits} is not supported; "
                                  "supported: [4, 8]")
    if not sym:
        raise NotImplementedError(f"compressed-tensors {group}: asymmetric int-quantized weights are not supported")
    return W4Spec("compressed-tensors", "ct_int", "int8", bits, gs, True, act=act)


def _patterns(key: str, entries) -> tuple:
    """compressed-tensors' ``is_match`` (``compressed_tensors/utils/match.py``): an entry is ``re:<regex>``
    (``re.match``, anchored at the start of the module name), else the exact module name or a class name of the
    module (along its MRO, so "Linear" selects every Linear). No suffix or glob matching."""
    out = []
    for e in names_of("compressed-tensors", key, entries):
        if e.startswith("re:"):
            out.append("re:" + check_regex("compressed-tensors", key, e[3:]))
        else:
            out += ["name:" + e, "class:" + e]
    return tuple(out)


def parse(q: dict) -> FormatConfig:
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise NotImplementedError(f"compressed-tensors quantization_status {status!r} is not supported; "
                                  "supported: 'compressed' (a saved, packed checkpoint)")
    for key in ("sparsity_config", "transform_config"):
        v = q.get(key) or {}
        if v and v.get("format", "dense") != "dense":
            raise NotImplementedError(f"compressed-tensors {key} {v} is not supported")
    if q.get("kv_cache_scheme"):
        logger.warning("hf_w4: compressed-tensors kv_cache_scheme is ignored (the KV cache stays in the model dtype)")
    rules = []
    ignore = _patterns("ignore", q.get("ignore"))
    if ignore:
        rules.append((ignore, None))
    for name, g in (q.get("config_groups") or {}).items():
        rules.append((_patterns(f"{name}.targets", g.get("targets")), _spec(name, g, q.get("format"))))
    if len(rules) == (1 if ignore else 0):
        raise ValueError("compressed-tensors config has no config_groups: nothing is quantized")
    return FormatConfig("compressed-tensors", None, rules=rules)
