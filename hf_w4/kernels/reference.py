"""The pure-PyTorch reference kernel: always implementable, exact, slow.

It keeps no derived tensors: every call dequantizes from the layer's checkpoint tensors
(so it also works on modules whose tensors an offload hook swaps in per forward)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import layouts
from .base import Kernel, fake_quantize_act


class TorchReferenceKernel(Kernel):
    NAME = "torch_reference"
    PRIORITY = -100
    DEVICES = ("cpu", "cuda", "xpu", "mps", "meta")
    WEIGHT_TYPES = frozenset({"int4", "int8", "nvfp4"})
    ACTIVATIONS = frozenset({"none", "int8_token", "int8_group"})
    SUPPORTS_EMPTY_K = True
    DESCRIPTION = "pure PyTorch: dequantize to fp32 on every call, then F.linear (exact; the test oracle)"

    def apply(self, layer, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        w = layouts.dequantize(layer.quantized_weight()).to(x.device)
        xf = fake_quantize_act(x, self.spec.act, self.spec.effective_group(self.k))
        y = F.linear(xf, w, None if bias is None else bias.float())
        return y.to(x.dtype)
