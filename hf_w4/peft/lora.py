"""PEFT LoRA on hf_w4 ``QuantLinear`` layers (QLoRA-style training on a packed 4-bit base).

PEFT picks the LoRA wrapper of a layer from its own list of layer types, so ``get_peft_model`` (and
transformers' ``model.add_adapter`` / ``load_adapter``, ``PeftModel.from_pretrained``) would refuse a
``QuantLinear``. ``enable()`` -- called by ``hf_w4.install()`` -- teaches PEFT's ``LoraModel`` one more type: a
``QuantLinear`` gets a ``QuantLoraLinear``, whose forward is the compiled kernel's output plus the adapter's, as
PEFT does for GPTQ / AWQ layers. Every other layer type goes to PEFT's own code unchanged. PEFT is not imported
for this: if it is not imported yet, an import hook applies the change when PEFT's LoRA module is first imported
(importing PEFT costs seconds). The change stays for the process; it acts on ``QuantLinear`` layers only.

What works: plain LoRA (any ``r`` / ``lora_alpha`` / dropout / ``lora_bias`` / rsLoRA, several adapters, mixed-adapter
batches, Gaussian or default init, ``target_modules="all-linear"``), training (input gradients flow through the
compiled ops), ``disable_adapter``, ``add_weighted_adapter``, saving and loading adapters, ``unload()``, ``torch.save`` of the whole
PEFT model (plain ``pickle`` of an NVFP4 model fails in torch itself: it cannot pickle float8 tensors).
Refused with an error saying why, before anything changes: merging into the packed weight (it would have to be
re-quantized: load the base with ``dequantize=True`` to merge; after ``model.dequantize()`` merging works),
LoRA variants (DoRA, aLoRA, ...), initialisations that read the dense base weight (PiSSA, OLoRA, LoftQ, EVA, CorDA)
and ``modules_to_save`` on a quantized module. The wrapper class is ``hf_w4.peft.layer.QuantLoraLinear``.
MoE models whose experts hf_w4 unfused (:mod:`hf_w4.loading.moe`) keep LoRA targets on the per-expert projections: PEFT's
retargeting of them to transformers 5's fused expert parameters is skipped for such models (``_patch_moe_conversion``).
Written against the PEFT internals of peft 0.21 (``LoraModel._create_new_module``, ``_replace_module``,
``_check_merge_allowed``, ``_check_new_adapter_config``, ``tuners_utils._maybe_include_all_linear_layers``,
``utils.transformers_weight_conversion``); where they are missing, a warning says so and PEFT is left alone.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

from ..nn import QuantLinear
from .common import base_of, merge_refusal

logger = logging.getLogger("hf_w4")
_TARGET = "peft.tuners.lora.model"
_CONVERSION = "peft.utils.transformers_weight_conversion"   # imported by PEFT only when an adapter is injected


def enable() -> None:
    """Make PEFT's LoRA accept ``QuantLinear`` layers (now, or when PEFT is imported). Idempotent."""
    for name, patch in ((_TARGET, _patch), (_CONVERSION, _patch_moe_conversion)):
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        elif not any(isinstance(f, _ImportHook) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _ImportHook(name, patch))


class _ImportHook(importlib.abc.MetaPathFinder):
    """Patches module ``name`` right after it is first executed, then removes itself."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, self.patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


def _patch(module) -> None:
    model_cls = module.LoraModel
    if getattr(model_cls, "_hf_w4_patched", False):
        return
    utils = sys.modules.get("peft.tuners.tuners_utils")
    missing = [f"LoraModel.{a}" for a in ("_create_new_module", "_replace_module", "_check_merge_allowed",
                                          "_check_new_adapter_config", "prefix") if not hasattr(model_cls, a)]
    missing += [f"tuners_utils.{a}" for a in ("_maybe_include_all_linear_layers", "BaseTunerLayer")
                if not hasattr(utils, a)]
    if missing:  # never break PEFT itself: QuantLinear layers then meet PEFT's own "not supported" error
        import peft
        logger.warning("hf_w4: LoRA on QuantLinear layers is unavailable with peft %s (it lacks %s; hf_w4.peft.lora "
                       "was written against peft 0.21)", getattr(peft, "__version__", "?"), ", ".join(missing))
        return
    create, replace = model_cls._create_new_module, model_cls._replace_module

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        if isinstance(base_of(target), QuantLinear):
            return _quant_lora_linear()(target, adapter_name, config=lora_config, **kwargs)
        return create(lora_config, adapter_name, target, **kwargs)

    def _replace_module(self, parent, child_name, new_module, child):
        # PEFT's own version looks for the base layer's device in its qweight / weight / parameters: a dropped code
        # tensor would be rebuilt several times per layer, and a bias-free compressed-tensors layer has none of them
        base = base_of(child)
        if not isinstance(base, QuantLinear):
            return replace(self, parent, child_name, new_module, child)
        setattr(parent, child_name, new_module)
        device = next(iter(base.buffers(recurse=False))).device
        for name, sub in new_module.named_modules():
            if self.prefix in name and not any(p.is_meta for p in sub.parameters()):
                sub.to(device)

    def _all_linear(peft_config, model):
        # target_modules="all-linear" collects nn.Linear (and Conv1D) layers: QuantLinear ones join them, except the
        # output embeddings (as PEFT leaves a dense lm_head out) and layers already inside an adapter wrapper
        asked = getattr(peft_config, "target_modules", None)
        asked = isinstance(asked, str) and asked.lower() == "all-linear"
        peft_config = all_linear(peft_config, model)
        if asked and isinstance(peft_config.target_modules, set):
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            wrapped = [n + "." for n, m in model.named_modules() if isinstance(m, utils.BaseTunerLayer)]
            peft_config.target_modules |= {n for n, m in model.named_modules() if isinstance(m, QuantLinear)
                                           and m is not head and not any(n.startswith(w) for w in wrapped)}
        return peft_config

    def _check_merge_allowed(self):
        # before PEFT merges anything: a refusal from inside its per-layer loop would leave the dense layers before
        # it merged (and, for GPTQ, PEFT's own check would answer without naming a layer or a way out)
        packed = [m for m in self.model.modules() if _packed_lora(m)]
        if packed:
            raise NotImplementedError(merge_refusal(packed[0]) + f" ({len(packed)} such layer(s); nothing was merged)")
        return check_merge(self)

    def _check_new_adapter_config(self, config):
        # modules_to_save trains a full copy of a module: a QuantLinear's copy has no trainable weight
        keep = getattr(config, "modules_to_save", None) or ()
        keep = [keep] if isinstance(keep, str) else keep
        hit = [n for n, m in self.model.named_modules() if isinstance(m, QuantLinear) and any(n.endswith(k) for k in keep)]
        if hit:
            raise NotImplementedError(
                f"modules_to_save={list(keep)} selects hf_w4 QuantLinear layer(s) {hit}: a quantized module has no "
                "dense weight to train in full; train it through LoRA (target_modules), or load the base with "
                "dequantize=True (or keep that module dense in the checkpoint)")
        return check_config(self, config)

    all_linear = utils._maybe_include_all_linear_layers
    check_merge, check_config = model_cls._check_merge_allowed, model_cls._check_new_adapter_config
    utils._maybe_include_all_linear_layers = _all_linear
    model_cls._create_new_module = staticmethod(_create_new_module)
    model_cls._replace_module = _replace_module
    model_cls._check_merge_allowed = _check_merge_allowed
    model_cls._check_new_adapter_config = _check_new_adapter_config
    model_cls._hf_w4_patched = True


def _patch_moe_conversion(conv) -> None:
    """PEFT (and transformers' ``load_adapter``) retarget a MoE model's ``gate_proj`` / ``up_proj`` / ``down_proj``
    (Mixtral's ``w1`` / ``w3`` / ``w2``) LoRA to the fused ``gate_up_proj`` / ``down_proj`` parameters of
    transformers 5, and merge per-expert adapter weights into them, by model type alone. In a model with
    :class:`~hf_w4.loading.moe.UnfusedExperts` the experts keep their per-expert Linears: the targets keep their names and
    the adapter weights load per expert."""
    from ..loading import moe
    if getattr(conv, "_hf_w4_patched", False):
        return
    import transformers.integrations.peft as tpeft
    for mod in (conv, tpeft):
        f = getattr(mod, "get_model_conversion_mapping", None)
        if f is not None and not hasattr(f, "_hf_w4_wraps"):
            mod.get_model_conversion_mapping = moe.without_unfused_merges(f)
    convert_moe = getattr(conv, "_convert_peft_config_moe", None)
    if convert_moe is not None:
        def _convert_peft_config_moe(peft_config, model):
            if moe.has_unfused(model):
                return None
            return convert_moe(peft_config, model)
        conv._convert_peft_config_moe = _convert_peft_config_moe
    conv._hf_w4_patched = True


def _quant_lora_linear():
    """The LoRA wrapper class (``hf_w4.peft.layer`` imports PEFT, so only once PEFT is in use)."""
    from .layer import QuantLoraLinear
    return QuantLoraLinear


def _packed_lora(m) -> bool:
    """A LoRA wrapper (it has a ``base_layer``) whose base is a QuantLinear."""
    return "base_layer" in m.__dict__.get("_modules", {}) and isinstance(base_of(m), QuantLinear)
