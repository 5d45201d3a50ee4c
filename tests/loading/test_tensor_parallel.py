"""Tensor parallelism: ``from_pretrained(..., tp_plan="auto")`` under ``torchrun --nproc-per-node 2`` (gloo, CPU)
splits every quantized layer of a tiny Llama between the ranks, in every layout, and gives the one-process logits.

Column-parallel layers (q/k/v, gate/up, a quantized lm_head) split N, row-parallel ones (o_proj, down_proj) split K;
each rank reads, repacks and holds only its slice, and transformers all-reduces the row-parallel outputs.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import hf_w4
from hf_w4.formats.spec import W4Spec
from hf_w4.loading import tensor_parallel
from hf_w4.tools import writers

from conftest import make_tiny_llama, rel_err

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("tp_worker.py")
INPUT_IDS = torch.arange(16).reshape(2, 8) * 7 % 500   # the worker's batch

def _tiny_qwen3_moe():
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, head_dim=64, mlp_only_layers=[])
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).eval()


# name: (format, writer options, model options (None: the tiny Qwen3-MoE), loading config)
CASES = {
    "gptq-bias": ("gptq", dict(group_size=32), dict(attention_bias=True, mlp_bias=True), None),
    "awq": ("awq", dict(group_size=32), {}, None),
    "ct-w4a16-asym-lm-head": ("ct-w4a16", dict(group_size=32, sym=False, quantize_lm_head=True), {}, None),
    "ct-w8a8-weight-only": ("ct-w8a8", {}, {}, ("CompressedTensorsConfig", {"activation": "none"})),
    "ct-w4a8-group": ("ct-w4a8", dict(group_size=32), {}, ("CompressedTensorsConfig", {"activation": "int8_group"})),
    "ct-nvfp4": ("ct-nvfp4", {}, {}, None),
    "modelopt-nvfp4": ("modelopt-nvfp4", {}, {}, None),
    # quantized experts run whole on every rank (their moe_tp_experts entry goes), the attention is split
    "qwen3-moe-gptq": ("gptq", dict(group_size=32), None, None),
    # refused: act-order GPTQ cannot split K; per-token int8 activations over a slice of K change the numbers
    "gptq-act-order": ("gptq", dict(group_size=32, desc_act=True), {}, None),
    "ct-w8a8-per-token": ("ct-w8a8", {}, {}, None),
}
INT8_ACTIVATIONS = {"ct-w4a8-group"}
REFUSED = {"gptq-act-order": "act-order", "ct-w8a8-per-token": "activation='none'"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _load(path, config):
    kw = {"quantization_config": getattr(hf_w4, config[0])(**config[1])} if config else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """{case: (one-process result, [rank 0, rank 1] results)} from one torchrun of the worker over every case."""
    d = tmp_path_factory.mktemp("tp")
    cases, single = [], {}
    hf_w4.install()
    try:
        for name, (fmt, wopts, mopts, config) in CASES.items():
            path = d / name
            model = _tiny_qwen3_moe() if mopts is None else make_tiny_llama(**mopts)
            writers.write_checkpoint(model, str(path), fmt, **wopts)
            cases.append({"name": name, "path": str(path),
                          "config": config and {"class": config[0], "kwargs": config[1]}})
            if name in REFUSED:
                continue
            model = _load(path, config)
            with torch.no_grad():
                logits = model(INPUT_IDS).logits
            layers = [m for m in model.modules() if isinstance(m, hf_w4.QuantLinear)]
            single[name] = {"logits": logits, "bytes": sum(m.packed_bytes() for m in layers),
                            "layers": sorted(m.name for m in layers),
                            "expert_bytes": sum(m.packed_bytes() for m in layers if ".experts." in m.name)}
    finally:
        hf_w4.uninstall()
    (d / "cases.json").write_text(json.dumps(cases))
    out = d / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), str(WORKER), str(d / "cases.json"), str(out)]
    p = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-6000:]}"
    return {name: (single.get(name), [torch.load(out / f"{name}.{r}.pt") for r in (0, 1)]) for name in CASES}


@pytest.mark.parametrize("name", [n for n in CASES if n not in REFUSED])
def test_two_ranks_give_the_one_process_logits_holding_half_each(two_ranks, name):
    one, ranks = two_ranks[name]
    for r, res in enumerate(ranks):
        assert "error" not in res, f"rank {r}: {res.get('error')}"
        assert res["layers"] == one["layers"]
        assert res["mapped"] == [], f"rank {r}: checkpoint files still mapped after loading: {res['mapped']}"
        assert res["split"] == [n for n in one["layers"] if ".experts." not in n]   # every one but the experts
        # the same numbers up to the fp32 rounding of the row-parallel sums. Activations quantized to int8 at run
        # time round that difference to whole int8 steps here and there: in one process, inputs perturbed by 1e-7
        # (relative) move this model's logits by ~1e-2 too
        tol = 3e-2 if name in INT8_ACTIVATIONS else 1e-5
        assert rel_err(res["logits"], one["logits"]) < tol, (r, rel_err(res["logits"], one["logits"]))
        # half of every split tensor, all of the few replicated ones (per-tensor scales, a row-parallel bias), all
        # of the experts
        split_bytes = res["bytes"] - one["expert_bytes"]
        assert 0.45 < split_bytes / (one["bytes"] - one["expert_bytes"]) < 0.56, (r, res["bytes"], one["bytes"])


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refusals_name_the_layer_and_why(two_ranks, name):
    for res in two_ranks[name][1]:
        err = res.get("error", "")
        assert "TensorParallelError" in err and "model.layers.0." in err and REFUSED[name] in err, err


# -- refusals, checked without processes: the checks run before any tensor is split

class _Mesh:
    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def get_local_rank(self):
        return self._rank


def _layer(spec, n, k):
    from hf_w4 import layouts
    from hf_w4.nn import QuantLinear
    decls = layouts.declare(spec, n, k, "model.layers.3.mlp.down_proj")
    with torch.device("meta"):
        return QuantLinear(spec, k, n, "model.layers.3.mlp.down_proj",
                           {t: (d.shape, d.dtypes[0]) for t, d in decls.items()})


@pytest.mark.parametrize("spec, n, k, ranks, dim, expect", [
    (W4Spec("awq", "awq", "int4", 4, 32, True), 24, 64, 2, "out", "out_features N=24 over 2 ranks: a slice of 12 is "
     "not whole packed words"),
    (W4Spec("gptq", "gptq", "int4", 4, 128, True), 64, 384, 2, "in", "in_features K=384 over 2 ranks: a slice of 192"),
    (W4Spec("gptq", "gptq", "int4", 4, 32, True), 64, 128, 3, "in", "K=128 over 3 ranks, which does not divide evenly"),
    (W4Spec("gptq", "gptq", "int4", 4, 32, True, has_g_idx=True, desc_act=True), 64, 128, 2, "in", "act-order"),
    (W4Spec("compressed-tensors", "ct_int", "int8", 8, -1, True, act="int8_token"), 64, 128, 2, "in",
     "one scale per token over all of K"),
    (W4Spec("modelopt", "modelopt_nvfp4", "nvfp4", 4, 16, True), 64, 32, 4, "in",
     "K=8 is not divisible by group_size=16"),
])
def test_layers_that_cannot_be_split_are_refused_naming_them(spec, n, k, ranks, dim, expect):
    m = _layer(spec, n, k)
    with pytest.raises(tensor_parallel.TensorParallelError) as e:
        tensor_parallel.shard_buffers(m, dim, "colwise" if dim == "out" else "rowwise", _Mesh(ranks))
    assert str(e.value).startswith("model.layers.3.mlp.down_proj: tp_plan style") and expect in str(e.value), e.value
    assert m.tp_shard is None


def test_act_order_splits_along_n():
    from torch.distributed.tensor import DTensor  # noqa: F401  (a torch with torch.distributed)
    spec = W4Spec("gptq", "gptq", "int4", 4, 32, True, has_g_idx=True, desc_act=True)
    m = _layer(spec, 64, 128)
    assert m.held_features == (64, 128)
    m.tp_shard = ("out", 1, 2)
    assert m.held_features == (32, 128)


def test_plan_entries_for_quantized_layers_take_hf_w4s_styles(hf_w4_installed, tiny_llama, tmp_path):
    writers.write_checkpoint(tiny_llama, str(tmp_path / "q"), "gptq", group_size=32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    plan = model.tp_plan
    assert plan["model.layers.*.self_attn.q_proj"] == "hf_w4_colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "hf_w4_rowwise"
    assert plan["lm_head"] == "colwise_gather_output"          # dense here: transformers' own
    # a plan override that names transformers' own style for a quantized layer is refused after loading
    model._tp_size = 2
    plan["model.layers.*.self_attn.q_proj"] = "colwise"
    with pytest.raises(tensor_parallel.TensorParallelError, match=r"model\.layers\.0\.self_attn\.q_proj: tp_plan "
                       r"style 'colwise' \(ColwiseParallel\).*hf_w4_colwise"):
        tensor_parallel.check_model(model)


def test_quantized_experts_stay_whole(hf_w4_installed, tmp_path):
    writers.write_checkpoint(_tiny_qwen3_moe(), str(tmp_path / "q"), "gptq", group_size=32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    plan = model.tp_plan
    assert not [k for k in plan if ".experts" in k]                 # the experts' entries went
    assert plan["model.layers.*.self_attn.o_proj"] == "hf_w4_rowwise"
    model._tp_size = 2
    tensor_parallel.check_model(model)
    plan["model.layers.*.mlp.experts"] = "moe_tp_experts"           # put back by an override: refused
    with pytest.raises(tensor_parallel.TensorParallelError, match=r"model\.layers\.0\.mlp\.experts\.0\.\w+_proj: "
                       r"tp_plan style 'moe_tp_experts' on model\.layers\.0\.mlp\.experts"):
        tensor_parallel.check_model(model)


def test_a_rank_refuses_to_save_or_dequantize_its_slices(hf_w4_installed, tiny_llama, tmp_path):
    writers.write_checkpoint(tiny_llama, str(tmp_path / "q"), "awq", group_size=32)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    model.model.layers[1].mlp.up_proj.tp_shard = ("out", 0, 2)     # as a rank's layer is after loading
    with pytest.raises(NotImplementedError, match=r"model\.layers\.1\.mlp\.up_proj: this rank holds only its "
                       r"tensor-parallel slice"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved" / "model.safetensors").exists()
    with pytest.raises(NotImplementedError, match=r"model\.layers\.1\.mlp\.up_proj: dequantizing a tensor-parallel"):
        model.dequantize()
    assert isinstance(model.model.layers[0].self_attn.q_proj, hf_w4.QuantLinear)   # nothing was changed


def test_uninstall_removes_the_styles():
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    hf_w4.install()
    assert isinstance(ALL_PARALLEL_STYLES["hf_w4_rowwise"], tensor_parallel.QuantRowwise)
    hf_w4.uninstall()
    assert not [s for s in ALL_PARALLEL_STYLES if s.startswith("hf_w4_")]
