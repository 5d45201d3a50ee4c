"""MoE models end to end (hf_w4.loading.moe): transformers 5 fuses a layer's experts into one module with 3-D parameters,
the producers store one quantized Linear per expert projection. Tiny seeded Qwen3-MoE and Mixtral models, written
per expert by hf_w4.tools.writers, load into ``UnfusedExperts`` of QuantLinears, match the writer's dense twin and, as an
independent check of the routing forward, transformers' own fused experts holding the same dense weights; they save
back bit-exact, generate, dequantize; the writer leaves its source fused; broken checkpoints are errors naming the
module."""
import copy
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import hf_w4
from conftest import assert_same_checkpoint
from conftest import rel_err as _rel
from hf_w4 import layouts
from hf_w4.loading import moe
from hf_w4.tools import writers
from hf_w4.loading.checkpoint import CheckpointError
from hf_w4.formats.spec import W4Spec
from hf_w4.nn import QuantLinear

VOCAB = 128
ARCHS = {
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[], decoder_sparse_step=1, tie_word_embeddings=False)),
    "mixtral": (MixtralForCausalLM, MixtralConfig, dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
}
NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}   # (gate, up, down)


def _disk(arch: str, key: str) -> str:
    """A model key as stored (transformers saves Mixtral's mlp as block_sparse_moe, and so does the writer)."""
    return key.replace(".mlp.", ".block_sparse_moe.") if arch == "mixtral" else key
E, LAYERS = 4, 2
QWEN_FORMATS = ["gptq", "awq", "autoround", "ct-w4a16", "ct-nvfp4", "modelopt-nvfp4", "modelopt-w4a16"]
GROUPED = {"gptq", "awq", "autoround", "ct-w4a16"}    # formats that take a group_size (NVFP4: always 16)
# the tensor holding the packed weight, per format (ModelOpt's is a uint8 'weight')
PACKED = {"gptq": "qweight", "awq": "qweight", "autoround": "qweight", "ct-w4a16": "weight_packed",
          "ct-nvfp4": "weight_packed", "modelopt-nvfp4": "weight", "modelopt-w4a16": "weight"}
CASES = [("qwen3_moe", f) for f in QWEN_FORMATS] + [("mixtral", f) for f in ("gptq", "ct-w4a16", "modelopt-nvfp4")]


pytestmark = pytest.mark.usefixtures("hf_w4_installed")




def _tokens(batch=2, seq=12):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _logits(model, x=None):
    with torch.no_grad():
        return model(_tokens() if x is None else x).logits


def make_moe(arch: str, seed: int = 0):
    """A seeded random tiny MoE causal LM in fp32 (weights ~0.05 randn, so the logits are not tiny)."""
    cls, cfg_cls, kw = ARCHS[arch]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**kw)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _opts(fmt, **kw):
    return {**({"group_size": 32} if fmt in GROUPED else {}), **kw}


@pytest.fixture(scope="module")
def sources():
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = make_moe(arch)
        return cache[arch]
    return get


@pytest.fixture(scope="module")
def written(tmp_path_factory, sources):
    """(arch, fmt, **writer options) -> WriteResult, each written once per module."""
    cache = {}

    def get(arch, fmt, **opts):
        opts = _opts(fmt, **opts)
        key = (arch, fmt, json.dumps(opts, sort_keys=True))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            cache[key] = writers.write_checkpoint(sources(arch), str(out / "ckpt"), fmt, **opts)
        return cache[key]
    return get


def _experts(model):
    return [layer.mlp.experts for layer in model.model.layers]


def fused_reference(arch, res):
    """A fresh instance of the original class (fused experts, transformers' own forward) holding the writer's dense
    weights: every expert's gate rows then up rows stacked into gate_up_proj, its down into down_proj."""
    cls, cfg_cls, kw = ARCHS[arch]
    torch.manual_seed(123)
    ref = cls(cfg_cls(**kw)).float().eval()
    gate, up, down = NAMES[arch]
    assert moe.projection_names(ref) == NAMES[arch]
    sd = res.dense_state_dict()
    per_expert = re.compile(r".*\.experts\.\d+\.\w+\.weight$")
    new = {k: v for k, v in sd.items() if not per_expert.match(k)}
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp.experts"
        new[f"{p}.gate_up_proj"] = torch.stack([torch.cat([sd[f"{p}.{e}.{gate}.weight"], sd[f"{p}.{e}.{up}.weight"]])
                                                for e in range(E)])
        new[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{e}.{down}.weight"] for e in range(E)])
    ref.load_state_dict(new, strict=True)
    assert all(type(m) is type(_experts(ref)[0]) and moe.is_fused_experts(m) for m in _experts(ref))
    return ref


def _keys(path):
    return load_file(os.path.join(path, "model.safetensors"))


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        sd = edit_tensors(_keys(src))
        save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        edit_config(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return str(dst)


# ------------------------------------------------------------------------------------------------------------
# 1. every format loads per expert, matches the dense twin and transformers' fused experts


@pytest.mark.parametrize("arch,fmt", CASES, ids=[f"{a}-{f}" for a, f in CASES])
def test_loads_per_expert_and_matches_twin_and_fused_reference(written, arch, fmt):
    res = written(arch, fmt)
    keys = _keys(res.path)
    for i in range(LAYERS):
        for e in range(E):
            for proj in NAMES[arch]:
                k = _disk(arch, f"model.layers.{i}.mlp.experts.{e}.{proj}.{PACKED[fmt]}")
                assert k in keys, f"{fmt}: {k} missing from the checkpoint (experts must be stored per expert)"
                assert keys[k].dtype in (torch.int32, torch.uint8), f"{k}: {keys[k].dtype} is not packed"
    fused = [k for k in keys if "gate_up_proj" in k or re.search(r"experts\.(down_proj|gate_up_proj)$", k)]
    assert not fused, f"{fmt}: fused expert tensors in a per-expert checkpoint: {fused[:3]}"

    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    for i, ex in enumerate(_experts(model)):
        assert isinstance(ex, moe.UnfusedExperts), f"layer {i}: mlp.experts is {type(ex).__name__}"
        assert len(ex) == E and ex.names == NAMES[arch]
        for e in range(E):
            for proj in NAMES[arch]:
                q = getattr(ex[e], proj)
                assert isinstance(q, QuantLinear) and q.kernel is not None, \
                    f"model.layers.{i}.mlp.experts.{e}.{proj}: {type(q).__name__}, kernel {getattr(q, 'kernel', None)}"
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)

    twin = res.dense_model().float().eval()
    ref = fused_reference(arch, res)
    x = _tokens()
    got, want, fused_want = _logits(model, x), _logits(twin, x), _logits(ref, x)
    rel = _rel(got, want)
    assert rel <= 1e-5, f"{arch} {fmt}: fp32 logits differ from the dense twin by {rel:.2e} (budget 1e-5)"
    rel = _rel(want, fused_want)
    assert rel <= 1e-5, (f"{arch} {fmt}: the unfused twin differs from transformers' fused experts with the same "
                         f"weights by {rel:.2e} (budget 1e-5)")
    rel = _rel(got, fused_want)
    assert rel <= 1e-5, f"{arch} {fmt}: quantized model vs fused reference {rel:.2e} (budget 1e-5)"


def _manual_experts(fused, h, idx, w):
    """Per token and slot, straight from the fused parameters: sum_j w[t, j] * down_e(act(gate_e(h)) * up_e(h));
    an index >= num_experts (a masked slot, as expert parallelism marks them) adds nothing."""
    n, inter = fused.num_experts, fused.down_proj.shape[-1]
    rows = []
    for t in range(h.shape[0]):
        y = torch.zeros_like(h[t])
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e >= n:
                continue
            gu = fused.gate_up_proj[e] @ h[t]
            y = y + w[t, j] * (fused.down_proj[e] @ (fused.act_fn(gu[:inter]) * gu[inter:]))
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_unfused_forward_matches_the_fused_module(sources, arch):
    """UnfusedExperts over views of a fused module's parameters computes what the fused module does, for routings
    with unused experts, one expert taking every token, and masked slots; gradients too (input, routing weights)."""
    fused = copy.deepcopy(_experts(sources(arch))[0])
    un = moe.unfuse(fused, NAMES[arch], share=True)
    assert isinstance(un, moe.UnfusedExperts) and len(un) == E
    assert getattr(un[2], NAMES[arch][2]).weight.data_ptr() == fused.down_proj[2].data_ptr()   # a view, no copy
    g = torch.Generator().manual_seed(7)
    t = 10
    h = torch.randn(t, 128, generator=g)
    w = torch.softmax(torch.randn(t, 2, generator=g), -1)
    routings = {"random": torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(t)]),
                "two experts unused": torch.tensor([[2, 0], [0, 2]] * (t // 2)),
                "one expert for all": torch.stack([torch.full((t,), 3), torch.randint(0, 3, (t,), generator=g)], 1),
                "masked slots": torch.tensor([[1, E], [E, 3], [E, E], [0, 1], [2, E]] * (t // 5))}
    for what, idx in routings.items():
        h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        got = un(h1, idx, w1)
        want = _manual_experts(fused, h2, idx, w2)
        rel = _rel(got, want)
        assert rel <= 1e-5, f"{arch} {what}: UnfusedExperts off the per-token reference by {rel:.2e} (budget 1e-5)"
        if what != "masked slots":   # transformers' own forward (its default experts implementation)
            with torch.no_grad():
                rel = _rel(got, fused(h, idx, w))
            assert rel <= 1e-5, f"{arch} {what}: UnfusedExperts off {type(fused).__name__} by {rel:.2e} (budget 1e-5)"
        got.pow(2).sum().backward()
        want.pow(2).sum().backward()
        for name, a, b in (("input", h1.grad, h2.grad), ("routing weights", w1.grad, w2.grad)):
            rel = _rel(a, b)
            assert rel <= 1e-5, f"{arch} {what}: gradient wrt the {name} off by {rel:.2e} (budget 1e-5)"
    h0 = torch.zeros(0, 128)
    assert un(h0, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)).shape == (0, 128)


# ------------------------------------------------------------------------------------------------------------
# 2. save_pretrained writes the checkpoint back per expert, bit-identical


SAVE_CASES = [("qwen3_moe", "gptq", ()), ("qwen3_moe", "modelopt-nvfp4", ()), ("qwen3_moe", "ct-w4a16", ()),
              ("mixtral", "gptq", ()), ("qwen3_moe", "awq", ("re:.*experts.*",))]


@pytest.mark.parametrize("arch,fmt,ignore", SAVE_CASES,
                         ids=[f"{a}-{f}" + ("-dense-experts" if i else "") for a, f, i in SAVE_CASES])
def test_save_is_bit_identical_and_reloads(written, tmp_path, arch, fmt, ignore):
    res = written(arch, fmt, ignore=list(ignore)) if ignore else written(arch, fmt)
    # bf16 as on disk, so the dense tensors round-trip too
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "re")
    assert_same_checkpoint(res.path, tmp_path / "re")
    qa = json.load(open(os.path.join(res.path, "config.json")))["quantization_config"]
    qb = json.load(open(tmp_path / "re" / "config.json"))["quantization_config"]
    assert qa == qb
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "re", dtype=torch.bfloat16)
    assert all(isinstance(ex, moe.UnfusedExperts) for ex in _experts(again))
    x = _tokens()
    assert torch.equal(_logits(model, x), _logits(again, x))


def test_mixtral_block_sparse_moe_layout_loads_and_saves_back(written, tmp_path):
    """Mixtral checkpoints on the Hub (and transformers' own save_pretrained of a dense Mixtral, and the writer) name
    the MoE block ``block_sparse_moe``: the model's renaming to ``mlp`` still applies, and the names are written back.
    A file under the model's own names (``mlp``) loads too."""
    res = written("mixtral", "gptq")
    src = res.path
    assert any(".block_sparse_moe.experts.0.w1.qweight" in k for k in _keys(src))
    assert not any(".mlp." in k for k in _keys(src))
    mlp = _rewrite(res.path, tmp_path / "mlp",
                   lambda sd: {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in sd.items()})
    for path in (src, mlp):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert all(isinstance(ex, moe.UnfusedExperts) for ex in _experts(model))
        rel = _rel(_logits(model), _logits(res.dense_model().float().eval()))
        assert rel <= 1e-5, f"{path}: logits off the twin by {rel:.2e} (budget 1e-5)"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)   # as on disk: a bit-exact round trip
    model.save_pretrained(tmp_path / "re")
    assert_same_checkpoint(src, tmp_path / "re")


# ------------------------------------------------------------------------------------------------------------
# 3. experts the writer leaves dense


ALL_EXPERTS = ("re:.*experts.*",)
# expert 1 of every layer, and layer 1's expert 2 down projection (Mixtral: w2), left dense next to quantized ones
SOME_EXPERTS = ("re:.*experts\\.1\\..*", "re:model\\.layers\\.1\\.mlp\\.experts\\.2\\.(down_proj|w2)$")
DENSE_CASES = [("qwen3_moe", "gptq", ALL_EXPERTS), ("qwen3_moe", "ct-w4a16", ALL_EXPERTS),
               ("qwen3_moe", "modelopt-nvfp4", ALL_EXPERTS), ("mixtral", "awq", ALL_EXPERTS),
               ("qwen3_moe", "gptq", SOME_EXPERTS), ("qwen3_moe", "awq", SOME_EXPERTS),
               ("qwen3_moe", "ct-nvfp4", SOME_EXPERTS), ("mixtral", "modelopt-w4a16", SOME_EXPERTS),
               ("mixtral", "autoround", SOME_EXPERTS)]


@pytest.mark.parametrize("arch,fmt,ignore", DENSE_CASES,
                         ids=[f"{a}-{f}-{'all' if i is ALL_EXPERTS else 'some'}" for a, f, i in DENSE_CASES])
def test_dense_experts_load_per_expert(written, arch, fmt, ignore):
    res = written(arch, fmt, ignore=list(ignore))
    dense = {n for n, r in res.skipped.items() if ".experts." in n and r == "ignored"}
    want_dense = ({f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(LAYERS) for e in range(E)
                   for p in NAMES[arch]} if ignore is ALL_EXPERTS else
                  {f"model.layers.{i}.mlp.experts.1.{p}" for i in range(LAYERS) for p in NAMES[arch]}
                  | {f"model.layers.1.mlp.experts.2.{NAMES[arch][2]}"})
    assert dense == want_dense, f"the writer left {sorted(dense)} dense"
    keys = _keys(res.path)
    for name in dense:
        assert keys[_disk(arch, name + ".weight")].dtype == torch.bfloat16, \
            f"{name}: dense expert weight not stored per expert"
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    for i, ex in enumerate(_experts(model)):
        assert isinstance(ex, moe.UnfusedExperts), f"layer {i}: mlp.experts is {type(ex).__name__}"
        for e in range(E):
            for proj in NAMES[arch]:
                name, m = f"model.layers.{i}.mlp.experts.{e}.{proj}", getattr(ex[e], proj)
                if name in dense:
                    assert type(m) is nn.Linear, f"{name}: {type(m).__name__}, the checkpoint stores it dense"
                else:
                    assert isinstance(m, QuantLinear) and m.kernel is not None, f"{name}: {type(m).__name__}"
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    twin = res.dense_model().float().eval()
    x = _tokens()
    got = _logits(model, x)
    rel = _rel(got, _logits(twin, x))
    assert rel <= 1e-5, f"{arch} {fmt} dense experts: logits off the twin by {rel:.2e} (budget 1e-5)"
    rel = _rel(got, _logits(fused_reference(arch, res), x))
    assert rel <= 1e-5, f"{arch} {fmt} dense experts: logits off the fused reference by {rel:.2e} (budget 1e-5)"


# ------------------------------------------------------------------------------------------------------------
# 4. generate and dequantize


def _assert_bf16_experts_match_twin(bf16, res, what):
    """Each layer's bf16 experts for a given routing (16 tokens, 2 experts each) within bf16 rounding (3e-2 of the
    output's scale) of the fp32 dense twin's experts."""
    twin = res.dense_model().float().eval()
    g = torch.Generator().manual_seed(5)
    h = torch.randn(16, 128, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(16)])
    w = torch.softmax(torch.randn(16, 2, generator=g), -1)
    for i in range(LAYERS):
        with torch.no_grad():
            got = bf16.model.layers[i].mlp.experts(h.bfloat16(), idx, w.bfloat16())
            want = twin.model.layers[i].mlp.experts(h, idx, w)
        rel = _rel(got, want)
        assert got.dtype == torch.bfloat16 and rel <= 3e-2, \
            f"{what} layer {i}: bf16 experts off the fp32 twin by {rel:.2e} (budget 3e-2, bf16 rounding)"


@pytest.mark.parametrize("arch,fmt", [("qwen3_moe", "gptq"), ("mixtral", "modelopt-nvfp4")])
def test_bf16_generate(written, arch, fmt):
    res = written(arch, fmt)
    x = _tokens(1, 6)
    gen = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    bf16 = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    with torch.no_grad():
        out = bf16.generate(x, **gen)
    assert out.shape == (1, 6 + 5) and torch.equal(out[:, :6], x)
    # whole-model logits are not compared in bf16: at these tiny sizes a near-tie in a router (probabilities 0.2041 /
    # 0.2032) flips an expert choice for some token, which is bf16 MoE routing, not the kernels
    _assert_bf16_experts_match_twin(bf16, res, f"{arch} {fmt}")
    # greedy in fp32: the same tokens as transformers' fused experts with the same dense weights
    fp32 = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    with torch.no_grad():
        got = fp32.generate(x, **gen)
        want = fused_reference(arch, res).generate(x, **gen)
    assert torch.equal(got, want), f"{arch} {fmt}: greedy tokens {got.tolist()} vs fused reference {want.tolist()}"


@pytest.mark.parametrize("arch,fmt", [("qwen3_moe", "gptq"), ("mixtral", "modelopt-nvfp4")])
def test_experts_on_the_cuda_kernel(written, cuda_kernel_on_cpu, tmp_path, arch, fmt):
    """Every expert projection on cuda_w4a16 (its kernels emulated on the CPU, tests/conftest.py): the bf16 experts for
    a given routing within bf16 rounding of the fp32 twin's, as above, generate, and a bit-exact save."""
    res = written(arch, fmt)
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    kernels = {m.kernel.NAME for e in _experts(model) for m in e.modules() if isinstance(m, QuantLinear)}
    assert kernels == {"cuda_w4a16"}, kernels
    _assert_bf16_experts_match_twin(model, res, f"{arch} {fmt} on cuda_w4a16")
    x = _tokens(1, 6)
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 11) and torch.equal(out[:, :6], x)
    model.save_pretrained(tmp_path / "re")
    assert_same_checkpoint(res.path, tmp_path / "re")


@pytest.mark.parametrize("arch,fmt", [("qwen3_moe", "awq"), ("mixtral", "modelopt-nvfp4")])
def test_dequantize_then_save_as_dense(written, tmp_path, arch, fmt):
    res = written(arch, fmt)
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    x = _tokens()
    before = _logits(model, x)
    model.dequantize()
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    for i, ex in enumerate(_experts(model)):
        assert isinstance(ex, moe.UnfusedExperts)
        for e in range(E):
            for proj in NAMES[arch]:
                name = f"model.layers.{i}.mlp.experts.{e}.{proj}"
                lin = getattr(ex[e], proj)
                assert type(lin) is nn.Linear and lin.weight.dtype == torch.float32, name
                assert torch.equal(lin.weight, res.dense_weights[name]), name
    after = _logits(model, x)
    rel = _rel(after, before)
    assert rel <= 1e-5, f"{arch} {fmt}: dequantize() moved the fp32 logits by {rel:.2e} (budget 1e-5)"
    # saved, it is an ordinary dense checkpoint (per-expert weights, no quantization_config) that transformers alone
    # loads into its fused experts
    model.save_pretrained(tmp_path / "dense")
    assert "quantization_config" not in json.load(open(tmp_path / "dense" / "config.json"))
    hf_w4.uninstall()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32)
    assert all(moe.is_fused_experts(ex) for ex in _experts(plain))
    rel = _rel(_logits(plain, x), after)
    assert rel <= 1e-5, f"{arch} {fmt}: the dequantized model saved and reloaded by transformers: {rel:.2e} (budget 1e-5)"


# ------------------------------------------------------------------------------------------------------------
# 5. the writer leaves its source fused and unchanged


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_writer_leaves_source_unchanged(tmp_path, arch):
    src = make_moe(arch, seed=3)
    fused_type = type(_experts(src)[0])
    before = {k: v.detach().clone() for k, v in src.state_dict().items()}
    params = {k: id(p) for k, p in src.named_parameters()}
    logits = _logits(src)

    def check(when):
        for i, ex in enumerate(_experts(src)):
            assert type(ex) is fused_type and moe.is_fused_experts(ex), \
                f"{when}: layer {i} mlp.experts is {type(ex).__name__}, not {fused_type.__name__}"
        assert not any(isinstance(m, (moe.UnfusedExperts, moe.Expert)) for m in src.modules()), when
        sd = src.state_dict()
        assert list(sd) == list(before), f"{when}: state_dict keys changed"
        for k, v in before.items():
            assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), f"{when}: {k} changed"
        assert {k: id(p) for k, p in src.named_parameters()} == params, f"{when}: parameters replaced"
        assert torch.equal(_logits(src), logits), when

    res = writers.write_checkpoint(src, str(tmp_path / "gptq"), "gptq", group_size=32)
    assert any(".experts.3." in n for n in res.quantized)
    check("after a gptq write")
    writers.write_checkpoint(src, str(tmp_path / "nvfp4"), "modelopt-nvfp4", ignore=["re:.*experts\\.0\\..*"])
    check("after a modelopt-nvfp4 write with experts.0 ignored")
    with pytest.raises(writers.WriterError, match="match no Linear"):
        writers.write_checkpoint(src, str(tmp_path / "bad"), "gptq", ignore=["no_such_proj"])
    check("after a failed write")
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------------------------------------
# 6. errors name the module and what was found


def test_expert_number_beyond_num_experts_is_an_error(written, tmp_path):
    res = written("qwen3_moe", "gptq")
    # Qwen3MoeConfig serializes num_experts as num_local_experts
    bad = _rewrite(res.path, tmp_path / "few", edit_config=lambda c: c.update(
        {k: 2 for k in ("num_experts", "num_local_experts") if k in c}))
    with pytest.raises(CheckpointError) as ei:
        AutoModelForCausalLM.from_pretrained(bad, dtype=torch.float32)
    msg = str(ei.value)
    assert "model.layers.0.mlp.experts" in msg and "expert number" in msg and "[2, 3]" in msg, msg
    assert "2 experts" in msg, msg


def test_unknown_projection_name_is_an_error(written, tmp_path):
    res = written("qwen3_moe", "gptq")
    bad = _rewrite(res.path, tmp_path / "names", edit_tensors=lambda sd: {
        k.replace("experts.1.up_proj.", "experts.1.upper_proj."): v for k, v in sd.items()})
    with pytest.raises(CheckpointError) as ei:
        AutoModelForCausalLM.from_pretrained(bad, dtype=torch.float32)
    msg = str(ei.value)
    assert "model.layers.0.mlp.experts" in msg and "upper_proj" in msg and "up_proj" in msg, msg


def _own_gate(self, gate_up_out):   # the default math under another name: a gate hf_w4 does not know
    gate, up = gate_up_out.chunk(2, dim=-1)
    return self.act_fn(gate) * up


def test_own_gate_function_with_quantized_experts_is_an_error(written, monkeypatch):
    res = written("qwen3_moe", "gptq")
    monkeypatch.setattr(Qwen3MoeExperts, "_apply_gate", _own_gate, raising=False)
    with pytest.raises(CheckpointError) as ei:
        AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert "model.layers.0.mlp.experts (Qwen3MoeExperts)" in msg and "own gate function" in msg, msg
    assert "model.layers.0.mlp.experts.0.down_proj" in msg, msg    # an example of what was found


def test_own_gate_function_with_dense_experts_stays_fused(written, monkeypatch):
    """Dense per-expert tensors of an experts module hf_w4 cannot unfuse are left to transformers' own merge."""
    res = written("qwen3_moe", "gptq", ignore=["re:.*experts.*"])
    ref = fused_reference("qwen3_moe", res)
    monkeypatch.setattr(Qwen3MoeExperts, "_apply_gate", _own_gate, raising=False)
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    assert all(type(ex) is Qwen3MoeExperts for ex in _experts(model))
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    rel = _rel(_logits(model), _logits(ref))
    assert rel <= 1e-5, f"fused experts merged by transformers: logits off the reference by {rel:.2e} (budget 1e-5)"


# ------------------------------------------------------------------------------------------------------------
# 7. drop_expert_merges drops the merges into experts and nothing else


def _meta(cls, cfg):
    with torch.device("meta"):
        return cls(cfg)


def _is_expert_merge(c):
    from transformers.core_model_loading import WeightConverter
    targets = getattr(c, "_original_target_patterns", None) or c.target_patterns
    return isinstance(c, WeightConverter) and any(re.search(r"experts\.(gate_up_proj|down_proj)\$?$", str(t))
                                                  for t in targets)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_drop_expert_merges_keeps_other_conversions(arch, monkeypatch):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming
    cls, cfg_cls, kw = ARCHS[arch]
    model = _meta(cls, cfg_cls(**kw))
    conv = get_model_conversion_mapping(model)
    merges = [c for c in conv if _is_expert_merge(c)]
    assert len(merges) == 2, conv
    others = [c for c in conv if not _is_expert_merge(c)]
    kept = moe.drop_expert_merges(conv, model)
    assert [id(c) for c in kept] == [id(c) for c in others], f"kept {kept}, expected {others}"
    if arch == "mixtral":
        assert any(isinstance(c, WeightRenaming) and ".block_sparse_moe." in [str(s) for s in c.source_patterns]
                   for c in kept), kept
    # the same once the experts are unfused (as at load)
    moe.unfuse_all(model)
    assert all(isinstance(ex, moe.UnfusedExperts) for ex in _experts(model))
    assert [id(c) for c in moe.drop_expert_merges(conv, model)] == [id(c) for c in others]
    # experts hf_w4 cannot unfuse keep their merges; a model without experts keeps everything
    if arch == "qwen3_moe":
        monkeypatch.setattr(Qwen3MoeExperts, "_apply_gate", _own_gate, raising=False)
        fused = _meta(cls, cfg_cls(**kw))
        assert [id(c) for c in moe.drop_expert_merges(conv, fused)] == [id(c) for c in conv]
    llama = _meta(LlamaForCausalLM, LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    assert [id(c) for c in moe.drop_expert_merges(conv, llama)] == [id(c) for c in conv]


# ------------------------------------------------------------------------------------------------------------
# LoRA on the expert projections (README: "LoRA on the expert projections work as for any other layer")


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("target", [["gate_proj", "up_proj", "down_proj"], "all-linear"], ids=["names", "all-linear"])
def test_lora_on_expert_projections(written, target):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    model = AutoModelForCausalLM.from_pretrained(written("qwen3_moe", "gptq").path, dtype=torch.float32)
    pm = get_peft_model(model, LoraConfig(r=4, target_modules=target, lora_dropout=0.0))
    adapted = {n.removeprefix("base_model.model.") for n, m in pm.named_modules() if hasattr(m, "lora_A")}
    want = {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(LAYERS) for e in range(E) for p in NAMES["qwen3_moe"]}
    assert want <= adapted, f"expert projections without an adapter: {sorted(want - adapted)[:3]}"


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_lora_adapter_on_experts_saves_and_reloads(written, tmp_path, arch):
    # per-expert adapters (PEFT would retarget these names to transformers 5's fused parameters): trained one step,
    # saved, and loaded back through PeftModel.from_pretrained and transformers' load_adapter, same logits
    pytest.importorskip("peft")
    from peft import LoraConfig, PeftModel, get_peft_model
    path = written(arch, "gptq").path
    names = list(NAMES[arch])
    torch.manual_seed(0)
    pm = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                        LoraConfig(r=4, target_modules=names, lora_dropout=0.0, init_lora_weights="gaussian"))
    adapted = {n.removeprefix("base_model.model.") for n, m in pm.named_modules() if hasattr(m, "lora_A")}
    want = {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(LAYERS) for e in range(E) for p in names}
    assert adapted == want
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    pm(ids, labels=ids).loss.backward()
    opt.step()
    with torch.no_grad():
        after = pm(ids).logits
        with pm.disable_adapter():
            base = pm(ids).logits
    assert (after - base).abs().max() > 1e-4, "the trained expert adapters change nothing"
    pm.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file
    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert any(f".experts.0.{names[0]}.lora_A" in k for k in keys) and not any("gate_up_proj" in k for k in keys)
    again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                      tmp_path / "adapter")
    m2 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m2.load_adapter(str(tmp_path / "adapter"))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, after)
        assert torch.equal(m2(ids).logits, after)


# ------------------------------------------------------------------------------------------------------------
# Architectures at the edges (found by an audit): what is not a per-expert MoE stays as it is


def _tiny(cfg_name, model_name, **kw):
    import transformers
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                tie_word_embeddings=False)
    torch.manual_seed(0)
    m = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**{**base, **kw})).float().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else 0.05 * torch.randn(p.shape, generator=g))
    return m


def test_router_that_subclasses_linear_stays_a_router(tmp_path):
    # PhiMoE's router is an nn.Linear subclass whose forward returns (logits, weights, index): quantized and swapped
    # for a QuantLinear it broke every forward. Only Linears whose forward is nn.Linear's are layers to quantize
    src = _tiny("PhimoeConfig", "PhimoeForCausalLM", intermediate_size=32, num_local_experts=16, num_experts_per_tok=2)
    res = writers.write_checkpoint(src, str(tmp_path / "q"), "ct-w4a16", group_size=32)
    assert not [n for n in res.quantized if n.endswith("mlp.router")]
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    assert type(model.model.layers[0].mlp.router).__name__ == "PhimoeTopKRouter"
    assert isinstance(model.model.layers[0].mlp.experts, moe.UnfusedExperts)
    rel = _rel(_logits(model), _logits(res.dense_model()))
    assert rel <= 1e-5, f"PhiMoE: logits off the twin by {rel:.2e} (budget 1e-5)"


@pytest.mark.parametrize("cfg_name,model_name,kw", [
    # no use_experts_implementation: another forward signature and an [E, H, 2I] layout
    ("Llama4TextConfig", "Llama4ForCausalLM", dict(intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4,
                                                   num_experts_per_tok=1, head_dim=16, interleave_moe_layer_step=1,
                                                   no_rope_layers=[1, 1], attention_chunk_size=16)),
    # no per-expert merge: its checkpoints store the experts fused (block_sparse_moe.input_linear)
    ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
], ids=["llama4", "granitemoe"])
def test_experts_not_stored_per_expert_stay_fused(tmp_path, cfg_name, model_name, kw):
    # the writer leaves them fused and dense, as their own checkpoints hold them; the model loads, and a dequantized
    # save loads back in plain transformers
    src = _tiny(cfg_name, model_name, **kw)
    fused = [type(m) for _, m in moe.fused_modules(src)]
    assert fused and all(moe.fused_problem(m) is not None or moe.projection_names(src) is None
                         for _, m in moe.fused_modules(src))
    res = writers.write_checkpoint(src, str(tmp_path / "q"), "gptq", group_size=32)
    assert not [k for k in _keys(res.path) if re.search(r"experts\.\d+\.", k)]
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    assert [type(m) for _, m in moe.fused_modules(model)] == fused
    x = _tokens()
    rel = _rel(_logits(model, x), _logits(res.dense_model(), x))
    assert rel <= 1e-5, f"{model_name}: logits off the twin by {rel:.2e} (budget 1e-5)"
    before = _logits(model, x)
    model.dequantize()
    model.save_pretrained(tmp_path / "dense")
    hf_w4.uninstall()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32)
    assert _rel(_logits(plain, x), before) <= 1e-5


LLAMA4 = dict(intermediate_size=32, intermediate_size_mlp=64, num_local_experts=4, num_experts_per_tok=1, head_dim=16,
              interleave_moe_layer_step=1, no_rope_layers=[1, 1], attention_chunk_size=16)


@pytest.mark.parametrize("fmt", ["gptq", "ct-w4a16"])
def test_llama4_experts_stored_per_expert_load(tmp_path, fmt):
    # Llama 4's experts (outside transformers' experts interface) quantized one Linear per expert, as llm-compressor
    # writes them: transformers' own per-expert module (SequentialLlama4TextExperts) takes them, for every format
    # (transformers swaps it in for compressed-tensors only, and whatever the files hold)
    src = _tiny("Llama4TextConfig", "Llama4ForCausalLM", **LLAMA4)
    res = writers.write_checkpoint(src, str(tmp_path / "q"), fmt, group_size=32)   # experts fused, dense
    spec = W4Spec("gptq", "gptq", "int4", 4, 32, True, zero_plus_one=True)
    twin = res.dense_model()
    paths = [n for n, m in twin.named_modules() if type(m).__name__ == "Llama4TextExperts"]

    def per_expert(sd):
        sd = dict(sd)
        for p in paths:
            gu, dn = sd.pop(f"{p}.gate_up_proj").float(), sd.pop(f"{p}.down_proj").float()   # [E, H, 2I], [E, I, H]
            i = dn.shape[1]
            fused = twin.get_submodule(p)
            for e in range(gu.shape[0]):
                dense = {}
                for proj, w in (("gate_proj", gu[e][:, :i].t()), ("up_proj", gu[e][:, i:].t()), ("down_proj", dn[e].t())):
                    r = writers.quantize_rtn(w.contiguous(), "int4", 32, True)
                    dense[proj] = r.dense()
                    for t, v in layouts.pack(spec, r.codes, r.scales, r.zeros).items():
                        sd[f"{p}.{e}.{proj}.{t}"] = v.contiguous()
                with torch.no_grad():   # the twin's experts: the dequantized per-expert weights, fused back
                    fused.gate_up_proj[e] = torch.cat([dense["gate_proj"], dense["up_proj"]]).t()
                    fused.down_proj[e] = dense["down_proj"].t()
        return sd

    # (GPTQ-packed experts inside a compressed-tensors checkpoint would be no real layout: that one keeps them fused)
    path = _rewrite(res.path, tmp_path / "per_expert", per_expert if fmt == "gptq" else None)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    experts = [m for n, m in model.named_modules() if n in paths]
    if fmt == "gptq":
        assert all(type(m).__name__ == "SequentialLlama4TextExperts" for m in experts)
        assert all(isinstance(m[0].gate_proj, QuantLinear) for m in experts)
    else:   # stored fused and dense: stays the fused module (transformers would have swapped it and failed)
        assert all(type(m).__name__ == "Llama4TextExperts" for m in experts)
    x = _tokens()
    rel = _rel(_logits(model, x), _logits(twin, x))
    assert rel <= 1e-5, f"Llama 4 {fmt}: logits off the twin by {rel:.2e} (budget 1e-5)"


def test_config_rule_by_model_name_on_a_renamed_module(written, tmp_path, sources):
    # Mixtral's experts are stored under block_sparse_moe but named mlp by the model: an auto-round extra_config
    # keyed by the model's name (as a producer on transformers 5 writes it) applies, though the name on disk falls
    # under the default
    key = "model.layers.0.mlp.experts.0.w1"
    res = writers.write_checkpoint(sources("mixtral"), str(tmp_path / "q"), "autoround", group_size=32,
                                   extra_config={key: {"group_size": 64}})
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    assert model.get_submodule(key).spec.group_size == 64
    assert model.get_submodule("model.layers.0.mlp.experts.0.w3").spec.group_size == 32
    rel = _rel(_logits(model), _logits(res.dense_model()))
    assert rel <= 1e-5, f"logits off the twin by {rel:.2e} (budget 1e-5)"


def test_transpose_of_fused_experts_is_not_dropped():
    # Qwen3-VL-MoE converts fused expert tensors of its older layout by a transpose (no per-expert sources): only
    # per-expert merges are hf_w4's to drop
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    from transformers.conversion_mapping import get_model_conversion_mapping
    tc = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
              mlp_only_layers=[], rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": [2, 3, 3]})
    vc = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0])
    m = _meta(Qwen3VLMoeForConditionalGeneration, Qwen3VLMoeConfig(text_config=tc, vision_config=vc))
    conv = get_model_conversion_mapping(m, add_legacy=False)
    assert [id(c) for c in moe.drop_expert_merges(conv, m)] == [id(c) for c in conv]
