"""One ``HfQuantizer`` for all formats: the module swap before loading, the kernel repack after it.

Per-method subclasses only name their method (they are what ``AUTO_QUANTIZER_MAPPING`` points at).
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer

from .. import formats, layouts
from ..kernels import cpu_dense
from . import checkpoint, memory, moe, tensor_parallel
from .checkpoint import CheckpointError
from ..nn import QuantLinear, plain_linear
from .config import ACTIVATION_MODES, CONFIGS, HfW4ConfigMixin
from ..log import logger



def _module_spec(spec, name: str, mod: nn.Module, stored: Optional[Dict[str, checkpoint.TensorInfo]],
                 activation: Optional[str]):
    """``spec`` completed for one module from what the checkpoint stores for it (bias, g_idx, input scale)."""
    has_bias = mod.bias is not None if stored is None else "bias" in stored
    spec = spec.replace(has_bias=has_bias)
    if spec.layout == "gptq":
        spec = spec.replace(has_g_idx=spec.desc_act if stored is None else "g_idx" in stored)
        if spec.desc_act and not spec.has_g_idx:
            raise CheckpointError(f"{name}.g_idx: missing from the checkpoint, but the config says desc_act: true "
                                  "(act-order needs g_idx)")
    if spec.weight_type == "nvfp4" and stored is not None:
        key = "input_global_scale" if spec.layout == "ct_nvfp4" else "input_scale"
        spec = spec.replace(has_input_scale=key in stored)
    if activation is not None:
        spec = spec.replace(act=activation)
    return spec


def _fits(spec, name: str, mod: nn.Module, stored: Optional[Dict[str, checkpoint.TensorInfo]]) -> bool:
    """Whether the checkpoint's tensors for the module are what ``spec`` (None: dense) declares."""
    if not stored:
        return False
    if spec is None:
        w = stored.get("weight")
        return (w is not None and w.dtype is not None and w.dtype.is_floating_point
                and not set(stored) & checkpoint.QUANTIZED_WEIGHT_TENSORS)
    try:
        decls = layouts.declare(_module_spec(spec, name, mod, stored, None), mod.out_features, mod.in_features, name)
    except (CheckpointError, layouts.LayoutError):
        return False
    return all(t in stored and stored[t].shape == tuple(d.shape) for t, d in decls.items())


def _spec_for(fmt: formats.FormatConfig, name: str, mod: nn.Module, stored_name: Optional[str],
              stored: Optional[Dict[str, checkpoint.TensorInfo]]):
    """The config's spec for module ``name``. Where transformers renames the module (``stored_name``: its name on
    disk), the config may name it either way: producers that ran on transformers 4 wrote the names on disk, those on
    transformers 5 the model's (and transformers 5 saves under the old names). Where the two readings differ, the
    name a rule or block list of the config uses wins; if it uses both or neither, the reading the files bear out;
    else the model's name."""
    cls = type(mod).__name__
    spec = fmt.spec_for(name, cls)
    if not stored_name or stored_name == name:
        return spec
    other = fmt.spec_for(stored_name, cls)
    if other == spec:
        return spec
    named, named_stored = fmt.names_module(name), fmt.names_module(stored_name)
    if named != named_stored:
        return spec if named else other
    fit = [s for s in (spec, other) if _fits(s, name, mod, stored)]
    return fit[0] if len(fit) == 1 else spec


def replace_linear(model: nn.Module, fmt: formats.FormatConfig, headers: Optional[Dict[str, checkpoint.TensorInfo]],
                   activation: Optional[str] = None, skip=(), stored_names: Optional[Dict[str, str]] = None) -> int:
    """Swap every ``nn.Linear`` the config quantizes for a :class:`QuantLinear` declaring exactly the tensors
    the checkpoint holds. With ``headers`` (from the safetensors files), every mismatch between config and
    files is raised here, before any tensor is read. ``headers`` are keyed by the names transformers loads the
    tensors as (:func:`checkpoint.loading_names`; ``stored_names``: a renamed module's name on disk). Returns the
    number of modules replaced."""
    count = 0
    modules = dict(model.named_modules())
    # header names outside the model: a renaming not known here (transformers 5.23 does not pass
    # from_pretrained's key_mapping to quantizers) or tensors the model does not use. A module with no tensors
    # under its own name may then be loaded under another one: the post-load guard checks it instead
    unsure = headers is not None and any(k.rpartition(".")[0] not in modules for k in headers)
    for name, mod in list(modules.items()):
        if not plain_linear(mod):
            continue
        stored = checkpoint.module_tensors(headers, name) if headers is not None else None
        if unsure and not stored:
            stored = None
        spec = _spec_for(fmt, name, mod, (stored_names or {}).get(name), stored)
        if spec is not None and any(name == s or name.startswith(s + ".") for s in skip):
            spec = None
        if spec is None:
            if stored and "weight" not in stored and set(stored) - {"bias"}:
                raise CheckpointError(f"{name}: the config leaves this module dense, but the checkpoint holds "
                                      f"quantized tensors {sorted(stored)} and no dense 'weight'")
            if stored is not None and "weight" in stored and stored["weight"].dtype in (torch.uint8,):
                raise CheckpointError(f"{name}.weight: the config leaves this module dense, but the checkpoint "
                                      f"stores it as {stored['weight'].dtype_name} {list(stored['weight'].shape)}")
            continue
        n, k = mod.out_features, mod.in_features
        spec = _module_spec(spec, name, mod, stored, activation)
        has_bias = spec.has_bias
        decls = layouts.declare(spec, n, k, name)
        dtypes = {}
        for t, d in decls.items():
            if stored is None:
                dtypes[t] = d.dtypes[0]
                continue
            if t not in stored:
                raise CheckpointError(
                    f"{name}.{t}: missing from the checkpoint; {spec.method} ({spec.describe()}) expects shape "
                    f"{list(d.shape)} dtype {str(d.dtypes[0]).replace('torch.', '')}"
                    + (f" (found instead: {sorted(stored)})" if stored else " (no tensors stored for this module)"))
            info = stored[t]
            if info.shape != tuple(d.shape):
                raise CheckpointError(f"{name}.{t}: shape {list(info.shape)} does not match the config "
                                      f"({spec.describe()}, in={k}, out={n}): expected {list(d.shape)}")
            if info.dtype not in d.dtypes:
                raise CheckpointError(f"{name}.{t}: dtype {info.dtype_name} is not supported for this tensor; "
                                      f"expected one of {[str(x).replace('torch.', '') for x in d.dtypes]}")
            dtypes[t] = info.dtype
        if stored is not None:
            extra = set(stored) - set(decls) - {"bias"} - checkpoint.KV_CACHE_SCALES
            if extra:
                raise CheckpointError(f"{name}: unexpected tensor(s) {sorted(extra)} for {spec.method} "
                                      f"({spec.describe()}); expected {sorted(decls)}")
            if has_bias and stored["bias"].shape != (n,):
                raise CheckpointError(f"{name}.bias: shape {list(stored['bias'].shape)}, expected [{n}]")
        bias_dtype = (stored["bias"].dtype if stored is not None and has_bias else
                      mod.bias.dtype if mod.bias is not None else None)
        ql = QuantLinear(spec, k, n, name, {t: (decls[t].shape, dtypes[t]) for t in decls}, bias_dtype=bias_dtype)
        model.set_submodule(name, ql)
        count += 1
    if headers is not None:
        checkpoint.check_unclaimed(headers, model)
    return count


def offloaded_layers(model: nn.Module) -> Dict[QuantLinear, tuple]:
    """Every ``QuantLinear`` inside a module that accelerate's ``dispatch_model`` offloads (an ``AlignDevicesHook``
    with ``offload=True``: ``device_map`` "disk", or "cpu" next to an accelerator), with the hook's weights map of
    its own tensors and the device the hook runs it on."""
    out: Dict[QuantLinear, tuple] = {}
    for mod in model.modules():
        hook = getattr(mod, "_hf_hook", None)
        for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):  # a SequentialHook or one
            if getattr(h, "offload", False) and getattr(h, "weights_map", None) is not None:
                from accelerate.utils import PrefixedDataset  # a hook means accelerate is there
                for sub_name, sub in mod.named_modules():
                    if isinstance(sub, QuantLinear):
                        source = PrefixedDataset(h.weights_map, sub_name + ".") if sub_name else h.weights_map
                        out[sub] = (source, h.execution_device)
    return out


class HfW4Quantizer(HfQuantizer):
    """Loads pre-quantized checkpoints of one ``quant_method`` into :class:`QuantLinear` modules."""

    METHOD = ""
    requires_calibration = True

    def __init__(self, quantization_config, **kwargs):
        cfg = quantization_config
        if not isinstance(cfg, HfW4ConfigMixin):
            cfg = CONFIGS[self.METHOD].from_config(cfg)
        if self.METHOD == "modelopt" and kwargs.get("pre_quantized") is False:
            # a ModelOpt export that only has hf_quant_config.json: read it before loading (see preprocess)
            kwargs["pre_quantized"] = True
            self._modelopt_from_file = True
        elif kwargs.get("pre_quantized") is False:  # transformers' own message asks for a flag that would not help
            raise CheckpointError(f"{type(cfg).__name__} was passed for a checkpoint with no quantization_config in "
                                  "its config.json: hf_w4 loads pre-quantized checkpoints only (it does not quantize "
                                  "a dense model; `hf-w4 convert` writes a quantized checkpoint from one)")
        super().__init__(cfg, **kwargs)
        self.options = cfg.loading_attributes()
        self.format: Optional[formats.FormatConfig] = None

    # -- environment
    def update_dtype(self, dtype):
        return self.options.get("compute_dtype") or dtype

    def update_parallel_plan(self, model, plan):
        # column- / row-parallel entries that reach a QuantLinear go to hf_w4's variants, which split packed tensors
        tensor_parallel.update_plan(model, plan)

    def _convert_model_for_quantization(self, model):
        pass  # per checkpoint, in _process_model_before_weight_loading (moe.sequential_for_checkpoint)

    def update_weight_conversions(self, weight_conversions, model):
        # per-expert tensors of MoE layers load as stored, into per-expert Linears (hf_w4.loading.moe), not merged
        return super().update_weight_conversions(moe.drop_expert_merges(weight_conversions, model), model)

    # -- loading
    def _checkpoint_dict(self, checkpoint_files) -> dict:
        raw = self.quantization_config.checkpoint_dict()
        if getattr(self, "_modelopt_from_file", False) or raw.keys() <= {"quant_method"}:
            d = os.path.dirname(str(checkpoint_files[0])) if checkpoint_files else None
            path = os.path.join(d, "hf_quant_config.json") if d else None
            if not path or not os.path.exists(path):
                raise CheckpointError(f"{self.METHOD}: the checkpoint has no quantization_config in config.json "
                                      f"and no hf_quant_config.json next to its weights ({d})")
            with open(path) as f:
                hq = json.load(f)
            raw = {"quant_method": "modelopt", **hq.get("quantization", {}), "producer": hq.get("producer")}
            self.quantization_config._raw = raw
        return raw

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        self._checkpoint_files = list(checkpoint_files or ())
        self.format = formats.parse(self._checkpoint_dict(checkpoint_files))
        headers = checkpoint.read_headers(checkpoint_files) if checkpoint_files else None
        stored_names: Dict[str, str] = {}   # renamed modules' names on disk
        if headers is not None:
            # transformers renames checkpoint keys only after this swap: match the names it will load them as
            headers = checkpoint.loading_names(headers, model, kwargs.get("key_mapping"), self, stored_names)
            # MoE experts stored one Linear per expert: unfused, so each projection is a Linear swapped below
            moe.sequential_for_checkpoint(model, headers)
            moe.unfuse_for_checkpoint(model, headers)
        skip = list(getattr(model, "_keep_in_fp32_modules", None) or ())
        act = ACTIVATION_MODES[self.options["activation"]]
        n = replace_linear(model, self.format, headers, activation=act, skip=skip, stored_names=stored_names)
        if n == 0:
            logger.warning("hf_w4: the %s config quantizes no Linear module of this model", self.METHOD)
        lm = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if isinstance(lm, QuantLinear) and getattr(model.config.get_text_config(), "tie_word_embeddings", False):
            # a quantized lm_head cannot share the embedding's dense weight: untie it
            model.config.get_text_config().tie_word_embeddings = False
            model.config.tie_word_embeddings = False
            tied = getattr(model, "all_tied_weights_keys", None) or {}
            for key in [k for k in tied if k.startswith(lm.name + ".")]:
                tied.pop(key)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        dtype = self.options.get("compute_dtype") or getattr(model, "dtype", None) or torch.float32
        tensor_parallel.check_model(model)
        # runs after accelerate's dispatch: layers it offloads read their packed tensors from its weights map
        for m, (source, device) in offloaded_layers(model).items():
            m.offload_to(source, device)
        # tensors transformers left as views of the checkpoint's memory maps get their own memory, layer by layer
        # before each repack (read with pread: the maps' pages are never faulted in), so the files are unmapped
        # and no more than one layer is ever held twice (loading/memory.py)
        maps = memory.CheckpointMaps(getattr(self, "_checkpoint_files", ()))
        try:
            for m in model.modules():
                if isinstance(m, QuantLinear):
                    if m.tp_shard is not None:
                        tensor_parallel.localize(m)
                    m.check_loaded()
                    maps.copy_out(m, recurse=False)
                    for p in m.parameters(recurse=False):
                        p.requires_grad_(False)
                    m.select_kernel(dtype, force=self.options["kernel"], deny=self.options["disabled_kernels"])
                    memory.trim_heap()  # the repack's scratch, before the next layer's
            maps.copy_out(model)
        finally:
            maps.close()
        if self.options.get("dequantize"):
            self._dequantize(model, dtype)
        else:
            for m in model.modules():   # experts that can run as one call per step: their kernel buffers stacked now
                if isinstance(m, moe.UnfusedExperts):
                    m.one_call()
            cpu_dense.adopt(model)      # the layers left dense (the LM head) decode through the compiled GEMV
        return model

    # -- saving / dequantizing
    def is_serializable(self, safe_serialization=None):
        return True

    @property
    def is_trainable(self):
        # the packed weights are frozen buffers, but input gradients flow through every kernel (the compiled ops
        # register grad_x = grad_y @ W), so adapters on a quantized base train (PEFT's LoRA through hf_w4.peft.lora)
        return True

    def get_state_dict_and_metadata(self, model):
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.check_loaded()  # refuse before any file is written
                if m.tp_shard is not None:
                    raise NotImplementedError(
                        f"{m.name}: this rank holds only its tensor-parallel slice of the layer; save the checkpoint "
                        "from a model loaded in one process (the files this one was loaded from are that checkpoint)")
        return None, {}

    def dequantize(self, model, dtype=None):
        # transformers falls back to config.dtype, which model.to(dtype) does not update: take the dtype the
        # model's dense parts have now, so the new Linears match them
        if dtype is None:
            dtype = next((p.dtype for m in model.modules() if not isinstance(m, QuantLinear)
                          for p in m.parameters(recurse=False) if p.is_floating_point()), None)
        return super().dequantize(model, dtype=dtype)

    def _dequantize(self, model, dtype=None):
        # trainable nn.Linears, as a dense model's (and transformers' own dequantize) are
        for name, m in model.named_modules():   # before any layer changes
            if isinstance(m, QuantLinear) and m.tp_shard is not None:
                raise NotImplementedError(f"{name}: dequantizing a tensor-parallel slice is not supported; "
                                          "dequantize a model loaded in one process")
        for name, m in list(model.named_modules()):
            if isinstance(m, QuantLinear):
                w = m.dequantize_weight()
                lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=w.device,
                                dtype=dtype or w.dtype)
                with torch.no_grad():
                    lin.weight.copy_(w)
                    if m.bias is not None:
                        lin.bias.copy_(m.bias)
                model.set_submodule(name, lin)
        return model


def _quantizer(method: str):
    cls_name = "HfW4" + "".join(p.capitalize() for p in method.replace("-", " ").split()) + "Quantizer"
    return type(cls_name, (HfW4Quantizer,), {"METHOD": method, "__module__": __name__})


QUANTIZERS = {m: _quantizer(m) for m in CONFIGS}
# module attributes under their own names, so pickle finds them (a pickled / torch.save'd model holds its quantizer)
globals().update({cls.__name__: cls for cls in QUANTIZERS.values()})
