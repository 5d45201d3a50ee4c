"""``QuantLoraLinear``: PEFT's LoRA ``Linear`` over an hf_w4 ``QuantLinear`` (imported only once PEFT is; see
``hf_w4.peft.lora``). A module of its own so that a PEFT model over a quantized base pickles (``torch.save``).

PEFT's ``lora.Linear`` supplies the forward (the base layer's output plus each active adapter's, mixed-adapter batches
included), ``get_delta_weight`` and, once the base has been dequantized (``model.dequantize()``), merging. This class
adds what a packed base needs: the layer's sizes and device without a dense weight, plain LoRA only, and refusals
for what would read or change the packed weight.
"""
from __future__ import annotations

from peft.tuners.lora.layer import Linear

from ..nn import QuantLinear
from .common import PLAIN_INITS, base_of, describe, merge_refusal


class QuantLoraLinear(Linear):
    """LoRA on an hf_w4 ``QuantLinear``: ``y = base(x) + sum over active adapters of B(A(dropout(x))) * scaling``."""

    def _packed(self) -> bool:
        return isinstance(base_of(self), QuantLinear)

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        if self._packed() and config.init_lora_weights not in PLAIN_INITS:
            raise NotImplementedError(
                f"{describe(self)}: init_lora_weights={config.init_lora_weights!r} reads the dense base weight, which "
                f"a quantized layer does not hold; supported here: {list(PLAIN_INITS)} (or load the base with "
                "dequantize=True)")
        return super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    @property
    def lora_variants(self):
        return {(): None}

    def resolve_lora_variant(self, *, config, **kwargs):
        try:
            return super().resolve_lora_variant(config=config, **kwargs)
        except ValueError as e:
            raise NotImplementedError(
                f"{describe(self)}: only plain LoRA is supported on a quantized layer, not the requested variant ({e}); "
                "DoRA and the other variants work on a base loaded with dequantize=True") from None

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features

    def _get_base_layer_device_and_dtype(self, base_layer):
        if not self._packed():
            return super()._get_base_layer_device_and_dtype(base_layer)
        # no float weight to follow: the adapter stays in its own (fp32) dtype, on the layer's device
        return next(iter(base_of(self).buffers(recurse=False))).device, None

    def merge(self, safe_merge=False, adapter_names=None):
        if self._packed():
            raise NotImplementedError(merge_refusal(self))
        return super().merge(safe_merge=safe_merge, adapter_names=adapter_names)
