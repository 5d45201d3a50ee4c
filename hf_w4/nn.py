"""``QuantLinear``: a Linear whose weight stays in the checkpoint's packed form.

The checkpoint tensors are persistent buffers, as in transformers' GPTQ / AWQ modules, named, shaped and typed
exactly as on disk (so transformers loads them as they are, ``.to()`` cannot cast them, ``requires_grad_`` and
optimizers never see them, and ``state_dict``/``save_pretrained`` write the checkpoint's own format); only the
bias is a parameter. The selected kernel's repacked copy lives in non-persistent buffers. When the kernel can give
the codes back exactly (``Kernel.CAN_UNPACK_CODES``), the checkpoint's code tensor is dropped after the repack, so the
packed weight is held once, and rebuilt from the kernel's copy whenever it is asked for (``state_dict``,
``save_pretrained``, ``dequantize``, a new kernel); ``HF_W4_KEEP_CHECKPOINT_TENSORS=1`` keeps both copies.

A layer that accelerate offloads (``device_map`` with ``"disk"``, or ``"cpu"`` next to an accelerator) holds nothing:
its checkpoint tensors stay where accelerate keeps them (the checkpoint's own safetensors for ``"disk"``), packed and
with their on-disk dtypes, and each forward brings them in, repacks them for the kernel, runs and lets both go
(:meth:`QuantLinear.offload_to`).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from . import env, layouts
from .formats.spec import W4Spec
from .kernels import registry

# Bumped whenever a QuantLinear's kernel buffers, device or hooks change: a MoE layer that runs its experts' packed
# weights in one call, without calling their modules (hf_w4.loading.moe_stack), checks them again only then.
_layout_epoch = 0


def layout_changed() -> None:
    global _layout_epoch
    _layout_epoch += 1


def layout_epoch() -> int:
    return _layout_epoch


def keep_checkpoint_tensors() -> bool:
    """``HF_W4_KEEP_CHECKPOINT_TENSORS``: keep the checkpoint's code tensor next to the kernel's copy."""
    return env.switch("HF_W4_KEEP_CHECKPOINT_TENSORS")


def plain_linear(m: nn.Module) -> bool:
    """An ``nn.Linear`` that computes a linear layer: a subclass with a forward of its own (PhiMoE's and Llama 4's
    routers return routing tuples) is no layer to quantize or swap."""
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward


class QuantLinear(nn.Module):
    # tensor parallelism: ("out" | "in", rank, ranks) when this module holds one rank's slice of the layer
    # (hf_w4.loading.tensor_parallel); in/out_features stay the whole layer's, as transformers' hooks expect
    tp_shard: Optional[Tuple[str, int, int]] = None

    def __init__(self, spec: W4Spec, in_features: int, out_features: int, name: str,
                 tensors: Dict[str, Tuple[tuple, torch.dtype]], bias_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.spec, self.in_features, self.out_features, self.name = spec, in_features, out_features, name
        self.tensor_names = tuple(tensors)
        for t, (shape, dtype) in tensors.items():
            self.register_buffer(t, torch.empty(shape, dtype=dtype))
        if spec.has_bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.kernel = None
        self.kernel_reasons: Dict[str, str] = {}
        self._dropped: Dict[str, Tuple[tuple, torch.dtype]] = {}  # checkpoint tensors only the kernel holds
        self._kernel_request: Optional[tuple] = None  # select_kernel's arguments, to repack after load_state_dict
        # set once check_loaded has passed: a plain attribute, so copies (deepcopy, pickle) and parameters
        # re-registered later (a new kernel, load_state_dict) keep it; transformers' own mark does not survive them
        self._loaded = False
        self._offload_source = None  # accelerate's weights map of an offloaded layer (offload_to)
        self._offload_device: Optional[torch.device] = None  # where it runs
        self._meta: Dict[str, torch.Tensor] = {}  # its tensors' meta placeholders

    @property
    def held_features(self) -> Tuple[int, int]:
        """(N, K) of the weight this module holds: the layer's, or this rank's slice under tensor parallelism."""
        n, k = self.out_features, self.in_features
        if self.tp_shard is None:
            return n, k
        dim, _, ranks = self.tp_shard
        return (n // ranks, k) if dim == "out" else (n, k // ranks)

    # -- tensors
    def checkpoint_tensors(self) -> Dict[str, torch.Tensor]:
        """The module's tensors exactly as in the checkpoint (a dropped code tensor is rebuilt, an offloaded one read
        from where accelerate keeps it)."""
        if self._offload_source is not None:  # brought in for a forward, or read now
            return {t: self._offloaded(t) if self._buffers[t].is_meta else self._buffers[t] for t in self.tensor_names}
        return {t: self._rebuild(t) if t in self._dropped else getattr(self, t) for t in self.tensor_names}

    def __getattr__(self, name: str):
        if name in self.__dict__.get("_dropped", ()):  # e.g. ``module.weight`` of a ModelOpt layer: rebuilt
            with torch.inference_mode():  # a copy: an in-place edit of it raises instead of being lost
                return self._rebuild(name)
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "weight" or "spec" not in self.__dict__:
                raise
        # e.g. resize_token_embeddings on a quantized lm_head: say what works instead
        raise AttributeError(
            f"{self.name} is an hf_w4 QuantLinear ({self.spec.method}, {self.spec.describe()}) with no dense "
            "'weight'; code that needs one (e.g. resize_token_embeddings on a quantized lm_head) works after "
            "model.dequantize(), or with a checkpoint that leaves this module dense")

    def _rebuild(self, t: str) -> torch.Tensor:
        shape, dtype = self._dropped[t]
        v = layouts.pack_codes(self.spec, self.kernel.unpack_codes(self))
        if tuple(v.shape) != shape or v.dtype != dtype:
            raise RuntimeError(f"{self.name}.{t}: rebuilt {tuple(v.shape)} {v.dtype} from the {self.kernel} kernel, "
                               f"expected {shape} {dtype}")
        return v

    def quantized_weight(self) -> layouts.QWeight:
        return layouts.to_qweight(self.spec, {t: v.data for t, v in self.checkpoint_tensors().items()},
                                  *self.held_features, self.name)

    def dequantize_weight(self) -> torch.Tensor:
        """The exact dense weight [out, in] in fp32."""
        return layouts.dequantize(self.quantized_weight())

    def packed_bytes(self) -> int:
        # a bias transformers split or replicated for tensor parallelism is a DTensor: count this rank's part
        own = sum(p.numel() * p.element_size() for p in
                  (p.to_local() if hasattr(p, "to_local") else p for p in self.parameters(recurse=False)))
        kern = sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))
        return own + kern

    # -- offload
    def offload_to(self, source, device=None) -> None:
        """Keep the checkpoint tensors in ``source`` (a mapping tensor name -> tensor: accelerate's weights map of
        this module) instead of in the layer; they are brought to ``device`` (default: as they come) to run. The
        kernel's copy is built from them for each forward and dropped after it, so an offloaded layer holds packed
        weights only while it runs."""
        layout_changed()
        self._offload_source = source
        self._offload_device = torch.device(device) if device is not None else None
        for b in list(self._non_persistent_buffers_set):  # a kernel's copy
            delattr(self, b)
        for t in self.tensor_names:  # meta placeholders: state_dict / save_pretrained read them back from source
            if t in self._dropped:
                shape, dtype = self._dropped.pop(t)
            else:
                shape, dtype = tuple(self._buffers[t].shape), self._buffers[t].dtype
            self._buffers[t] = torch.empty(shape, dtype=dtype, device="meta")
        self._meta = {t: self._buffers[t] for t in self.tensor_names}

    def _offloaded(self, t: str) -> torch.Tensor:
        """Tensor ``t`` of an offloaded layer, as stored: accelerate must neither cast nor dequantize it."""
        want = self._meta[t]
        try:
            v = self._offload_source[t]
        except KeyError:
            raise layouts.LayoutError(f"{self.name}.{t}: offloaded, but not in the offloaded weights (missing from the "
                                      "checkpoint, or stored under another name)") from None
        if tuple(v.shape) != tuple(want.shape) or v.dtype != want.dtype:
            raise layouts.LayoutError(f"{self.name}.{t}: the offloaded tensor came back as {tuple(v.shape)} {v.dtype}, "
                                      f"expected {tuple(want.shape)} {want.dtype} as in the checkpoint")
        return v if self._offload_device is None else v.to(self._offload_device)  # a move, never a cast

    @contextlib.contextmanager
    def _brought_in(self):
        """An offloaded layer's checkpoint tensors in place for the body; afterwards they and the kernel's copy go."""
        try:
            for t in self.tensor_names:
                self._buffers[t] = self._offloaded(t)
            yield
        finally:
            for b in list(self._non_persistent_buffers_set):
                delattr(self, b)
            self._buffers.update(self._meta)

    def check_loaded(self) -> None:
        """Raise if any tensor was not loaded from the checkpoint (transformers fills missing tensors with
        ``torch.empty_like``, i.e. uninitialised memory)."""
        names = self.tensor_names + (("bias",) if self.bias is not None else ())
        if self._offload_source is not None:  # accelerate holds them: read, and checked, when the layer runs
            names = ()
        for t in names:
            if t in self._dropped:  # checked when it was loaded; now held by the kernel
                continue
            p = getattr(self, t)
            if p.device.type == "meta":
                raise layouts.LayoutError(f"{self.name}.{t}: still on the meta device after loading, and the layer "
                                          "is not offloaded by accelerate")
            if not self._loaded and not getattr(p, "_is_hf_initialized", False):
                raise layouts.LayoutError(f"{self.name}.{t}: missing from the checkpoint (expected {tuple(p.shape)} "
                                          f"{p.dtype}); refusing to run on uninitialised memory")
        self._loaded = True

    # -- kernel
    def select_kernel(self, dtype: torch.dtype, force: Optional[str] = None, deny: Sequence[str] = ()) -> None:
        if self._offload_source is not None:  # chosen (and checked) on the tensors as stored, then let go
            with self._brought_in():
                self._select_kernel(dtype, force, deny)
            return
        self._select_kernel(dtype, force, deny)

    def _select_kernel(self, dtype: torch.dtype, force: Optional[str], deny: Sequence[str]) -> None:
        layout_changed()
        tensors = {t: v.data for t, v in self.checkpoint_tensors().items()}  # before the old kernel's buffers go
        device = next(iter(tensors.values())).device
        n, k = self.held_features
        qw = layouts.to_qweight(self.spec, tensors, n, k, self.name)
        # a stored g_idx that only says "groups in order" (GPTQ writes one even without act-order) is dropped by
        # to_qweight: kernels without act-order support can take the layer
        spec = self.spec.replace(has_g_idx=False) if self.spec.has_g_idx and qw.g_idx is None else self.spec
        cls, self.kernel_reasons = registry.select(spec, n, k, device, dtype, force=force, deny=deny, name=self.name)
        for b in list(self._non_persistent_buffers_set):  # the old kernel's
            delattr(self, b)
        kernel = cls(spec, n, k)
        kernel.prepare(self, qw)
        self.kernel = kernel
        self._kernel_request = (dtype, force, tuple(deny))
        # hold the packed weight once: the kernel's copy stands in for the checkpoint's code tensor if it can
        code = layouts.CODE_TENSOR.get(self.spec.layout)
        if self._offload_source is not None:
            pass  # the stored tensors are the one copy
        elif code in self.tensor_names and kernel.CAN_UNPACK_CODES and not keep_checkpoint_tensors():
            if code not in self._dropped:
                b = self._buffers.pop(code)
                self._dropped[code] = (tuple(b.shape), b.dtype)
        elif code in self._dropped:  # this kernel cannot rebuild it: the checkpoint tensor comes back
            del self._dropped[code]
            self.register_buffer(code, tensors[code])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for t in self._dropped:
            destination[prefix + t] = self._rebuild(t)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # a dropped code tensor in the state dict comes back as a buffer to load into; either way the kernel is
        # repacked afterwards from the new tensors (forward, state_dict and dequantize must keep agreeing)
        for t in [t for t in self._dropped if prefix + t in state_dict]:
            v = self._rebuild(t)
            del self._dropped[t]
            self.register_buffer(t, v)
        n_err = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        touched = any(prefix + t in state_dict for t in self.tensor_names + ("bias",))
        if self.kernel is not None and touched and len(error_msgs) == n_err:
            dtype, force, deny = self._kernel_request
            self.select_kernel(dtype, force=force, deny=deny)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError(f"{self.name}: QuantLinear has no kernel yet (call select_kernel; transformers does "
                               "this after loading)")
        k = self.held_features[1]
        if x.shape[-1] != k:  # for every kernel: their own errors name neither layer nor K
            want = (f"in_features K={k}" if self.tp_shard is None else
                    f"K={k} (this rank's slice of in_features={self.in_features})")
            raise RuntimeError(f"{self.name}: input has {x.shape[-1]} features (shape {list(x.shape)}), expected "
                               f"{want}")
        if self._offload_source is not None:
            with self._brought_in():
                self.kernel.prepare(self, self.quantized_weight())
                return self.kernel.apply(self, x, self.bias)
        return self.kernel.apply(self, x, self.bias)

    def register_forward_hook(self, *args, **kwargs):
        layout_changed()
        return super().register_forward_hook(*args, **kwargs)

    def register_forward_pre_hook(self, *args, **kwargs):
        layout_changed()
        return super().register_forward_pre_hook(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        layout_changed()
        # device moves apply, dtype casts do not: the packed tensors and scales keep their on-disk dtypes and values
        # (a cast result cast back would have lost the fp32 scales' low bits, so the original goes to the new device)
        return super()._apply(lambda t: (lambda o: o if o.dtype == t.dtype else t.to(o.device))(fn(t)), recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.spec.method}:{self.spec.describe()}, kernel={self.kernel}")
