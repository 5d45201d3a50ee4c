"""Loading a quantized checkpoint into transformers: the config classes (config.py), the HfQuantizer (quantizer.py),
the checkpoint headers it checks against (checkpoint.py) and MoE experts unfused for per-expert tensors (moe.py)."""
from .quantizer import QUANTIZERS, HfW4Quantizer, replace_linear
from .config import CONFIGS, AutoRoundConfig, AwqConfig, CompressedTensorsConfig, GPTQConfig, ModelOptConfig

__all__ = ["QUANTIZERS", "HfW4Quantizer", "replace_linear", "CONFIGS", "AutoRoundConfig", "AwqConfig",
           "CompressedTensorsConfig", "GPTQConfig", "ModelOptConfig"]
