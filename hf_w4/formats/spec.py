"""The normalized, per-module description of a quantized Linear.

Every checkpoint format (``hf_w4.formats.*``) parses its ``quantization_config`` into a
:class:`FormatConfig`, which answers ``spec_for(module_name)`` with a :class:`W4Spec` (or ``None``
for a module left dense). Kernels and ``QuantLinear`` only ever see ``W4Spec``; the on-disk tensor
names/shapes/dtypes and all bit-twiddling live in :mod:`hf_w4.layouts`.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Optional

# on-disk layouts (docs/formats.md has one section each)
LAYOUTS = (
    "gptq",            # qweight int32 [K/8, N] along K; qzeros [G, N/8]; scales fp16 [G, N]; opt. g_idx
    "awq",             # qweight int32 [K, N/8] along N in AWQ order; qzeros [G, N/8]; scales fp16 [G, N]
    "ct_pack",         # weight_packed int32 [N, K/8]; weight_scale [N, G]; opt. weight_zero_point [N/8, G]; weight_shape
    "ct_int",          # weight int8 [N, K]; weight_scale [N, G]
    "ct_nvfp4",        # weight_packed uint8 [N, K/2]; weight_scale fp8 [N, K/16]; weight_global_scale fp32 [1]
    "modelopt_nvfp4",  # weight uint8 [N, K/2]; weight_scale fp8 [N, K/16]; weight_scale_2 fp32 []; opt. input_scale
)

WEIGHT_TYPES = ("int4", "int8", "nvfp4")   # int8 = one signed value per int8 (W8A8, and W4A8's int4-in-int8)
# activation schemes: "none" = weight-only (activations stay float); "int8_token" = dynamic per-token symmetric
# int8 (compressed-tensors rules: scale = max|x|/127.5, round half to even); "int8_group" = the same per token
# and per K-group of the weight (opt-in W4A8 for better accuracy)
ACTIVATIONS = ("none", "int8_token", "int8_group")


@dataclass(frozen=True)
class W4Spec:
    """What one quantized Linear is, independent of the file it came from."""

    method: str                 # quant_method of the checkpoint ("gptq", "awq", "auto-round", ...)
    layout: str                 # one of LAYOUTS
    weight_type: str            # one of WEIGHT_TYPES
    bits: int                   # 4 or 8 (int8 layout with 4 = W4A8 int4-in-int8)
    group_size: int             # K-group of the scales; -1 = one group over all of K (per channel)
    sym: bool
    zero_plus_one: bool = False  # GPTQ v1: the file stores zero-1
    has_g_idx: bool = False      # GPTQ: a g_idx tensor is in the file
    desc_act: bool = False       # GPTQ act-order declared by the config
    act: str = "none"            # checkpoint activation scheme (one of ACTIVATIONS)
    has_input_scale: bool = False  # ModelOpt NVFP4 (W4A4) carries input_scale; loaded, kept, not applied
    has_bias: bool = False

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; supported: {LAYOUTS}")
        if self.weight_type not in WEIGHT_TYPES:
            raise ValueError(f"unknown weight_type {self.weight_type!r}; supported: {WEIGHT_TYPES}")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"unknown activation scheme {self.act!r}; supported: {ACTIVATIONS}")

    def replace(self, **kw) -> "W4Spec":
        return dataclasses.replace(self, **kw)

    def groups(self, k: int) -> int:
        return 1 if self.group_size in (-1, k) else k // self.group_size

    def effective_group(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def describe(self) -> str:
        g = "channel" if self.group_size == -1 else f"g{self.group_size}"
        parts = [self.layout, f"{self.weight_type}" if self.bits == 4 or self.weight_type != "int8" else "int8",
                 g, "sym" if self.sym else "asym"]
        if self.weight_type == "int8" and self.bits == 4:
            parts[1] = "int4-in-int8"
        if self.act != "none":
            parts.append(f"act={self.act}")
        if self.has_g_idx:
            parts.append("g_idx")
        return " ".join(parts)


def matches(pattern: str, name: str, cls_name: str = "Linear") -> bool:
    """Does one config pattern select the module ``name`` (of class ``cls_name``)?

    Producers disagree on what an entry of an ignore / target list means, so each parser prefixes its entries with
    the rule of the library that wrote (and itself loads) the checkpoint:

    * ``re:<regex>``: ``re.match``, i.e. anchored at the start of the name (compressed-tensors, gptqmodel ``dynamic``);
    * ``search:<regex>``: ``re.search``, anywhere in the name (auto-round's loader: ``extra_config`` regex keys,
      ``modules_to_not_convert``, ``modules_in_block_to_quantize``);
    * ``sub:<text>``: plain substring (AutoAWQ ``modules_to_not_convert``: ``any(key in name ...)``);
    * ``suffix:<text>``: plain ``str.endswith`` (optimum's GPTQ ``modules_in_block_to_quantize``);
    * ``name:<name>``: that exact module name (compressed-tensors, auto-round's exact ``extra_config`` keys);
    * ``class:<Class>``: the module's class; every module asked about is an ``nn.Linear`` and compressed-tensors
      matches classes along the MRO, so ``class:Linear`` selects them all;
    * ``glob:<pattern>``: ModelOpt ``exclude_modules``: fnmatch wildcards (ModelOpt writes ``module_path*``), else
      the exact name, a parent module of it or a dotted suffix (older ModelOpt exports list parent modules without
      the ``*``, which vLLM also accepts);
    * no prefix (configs built by hand): a glob, the exact name, a dotted suffix of it, or the class name.
    """
    kind, sep, p = pattern.partition(":")
    if not sep:
        if any(c in pattern for c in "*?["):
            return fnmatch.fnmatchcase(name, pattern)
        return name == pattern or name.endswith("." + pattern) or pattern == cls_name
    if kind == "re":
        return re.match(p, name) is not None
    if kind == "search":
        return re.search(p, name) is not None
    if kind == "sub":
        return p in name
    if kind == "suffix":
        return name.endswith(p)
    if kind == "name":
        return name == p
    if kind == "class":
        return p in (cls_name, "Linear")
    if kind == "glob":
        if any(c in p for c in "*?["):
            return fnmatch.fnmatchcase(name, p)
        return name == p or name.startswith(p + ".") or name.endswith("." + p)
    raise ValueError(f"unknown module pattern kind {kind!r} in {pattern!r}")


@dataclass
class FormatConfig:
    """A parsed checkpoint config: default spec plus per-module rules.

    ``rules`` are tried in order: (patterns, spec-or-None); the first rule with a matching pattern (see
    :func:`matches`) wins; ``None`` means "leave this module dense". ``default`` applies to any other Linear inside
    ``blocks`` (None = everywhere except ``lm_head``). ``lm_head`` is only quantized when a rule or
    ``quantize_lm_head`` says so. ``block_modules`` (GPTQ ``modules_in_block_to_quantize``): a Linear inside the
    blocks that matches none of these patterns stays dense, whatever the rules say.
    """

    method: str
    default: Optional[W4Spec]
    rules: list = field(default_factory=list)        # [(tuple[str, ...], Optional[W4Spec])]
    blocks: Optional[tuple] = None                   # module name prefixes that hold quantized layers
    quantize_lm_head: bool = False
    class_targets: Optional[tuple] = None            # class names a default applies to (CT "Linear")
    block_modules: Optional[tuple] = None            # patterns of the block Linears that are quantized (None = all)

    def names_module(self, name: str) -> bool:
        """Whether a rule, the block list or the block-module list names this module by its name (not by its class):
        which of a renamed module's two names (as stored, as the model calls it) the config uses."""
        by_name = [p for pats, _ in self.rules for p in pats] + list(self.block_modules or ())
        return (any(not p.startswith("class:") and matches(p, name, "\0") for p in by_name)
                or any(name == b or name.startswith(b + ".") for b in self.blocks or ()))

    def spec_for(self, name: str, cls_name: str = "Linear") -> Optional[W4Spec]:
        lm_head = name == "lm_head" or name.endswith(".lm_head")
        # block prefixes end at a module boundary ("model.layers.1" is not a prefix of "model.layers.10"); optimum and
        # auto-round compare with a bare startswith, which only differs for names no producer writes
        in_blocks = self.blocks is None or any(name == b or name.startswith(b + ".") for b in self.blocks)
        if (self.block_modules is not None and in_blocks and not lm_head
                and not any(matches(p, name, cls_name) for p in self.block_modules)):
            return None
        for patterns, spec in self.rules:
            if any(matches(p, name, cls_name) for p in patterns):
                return spec
        if lm_head:
            return self.default if self.quantize_lm_head else None
        if not in_blocks:
            return None
        return self.default
