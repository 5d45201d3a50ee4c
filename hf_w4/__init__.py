"""hf_w4: 4-bit checkpoints (AutoRound, GPTQ, AWQ, compressed-tensors, ModelOpt NVFP4) in transformers,
on compiled kernels, with no producer library installed.

    import hf_w4
    hf_w4.install()                      # or: with hf_w4.enabled(): ...
    model = AutoModelForCausalLM.from_pretrained(path)
    print(hf_w4.kernel_report(model))

The names below load on first use, so ``import hf_w4`` (and ``hf-w4 --help``) imports neither torch nor
transformers. ``import hf_w4`` changes only error messages (``install_hint.py``); ``install()`` does the rest.
"""
import importlib

from . import install_hint

__version__ = "0.1.0"

# public name -> the module that defines it (and its name there)
_API = {
    "install": ("integration", "install"), "uninstall": ("integration", "uninstall"),
    "enabled": ("integration", "enabled"), "installed": ("integration", "installed"),
    "list_kernels": ("kernels", "kernels"), "support_matrix": ("kernels", "support_matrix"),
    "QuantLinear": ("nn", "QuantLinear"),
    "AutoRoundConfig": ("loading.config", "AutoRoundConfig"), "AwqConfig": ("loading.config", "AwqConfig"),
    "CompressedTensorsConfig": ("loading.config", "CompressedTensorsConfig"),
    "GPTQConfig": ("loading.config", "GPTQConfig"), "ModelOptConfig": ("loading.config", "ModelOptConfig"),
    "kernel_report": ("report", "kernel_report"), "layer_table": ("report", "layer_table"),
}
__all__ = list(_API)

install_hint.enable()


def __getattr__(name):
    if name in _API:
        module, attr = _API[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    try:   # a submodule, as after an eager import: hf_w4.ops, hf_w4.kernels, ...
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_API))
