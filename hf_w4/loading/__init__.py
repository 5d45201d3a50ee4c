from .quantizer import QUANTIZERS, HfW4Quantizer, replace_linear
from .config import CONFIGS, AutoRoundConfig, AwqConfig, CompressedTensorsConfig, GPTQConfig, ModelOptConfig

__all__ = ["QUANTIZERS", "HfW4Quantizer", "replace_linear", "CONFIGS", "AutoRoundConfig", "AwqConfig",
           "CompressedTensorsConfig", "GPTQConfig", "ModelOptConfig"]
