"""End to end: checkpoints written by hf_w4.tools.writers (docs/formats.md) load through from_pretrained into packed
QuantLinear modules, match a dense twin built from the writer's own dense weights, and save back bit-exact."""
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_w4
from conftest import WRITER_IDS as IDS
from conftest import assert_same_checkpoint
from conftest import WRITER_VARIANTS as VARIANTS
from conftest import rel_err as _rel
from conftest import tokens as _tokens
from hf_w4.tools import writers
from hf_w4.nn import QuantLinear

ACT_FORMATS = {"ct-w8a8", "ct-w4a8"}   # dynamic int8 activations: compared with activation="none" against the twin


pytestmark = pytest.mark.usefixtures("hf_w4_installed")


@pytest.mark.parametrize("fmt,opts", VARIANTS, ids=IDS)
def test_fp32_logits_match_dense_twin(written, fmt, opts):
    res = written(fmt, opts)
    kw = {"quantization_config": hf_w4.CompressedTensorsConfig(activation="none")} if fmt in ACT_FORMATS else {}
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32, **kw)
    qls = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert qls, "nothing was quantized"
    assert all(m.kernel is not None for m in qls)
    twin = res.dense_model().float().eval()
    x = _tokens()
    with torch.no_grad():
        rel = _rel(model(x).logits, twin(x).logits)
    assert rel <= 1e-5, f"{fmt}: fp32 logits differ from the dense twin by {rel:.2e} (budget 1e-5)"


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct-w4a16", "modelopt-w4a16", "ct-nvfp4"])
def test_bf16_within_bf16_rounding(written, fmt):
    res = written(fmt, {})
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    twin = res.dense_model().float().eval()
    x = _tokens()
    with torch.no_grad():
        rel = _rel(model(x).logits, twin(x).logits)
    assert rel <= 3e-2, f"{fmt}: bf16 logits off by {rel:.2e} relative (budget 3e-2, a few bf16 ulps through 2 layers)"


@pytest.mark.parametrize("fmt,opts", [VARIANTS[i] for i in (0, 2, 5, 6, 9, 13, 14, 16)],
                         ids=[IDS[i] for i in (0, 2, 5, 6, 9, 13, 14, 16)])
def test_save_is_bit_identical_and_reloads(written, tmp_path, fmt, opts):
    res = written(fmt, opts)
    # dtype as on disk (bf16), so the dense tensors round-trip too; quantized ones keep their dtypes regardless
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "re")          # after the kernel repack
    assert_same_checkpoint(res.path, tmp_path / "re")
    qa = json.load(open(os.path.join(res.path, "config.json")))["quantization_config"]
    qb = json.load(open(tmp_path / "re" / "config.json"))["quantization_config"]
    assert qa == qb, "the producer's quantization_config must be written back unchanged"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "re", dtype=torch.bfloat16)
    x = _tokens()
    with torch.no_grad():
        assert torch.equal(model(x).logits, again(x).logits)


def test_dequantize_gives_exact_dense_linears(written):
    res = written("awq", dict(sym=False))
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    model.dequantize()
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    for name, w in res.dense_weights.items():
        assert torch.equal(model.get_submodule(name).weight, w), name
    assert getattr(model.config, "quantization_config", None) is None


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_lm_head(tmp_path, tiny_llama, tiny_llama_tied, tied):
    src = tiny_llama_tied if tied else tiny_llama
    res = writers.write_checkpoint(src, str(tmp_path / "c"), "autoround", quantize_lm_head=True)
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    assert isinstance(model.lm_head, QuantLinear)
    twin = res.dense_model().float().eval()
    x = _tokens()
    with torch.no_grad():
        assert _rel(model(x).logits, twin(x).logits) <= 1e-5
    emb = model.get_input_embeddings().weight
    assert emb.device.type == "cpu" and torch.isfinite(emb).all()


def test_lm_head_stays_dense_by_default(written):
    model = AutoModelForCausalLM.from_pretrained(written("ct-w4a16", {}).path, dtype=torch.float32)
    assert type(model.lm_head) is torch.nn.Linear


def test_bias_is_loaded(tmp_path, tiny_llama_bias):
    res = writers.write_checkpoint(tiny_llama_bias, str(tmp_path / "c"), "gptq")
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantLinear) and q.bias is not None
    twin = res.dense_model().float().eval()
    x = _tokens()
    with torch.no_grad():
        assert _rel(model(x).logits, twin(x).logits) <= 1e-5


@pytest.mark.parametrize("explicit", [True, False], ids=["ModelOptConfig", "plain"])
def test_modelopt_hf_quant_config_only(tmp_path, tiny_llama, explicit):
    """An older ModelOpt export (hf_quant_config.json, no quantization_config in config.json) loads with
    ModelOptConfig() and, once hf_w4 is installed, with a plain from_pretrained as vLLM reads it."""
    res = writers.write_checkpoint(tiny_llama, str(tmp_path / "c"), "modelopt-w4a16", hf_quant_config_only=True)
    assert "quantization_config" not in json.load(open(os.path.join(res.path, "config.json")))
    kw = dict(quantization_config=hf_w4.ModelOptConfig()) if explicit else {}
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32, **kw)
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)
    twin = res.dense_model().float().eval()
    x = _tokens()
    with torch.no_grad():
        assert _rel(model(x).logits, twin(x).logits) <= 1e-5


def test_modelopt_sidecar_detection_is_scoped(tmp_path, tiny_llama):
    """The sidecar takes effect only while hf_w4 is installed, and a KV-cache-only hf_quant_config.json (quant_algo
    null) beside dense weights leaves the model dense."""
    res = writers.write_checkpoint(tiny_llama, str(tmp_path / "c"), "modelopt-w4a16", hf_quant_config_only=True)
    hf_w4.uninstall()
    with pytest.raises(Exception, match="size mismatch|mismatched|MISMATCH"):
        AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    hf_w4.install()
    dense = tmp_path / "dense"
    tiny_llama.save_pretrained(dense)
    with open(dense / "hf_quant_config.json", "w") as f:
        json.dump({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": None,
                                                                     "kv_cache_quant_algo": "FP8"}}, f)
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    # a sidecar hf_w4 cannot serve, or cannot read, is an error naming the file (not a size-mismatch report)
    for content, err, what in (({"quantization": {"quant_algo": "FP8"}}, NotImplementedError, "quant_algo 'FP8'"),
                               ("{not json", ValueError, "cannot read")):
        with open(dense / "hf_quant_config.json", "w") as f:
            f.write(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(err, match=f"hf_quant_config.json: .*{what}"):
            AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)


@pytest.mark.parametrize("fmt,cfg", [("gptq", hf_w4.GPTQConfig), ("awq", hf_w4.AwqConfig),
                                     ("autoround", hf_w4.AutoRoundConfig), ("ct-w4a16", hf_w4.CompressedTensorsConfig),
                                     ("modelopt-w4a16", hf_w4.ModelOptConfig)])
def test_loading_attributes_reach_every_family(written, fmt, cfg):
    res = written(fmt, {})
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32,
                                                 quantization_config=cfg(kernel="torch_reference"))
    kernels = {str(m.kernel) for m in model.modules() if isinstance(m, QuantLinear)}
    assert kernels == {"torch_reference"}
    assert "kernel" not in json.dumps(model.config.to_dict()["quantization_config"])


def test_transformers_own_autoround_config_is_accepted(written):
    import transformers
    res = written("autoround", {})
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32,
                                                 quantization_config=transformers.AutoRoundConfig())
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)


def test_w4a8_opt_in_changes_the_activation_scheme(written):
    res = written("gptq", {})
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32,
                                                 quantization_config=hf_w4.GPTQConfig(activation="int8"))
    q = model.model.layers[0].self_attn.q_proj
    assert q.spec.act == "int8_token"
    ref = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    # per-token int8 rounds each input element to a step of amax / 127.5: uniform noise of variance step^2 / 12,
    # relative to the input's own size; the quantized Linears' noises are independent and add in quadrature
    eps = []

    def noise(_m, inp, _out):
        x = inp[0].float().reshape(-1, inp[0].shape[-1])
        step = x.abs().amax(-1) / 127.5
        eps.append(((step ** 2 / 12).mean() / x.pow(2).mean()).sqrt().item())
    hooks = [m.register_forward_hook(noise) for m in ref.modules() if isinstance(m, QuantLinear)]
    x = _tokens()
    with torch.no_grad():
        a, b = model(x).logits, ref(x).logits
    for h in hooks:
        h.remove()
    predicted = sum(e * e for e in eps) ** 0.5
    assert len(eps) == 14 and 0.5 * predicted < ((a - b).norm() / b.norm()).item() < 1.5 * predicted, predicted


def test_to_dtype_keeps_packed_dtypes(written):
    res = written("modelopt-w4a16", {})
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    q = model.model.layers[0].mlp.up_proj
    before = {n: b.clone() for n, b in q.named_buffers()}
    model.to(torch.bfloat16)
    # the kernel's buffers too (fp32 scales), values included: a cast there and back would round them
    assert all(b.dtype == before[n].dtype and torch.equal(b, before[n]) for n, b in q.named_buffers())
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_scale_2.dtype == torch.float32
    assert q.weight.dtype == torch.uint8
    with torch.no_grad():
        model(_tokens())


def test_extra_repr_and_report(written):
    model = AutoModelForCausalLM.from_pretrained(written("awq", {}).path, dtype=torch.float32)
    r = repr(model.model.layers[0].self_attn.q_proj)
    assert "format=awq:awq int4 g128" in r and "kernel=" in r
    rep = hf_w4.kernel_report(model, per_layer=True)
    assert "model.layers.0.self_attn.q_proj: awq:awq int4 g128" in rep and "->" in rep
    n = model.config.num_hidden_layers
    rep = hf_w4.kernel_report(model)   # layers alike but for their numbers: one line
    assert f"model.layers.*.self_attn.q_proj ({n} layers): awq:awq int4 g128" in rep, rep
    assert "model.layers.0.self_attn.q_proj" not in rep and len(rep.splitlines()) == 7, rep


def test_compute_dtype_loading_attribute(written):
    res = written("awq", {})
    assert AutoModelForCausalLM.from_pretrained(res.path).dtype == torch.bfloat16          # config.json's dtype
    model = AutoModelForCausalLM.from_pretrained(res.path, quantization_config=hf_w4.AwqConfig(compute_dtype="float32"))
    assert model.dtype == torch.float32


@pytest.mark.parametrize("fmt", ["gptq", "modelopt-w4a16", "ct-w4a16", "autoround"])
def test_ignored_layers_and_quantized_lm_head(tmp_path, tiny_llama, fmt):
    res = writers.write_checkpoint(tiny_llama, str(tmp_path / "c"), fmt, ignore=["model.layers.0.mlp.down_proj"],
                                   quantize_lm_head=True)
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    assert isinstance(model.lm_head, QuantLinear)
    twin = res.dense_model().float().eval()
    x = _tokens()
    with torch.no_grad():
        assert _rel(model(x).logits, twin(x).logits) <= 1e-5


@pytest.mark.parametrize("fmt", ["gptq", "modelopt-nvfp4"])
def test_torch_compile_fullgraph(written, fmt):
    """The ops have fake implementations, so a QuantLinear compiles into one graph (no breaks) and gives the same
    numbers as eager."""
    model = AutoModelForCausalLM.from_pretrained(written(fmt, {}).path, dtype=torch.float32)
    q = model.model.layers[0].mlp.up_proj
    h = torch.randn(3, q.in_features, generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(q, fullgraph=True)(h), q(h))
