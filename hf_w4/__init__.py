"""hf_w4: 4-bit checkpoints (AutoRound, GPTQ, AWQ, compressed-tensors, ModelOpt NVFP4) in transformers,
on compiled kernels, with no producer library installed.

    import hf_w4
    hf_w4.install()                      # or: with hf_w4.enabled(): ...
    model = AutoModelForCausalLM.from_pretrained(path)
    print(hf_w4.kernel_report(model))
"""
from .integration import enabled, install, installed, uninstall
from .kernels import kernels as list_kernels
from .kernels import support_matrix
from .nn import QuantLinear
from .loading.config import AutoRoundConfig, AwqConfig, CompressedTensorsConfig, GPTQConfig, ModelOptConfig
from .report import kernel_report, layer_table

__version__ = "0.1.0"
__all__ = ["install", "uninstall", "enabled", "installed", "list_kernels", "support_matrix", "QuantLinear",
           "AutoRoundConfig", "AwqConfig", "CompressedTensorsConfig", "GPTQConfig", "ModelOptConfig",
           "kernel_report", "layer_table"]
