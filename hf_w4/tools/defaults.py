"""The tools' defaults, in a module that imports nothing heavy: ``hf-w4 --help`` shows them without importing torch."""
import argparse

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."
DEFAULT_WINDOW = 512          # tokens per perplexity window
DEFAULT_MAX_TOKENS = 4096     # text tokens eval scores (0 = the whole text)
DEFAULT_DECODE_TOKENS = 32    # greedy tokens timed
DEMO_MAX_TOKENS = 2048
QUICK = dict(max_tokens=512, decode_tokens=8)   # demo --quick
DEMO_GROUP_SIZE = 64          # SmolLM2's K = 576 is not a multiple of 128; 64 and 32 fit every projection
# convert's group size when none is given: the first of these that divides every quantized layer's input size
GROUP_SIZES = (128, 64, 32, 16)
# 4-bit integer weight formats, which the cpu_int8 kernel also runs with dynamic int8 activations (W4A8); the NVFP4
# formats have no int8 kernel (they would fall back to the slow reference kernel)
W4A8_FORMATS = ("gptq", "autoround", "autoround-awq", "awq", "ct-w4a16")
DTYPES = ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's default shown unless its help already says it (or it has none)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default not in (None, False, argparse.SUPPRESS)
                and "default" not in text):
            text += " (default: %(default)s)"
        return text
