"""Writes the AutoAWQ golden checkpoint. Run by regenerate.py inside its venv.

usage: python make_autoawq.py OUT_ROOT [NAME ...]

AutoAWQ quantizes on CPU. Its inference kernels need CUDA or Triton, so the reference uses its own naive
dequantizer (awq.utils.packing_utils.dequantize_gemm, the fallback its WQLinear_GEMM uses without them) over the
saved file, with the fp16 scales widened to fp32, in a dense fp32 model that takes every other tensor from the
same file (AWQ folds its activation scales into the preceding norms).
"""
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402

# name -> AutoAWQ quant_config (GEMM layout; zero_point=True is AutoAWQ's default, asymmetric)
SCHEMES = {"gemm-asym": {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}}


def dequantized_model(out: str, group_size: int):
    from awq.utils.packing_utils import dequantize_gemm
    from transformers import AutoModelForCausalLM
    packed = load_file(os.path.join(out, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tiny.dense_checkpoint(tempfile.mkdtemp()), dtype=torch.float32)
    dense = {}
    for k in packed:
        if k.endswith(".qweight"):
            name = k[: -len(".qweight")]
            w = dequantize_gemm(packed[k], packed[f"{name}.qzeros"], packed[f"{name}.scales"].float(), 4, group_size)
            dense[f"{name}.weight"] = w.t().contiguous()  # AWQ stores [K, N]
        elif packed[k].is_floating_point() and not k.endswith(".scales"):
            dense[k] = packed[k].float()
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not missing and not unexpected, f"{out}: missing {missing}, unexpected {unexpected}"
    return model, sum(k.endswith(".qweight") for k in packed)


def make(out_root: str, name: str) -> None:
    import awq
    from awq import AutoAWQForCausalLM
    cfg = SCHEMES[name]
    out = os.path.join(out_root, f"autoawq-{name}")
    shutil.rmtree(out, ignore_errors=True)
    model = AutoAWQForCausalLM.from_pretrained(tiny.dense_checkpoint(tempfile.mkdtemp()), torch_dtype=torch.float16,
                                               device_map="cpu")
    # token ids as lists of ints: AutoAWQ takes them as pre-tokenized samples
    model.quantize(tiny.stub_tokenizer(), quant_config=cfg, calib_data=tiny.calibration_ids().tolist(),
                   max_calib_samples=tiny.CALIB_SAMPLES, max_calib_seq_len=tiny.CALIB_LEN)
    model.save_quantized(out)
    tiny.strip_side_files(out)

    ref_model, n_quant = dequantized_model(out, cfg["q_group_size"])
    assert n_quant == 14, f"{out}: {n_quant} quantized Linears, expected the 14 decoder Linears"
    ids, logits = tiny.fp32_logits(ref_model)
    tiny.save_reference(out, ids, logits, producer="autoawq", scheme=name,
                        versions={"autoawq": awq.__version__, "torch": torch.__version__},
                        how="fp32 forward of the dense model whose Linear weights are AutoAWQ's dequantize_gemm of "
                            "this file (fp16 scales widened to fp32)")


if __name__ == "__main__":
    root = sys.argv[1]
    for n in (sys.argv[2:] or SCHEMES):
        make(root, n)
