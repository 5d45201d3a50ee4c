"""MoE experts in one compiled call per step (hf_w4.loading.moe_stack, op cpu_w4a16_moe): where every expert
projection of a layer runs on cpu_w4a16, the layer's kernel buffers are stacked once (the experts keep views of them)
and a step of few tokens runs all routed experts in one op. Its output is bit for bit the per-expert forward's (int4
symmetric / asymmetric, NVFP4; fp32 / bf16 / fp16; one token and several; masked slots; one and two threads); the
layer falls back to the per-expert forward, with the reason, where one call cannot stand in for the modules (an
expert dense, on another kernel, LoRA-wrapped, offloaded, hooked, act-order; an activation other than silu;
gradients), and checks again after its experts change; bad op input is an error naming the argument."""
import os

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from conftest import assert_same_checkpoint, w4a16_isa_available
from hf_w4 import _ext
from hf_w4.loading import moe_stack
from hf_w4.loading import moe
from hf_w4.nn import QuantLinear
from hf_w4.tools import writers

pytestmark = pytest.mark.usefixtures("hf_w4_installed")

# hidden 256, experts of 80 (three panels of 32 columns, the last a partial one, and not a multiple of 64: silu
# per expert's rows), 8 experts, top 3
H, I, E, K = 256, 80, 8, 3
CFG = dict(vocab_size=128, hidden_size=H, intermediate_size=256, moe_intermediate_size=I, num_hidden_layers=1,
           num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=E, num_experts_per_tok=K,
           mlp_only_layers=[], decoder_sparse_step=1, tie_word_embeddings=False)
# (writer format, options): int4 symmetric, asymmetric (GPTQ channel-wise: groups of 256 in gate / up, of 80 in down;
# AWQ), NVFP4 (compressed-tensors, ModelOpt)
FORMATS = {"int4-sym": ("gptq", dict(group_size=16)), "int4-asym": ("gptq", dict(group_size=-1, sym=False)),
           "awq": ("awq", dict(group_size=16)), "nvfp4": ("modelopt-nvfp4", {}), "ct-nvfp4": ("ct-nvfp4", {}),
           "act-order": ("gptq", dict(group_size=16, desc_act=True))}


# the per-expert forward's bf16 calls can take AMX tiles (docs/cpu-kernels.md, "M crossovers"), which the one call
# does not use
AMX = {"amx_bf16", "amx_tile"} <= _ext.cpu_flags() and os.environ.get("HF_W4_AMX") != "0"


def make_model(seed=0):
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CFG)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else 0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    cache = {}

    def get(key, **extra):
        k = (key, repr(sorted(extra.items())))
        if k not in cache:
            fmt, opts = FORMATS[key]
            out = tmp_path_factory.mktemp(key)
            cache[k] = writers.write_checkpoint(make_model(), str(out / "ckpt"), fmt, **opts, **extra)
        return cache[k]
    return get


def experts_of(model) -> moe.UnfusedExperts:
    ex = model.model.layers[0].mlp.experts
    assert isinstance(ex, moe.UnfusedExperts)
    return ex


def routing(t, seed=0, masked=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(t, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    if masked:   # slots >= E (expert parallelism masks them so) add nothing
        idx[::2, 0] = E
        idx[1::3, 1] = E + 5
    w = torch.softmax(torch.randn(t, K, generator=g), -1)
    return h, idx, w


@pytest.fixture
def calls(monkeypatch):
    """The number of one-call forwards run."""
    n = [0]
    orig = moe_stack.StackedExperts.__call__

    def counted(self, *a):
        n[0] += 1
        return orig(self, *a)
    monkeypatch.setattr(moe_stack.StackedExperts, "__call__", counted)
    return n


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------------------
# the one call equals the per-expert forward, bit for bit


@pytest.mark.parametrize("key", ["int4-sym", "int4-asym", "awq", "nvfp4", "ct-nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
def test_one_call_equals_per_expert(written, calls, threads, key, dtype):
    model = AutoModelForCausalLM.from_pretrained(written(key).path, dtype=dtype)
    ex = experts_of(model)
    assert ex.one_call() is not None and ex.one_call_problem == "", ex.one_call_problem
    n = 0
    for nt in (1, 2):
        threads(nt)
        for t, masked in ((1, False), (2, False), (5, True), (moe_stack.MAX_TOKENS, False)):
            for wdt in {dtype, torch.float32}:   # routing weights in x's dtype (Qwen3) or fp32
                h, idx, w = routing(t, seed=t + nt, masked=masked)
                h, w = h.to(dtype), w.to(wdt)
                with torch.no_grad():
                    got = ex(h, idx, w)
                    want = ex.per_expert(h, idx, w)
                n += 1
                assert calls[0] == n, "the layer did not take the one call"
                if dtype == torch.bfloat16 and AMX:
                    # here an expert's rows take AMX tiles in the per-expert forward from a few rows, the int16
                    # kernel in the one call: each within the bf16 budget, not the same bits
                    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    assert got.dtype == dtype and rel < 1e-2, f"{key} T={t} threads={nt}: {rel:.3g}"
                    continue
                assert got.dtype == dtype and torch.equal(got, want), (
                    f"{key} {dtype} T={t} threads={nt} weights {wdt}: one call differs from the per-expert forward "
                    f"by {(got.float() - want.float()).abs().max().item():.3g}")
    # and the per-expert forward is the dense twin's within the format's budget (the one call is no new numerics)
    twin = written(key).dense_model().float().eval()
    h, idx, w = routing(4, seed=9)
    with torch.no_grad():
        got = ex(h.to(dtype), idx, w.to(dtype)).float()
        want = twin.model.layers[0].mlp.experts(h, idx, w)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= (1e-5 if dtype == torch.float32 else 3e-2), f"{key} {dtype}: off the dense twin by {rel:.2e}"


@pytest.mark.parametrize("isa", [i for i in ("generic", "avx2") if w4a16_isa_available(i)])
@pytest.mark.parametrize("key", ["int4-sym", "int4-asym", "nvfp4"])
def test_one_call_equals_per_expert_on_every_isa(written, calls, threads, monkeypatch, isa, key):
    # HF_W4_ISA (read by every call) takes both forwards to the same ISA level
    monkeypatch.setenv("HF_W4_ISA", isa)
    threads(2)
    for dtype in (torch.bfloat16, torch.float32):
        ex = experts_of(AutoModelForCausalLM.from_pretrained(written(key).path, dtype=dtype))
        for t in (1, 3):
            h, idx, w = routing(t, seed=t, masked=t > 1)
            with torch.no_grad():
                got = ex(h.to(dtype), idx, w.to(dtype))
                want = ex.per_expert(h.to(dtype), idx, w.to(dtype))
            assert torch.equal(got, want), f"{isa} {key} {dtype} T={t}: one call differs from the per-expert forward"
    assert calls[0] == 4


def test_decode_through_generate_takes_one_call_per_layer_and_step(written, calls):
    model = AutoModelForCausalLM.from_pretrained(written("int4-sym").path, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 11)
    assert calls[0] == 6   # the prompt (5 tokens) and 5 decode steps, one layer
    # the same tokens as the per-expert forward
    with torch.no_grad():
        per = experts_of(model)
        per.forward = per.per_expert
        again = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out, again)


def test_many_tokens_and_gradients_take_the_per_expert_forward(written, calls):
    model = AutoModelForCausalLM.from_pretrained(written("int4-sym").path, dtype=torch.float32)
    ex = experts_of(model)
    h, idx, w = routing(moe_stack.MAX_TOKENS + 1)
    with torch.no_grad():
        ex(h, idx, w)
    assert calls[0] == 0
    for t in (1, 2):
        h, idx, w = routing(t)
        h.requires_grad_(True)
        w.requires_grad_(True)
        ex(h, idx, w).pow(2).sum().backward()   # the per-expert ops have backwards, the one call has none
        assert calls[0] == 0 and h.grad.abs().sum() > 0 and w.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------------------
# the stacked buffers: held once, checkpoint unchanged


def test_experts_hold_views_of_the_stack_and_save_back_bit_exact(written, tmp_path):
    res = written("int4-asym")
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16)
    ex = experts_of(model)
    st = ex.one_call()
    gate, up, down = ex.names
    for e in range(E):
        for j, name in enumerate(ex.names):
            m = getattr(ex[e], name)
            for b, s in zip(moe_stack.BUFFERS, st.gate_up if j < 2 else st.down):
                view = s[e, j] if j < 2 else s[e]
                assert m._buffers[b].data_ptr() == view.data_ptr(), f"expert {e} {name}.{b} is not a view"
    storages = {m._buffers[b].untyped_storage().data_ptr() for m in ex.modules() if isinstance(m, QuantLinear)
                for b in moe_stack.BUFFERS}
    assert storages == {t.untyped_storage().data_ptr() for t in st.gate_up + st.down}, "a per-expert copy is left"
    assert all("qweight" not in m._buffers for m in ex.modules() if isinstance(m, QuantLinear))   # codes held once
    model.save_pretrained(tmp_path / "re")
    assert_same_checkpoint(res.path, tmp_path / "re")


# ------------------------------------------------------------------------------------------------------------
# where one call cannot stand in for the modules: the per-expert forward, and why


def _falls_back(ex, calls, match, dtype=torch.float32):
    """The layer runs per expert, for the reason ``match`` says; its output for one token."""
    assert ex.one_call() is None and match in ex.one_call_problem, ex.one_call_problem
    h, idx, w = routing(1)
    before = calls[0]
    with torch.no_grad():
        got = ex(h.to(dtype), idx, w.to(dtype))
    assert calls[0] == before, "the layer took the one call"
    return got


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
def test_act_order_and_other_kernel_fall_back(written, calls):
    model = AutoModelForCausalLM.from_pretrained(written("act-order").path, dtype=torch.float32)
    _falls_back(experts_of(model), calls, "act-order permutation")
    from hf_w4 import GPTQConfig
    model = AutoModelForCausalLM.from_pretrained(written("int4-sym").path, dtype=torch.float32,
                                                 quantization_config=GPTQConfig(kernel="torch_reference"))
    _falls_back(experts_of(model), calls, "runs the torch_reference kernel")


def test_dense_expert_falls_back(written, calls):
    res = written("int4-sym", ignore=["re:.*experts\\.3\\.up_proj$"])
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    _falls_back(experts_of(model), calls, "experts.3.up_proj is a Linear")


def test_other_activation_falls_back(written, calls):
    model = AutoModelForCausalLM.from_pretrained(written("int4-sym").path, dtype=torch.float32)
    ex = experts_of(model)
    h, idx, w = routing(2)
    with torch.no_grad():
        silu = ex(h, idx, w)
        ex.act_fn = nn.GELU()
        got = _falls_back(ex, calls, "activation is GELU")
        want = ex.per_expert(*routing(1))
        assert torch.equal(ex(h, idx, w), ex.per_expert(h, idx, w)) and not torch.equal(ex(h, idx, w), silu)
    assert torch.equal(got, want)


def test_changes_after_loading_are_seen(written, calls):
    """A kernel re-selected on one expert, a hook, a swapped projection: the layer checks again (the stale stack is
    never run), and takes the one call again, without copying, once the experts can."""
    model = AutoModelForCausalLM.from_pretrained(written("nvfp4").path, dtype=torch.bfloat16)
    ex = experts_of(model)
    st = ex.one_call()
    h, idx, w = routing(1)
    h, w = h.bfloat16(), w.bfloat16()
    with torch.no_grad():
        want = ex(h, idx, w)
    q = ex[5].down_proj
    q.select_kernel(torch.bfloat16, force="torch_reference")
    _falls_back(ex, calls, "experts.5.down_proj runs the torch_reference kernel", torch.bfloat16)
    q.select_kernel(torch.bfloat16)   # its own buffers again: stacked anew
    st2 = ex.one_call()
    assert st2 is not None and st2 is not st
    with torch.no_grad():
        assert torch.equal(ex(h, idx, w), want)
    assert calls[0] == 2

    seen = []
    handle = ex[2].gate_proj.register_forward_hook(lambda m, a, o: seen.append(1))
    _falls_back(ex, calls, "has forward hooks", torch.bfloat16)
    assert seen
    handle.remove()
    q = ex[1].up_proj
    ex[1].up_proj = nn.Identity()
    assert ex.one_call() is None and "experts.1.up_proj is a Identity" in ex.one_call_problem
    ex[1].up_proj = q
    st3 = ex.one_call()   # the experts still hold views of the same tensors: nothing moved
    assert [t.data_ptr() for t in st3.gate_up + st3.down] == [t.data_ptr() for t in st2.gate_up + st2.down]
    with torch.no_grad():
        assert torch.equal(ex(h, idx, w), want)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_wrapped_experts_fall_back(written, calls):
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(written("int4-sym").path, dtype=torch.float32)
    ex = experts_of(model)
    h, idx, w = routing(1)
    with torch.no_grad():
        base = ex(h, idx, w)
    assert calls[0] == 1
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False))
    ex = experts_of(pm.base_model.model)
    assert ex.one_call() is None and "not an hf_w4 QuantLinear" in ex.one_call_problem
    with torch.no_grad():
        adapted = ex(h, idx, w)
        with pm.disable_adapter():
            assert torch.equal(ex(h, idx, w), base)
    assert calls[0] == 1 and not torch.equal(adapted, base)


def test_offloaded_experts_fall_back(written, calls, tmp_path):
    res = written("int4-sym")
    want = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    h, idx, w = routing(1)
    with torch.no_grad():
        want = experts_of(want)(h, idx, w)
    dm = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
          "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32, device_map=dm,
                                                 offload_folder=str(tmp_path / "off"))
    ex = experts_of(model)
    assert ex.one_call() is None and "is offloaded" in ex.one_call_problem, ex.one_call_problem
    with torch.no_grad():
        assert torch.equal(model.model.layers[0].mlp.experts(h, idx, w), want)
    assert calls[0] == 1   # the in-memory model's


# ------------------------------------------------------------------------------------------------------------
# the op's argument checks


def test_op_rejects_bad_input(written):
    model = AutoModelForCausalLM.from_pretrained(written("int4-asym").path, dtype=torch.bfloat16)
    st = experts_of(model).one_call()
    h, idx, w = routing(2)
    h, w = h.bfloat16(), w.bfloat16()
    args = lambda **kw: dict(dict(x=h, expert_ids=idx, expert_weights=w, gate_up_qpack=st.gate_up[0],  # noqa: E731
                                  gate_up_scales=st.gate_up[1], gate_up_zs=st.gate_up[2], down_qpack=st.down[0],
                                  down_scales=st.down[1], down_zs=st.down[2], global_scales=st.global_scales,
                                  intermediate=I, gate_up_group_size=H, down_group_size=I, weight_type="int4"), **kw)
    op = torch.ops.hf_w4.cpu_w4a16_moe
    assert torch.equal(op(**args()), experts_of(model).per_expert(h, idx, w))
    bad = idx.clone()
    bad[1, 2] = -1
    cases = [
        (dict(expert_ids=bad), r"expert_ids\[1, 2\] = -1 is negative"),
        (dict(expert_ids=idx.float()), "expert_ids must be an integer tensor"),
        (dict(expert_weights=w[:, :2]), "expert_weights must be float32 / bfloat16 / float16 shaped like"),
        (dict(x=h[:, :128], gate_up_group_size=128), "gate_up_qpack must be contiguous uint8"),
        (dict(intermediate=64), "gate_up_qpack must be contiguous uint8"),
        (dict(gate_up_group_size=64), "gate_up_scales must be contiguous"),
        (dict(down_group_size=36), "down: the group size must be even and divide K"),
        (dict(down_zs=st.down[2][:, :1]), "down_zs must be empty"),
        (dict(weight_type="nvfp4"), "gate_up_scales must be contiguous Byte"),
        (dict(weight_type="int8"), "weight_type must be 'int4' or 'nvfp4'"),
        (dict(act="gelu"), "act must be 'silu'"),
        (dict(global_scales=st.global_scales[:, :2]), "global_scales must be contiguous float32"),
        (dict(x=h.double()), "x must be float32, bfloat16 or float16"),
    ]
    for kw, match in cases:
        with pytest.raises(RuntimeError, match=match):
            op(**args(**kw))
    assert op(**args(x=h[:0], expert_ids=idx[:0], expert_weights=w[:0])).shape == (0, H)


def test_opcheck(written):
    """Schema, fake implementation (torch.compile) and dispatch of the op."""
    model = AutoModelForCausalLM.from_pretrained(written("nvfp4").path, dtype=torch.bfloat16)
    st = experts_of(model).one_call()
    h, idx, w = routing(3, masked=True)
    torch.library.opcheck(torch.ops.hf_w4.cpu_w4a16_moe,
                          (h.bfloat16(), idx, w.bfloat16(), *st.gate_up, *st.down, st.global_scales, I, 16, 16,
                           "nvfp4", "silu", ""))


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
def test_kernel_report_says_how_the_experts_run(written):
    import hf_w4
    rep = hf_w4.kernel_report(AutoModelForCausalLM.from_pretrained(written("int4-sym").path, dtype=torch.bfloat16))
    want = (f"model.layers.0.mlp.experts: MoE experts: the routed experts of up to {moe_stack.MAX_TOKENS} tokens in one "
            "cpu_w4a16_moe call")
    assert want in rep, rep
    rep = hf_w4.kernel_report(AutoModelForCausalLM.from_pretrained(written("act-order").path, dtype=torch.bfloat16))
    assert ("model.layers.0.mlp.experts: MoE experts: one projection at a time (model.layers.0.mlp.experts.0.gate_proj "
            "has an act-order permutation)") in rep, rep


def test_whole_model_benchmark_time_split_keeps_the_one_call(written, calls):
    # the benchmark's split hooks the experts module as a whole, never its projections (a hooked projection would
    # send the layer to the per-expert forward)
    from hf_w4.tools.bench.model import _time_split
    model = AutoModelForCausalLM.from_pretrained(written("int4-sym").path, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        linear, rest = _time_split(model, ids, 6)
    assert calls[0] == 6 and linear > 0 and rest > 0
