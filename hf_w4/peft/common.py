"""What the PEFT patch and the LoRA wrapper share, without importing PEFT."""
from __future__ import annotations

from ..loading.config import CONFIGS
from ..nn import QuantLinear

PLAIN_INITS = (True, False, "gaussian")   # init_lora_weights values that do not read the base weight


def base_of(module):
    """The layer under any PEFT wrappers."""
    base = module.__dict__.get("_modules", {}).get("base_layer")  # a PEFT wrapper; QuantLinear has none
    return module if base is None else base_of(base)


def describe(layer) -> str:
    base = base_of(layer)
    if isinstance(base, QuantLinear):
        return f"{base.name} (hf_w4 QuantLinear, {base.spec.method})"
    return f"a LoRA layer over {type(base).__name__}"


def merge_refusal(layer) -> str:
    cfg = CONFIGS[base_of(layer).spec.method].__name__
    return (f"{describe(layer)}: merging a LoRA adapter into quantized weights would need re-quantization. To merge, "
            f"load the base model with quantization_config=hf_w4.{cfg}(dequantize=True) (or call model.dequantize() "
            "before adding the adapter), then PeftModel.from_pretrained(...).merge_and_unload()")
