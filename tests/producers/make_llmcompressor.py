"""Writes the llm-compressor / compressed-tensors golden checkpoints. Run by regenerate.py inside its venv.

usage: python make_llmcompressor.py OUT_ROOT
"""
import os
import shutil
import sys
import tempfile

import torch
from datasets import Dataset

from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402

# g32 keeps several groups per row in a 128-wide model; the presets (W8A8, W4A8, NVFP4A16) are used as shipped
W4 = dict(num_bits=4, type="int", dynamic=False)


def custom(symmetric: bool, **strategy):
    return {"group_0": QuantizationScheme(targets=["Linear"],
                                          weights=QuantizationArgs(**W4, **strategy, symmetric=symmetric))}


# name -> (modifier class, its keyword arguments)
SCHEMES = {
    "w4a16-sym": (GPTQModifier, dict(config_groups=custom(True, strategy="group", group_size=32))),
    "w4a16-asym": (QuantizationModifier, dict(config_groups=custom(False, strategy="group", group_size=32))),
    "w4a16-channel": (QuantizationModifier, dict(config_groups=custom(True, strategy="channel"))),
    "w8a8": (GPTQModifier, dict(scheme="W8A8", targets="Linear")),
    "w4a8": (QuantizationModifier, dict(scheme="W4A8", targets="Linear")),
    "nvfp4a16": (QuantizationModifier, dict(scheme="NVFP4A16", targets="Linear")),
}


def make(out_root: str, name: str) -> None:
    import compressed_tensors
    import llmcompressor
    cls, kwargs = SCHEMES[name]
    out = os.path.join(out_root, f"llmcompressor-{name}")
    shutil.rmtree(out, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(tiny.dense_checkpoint(tempfile.mkdtemp()), dtype=torch.bfloat16)
    calib = Dataset.from_dict({"input_ids": tiny.calibration_ids().tolist()})
    oneshot(model=model, dataset=calib, processor=tiny.stub_tokenizer(), recipe=cls(ignore=["lm_head"], **kwargs),
            num_calibration_samples=tiny.CALIB_SAMPLES, max_seq_length=tiny.CALIB_LEN)
    with torch.no_grad():  # the producer's fake-quant forward, for the log only
        fq = model(input_ids=tiny.probe_ids()).logits.float()
    model.save_pretrained(out, save_compressed=True)
    tiny.strip_side_files(out)

    # The reference: compressed-tensors reads its own file back (through transformers, dequantize on load) and
    # runs its quantized forward in fp32, activation quantization included.
    ref_model = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    ids, logits = tiny.fp32_logits(ref_model)
    cos = torch.nn.functional.cosine_similarity(logits.flatten(), fq.flatten(), dim=0).item()
    print(f"{name}: reloaded vs in-memory fake-quant cosine {cos:.6f}")
    tiny.save_reference(out, ids, logits, producer="llmcompressor", scheme=name,
                        versions={"llmcompressor": llmcompressor.__version__,
                                  "compressed-tensors": compressed_tensors.__version__,
                                  "torch": torch.__version__},
                        how="transformers from_pretrained(dtype=float32) with compressed-tensors decompressing")


if __name__ == "__main__":
    root = sys.argv[1]
    for n in (sys.argv[2:] or SCHEMES):
        make(root, n)
