"""The formats the writers know: one table per producer (auto-round, AutoAWQ, llm-compressor / compressed-tensors,
ModelOpt), each entry saying what the producer writes (layout, scale rule, config dict, side files) and which
options it takes. The writer itself never branches on a format's name.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence

import torch

from ... import layouts
from ...formats.spec import W4Spec, matches

# versions the written configs claim (the producer versions whose files these layouts were checked against)
AUTOROUND_VERSION = "0.16.1"
CT_VERSION = "0.19.0"
MODELOPT_VERSION = "0.47.0"
# gptq checkpoint_format -> stores zero - 1 (GPTQ v1)
GPTQ_CHECKPOINT_FORMATS = {"gptq": True, "gptq_v1": True, "gptq_v2": False}


class WriterError(ValueError):
    """A format/option/model combination the producer cannot write; names module, shape and supported values."""


@dataclass
class ConfigInputs:
    """What a format's config builder reads: the options and the per-module plan of one write."""
    opts: dict                      # group_size, sym, desc_act, checkpoint_format, extra_config, ...
    plans: dict                     # module name -> plan (``.spec`` None = dense)
    lm_name: str
    emb_name: str
    blocks: Sequence[str]

    @property
    def lm_quantized(self) -> bool:
        p = self.plans.get(self.lm_name)
        return p is not None and p.spec is not None

    @property
    def block_str(self) -> Optional[str]:
        return ",".join(self.blocks) if self.blocks else None

    def dense(self, in_block_only: bool = False) -> List[str]:
        """Linear modules left dense, lm_head aside."""
        return [p.name for p in self.plans.values() if p.spec is None and p.name != self.lm_name
                and (p.in_block or not in_block_only)]


@dataclass(frozen=True)
class Format:
    name: str
    description: str
    spec: Callable[[int, bool, dict], W4Spec]       # (group size, sym, options) -> the module's spec
    kind: str                                       # hf_w4.tools.rtn.quantize_rtn's kind
    quant_config: Callable[[ConfigInputs], dict]    # the dict written as quantization_config
    files: Callable[[dict], Dict[str, str]] = lambda q: {}   # side files: name -> text, from quantization_config
    in_config_json: bool = True                     # quantization_config in config.json (unless hf_quant_config_only)
    scale_dtype: Optional[torch.dtype] = None       # stored scales' dtype; None: the model dtype
    group_size: Optional[int] = None                # fixed by the format (-1: per channel); None: the option
    per_channel: bool = True                        # accepts group_size -1
    asym: bool = True
    blocks_only: bool = False                       # quantizes the decoder blocks only
    lm_head: bool = True                            # may quantize lm_head
    sym_scale: Optional[str] = None                 # default int4 scale rule ("amax7" / "signed"); None: fixed
    options: FrozenSet[str] = field(default_factory=frozenset)   # its own write_checkpoint options
    input_scale: bool = False                       # writes static input_scale tensors


def _dump(obj) -> str:
    return json.dumps(obj, indent=2) + "\n"


# ---- auto-round (its gptq, auto_gptq and auto_awq exports) and AutoAWQ's GEMM layout
def _gptq_config(c: ConfigInputs) -> dict:
    o = c.opts
    q = {"bits": 4, "group_size": o["group_size"], "sym": o["sym"], "data_type": "int",
         "autoround_version": AUTOROUND_VERSION, "provider": "auto-round", "lm_head": c.lm_quantized,
         "quant_method": "gptq", "desc_act": o["desc_act"], "true_sequential": False, "damp_percent": 0.01}
    if o["checkpoint_format"] is not None:
        q["checkpoint_format"] = o["checkpoint_format"]
    if c.dense():  # auto-round's gptq export: GPTQModel-style negative "dynamic" entries
        q["dynamic"] = {"-:" + re.escape(n) + "$": {} for n in c.dense()}
    return q


def _autoround_config(packing: str) -> Callable[[ConfigInputs], dict]:
    def build(c: ConfigInputs) -> dict:
        o = c.opts
        q = {"bits": 4, "group_size": o["group_size"], "sym": o["sym"], "data_type": "int",
             "autoround_version": AUTOROUND_VERSION, "block_name_to_quantize": c.block_str,
             "quant_method": "auto-round", "packing_format": packing}
        if c.block_str is None:
            q.pop("block_name_to_quantize")
        extra = {k: dict(v) for k, v in (o["extra_config"] or {}).items()}
        for n in c.dense(in_block_only=True):
            if not any(matches(k, n) for k in extra):
                extra[n] = {"bits": 16, "data_type": "float"}
        if c.lm_quantized:
            lm = c.plans[c.lm_name]
            extra[c.lm_name] = {"bits": 4, "group_size": lm.group_size, "sym": lm.sym, "data_type": "int"}
        if extra:
            q["extra_config"] = extra
        return q
    return build


def _awq_config(c: ConfigInputs) -> dict:
    o = c.opts
    return {"bits": 4, "group_size": o["group_size"], "sym": o["sym"], "data_type": "int",
            "autoround_version": AUTOROUND_VERSION, "provider": "auto-round", "quant_method": "awq",
            "version": "gemm", "zero_point": not o["sym"],
            "modules_to_not_convert": [c.lm_name] + c.dense(in_block_only=True),
            **({"to_quant_block_names": c.block_str} if c.block_str else {})}


def _gptq_spec(gs, sym, o):
    v1 = GPTQ_CHECKPOINT_FORMATS.get(o["checkpoint_format"] or "gptq", True)
    return W4Spec("gptq", "gptq", "int4", 4, gs, sym, zero_plus_one=v1, has_g_idx=True, desc_act=o["desc_act"])


_INT4 = dict(kind="int4", scale_dtype=torch.float16, blocks_only=True)
AUTOROUND = {
    "gptq": Format("gptq", "GPTQ v1 (quant_method gptq, as auto-round exports it): qweight [K/8,N], qzeros (zero-1), "
                   "fp16 scales, g_idx", _gptq_spec, quant_config=_gptq_config, sym_scale="amax7",
                   files=lambda q: {"quantize_config.json": _dump(q)},   # auto-round's gptq export writes it too
                   options=frozenset({"desc_act", "checkpoint_format"}), **_INT4),
    "autoround": Format("autoround", "auto-round, packing_format auto_round:auto_gptq (GPTQ layout, zero-1, no "
                        "g_idx), signed sym scales",
                        lambda gs, sym, o: W4Spec("auto-round", "gptq", "int4", 4, gs, sym, zero_plus_one=True),
                        quant_config=_autoround_config("auto_round:auto_gptq"), sym_scale="signed",
                        files=lambda q: {"quantization_config.json": _dump(q)},
                        options=frozenset({"extra_config"}), **_INT4),
    "autoround-awq": Format("autoround-awq", "auto-round, packing_format auto_round:auto_awq (AWQ GEMM layout)",
                            lambda gs, sym, o: W4Spec("auto-round", "awq", "int4", 4, gs, sym),
                            quant_config=_autoround_config("auto_round:auto_awq"), sym_scale="signed",
                            files=lambda q: {"quantization_config.json": _dump(q)}, per_channel=False,
                            options=frozenset({"extra_config"}), **_INT4),
}
AUTOAWQ = {
    "awq": Format("awq", "AutoAWQ GEMM (quant_method awq, version gemm): qweight [K,N/8] in AWQ nibble order, "
                  "fp16 scales", lambda gs, sym, o: W4Spec("awq", "awq", "int4", 4, gs, sym),
                  quant_config=_awq_config, sym_scale="amax7", per_channel=False,
                  lm_head=False,   # AutoAWQ keeps lm_head in modules_to_not_convert
                  **_INT4),
}


# ---- llm-compressor / compressed-tensors
_ACT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "token",
         "block_structure": None, "dynamic": True, "actorder": None, "scale_dtype": None, "zp_dtype": None,
         "observer": None, "observer_kwargs": {}}
_CT_SCHEMES = {"ct-w4a16": "W4A16", "ct-w8a8": "W8A8", "ct-w4a8": "W4A8", "ct-nvfp4": "NVFP4A16"}


def _ct_weights(bits, typ, strategy, group, symmetric, scale_dtype=None, observer="minmax") -> dict:
    return {"num_bits": bits, "type": typ, "symmetric": symmetric, "group_size": group, "strategy": strategy,
            "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": scale_dtype,
            "zp_dtype": None if symmetric else "torch.int8", "observer": observer, "observer_kwargs": {}}


def _ct_config(form: str, weights: Callable[[dict], dict], acts: Optional[dict]) -> Callable[[ConfigInputs], dict]:
    def build(c: ConfigInputs) -> dict:
        ignore = ([] if c.lm_quantized else [c.lm_name]) + c.dense()
        group = {"targets": ["Linear"], "weights": weights(c.opts), "input_activations": acts,
                 "output_activations": None, "format": form}
        return {"config_groups": {"group_0": group}, "format": form, "global_compression_ratio": None,
                "ignore": ignore, "kv_cache_scheme": None, "quant_method": "compressed-tensors",
                "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
                "version": CT_VERSION}
    return build


def _ct_int4_weights(o: dict) -> dict:
    gs = o["group_size"]
    return _ct_weights(4, "int", "group" if gs != -1 else "channel", gs if gs != -1 else None, o["sym"])


def _ct_recipe(scheme: str) -> Callable[[dict], Dict[str, str]]:
    def files(q: dict) -> Dict[str, str]:
        ign = ", ".join(json.dumps(x) for x in q["ignore"])
        return {"recipe.yaml": "default_stage:\n  default_modifiers:\n    QuantizationModifier:\n      targets: "
                               f"[Linear]\n      ignore: [{ign}]\n      scheme: {scheme}\n"}
    return files


COMPRESSED_TENSORS = {
    "ct-w4a16": Format("ct-w4a16", "compressed-tensors pack-quantized int4 (group or channel, sym or asym), scales "
                       "in the model dtype", lambda gs, sym, o: W4Spec("compressed-tensors", "ct_pack", "int4", 4, gs,
                                                                       sym),
                       kind="ct-int4", quant_config=_ct_config("pack-quantized", _ct_int4_weights, None),
                       files=_ct_recipe("W4A16")),
    "ct-w8a8": Format("ct-w8a8", "compressed-tensors int-quantized int8 per-channel weights + dynamic per-token int8 "
                      "activations", lambda gs, sym, o: W4Spec("compressed-tensors", "ct_int", "int8", 8, -1, True,
                                                               act="int8_token"),
                      kind="int8", group_size=-1, asym=False,
                      quant_config=_ct_config("int-quantized",
                                              lambda o: _ct_weights(8, "int", "channel", None, True), _ACT8),
                      files=_ct_recipe("W8A8")),
    "ct-w4a8": Format("ct-w4a8", "compressed-tensors int-quantized int4-in-int8 weights (group) + dynamic per-token "
                      "int8 activations", lambda gs, sym, o: W4Spec("compressed-tensors", "ct_int", "int8", 4, gs,
                                                                    True, act="int8_token"),
                      kind="int4in8", asym=False,
                      quant_config=_ct_config("int-quantized", lambda o: _ct_int4_weights({**o, "sym": True}), _ACT8),
                      files=_ct_recipe("W4A8")),
    "ct-nvfp4": Format("ct-nvfp4", "compressed-tensors nvfp4-pack-quantized (NVFP4A16): E2M1 + fp8 per-16 scales + "
                       "fp32 global divisor",
                       lambda gs, sym, o: W4Spec("compressed-tensors", "ct_nvfp4", "nvfp4", 4, 16, True),
                       kind="nvfp4-ct", scale_dtype=layouts.FP8, group_size=16, asym=False,
                       quant_config=_ct_config("nvfp4-pack-quantized", lambda o: _ct_weights(
                           4, "float", "tensor_group", 16, True, "torch.float8_e4m3fn", "static_minmax"), None),
                       files=_ct_recipe("NVFP4A16")),
}


# ---- NVIDIA ModelOpt
def _modelopt_config(algo: str) -> Callable[[ConfigInputs], dict]:
    def build(c: ConfigInputs) -> dict:
        w = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
        group = {"targets": ["Linear"], "weights": dict(w)}
        if algo == "NVFP4":
            group["input_activations"] = dict(w)
        return {"quant_method": "modelopt", "quant_algo": algo,
                "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
                "ignore": ([] if c.lm_quantized else [c.lm_name]) + [c.emb_name] + c.dense(),
                "config_groups": {"group_0": group}}
    return build


def _hf_quant_config(q: dict) -> Dict[str, str]:
    return {"hf_quant_config.json": _dump({
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quantization": {"quant_algo": q["quant_algo"], "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": list(q["ignore"])}})}


_NVFP4_MODELOPT = dict(kind="nvfp4-modelopt", scale_dtype=layouts.FP8, group_size=16, asym=False,
                       files=_hf_quant_config, options=frozenset({"hf_quant_config_only"}))
MODELOPT = {
    "modelopt-w4a16": Format("modelopt-w4a16", "NVIDIA ModelOpt W4A16_NVFP4: E2M1 + fp8 per-16 scales + fp32 "
                             "weight_scale_2 multiplier",
                             lambda gs, sym, o: W4Spec("modelopt", "modelopt_nvfp4", "nvfp4", 4, 16, True),
                             quant_config=_modelopt_config("W4A16_NVFP4"), **_NVFP4_MODELOPT),
    "modelopt-nvfp4": Format("modelopt-nvfp4", "NVIDIA ModelOpt NVFP4 (W4A4): as modelopt-w4a16 plus static "
                             "input_scale tensors",
                             lambda gs, sym, o: W4Spec("modelopt", "modelopt_nvfp4", "nvfp4", 4, 16, True,
                                                       has_input_scale=True),
                             quant_config=_modelopt_config("NVFP4"), input_scale=True, **_NVFP4_MODELOPT),
}

FORMATS: Dict[str, Format] = {**AUTOROUND, **AUTOAWQ, **COMPRESSED_TENSORS, **MODELOPT}
