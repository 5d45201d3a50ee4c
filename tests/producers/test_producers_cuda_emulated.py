"""The CUDA kernel class end to end without a GPU: the checkpoints the producers wrote load through from_pretrained
onto cuda_w4a16 (HF_W4_KERNEL), its two ops run by the CUDA kernels themselves, built for the CPU against the
stand-in of tests/kernels/cuda_emu and planned as on an H100 (tests/conftest.py, cuda_kernel_on_cpu). This covers what
the kernel tests leave out: the layer's repack of producer bytes, ``apply`` (act-order permutation, bias, the switch
to dequantize + F.linear at ``large_m``), each kernel inside a model, the logits against the producer's own,
``save_pretrained`` from the kernel layout, ``generate``, ``torch.compile``, fp32 inputs to a half-precision model.

Budget: the model runs in fp16 / bf16 and the kernels multiply weights rounded to that type, while the reference
is fp32. Measured cosines to it: fp16 0.99998-0.999999; bf16 0.99988-0.99994 (the CPU path in bf16: 0.99992-
0.99994). A wrong nibble order, zero point, scale or column permutation costs tens of percent (the act-order test
without the permutation: cosine -0.05).
"""
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hf_w4
from conftest import assert_same_checkpoint, cosine
from test_producers import DATA, DECODER_LINEARS, EXPECT

COSINE_MIN = {torch.float16: 0.9999, torch.bfloat16: 0.9997}
W4A16 = sorted(name for name, e in EXPECT.items()
               if e["weight_type"] in ("int4", "nvfp4") and e.get("act", "none") == "none")


def _load(path, dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    layers = [m for m in model.modules() if isinstance(m, hf_w4.QuantLinear)]
    assert len(layers) == len(DECODER_LINEARS) * model.config.num_hidden_layers
    assert all(m.kernel.NAME == "cuda_w4a16" for m in layers), {m.name: str(m.kernel) for m in layers}
    return model


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", W4A16)
def test_producer_checkpoint_on_the_cuda_kernel(cuda_kernel_on_cpu, name, dtype, tmp_path):
    with safe_open(str(DATA / name / "reference.safetensors"), "pt") as f:
        ids, ref = f.get_tensor("input_ids"), f.get_tensor("logits")
    model = _load(DATA / name, dtype)
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert torch.isfinite(out).all()
    cos = cosine(out, ref)
    assert cos >= COSINE_MIN[dtype], f"{name} {dtype}: cosine {cos:.6f} to the producer's logits"
    with safe_open(str(DATA / name / "model.safetensors"), "pt") as f:
        own = f.get_slice("model.embed_tokens.weight").get_dtype()
    if own == {torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]:  # in the file's dtype: every tensor written back
        model.save_pretrained(tmp_path / "re")
        assert_same_checkpoint(DATA / name, tmp_path / "re")


# each kernel of the fused path forced (the glue's settings), and the large-M path from the first row
KERNELS = {"rule": {}, "wide": {"HF_W4_CUDA_WIDE": "1"}, "four-tiles": {"HF_W4_CUDA_MT": "4"},
           "wgmma": {"HF_W4_CUDA_WGMMA": "1"},
           "dequantize": {"HF_W4_CUDA_LARGE_M": "1"}}


@pytest.mark.parametrize("kernel", KERNELS)
def test_act_order_bias_and_each_kernel_in_the_model(cuda_kernel_on_cpu, monkeypatch, tmp_path, tiny_llama_bias,
                                                     kernel):
    """Act-order (the activations permuted to the kernel's column order) with q / k / v biases, through each kernel,
    against the CPU path; then generate, and save bit-exact."""
    from hf_w4.tools import writers
    res = writers.write_checkpoint(tiny_llama_bias, str(tmp_path / "ckpt"), "gptq", sym=False, group_size=64,
                                   desc_act=True)
    for var, value in KERNELS[kernel].items():
        monkeypatch.setenv(var, value)
    model = _load(res.path, torch.bfloat16)
    monkeypatch.delenv("HF_W4_KERNEL")
    cpu = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32).eval()
    assert {m.kernel.NAME for m in cpu.modules() if isinstance(m, hf_w4.QuantLinear)} != {"cuda_w4a16"}
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cos = cosine(model(ids).logits, cpu(ids).logits)
    assert cos >= COSINE_MIN[torch.bfloat16], f"cosine {cos:.6f} to the CPU path's logits"
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 16)
    if kernel == "rule":  # the codes come back in the checkpoint's column order
        model.save_pretrained(tmp_path / "re")
        assert_same_checkpoint(res.path, tmp_path / "re")


@pytest.mark.parametrize("name", ["gptqmodel-gptq-asym", "modelopt-w4a16-nvfp4"])
def test_torch_compile_fullgraph_on_the_cuda_kernel(cuda_kernel_on_cpu, name):
    """The layer's forward on cuda_w4a16 compiles into one graph (the ops' fake implementations) and gives eager's
    bits, through the fused and the dequantize path."""
    model = _load(DATA / name, torch.bfloat16)
    q = model.model.layers[0].mlp.up_proj
    torch._dynamo.reset()
    compiled = torch.compile(q, fullgraph=True)
    with torch.no_grad():
        for m in (3, q.kernel.large_m):
            h = torch.randn(m, q.in_features, generator=torch.Generator().manual_seed(4)).bfloat16()
            assert torch.equal(compiled(h), q(h)), m


@pytest.mark.parametrize("name", ["gptqmodel-gptq-asym", "llmcompressor-nvfp4a16"])
def test_fp32_input_to_a_half_precision_layer_on_the_cuda_kernel(cuda_kernel_on_cpu, name):
    """An fp32 input to a layer of a bf16 model (a model that upcasts somewhere): the weight dequantized to bf16 by the
    dequantize kernel, an fp32 product, an fp32 output; off the exact weight's product by at most the bf16 rounding of
    the weight (2^-8 relative) plus fp32 noise."""
    model = _load(DATA / name, torch.bfloat16)
    q = model.model.layers[0].self_attn.o_proj
    h = torch.randn(5, q.in_features, generator=torch.Generator().manual_seed(6))
    w = q.dequantize_weight()
    with torch.no_grad():
        y = q(h)
    assert y.dtype == torch.float32
    bound = 2.0 ** -8 * (h.abs() @ w.abs().T) + 1e-5 * (h @ w.T).abs().max()
    assert ((y - h @ w.T).abs() <= bound).all()
