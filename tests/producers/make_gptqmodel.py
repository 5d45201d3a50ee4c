"""Writes the GPTQModel golden checkpoints. Run by regenerate.py inside its venv (GPTQMODEL_CPU_WORKERS=2 on a
small machine: its CPU thread pool wants two loader workers).

usage: python make_gptqmodel.py OUT_ROOT [NAME ...]

GPTQModel quantizes on CPU. The reference is GPTQModel reading its own file back with BACKEND.TORCH and
dequantizing every layer with its own dequantize_weight() (fp16 scales widened to fp32), in a dense fp32 model that
takes every other tensor from the same file. Its loader turns GPTQ v1 zeros into its internal v2 form by adding
0x11111111 to each qzeros word, and its v1 export subtracts the same: in the asymmetric v1 file a zero of 0 is
stored as 15 and borrows from the next slot.
"""
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402

GROUP_SIZE = 32
# name -> (sym, on-disk checkpoint format): "gptq" stores zero - 1 (v1), "gptq_v2" stores the zero itself
SCHEMES = {"gptq-sym": (True, "gptq"), "gptq-asym": (False, "gptq"), "gptqv2-asym": (False, "gptq_v2")}


def dequantized_model(out: str):
    from gptqmodel import BACKEND, GPTQModel
    from transformers import AutoModelForCausalLM
    torch._dynamo.config.disable = True
    # TorchLinear runs in fp16/bf16 only; only its dequantized weights are used, computed in fp32 below
    # (from a copy with a tokenizer beside it, which GPTQModel.load requires and the golden folder omits)
    copy = os.path.join(tempfile.mkdtemp(), "model")
    shutil.copytree(out, copy)
    tiny.stub_tokenizer().save_pretrained(copy)
    reader = GPTQModel.load(copy, backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
    model = AutoModelForCausalLM.from_pretrained(tiny.dense_checkpoint(tempfile.mkdtemp()), dtype=torch.float32)
    dense = {k: v.float() for k, v in load_file(os.path.join(out, "model.safetensors")).items()
             if v.is_floating_point() and not k.endswith(".scales")}
    n_quant = 0
    for name, q in reader.model.named_modules():
        if not hasattr(q, "qweight"):
            continue
        q.scales.data = q.scales.data.float()  # (dynamo off: its cached dequantizer is traced for fp16 scales)
        w = q.dequantize_weight().float()
        lin = model.get_submodule(name)
        assert w.shape == (lin.in_features, lin.out_features), (name, tuple(w.shape))
        dense[f"{name}.weight"] = w.t().contiguous()
        n_quant += 1
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not missing and not unexpected, f"{out}: missing {missing}, unexpected {unexpected}"
    return model, n_quant


def quantize(out: str, sym: bool, fmt: str) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    dense = tiny.dense_checkpoint(tempfile.mkdtemp())
    tiny.stub_tokenizer().save_pretrained(dense)  # GPTQModel.load wants a tokenizer beside the model
    # no disk offload: a tiny model does not need it, and its temporary path would end up in the saved config
    qc = QuantizeConfig(bits=4, group_size=GROUP_SIZE, sym=sym, format=fmt, offload_to_disk=False)
    model = GPTQModel.load(dense, qc, device="cpu")
    calib = [{"input_ids": r[None], "attention_mask": torch.ones_like(r[None])} for r in tiny.calibration_ids()]
    model.quantize(calib, batch_size=4)
    model.save(out)
    tiny.strip_side_files(out, keep=tiny.KEEP + ("quantize_config.json",))


def make(out_root: str, name: str) -> None:
    import gptqmodel
    sym, fmt = SCHEMES[name]
    out = os.path.join(out_root, f"gptqmodel-{name}")
    shutil.rmtree(out, ignore_errors=True)
    quantize(out, sym, fmt)
    ref_model, n_quant = dequantized_model(out)
    assert n_quant == 14, f"{out}: {n_quant} quantized Linears, expected the 14 decoder Linears"
    ids, logits = tiny.fp32_logits(ref_model)
    tiny.save_reference(out, ids, logits, producer="gptqmodel", scheme=name,
                        versions={"gptqmodel": gptqmodel.__version__, "torch": torch.__version__},
                        how="fp32 forward of the dense model whose Linear weights are GPTQModel's own "
                            "dequantize_weight() after loading this file with BACKEND.TORCH (scales widened to fp32)")

if __name__ == "__main__":
    root = sys.argv[1]
    for n in (sys.argv[2:] or SCHEMES):
        make(root, n)
