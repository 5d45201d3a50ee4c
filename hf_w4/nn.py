"""``QuantLinear``: a Linear whose weight stays in the checkpoint's packed form.

Parameters are named, shaped and typed exactly as on disk (so transformers loads them as they are, disk
offload and ``.to()`` cannot cast them, and ``state_dict``/``save_pretrained`` write the checkpoint's own
format). The selected kernel's repacked copy lives in non-persistent buffers.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from . import layouts
from .formats.spec import W4Spec
from .kernels import registry


class QuantLinear(nn.Module):
    def __init__(self, spec: W4Spec, in_features: int, out_features: int, name: str,
                 tensors: Dict[str, Tuple[tuple, torch.dtype]], bias_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.spec, self.in_features, self.out_features, self.name = spec, in_features, out_features, name
        self.tensor_names = tuple(tensors)
        for t, (shape, dtype) in tensors.items():
            self.register_parameter(t, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
        if spec.has_bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.kernel = None
        self.kernel_reasons: Dict[str, str] = {}

    # -- tensors
    def checkpoint_tensors(self) -> Dict[str, torch.Tensor]:
        return {t: getattr(self, t) for t in self.tensor_names}

    def quantized_weight(self) -> layouts.QWeight:
        return layouts.to_qweight(self.spec, {t: v.data for t, v in self.checkpoint_tensors().items()},
                                  self.out_features, self.in_features, self.name)

    def dequantize_weight(self) -> torch.Tensor:
        """The exact dense weight [out, in] in fp32."""
        return layouts.dequantize(self.quantized_weight())

    def packed_bytes(self) -> int:
        own = sum(p.numel() * p.element_size() for p in self.parameters(recurse=False))
        kern = sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))
        return own + kern

    def check_loaded(self) -> None:
        """Raise if any tensor was not loaded from the checkpoint (transformers fills missing tensors with
        ``torch.empty_like``, i.e. uninitialised memory)."""
        for t in self.tensor_names + (("bias",) if self.bias is not None else ()):
            p = getattr(self, t)
            if p.device.type == "meta":
                raise layouts.LayoutError(f"{self.name}.{t}: still on the meta device after loading "
                                          "(disk offload is not supported for quantized modules)")
            if not getattr(p, "_is_hf_initialized", False):
                raise layouts.LayoutError(f"{self.name}.{t}: missing from the checkpoint (expected {tuple(p.shape)} "
                                          f"{p.dtype}); refusing to run on uninitialised memory")

    # -- kernel
    def select_kernel(self, dtype: torch.dtype, force: Optional[str] = None, deny: Sequence[str] = ()) -> None:
        device = next(iter(self.checkpoint_tensors().values())).device
        cls, self.kernel_reasons = registry.select(self.spec, self.out_features, self.in_features, device, dtype,
                                                   force=force, deny=deny, name=self.name)
        for b in list(self._buffers):
            del self._buffers[b]
        kernel = cls(self.spec, self.out_features, self.in_features)
        kernel.prepare(self, self.quantized_weight())
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            raise RuntimeError(f"{self.name}: QuantLinear has no kernel yet (call select_kernel; transformers does "
                               "this after loading)")
        return self.kernel.apply(self, x, self.bias)

    def _apply(self, fn, recurse=True):
        # device moves apply, dtype casts do not: the packed tensors and scales keep their on-disk dtypes
        return super()._apply(lambda t: (lambda o: o if o.dtype == t.dtype else o.to(t.dtype))(fn(t)), recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"format={self.spec.method}:{self.spec.describe()}, kernel={self.kernel}")
