"""Writes the auto-round golden checkpoints. Run by regenerate.py inside its venv.

usage: python make_autoround.py OUT_ROOT [NAME ...]
"""
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402

# name -> (export format, sym, iters); iters=0 is auto-round's RTN mode, a few iters run its sign-gradient tuning
SCHEMES = {
    "autogptq-sym": ("auto_gptq", True, 0),
    "autogptq-asym": ("auto_gptq", False, 0),
    "autoawq-sym": ("auto_awq", True, 0),
    "autoawq-asym": ("auto_awq", False, 0),
    "autoround-sym": ("auto_round", True, 4),
    "autoround-asym": ("auto_round", False, 4),
}
GROUP_SIZE = 32


def quantize(fmt: str, sym: bool, iters: int) -> str:
    """One auto-round run from the dense tiny model; returns the folder it exported to."""
    from auto_round import AutoRound
    dense = tiny.dense_checkpoint(tempfile.mkdtemp())
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16)
    calib = [row[None] for row in tiny.calibration_ids()]
    ar = AutoRound(model, tokenizer=tiny.stub_tokenizer(), bits=4, group_size=GROUP_SIZE, sym=sym, iters=iters,
                   dataset=calib, nsamples=tiny.CALIB_SAMPLES, seqlen=tiny.CALIB_LEN, batch_size=4,
                   device_map="cpu", seed=tiny.SEED)
    _, folders = ar.quantize_and_save(tempfile.mkdtemp(), format=fmt)  # <dir>/<model name>-w4g32/
    return folders if isinstance(folders, str) else folders[0]


def tensors(folder: str) -> dict:
    return load_file(os.path.join(folder, "model.safetensors"))


def make(out_root: str, name: str) -> None:
    import auto_round
    fmt, sym, iters = SCHEMES[name]
    out = os.path.join(out_root, f"autoround-{name}")
    shutil.rmtree(out, ignore_errors=True)
    # The reference comes from auto-round's "fake" export: the dense model with every weight quantized and
    # dequantized by auto-round itself. It takes its own run (auto-round 0.16.1 fails to pack the asymmetric
    # auto_round format after another export of the same run), so the real export is made twice to show the
    # quantization is deterministic and the fake export belongs to the same integers and scales.
    real = quantize(fmt, sym, iters)
    fake = quantize("fake", sym, iters)
    again = tensors(quantize(fmt, sym, iters))
    first = tensors(real)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first), \
        f"{name}: two auto-round runs wrote different tensors; the fake export cannot serve as the reference"
    shutil.move(real, out)
    tiny.strip_side_files(out)

    ref_model = AutoModelForCausalLM.from_pretrained(fake, dtype=torch.float32)
    assert getattr(ref_model.config, "quantization_config", None) is None, f"{fake}: not a dense export"
    ids, logits = tiny.fp32_logits(ref_model)
    tiny.save_reference(out, ids, logits, producer="auto-round", scheme=name,
                        versions={"auto-round": auto_round.__version__, "torch": torch.__version__},
                        how="fp32 forward of auto-round's 'fake' export (its own dequantized weights, bf16) "
                            "from an identical run")

if __name__ == "__main__":
    root = sys.argv[1]
    for n in (sys.argv[2:] or SCHEMES):
        make(root, n)
