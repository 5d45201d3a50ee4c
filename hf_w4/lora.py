"""PEFT LoRA on hf_w4 ``QuantLinear`` layers (QLoRA-style training on a packed 4-bit base).

PEFT picks the LoRA wrapper of a layer from its own list of layer types, so ``get_peft_model`` (and
transformers' ``model.add_adapter`` / ``load_adapter``, ``PeftModel.from_pretrained``) would refuse a
``QuantLinear``. ``enable()`` -- called by ``hf_w4.install()`` -- teaches PEFT's ``LoraModel`` one more type: a
``QuantLinear`` gets a ``QuantLoraLinear``, whose forward is the compiled kernel's output plus the adapter's, as
PEFT does for GPTQ / AWQ layers. Every other layer type goes to PEFT's own code unchanged. PEFT is not imported
for this: if it is not imported yet, an import hook applies the change when PEFT's LoRA module is first imported
(importing PEFT costs seconds). The change stays for the process; it acts on ``QuantLinear`` layers only.

What works: plain LoRA (any ``r`` / ``lora_alpha`` / dropout / ``lora_bias`` / rsLoRA, several adapters, Gaussian or
default init, ``target_modules="all-linear"``), training (input gradients flow through the compiled ops), ``disable_adapter``, saving and loading
adapters, ``unload()``. Refused with an error saying why: merging into the packed weight (it would have to be
re-quantized: load the base with ``dequantize=True`` to merge), LoRA variants (DoRA, aLoRA, ...) and
initialisations that read the dense base weight (PiSSA, OLoRA, LoftQ, EVA, CorDA).
Written against the PEFT internals of peft 0.21 (``LoraModel._create_new_module`` / ``_replace_module``); where
they are missing, a warning says so and PEFT is left alone.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

from .nn import QuantLinear

logger = logging.getLogger("hf_w4")
_TARGET = "peft.tuners.lora.model"
_PLAIN_INITS = (True, False, "gaussian")
_layer_cls = None


def enable() -> None:
    """Make PEFT's LoRA accept ``QuantLinear`` layers (now, or when PEFT is imported). Idempotent."""
    module = sys.modules.get(_TARGET)
    if module is not None:
        _patch(module)
    elif not any(isinstance(f, _ImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook())


class _ImportHook(importlib.abc.MetaPathFinder):
    """Patches ``peft.tuners.lora.model`` right after it is first executed, then removes itself."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _patch(module)


def _patch(module) -> None:
    model_cls = module.LoraModel
    if getattr(model_cls, "_hf_w4_patched", False):
        return
    utils = sys.modules.get("peft.tuners.tuners_utils")
    missing = [f"LoraModel.{a}" for a in ("_create_new_module", "_replace_module", "prefix") if not hasattr(model_cls, a)]
    missing += [f"tuners_utils.{a}" for a in ("_maybe_include_all_linear_layers", "BaseTunerLayer")
                if not hasattr(utils, a)]
    if missing:  # never break PEFT itself: QuantLinear layers then meet PEFT's own "not supported" error
        import peft
        logger.warning("hf_w4: LoRA on QuantLinear layers is unavailable with peft %s (it lacks %s; hf_w4.lora "
                       "was written against peft 0.21)", getattr(peft, "__version__", "?"), ", ".join(missing))
        return
    create, replace = model_cls._create_new_module, model_cls._replace_module

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        if isinstance(_base(target), QuantLinear):
            return _quant_lora_linear()(target, adapter_name, config=lora_config, **kwargs)
        return create(lora_config, adapter_name, target, **kwargs)

    def _replace_module(self, parent, child_name, new_module, child):
        # PEFT's own version looks for the base layer's device in its qweight / weight / parameters: a dropped code
        # tensor would be rebuilt several times per layer, and a bias-free compressed-tensors layer has none of them
        base = _base(child)
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

    all_linear = utils._maybe_include_all_linear_layers
    utils._maybe_include_all_linear_layers = _all_linear
    model_cls._create_new_module = staticmethod(_create_new_module)
    model_cls._replace_module = _replace_module
    model_cls._hf_w4_patched = True


def _base(module):
    base = module.__dict__.get("_modules", {}).get("base_layer")  # a PEFT wrapper; QuantLinear has none
    return module if base is None else _base(base)


def _quant_lora_linear():
    """The LoRA wrapper class (built on first use: it derives from PEFT's ``LoraLayer``)."""
    global _layer_cls
    if _layer_cls is not None:
        return _layer_cls
    import torch
    from peft.tuners.lora.layer import LoraLayer

    class QuantLoraLinear(torch.nn.Module, LoraLayer):
        """LoRA on an hf_w4 ``QuantLinear``: ``y = base(x) + sum over active adapters of B(A(dropout(x))) * scaling``."""

        def __init__(self, base_layer, adapter_name, config, r=0, lora_alpha=1, **kwargs):
            super().__init__()
            LoraLayer.__init__(self, base_layer, **kwargs)
            self._active_adapter = adapter_name
            self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        def _what(self) -> str:
            return f"{_base(self).name} (hf_w4 QuantLinear, {_base(self).spec.method})"

        def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
            if config.init_lora_weights not in _PLAIN_INITS:
                raise NotImplementedError(
                    f"{self._what()}: init_lora_weights={config.init_lora_weights!r} reads the dense base weight, "
                    f"which a quantized layer does not hold; supported here: {list(_PLAIN_INITS)} (or load the "
                    "base with dequantize=True)")
            return super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

        @property
        def lora_variants(self):
            return {(): None}

        def resolve_lora_variant(self, *, config, **kwargs):
            try:
                return super().resolve_lora_variant(config=config, **kwargs)
            except ValueError as e:
                raise NotImplementedError(
                    f"{self._what()}: only plain LoRA is supported on a quantized layer, not the requested variant "
                    f"({e}); DoRA and the other variants work on a base loaded with dequantize=True") from None

        def _get_in_out_features(self, module):
            return module.in_features, module.out_features

        def _get_base_layer_device_and_dtype(self, base_layer):
            # no float weight to follow: the adapter stays in its own (fp32) dtype, on the layer's device
            return next(iter(_base(self).buffers(recurse=False))).device, None

        def merge(self, safe_merge=False, adapter_names=None):
            from .quantizers.config import CONFIGS
            cfg = CONFIGS[_base(self).spec.method].__name__
            raise NotImplementedError(
                f"{self._what()}: merging a LoRA adapter into quantized weights would need re-quantization. To merge, "
                f"load the base model with quantization_config=hf_w4.{cfg}(dequantize=True) (or call "
                "model.dequantize() before adding the adapter), then PeftModel.from_pretrained(...).merge_and_unload()")

        def unmerge(self):
            raise NotImplementedError(f"{self._what()}: nothing is merged (merging is not supported)")

        def forward(self, x, *args, **kwargs):
            result = self.base_layer(x, *args, **kwargs)
            if self.disable_adapters:
                return result
            for name in self.active_adapters:
                if name not in self.lora_A:
                    continue
                lora_a, lora_b = self.lora_A[name], self.lora_B[name]
                xa = self._cast_input_dtype(x, lora_a.weight.dtype)
                delta = lora_b(lora_a(self.lora_dropout[name](xa))) * self.scaling[name]
                result = result + delta.to(result.dtype)
            return result

        def __repr__(self) -> str:
            return "lora." + super().__repr__()

    _layer_cls = QuantLoraLinear
    return _layer_cls
