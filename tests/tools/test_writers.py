"""hf_w4.writers: every format writes the files, tensors and config keys formats.md describes, and the
tensors on disk dequantize (through hf_w4.layouts) to exactly the writer's independent dense oracle."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from hf_w4 import formats, layouts
from hf_w4.tools import writers
from conftest import make_tiny_llama

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.1.mlp.down_proj"
K_OF = {"q_proj": 256, "k_proj": 256, "v_proj": 256, "o_proj": 256, "gate_proj": 256, "up_proj": 256,
        "down_proj": 512, "lm_head": 256}
N_OF = {"q_proj": 256, "k_proj": 128, "v_proj": 128, "o_proj": 256, "gate_proj": 512, "up_proj": 512,
        "down_proj": 256, "lm_head": 512}
W0x77777777 = 0x77777777
W0x88888888 = 0x88888888 - 2 ** 32          # as a signed int32

VARIANTS = [
    ("gptq", dict()),
    ("gptq", dict(sym=False, group_size=64)),
    ("gptq", dict(desc_act=True)),
    ("gptq", dict(checkpoint_format="gptq_v2")),
    ("gptq", dict(sym=False, checkpoint_format="gptq_v2", group_size=-1)),
    ("autoround", dict()),
    ("autoround", dict(sym=False, group_size=32, extra_config={DOWN: {"bits": 16}})),
    ("autoround", dict(sym_scale="amax7", quantize_lm_head=True)),
    ("autoround-awq", dict(sym=False)),
    ("awq", dict()),
    ("awq", dict(sym=False, group_size=64)),
    ("ct-w4a16", dict()),
    ("ct-w4a16", dict(sym=False, group_size=32)),
    ("ct-w4a16", dict(group_size=-1)),
    ("ct-w4a16", dict(sym=False, group_size=None)),
    ("ct-w8a8", dict()),
    ("ct-w4a8", dict()),
    ("ct-nvfp4", dict()),
    ("modelopt-w4a16", dict()),
    ("modelopt-nvfp4", dict()),
    ("modelopt-nvfp4", dict(input_amax=3.0, quantize_lm_head=True)),
]
IDS = [f + "-" + "-".join(f"{k}={v}" for k, v in o.items() if k != "extra_config") + ("-extra" if "extra_config" in o
                                                                                      else "") for f, o in VARIANTS]


def _int32(words):
    return words.to(torch.int64) & 0xFFFFFFFF


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_llama):
    cache = {}

    def get(fmt, opts, model=None):
        key = (fmt, json.dumps(opts, sort_keys=True, default=str), id(model))
        if key not in cache:
            out = tmp_path_factory.mktemp(fmt) / "ckpt"
            res = writers.write_checkpoint(model if model is not None else tiny_llama, str(out), fmt, **opts)
            cache[key] = (res, load_file(os.path.join(res.path, "model.safetensors")),
                          json.load(open(os.path.join(res.path, "config.json"))))
        return cache[key]
    return get


def _module_tensors(sd, name):
    p = name + "."
    return {k[len(p):]: v for k, v in sd.items() if k.startswith(p) and "." not in k[len(p):]}


def _qconfig(res, cj):
    if "quantization_config" in cj:
        return cj["quantization_config"]
    return json.load(open(os.path.join(res.path, "hf_quant_config.json")))


# ---------------------------------------------------------------------------------------------- the oracle


@pytest.mark.parametrize("fmt,opts", VARIANTS, ids=IDS)
def test_layouts_dequantize_equals_dense_weights(written, tiny_llama, fmt, opts):
    res, sd, cj = written(fmt, opts)
    fc = formats.parse(_qconfig(res, cj))
    assert res.dense_weights, "nothing was quantized"
    for name, dense in res.dense_weights.items():
        spec = fc.spec_for(name)
        assert spec is not None, f"{name} was quantized but the config leaves it dense"
        t = _module_tensors(sd, name)
        assert "weight" not in t or t["weight"].dtype in (torch.int8, torch.uint8), name
        n, k = dense.shape
        if spec.layout == "gptq":
            spec = spec.replace(has_g_idx="g_idx" in t)
        for tname, decl in layouts.declare(spec, n, k, name).items():
            assert tuple(t[tname].shape) == decl.shape and t[tname].dtype == decl.dtypes[0], (name, tname)
        got = layouts.dequantize(layouts.to_qweight(spec, t, n, k, name))
        assert got.dtype == torch.float32 and dense.dtype == torch.float32
        if fmt == "ct-nvfp4":
            # the loader multiplies by fp32(1/global); the oracle divides (correctly rounded): <= 1 ulp apart
            torch.testing.assert_close(got, dense, rtol=2 ** -23, atol=0)
        else:
            assert torch.equal(got, dense), f"{name}: max diff {(got - dense).abs().max().item()}"
        w = tiny_llama.get_submodule(name).weight.float()
        assert ((dense - w).norm() / w.norm()).item() < 0.15, name
    for name, m in tiny_llama.named_modules():      # everything not quantized is dense in the file and config
        if isinstance(m, torch.nn.Linear) and name not in res.dense_weights:
            assert fc.spec_for(name) is None, name
            assert sd[name + ".weight"].dtype == torch.bfloat16, name


def test_dense_twin(written, tiny_llama):
    res, sd, _ = written("awq", dict(sym=False, group_size=64))
    twin = res.dense_model()
    assert all(type(m) is torch.nn.Linear for m in twin.modules() if isinstance(m, torch.nn.Linear))
    for name, w in res.dense_weights.items():
        assert torch.equal(twin.get_submodule(name).weight, w)
    assert torch.equal(twin.model.norm.weight, sd["model.norm.weight"].float())
    assert torch.equal(twin.lm_head.weight, sd["lm_head.weight"].float())
    full = res.dense_state_dict()
    assert set(full) == set(tiny_llama.state_dict())
    # each quantized Linear adds its own rounding noise (relative size: its weight's) to an isotropic-ish input;
    # independent noises add in quadrature at the logits, and the twin must show that much, not less, not more
    orig = dict(tiny_llama.named_modules())
    eps = [((w - orig[n].weight).norm() / orig[n].weight.norm()).item() for n, w in res.dense_weights.items()]
    predicted = sum(e * e for e in eps) ** 0.5
    x = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = twin(x).logits, tiny_llama(x).logits
    assert 0.5 * predicted < ((a - b).norm() / b.norm()).item() < 1.5 * predicted, predicted


# ---------------------------------------------------------------------------------------------- per format


def test_gptq_sym_golden(written):
    res, sd, cj = written("gptq", {})
    q = cj["quantization_config"]
    assert q == {"bits": 4, "group_size": 128, "sym": True, "data_type": "int", "autoround_version": "0.16.1",
                 "provider": "auto-round", "lm_head": False, "quant_method": "gptq", "desc_act": False,
                 "true_sequential": False, "damp_percent": 0.01}
    assert json.load(open(os.path.join(res.path, "quantize_config.json"))) == q
    t = _module_tensors(sd, Q)
    assert set(t) == {"qweight", "qzeros", "scales", "g_idx"}
    assert t["qweight"].shape == (32, 256) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (2, 32) and bool((_int32(t["qzeros"]) == W0x77777777).all())
    assert t["scales"].shape == (2, 256) and t["scales"].dtype == torch.float16
    assert bool((t["scales"] > 0).all())                      # amax/7: positive scales
    assert t["g_idx"].dtype == torch.int32 and torch.equal(t["g_idx"], torch.arange(256, dtype=torch.int32) // 128)
    # packed along K: slot i of qweight[r, n] is the code of input column 8r+i
    codes = res._rtn[Q].codes
    assert int(_int32(t["qweight"])[3, 5] >> 8 & 0xF) == int(codes[5, 26])
    assert set(sd) >= {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"}
    assert sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert cj["dtype"] == "bfloat16"
    # sym codes: amax/7 maps the largest magnitude of a group onto +-7 (code 1 or 15)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15


def test_gptq_v2_and_asym_zeros(written):
    res, sd, cj = written("gptq", dict(checkpoint_format="gptq_v2"))
    assert cj["quantization_config"]["checkpoint_format"] == "gptq_v2"
    assert bool((_int32(_module_tensors(sd, Q)["qzeros"]) == 0x88888888).all())
    res, sd, cj = written("gptq", dict(sym=False, group_size=64))
    assert "checkpoint_format" not in cj["quantization_config"]
    z = layouts.unpack_nibbles(_module_tensors(sd, Q)["qzeros"], 1)
    true = res._rtn[Q].zeros.t()
    assert torch.equal(z.long(), true - 1) and int(true.min()) >= 1     # v1: zero-1 never wraps


def test_gptq_desc_act(written, tiny_llama):
    res, sd, cj = written("gptq", dict(desc_act=True))
    assert cj["quantization_config"]["desc_act"] is True
    g = _module_tensors(sd, Q)["g_idx"].long()
    assert not torch.equal(g, torch.arange(256) // 128)
    assert torch.equal(torch.bincount(g), torch.tensor([128, 128]))
    again = writers.write_checkpoint(tiny_llama, res.path + "-again", "gptq", desc_act=True)
    assert torch.equal(load_file(again.path + "/model.safetensors")[f"{Q}.g_idx"].long(), g)   # seeded


def test_autoround_configs_and_signed_scales(written):
    res, sd, cj = written("autoround", {})
    q = cj["quantization_config"]
    assert q == {"bits": 4, "group_size": 128, "sym": True, "data_type": "int", "autoround_version": "0.16.1",
                 "block_name_to_quantize": "model.layers", "quant_method": "auto-round",
                 "packing_format": "auto_round:auto_gptq"}
    assert json.load(open(os.path.join(res.path, "quantization_config.json"))) == q
    t = _module_tensors(sd, Q)
    assert set(t) == {"qweight", "qzeros", "scales"}                    # no g_idx in auto-round files
    assert bool((_int32(t["qzeros"]) == W0x77777777).all())
    neg = (t["scales"] < 0).float().mean().item()
    assert 0.3 < neg < 0.7, "auto-round's signed sym scales: about half negative"
    r = res._rtn[Q]
    x = r.codes.reshape(256, 2, 128)
    w = res.dense_weights[Q].reshape(256, 2, 128)
    at = w.abs().argmax(-1, keepdim=True)
    assert bool((torch.gather(x, -1, at) == 0).all()), "largest magnitude lands on code -8"


def test_autoround_extra_config_and_lm_head(written):
    res, sd, cj = written("autoround", dict(sym=False, group_size=32, extra_config={DOWN: {"bits": 16}}))
    q = cj["quantization_config"]
    assert q["extra_config"] == {DOWN: {"bits": 16}} and q["sym"] is False and q["group_size"] == 32
    assert sd[DOWN + ".weight"].dtype == torch.bfloat16 and DOWN + ".qweight" not in sd
    assert DOWN not in res.dense_weights and res.skipped[DOWN].startswith("extra_config")
    res, sd, cj = written("autoround", dict(sym_scale="amax7", quantize_lm_head=True))
    assert cj["quantization_config"]["extra_config"] == {"lm_head": {"bits": 4, "group_size": 128, "sym": True,
                                                                     "data_type": "int"}}
    assert "lm_head.qweight" in sd and "lm_head.weight" not in sd
    assert bool((_module_tensors(sd, Q)["scales"] > 0).all())


def test_awq_golden(written):
    res, sd, cj = written("awq", {})
    q = cj["quantization_config"]
    assert q == {"bits": 4, "group_size": 128, "sym": True, "data_type": "int", "autoround_version": "0.16.1",
                 "provider": "auto-round", "quant_method": "awq", "version": "gemm", "zero_point": False,
                 "modules_to_not_convert": ["lm_head"], "to_quant_block_names": "model.layers"}
    t = _module_tensors(sd, Q)
    assert set(t) == {"qweight", "qzeros", "scales"}
    assert t["qweight"].shape == (256, 32) and t["qzeros"].shape == (2, 32) and t["scales"].dtype == torch.float16
    assert bool((t["qzeros"] == W0x88888888).all())
    # AWQ order: column 8c+j sits in slot [0,4,1,5,2,6,3,7][j]
    codes = res._rtn[Q].codes                            # [N, K]
    word = int(_int32(t["qweight"])[7, 2])
    for j, slot in enumerate((0, 4, 1, 5, 2, 6, 3, 7)):
        assert word >> (4 * slot) & 0xF == int(codes[16 + j, 7])
    res, sd, cj = written("autoround-awq", dict(sym=False))
    assert cj["quantization_config"]["packing_format"] == "auto_round:auto_awq"
    z = layouts.unpack_nibbles(_module_tensors(sd, Q)["qzeros"], 1, layouts.AWQ_SLOTS)
    assert torch.equal(z.long(), res._rtn[Q].zeros.t())              # AWQ stores the zero as is


def test_ct_w4a16(written):
    res, sd, cj = written("ct-w4a16", {})
    q = cj["quantization_config"]
    g = q["config_groups"]["group_0"]
    assert q["format"] == g["format"] == "pack-quantized" and q["quant_method"] == "compressed-tensors"
    assert g["targets"] == ["Linear"] and g["input_activations"] is None
    assert {k: g["weights"][k] for k in ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic")} == \
        {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True, "dynamic": False}
    assert q["ignore"] == ["lm_head"] and q["quantization_status"] == "compressed" and q["version"] == "0.19.0"
    assert q["kv_cache_scheme"] is None and q["sparsity_config"] == {} and q["transform_config"] == {}
    assert os.path.exists(os.path.join(res.path, "recipe.yaml"))
    t = _module_tensors(sd, Q)
    assert set(t) == {"weight_packed", "weight_scale", "weight_shape"}
    assert t["weight_packed"].shape == (256, 32) and t["weight_scale"].dtype == torch.bfloat16
    assert t["weight_scale"].shape == (256, 2) and t["weight_shape"].tolist() == [256, 256]
    assert t["weight_shape"].dtype == torch.int64
    # nibble order: slot i of word c is column 8c+i, stored q+8; sym scale = amax/7.5 in bf16
    codes = res._rtn[Q].codes
    word = int(_int32(t["weight_packed"])[9, 3])
    assert [word >> (4 * i) & 0xF for i in range(8)] == codes[9, 24:32].tolist()
    assert int(codes.min()) == 0, "the -8 code occurs with amax/7.5"


def test_ct_scale_convention(tiny_llama):
    w = tiny_llama.get_submodule(Q).weight
    r = writers.quantize_rtn(w, "ct-int4", 128, True, scale_dtype=torch.bfloat16)
    amax = w.detach().reshape(256, 2, 128).abs().amax(-1)
    assert torch.equal(r.scales, (amax / 7.5).to(torch.bfloat16).float())
    r = writers.quantize_rtn(w, "int4", 128, True, scale_dtype=torch.float16)
    assert torch.equal(r.scales, (amax / 7.0).to(torch.float16).float())


def test_ct_w4a16_asym_and_channel(written):
    res, sd, cj = written("ct-w4a16", dict(sym=False, group_size=32))
    w = cj["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert w["symmetric"] is False and w["zp_dtype"] == "torch.int8" and w["group_size"] == 32
    t = _module_tensors(sd, Q)
    assert t["weight_zero_point"].shape == (32, 8) and t["weight_zero_point"].dtype == torch.int32
    zp = layouts.unpack_nibbles(t["weight_zero_point"], 0)               # along N, stored zp+8
    assert torch.equal(zp.long(), res._rtn[Q].zeros)
    res, sd, cj = written("ct-w4a16", dict(group_size=-1))
    w = cj["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert w["strategy"] == "channel" and w["group_size"] is None
    assert _module_tensors(sd, Q)["weight_scale"].shape == (256, 1)


@pytest.mark.parametrize("fmt", ["ct-w8a8", "ct-w4a8"])
def test_ct_int_quantized(written, fmt):
    res, sd, cj = written(fmt, {})
    g = cj["quantization_config"]["config_groups"]["group_0"]
    assert cj["quantization_config"]["format"] == g["format"] == "int-quantized"
    a = g["input_activations"]
    assert {k: a[k] for k in ("num_bits", "type", "strategy", "dynamic", "symmetric")} == \
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
    t = _module_tensors(sd, Q)
    assert set(t) == {"weight", "weight_scale"} and t["weight"].dtype == torch.int8 and t["weight"].shape == (256, 256)
    if fmt == "ct-w8a8":
        assert g["weights"]["num_bits"] == 8 and g["weights"]["strategy"] == "channel"
        assert t["weight_scale"].shape == (256, 1)
    else:
        assert g["weights"]["num_bits"] == 4 and g["weights"]["strategy"] == "group" and g["weights"]["group_size"] == 128
        assert t["weight_scale"].shape == (256, 2)
        assert int(t["weight"].min()) >= -8 and int(t["weight"].max()) <= 7


def test_ct_nvfp4(written, tiny_llama):
    res, sd, cj = written("ct-nvfp4", {})
    q = cj["quantization_config"]
    w = q["config_groups"]["group_0"]["weights"]
    assert q["format"] == "nvfp4-pack-quantized" and q["ignore"] == ["lm_head"]
    assert {k: w[k] for k in ("num_bits", "type", "strategy", "group_size", "symmetric", "scale_dtype")} == \
        {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
         "scale_dtype": "torch.float8_e4m3fn"}
    t = _module_tensors(sd, Q)
    assert set(t) == {"weight_packed", "weight_scale", "weight_global_scale"}
    assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (256, 128)
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and t["weight_scale"].shape == (256, 16)
    amax = tiny_llama.get_submodule(Q).weight.abs().max()
    gs = t["weight_global_scale"]
    assert gs.shape == (1,) and gs.dtype == torch.float32
    assert gs.item() == (448 * 6 / amax).to(torch.bfloat16).item()            # a divisor, computed in bf16
    codes = res._rtn[Q].codes
    b = t["weight_packed"][4, 10].item()
    assert (b & 0xF, b >> 4) == (codes[4, 20].item(), codes[4, 21].item())    # low nibble = even column


@pytest.mark.parametrize("fmt", ["modelopt-w4a16", "modelopt-nvfp4"])
def test_modelopt(written, tiny_llama, fmt):
    res, sd, cj = written(fmt, {})
    algo = "NVFP4" if fmt == "modelopt-nvfp4" else "W4A16_NVFP4"
    hq = json.load(open(os.path.join(res.path, "hf_quant_config.json")))
    assert hq == {"producer": {"name": "modelopt", "version": "0.47.0"},
                  "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
                                   "exclude_modules": ["lm_head", "model.embed_tokens"]}}
    q = cj["quantization_config"]
    assert q["quant_method"] == "modelopt" and q["quant_algo"] == algo and q["producer"] == hq["producer"]
    assert q["ignore"] == ["lm_head", "model.embed_tokens"]
    g = q["config_groups"]["group_0"]
    assert g["targets"] == ["Linear"]
    assert g["weights"] == {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
    assert ("input_activations" in g) == (fmt == "modelopt-nvfp4")
    t = _module_tensors(sd, Q)
    want = {"weight", "weight_scale", "weight_scale_2"} | ({"input_scale"} if fmt == "modelopt-nvfp4" else set())
    assert set(t) == want
    assert t["weight"].dtype == torch.uint8 and t["weight"].shape == (256, 128)
    assert t["weight_scale"].dtype == torch.float8_e4m3fn
    amax = tiny_llama.get_submodule(Q).weight.abs().max()
    assert t["weight_scale_2"].shape == () and t["weight_scale_2"].dtype == torch.float32
    assert t["weight_scale_2"].item() == (amax / (6 * 448)).item()
    bs = t["weight_scale"].float()
    assert bs.max().item() == 448.0 and bs.min().item() >= 2 ** -9
    if fmt == "modelopt-nvfp4":
        assert t["input_scale"].shape == () and t["input_scale"].item() > 0
    assert sd["lm_head.weight"].dtype == sd["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_modelopt_given_input_amax_and_lm_head(written):
    res, sd, cj = written("modelopt-nvfp4", dict(input_amax=3.0, quantize_lm_head=True))
    assert sd[f"{Q}.input_scale"].item() == torch.tensor(3.0 / 2688, dtype=torch.float32).item()
    assert cj["quantization_config"]["ignore"] == ["model.embed_tokens"]
    assert "lm_head.weight_scale_2" in sd and sd["lm_head.weight"].dtype == torch.uint8


def test_modelopt_hf_quant_config_only(tmp_path, tiny_llama):
    res = writers.write_checkpoint(tiny_llama, tmp_path / "c", "modelopt-w4a16", hf_quant_config_only=True)
    assert "quantization_config" not in json.load(open(os.path.join(res.path, "config.json")))
    assert os.path.exists(os.path.join(res.path, "hf_quant_config.json"))


# ---------------------------------------------------------------------------------------------- options


def test_e2m1_codes_match_layouts_encoder():
    x = torch.cat([torch.linspace(-7, 7, 20001), torch.randn(20000) * 2,
                   torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, -0.0, 6.0, -6.0, 1e9])])
    assert torch.equal(writers.e2m1_codes(x), layouts.e2m1_encode(x).long())


def test_source_directory_dtype_and_side_files(tmp_path, tiny_llama_dir, written):
    src = tmp_path / "src"
    src.mkdir()
    for f in os.listdir(tiny_llama_dir):
        os.symlink(os.path.join(tiny_llama_dir, f), src / f)
    (src / "tokenizer_config.json").write_text("{}")
    (src / "special_tokens_map.json").write_text("{}")
    res = writers.write_checkpoint(str(src), tmp_path / "out", "gptq", dtype=torch.float16)
    files = set(os.listdir(res.path))
    assert {"tokenizer_config.json", "special_tokens_map.json", "config.json", "model.safetensors"} <= files
    sd = load_file(os.path.join(res.path, "model.safetensors"))
    assert sd["model.norm.weight"].dtype == torch.float16 and sd["lm_head.weight"].dtype == torch.float16
    _, ref, _ = written("gptq", {})
    for k in ref:
        if ref[k].dtype in (torch.int32, torch.float16):
            assert torch.equal(sd[k], ref[k]), k       # same model, same codes and fp16 scales
    ct = writers.write_checkpoint(str(src), tmp_path / "ct", "ct-w4a16", dtype=torch.float32)
    assert load_file(os.path.join(ct.path, "model.safetensors"))[f"{Q}.weight_scale"].dtype == torch.float32


def test_tied_embeddings(tmp_path, tiny_llama_tied):
    res = writers.write_checkpoint(tiny_llama_tied, tmp_path / "a", "ct-w4a16")
    sd = load_file(os.path.join(res.path, "model.safetensors"))
    assert "lm_head.weight" not in sd and json.load(open(os.path.join(res.path, "config.json")))["tie_word_embeddings"]
    twin = res.dense_model()
    assert twin.lm_head.weight.data_ptr() == twin.model.embed_tokens.weight.data_ptr()
    res = writers.write_checkpoint(tiny_llama_tied, tmp_path / "b", "gptq", quantize_lm_head=True)
    sd = load_file(os.path.join(res.path, "model.safetensors"))
    cj = json.load(open(os.path.join(res.path, "config.json")))
    assert cj["tie_word_embeddings"] is False and cj["quantization_config"]["lm_head"] is True
    assert "lm_head.qweight" in sd and "model.embed_tokens.weight" in sd
    assert tiny_llama_tied.config.tie_word_embeddings is True                  # the source is not modified
    twin = res.dense_model()
    assert torch.equal(twin.lm_head.weight, res.dense_weights["lm_head"])
    assert torch.equal(twin.model.embed_tokens.weight, sd["model.embed_tokens.weight"].float())


def test_bias_is_written(tmp_path, tiny_llama_bias):
    res = writers.write_checkpoint(tiny_llama_bias, tmp_path / "c", "awq")
    sd = load_file(os.path.join(res.path, "model.safetensors"))
    assert sd[f"{Q}.bias"].dtype == torch.bfloat16 and sd[f"{Q}.bias"].shape == (256,)
    assert torch.equal(res.dense_model().get_submodule(Q).bias, sd[f"{Q}.bias"].float())


@pytest.mark.parametrize("fmt,key", [("ct-w4a16", "ignore"), ("awq", "modules_to_not_convert"),
                                     ("modelopt-w4a16", "ignore"), ("autoround", "extra_config"),
                                     ("gptq", "dynamic")])
def test_ignore_is_listed_as_the_producer_would(tmp_path, tiny_llama, fmt, key):
    res = writers.write_checkpoint(tiny_llama, tmp_path / "c", fmt, ignore=["re:.*\\.k_proj$", DOWN])
    q = res.quantization_config
    dense = {f"model.layers.{i}.self_attn.k_proj" for i in range(2)} | {DOWN}
    assert set(res.skipped) == dense and not dense & set(res.dense_weights)
    listed = json.dumps(q[key])
    for n in dense:
        assert n.replace(".", "\\\\.") in listed or n in listed, (n, q[key])
    if fmt != "gptq":                     # hf_w4's gptq parser does not read GPTQModel "dynamic" (yet)
        fc = formats.parse(q)
        assert all(fc.spec_for(n) is None for n in dense)
        assert fc.spec_for(Q) is not None


def test_incompatible_k_raises_or_skips(tmp_path):
    m = make_tiny_llama(hidden_size=192, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj .*K=192.*group_size=128.*"
                                         r"\[32, 64, -1\].*skip_incompatible"):
        writers.write_checkpoint(m, tmp_path / "x", "gptq")
    assert not os.path.exists(tmp_path / "x")
    res = writers.write_checkpoint(m, tmp_path / "c", "ct-w4a16", skip_incompatible=True)
    assert set(res.dense_weights) == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}   # K=384
    assert "model.layers.0.mlp.up_proj" in res.quantization_config["ignore"]
    assert res.skipped["model.layers.0.mlp.up_proj"].startswith("incompatible shape")


@pytest.mark.parametrize("fmt,opts,match", [
    ("awq", dict(group_size=-1), r"awq: group_size=-1 .*supported: a positive group size"),
    ("autoround-awq", dict(group_size=None), r"per channel"),
    ("nope", {}, r"unknown format 'nope'; supported: \['gptq'"),
    ("ct-w8a8", dict(sym=False), r"symmetric only"),
    ("awq", dict(desc_act=True), r"desc_act"),
    ("ct-w4a16", dict(checkpoint_format="gptq_v2"), r"checkpoint_format"),
    ("gptq", dict(checkpoint_format="gptq_v3"), r"supported: None"),
    ("gptq", dict(extra_config={DOWN: {"bits": 16}}), r"extra_config"),
    ("awq", dict(quantize_lm_head=True), r"lm_head"),
    ("autoround", dict(extra_config={DOWN: {"bits": 8}}), r"bits=8 .*supported: 4 or 16"),
    ("gptq", dict(group_size=-5), r"group_size=-5 is invalid"),
])
def test_invalid_combinations(tmp_path, tiny_llama, fmt, opts, match):
    with pytest.raises(ValueError, match=match):
        writers.write_checkpoint(tiny_llama, tmp_path / "c", fmt, **opts)
    assert os.listdir(tmp_path) == []


def test_atomic_write_and_replace(tmp_path, tiny_llama, monkeypatch):
    out = tmp_path / "ckpt"
    writers.write_checkpoint(tiny_llama, out, "ct-w8a8")
    before = load_file(out / "model.safetensors")
    import safetensors.torch as st

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(st, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        writers.write_checkpoint(tiny_llama, out, "gptq")
    assert os.listdir(tmp_path) == ["ckpt"]                       # no temp dir left behind
    assert set(load_file(out / "model.safetensors")) == set(before)  # the old checkpoint is intact
    monkeypatch.undo()
    writers.write_checkpoint(tiny_llama, out, "gptq")             # replacing a checkpoint works
    assert f"{Q}.qweight" in load_file(out / "model.safetensors") and os.listdir(tmp_path) == ["ckpt"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        writers.write_checkpoint(tiny_llama, tmp_path / "other", "gptq")


def test_formats_listing():
    assert list(writers.FORMATS) == ["gptq", "autoround", "autoround-awq", "awq", "ct-w4a16", "ct-w8a8", "ct-w4a8",
                                     "ct-nvfp4", "modelopt-w4a16", "modelopt-nvfp4"]
    assert all(f.name == n and f.description for n, f in writers.FORMATS.items())
