"""device_map offload: part of a quantized model in memory, part on disk, through transformers' and accelerate's own
route (``device_map`` with ``"disk"`` entries, or ``"auto"`` with a ``max_memory``, and ``offload_folder``).

An offloaded QuantLinear holds nothing between forwards: its packed tensors stay in the checkpoint's safetensors,
come in with their on-disk dtypes when the layer runs, are repacked for the kernel and let go. The logits are those
of the model loaded all in memory, bit for bit, and ``save_pretrained`` writes the checkpoint back bit-exact.
"""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import assert_same_checkpoint, tokens
from hf_w4 import layouts
from hf_w4.nn import QuantLinear

pytestmark = pytest.mark.usefixtures("hf_w4_installed")

# every format family: GPTQ (with act-order), AWQ, auto-round, compressed-tensors W4A16 sym / asym, NVFP4 (CT and
# ModelOpt), W8A8 (int8 activations)
VARIANTS = [
    ("gptq", dict(sym=True)),
    ("gptq", dict(sym=False, desc_act=True)),
    ("awq", dict(sym=False)),
    ("autoround", dict(sym=True)),
    ("ct-w4a16", dict(sym=True)),
    ("ct-w4a16", dict(sym=False, group_size=32)),
    ("ct-nvfp4", dict()),
    ("modelopt-nvfp4", dict()),
    ("ct-w8a8", dict()),
]
IDS = [f + "".join(f"-{k}={v}" for k, v in o.items()) for f, o in VARIANTS]

# layer 1 and the head on disk, the rest in memory
DISK_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
            "model.rotary_emb": "cpu", "lm_head": "disk"}


def _logits(model):
    with torch.no_grad():
        return model(tokens(5)).logits


def _offloaded(model):
    return [m for m in model.modules() if isinstance(m, QuantLinear) and m._offload_source is not None]


def _holds_nothing(m: QuantLinear) -> bool:
    """No packed tensor and no kernel copy in memory: only meta placeholders."""
    return all(b is None or b.is_meta for b in m._buffers.values()) and not m._non_persistent_buffers_set


@pytest.mark.parametrize("fmt,opts", VARIANTS, ids=IDS)
def test_offloaded_logits_equal_in_memory(written, tmp_path, fmt, opts):
    res = written(fmt, opts)
    ref = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32)
    want = _logits(ref)
    # an explicit map with "disk" entries
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32, device_map=DISK_MAP,
                                                 offload_folder=str(tmp_path / "a"))
    off = _offloaded(model)
    assert off and {m.name for m in off} >= {f"model.layers.1.{p}" for p in ("self_attn.q_proj", "mlp.down_proj")}
    assert all(_holds_nothing(m) for m in off)
    kernels = {m.name: str(m.kernel) for m in ref.modules() if isinstance(m, QuantLinear)}
    assert {m.name: str(m.kernel) for m in model.modules() if isinstance(m, QuantLinear)} == kernels
    assert torch.equal(_logits(model), want)
    assert all(_holds_nothing(m) for m in off), "the packed tensors or the kernel's copy stayed after the forward"
    # "auto" with a max_memory that leaves room for part of the model only
    budget = int(0.85 * ref.get_memory_footprint())
    auto = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32, device_map="auto",
                                                max_memory={"cpu": budget}, offload_folder=str(tmp_path / "b"))
    assert {"cpu", "disk"} <= set(auto.hf_device_map.values()), auto.hf_device_map
    assert _offloaded(auto)
    assert torch.equal(_logits(auto), want)


@pytest.mark.parametrize("fmt,opts", [VARIANTS[i] for i in (1, 2, 5, 7, 8)], ids=[IDS[i] for i in (1, 2, 5, 7, 8)])
def test_save_pretrained_of_offloaded_model_is_bit_exact(written, tmp_path, fmt, opts):
    res = written(fmt, opts)
    # dtype as on disk (bf16), so the dense tensors round-trip too
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.bfloat16, device_map=DISK_MAP,
                                                 offload_folder=str(tmp_path / "off"))
    _logits(model)   # a forward first: bringing layers in must leave nothing changed behind
    with pytest.warns(UserWarning, match="offloaded modules"):
        model.save_pretrained(tmp_path / "re")
    assert_same_checkpoint(res.path, tmp_path / "re")


def test_everything_on_disk(written, tmp_path):
    res = written("gptq", dict(sym=True))
    want = _logits(AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32))
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32, device_map={"": "disk"},
                                                 offload_folder=str(tmp_path))
    assert len(_offloaded(model)) == 14   # 7 projections x 2 layers (lm_head stays dense in this checkpoint)
    assert torch.equal(_logits(model), want)


def test_offloaded_tensors_come_in_as_stored(written, tmp_path):
    """What the layer reads from accelerate's weights map must be the stored tensor: a cast (or dequantized) one is
    an error naming the tensor, never a silent conversion."""
    res = written("gptq", dict(sym=True))
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32, device_map=DISK_MAP,
                                                 offload_folder=str(tmp_path))
    m = model.get_submodule("model.layers.1.self_attn.q_proj")
    seen = {}

    class Spy(dict):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __getitem__(self, k):
            seen[k] = self.inner[k]
            return seen[k]

    m._offload_source = Spy(m._offload_source)
    _logits(model)
    disk = load_file(f"{res.path}/model.safetensors")
    assert set(seen) == set(m.tensor_names)
    for t, v in seen.items():
        assert v.dtype == disk[f"{m.name}.{t}"].dtype and torch.equal(v, disk[f"{m.name}.{t}"]), t

    class Casting(Spy):
        def __getitem__(self, k):
            return self.inner[k].float()

    m._offload_source = Casting(m._offload_source.inner)
    with pytest.raises(layouts.LayoutError, match=r"q_proj\.qweight: the offloaded tensor came back as "
                                                  r".* torch.float32, expected .* torch.int32"):
        _logits(model)


def test_missing_offloaded_tensor_is_named(written, tmp_path):
    res = written("awq", dict(sym=False))
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32, device_map=DISK_MAP,
                                                 offload_folder=str(tmp_path))
    m = model.get_submodule("model.layers.1.mlp.up_proj")
    m._offload_source = {}
    with pytest.raises(layouts.LayoutError, match=r"mlp\.up_proj\.qweight: offloaded, but not in the offloaded"):
        _logits(model)


def test_offload_buffers_too(written, tmp_path):
    """With offload_buffers=True accelerate's hook also brings the layer's tensors in (they are buffers); the layer
    still reads its own and leaves nothing behind."""
    res = written("ct-w4a16", dict(sym=False, group_size=32))
    want = _logits(AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32))
    model = AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32, device_map=DISK_MAP,
                                                 offload_folder=str(tmp_path), offload_buffers=True)
    off = _offloaded(model)
    assert off and all(_holds_nothing(m) for m in off)
    assert torch.equal(_logits(model), want)
    assert all(_holds_nothing(m) for m in off)
