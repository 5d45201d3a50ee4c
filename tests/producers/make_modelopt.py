"""Writes the NVIDIA ModelOpt golden checkpoints. Run by regenerate.py inside its venv.

usage: python make_modelopt.py OUT_ROOT [NAME ...]

ModelOpt quantizes and exports on CPU, but its fake-quant forward for NVFP4 needs CUDA (the dynamic block
quantizer asserts a CUDA amax), so the reference is built from ModelOpt's own NVFP4QTensor.dequantize over the
exported tensors: the dense model with those weights, run in fp32. For the W4A4 "NVFP4" algorithm the reference
is weight-only as well (activations unquantized), which is how hf_w4 serves such checkpoints.
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

# name -> modelopt config attribute; the export names the algorithm NVFP4 / W4A16_NVFP4
SCHEMES = {"nvfp4": "NVFP4_DEFAULT_CFG", "w4a16-nvfp4": "W4A16_NVFP4_CFG"}


def dequantized_model(out: str):
    """The exported file read back by ModelOpt's NVFP4QTensor.dequantize, as a dense fp32 model."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    packed = load_file(os.path.join(out, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tiny.dense_checkpoint(tempfile.mkdtemp()), dtype=torch.float32)
    dense = {}
    for k, v in packed.items():
        if k.endswith(".weight_scale_2"):
            name = k[: -len(".weight_scale_2")]
            codes = packed[f"{name}.weight"]
            shape = torch.Size((codes.shape[0], codes.shape[1] * 2))
            w = NVFP4QTensor(shape, torch.float32, codes).dequantize(
                dtype=torch.float32, scale=packed[f"{name}.weight_scale"], double_scale=v, block_sizes={-1: 16})
            dense[f"{name}.weight"] = w
    n_quant = len(dense)
    for k, v in packed.items():
        if k not in dense and v.is_floating_point() and not k.endswith(("_scale", "_scale_2")):
            dense[k] = v.float()
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not missing and not unexpected, f"{out}: missing {missing}, unexpected {unexpected}"
    return model, n_quant


def make(out_root: str, name: str) -> None:
    import modelopt
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    out = os.path.join(out_root, f"modelopt-{name}")
    shutil.rmtree(out, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(tiny.dense_checkpoint(tempfile.mkdtemp()), dtype=torch.bfloat16)
    calib = tiny.calibration_ids()

    def forward_loop(m):
        with torch.no_grad():
            for row in calib:
                m(input_ids=row[None])

    mtq.quantize(model, getattr(mtq, SCHEMES[name]), forward_loop)
    export_hf_checkpoint(model, export_dir=out)
    tiny.strip_side_files(out)

    ref_model, n_quant = dequantized_model(out)
    assert n_quant == 14, f"{out}: {n_quant} NVFP4 Linears in the export, expected the 14 decoder Linears"
    ids, logits = tiny.fp32_logits(ref_model)
    tiny.save_reference(out, ids, logits, producer="modelopt", scheme=name,
                        versions={"nvidia-modelopt": modelopt.__version__, "torch": torch.__version__},
                        how="fp32 forward of the dense model whose Linear weights are ModelOpt's "
                            "NVFP4QTensor.dequantize of this file (activations unquantized)")


if __name__ == "__main__":
    root = sys.argv[1]
    for n in (sys.argv[2:] or SCHEMES):
        make(root, n)
