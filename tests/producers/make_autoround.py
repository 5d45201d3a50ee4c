"""Writes the auto-round golden checkpoints. Run by regenerate.py inside its venv.

usage: python make_autoround.py OUT_ROOT [NAME ...]
"""
import json
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


def gptq_reader_model(fake: str, real: str):
    """The dense model of the fake export with every quantized Linear replaced by auto-round's own CPU reader of
    the GPTQ layout (auto_round_extension.torch.qlinear_torch_zp), fed the real export's tensors with the fp16
    scales widened to fp32 so that it dequantizes exactly."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    model = AutoModelForCausalLM.from_pretrained(fake, dtype=torch.float32)
    packed = tensors(real)
    for name in sorted({k.rsplit(".", 1)[0] for k in packed if k.endswith(".qweight")}):
        dense = model.get_submodule(name)
        # the reader's g_idx branch slices the scales by K along N (wrong unless N == K); auto-round only writes
        # the trivial g_idx = k // group_size, which the plain branch implements
        g_idx = packed.get(f"{name}.g_idx")
        assert g_idx is None or torch.equal(g_idx, torch.arange(dense.in_features) // GROUP_SIZE), name
        q = QuantLinear(4, GROUP_SIZE, dense.in_features, dense.out_features, bias=False)
        q.qweight, q.qzeros = packed[f"{name}.qweight"], packed[f"{name}.qzeros"]
        q.scales = packed[f"{name}.scales"].float()
        model.set_submodule(name, q)
    return model


def make(out_root: str, name: str) -> None:
    import auto_round
    fmt, sym, iters = SCHEMES[name]
    out = os.path.join(out_root, f"autoround-{name}")
    shutil.rmtree(out, ignore_errors=True)
    # auto-round's "fake" export is the dense model with every weight quantized and dequantized by auto-round
    # itself. It takes its own run (auto-round 0.16.1 fails to pack the asymmetric auto_round format after another
    # export of the same run), so the real export is made twice to show that the quantization is deterministic
    # and the fake export belongs to the same integers and scales.
    real = quantize(fmt, sym, iters)
    fake = quantize("fake", sym, iters)
    again = tensors(quantize(fmt, sym, iters))
    first = tensors(real)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first), \
        f"{name}: two auto-round runs wrote different tensors; the fake export cannot serve as the reference"
    fake_model = AutoModelForCausalLM.from_pretrained(fake, dtype=torch.float32)
    assert getattr(fake_model.config, "quantization_config", None) is None, f"{fake}: not a dense export"
    ids, fake_logits = tiny.fp32_logits(fake_model)

    with open(os.path.join(real, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    if qc["quant_method"] == "gptq" or qc.get("packing_format") == "auto_round:auto_gptq":
        # GPTQ layout: the file stores zero - 1, clamped at 0 (auto-round's packer), so a group whose zero is 0
        # reads back as zero 1, unlike in the fake export. The reference is what auto-round's reader makes of
        # the file.
        _, logits = tiny.fp32_logits(gptq_reader_model(fake, real))
        how = ("fp32 forward with auto-round's own GPTQ-layout reader (auto_round_extension.torch.qlinear_torch_zp,"
               " scales widened to fp32) over this file")
    else:
        # AWQ layout stores the zero as is: the fake export is exactly the file's content (rounded to bf16)
        logits = fake_logits
        how = "fp32 forward of auto-round's 'fake' export (its own dequantized weights, bf16) of an identical run"
    cos = torch.nn.functional.cosine_similarity(logits.flatten(), fake_logits.flatten(), dim=0).item()
    print(f"{name}: reference vs fake export cosine {cos:.6f}")
    shutil.move(real, out)
    tiny.strip_side_files(out)
    tiny.save_reference(out, ids, logits, producer="auto-round", scheme=name, how=how,
                        versions={"auto-round": auto_round.__version__, "torch": torch.__version__})


if __name__ == "__main__":
    root = sys.argv[1]
    for n in (sys.argv[2:] or SCHEMES):
        make(root, n)
