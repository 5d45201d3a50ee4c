"""Bit layouts against the facts in formats.md (golden words), and pack/unpack round trips."""
import pytest
import torch

from hf_w4 import layouts
from hf_w4.formats.spec import W4Spec


def u32(x: int) -> int:
    return x - 2**32 if x >= 2**31 else x


def test_sequential_nibbles_low_first():
    # CT weight_packed / GPTQ qweight: slot i = element i, slot 0 is the low nibble
    w = layouts.pack_nibbles(torch.arange(1, 9).reshape(1, 8), dim=1)
    assert w.dtype == torch.int32 and w.item() == u32(0x87654321)


def test_awq_order():
    # slot i of an AWQ word holds column 8c + [0,2,4,6,1,3,5,7][i]
    w = layouts.pack_nibbles(torch.arange(8).reshape(1, 8), dim=1, slots=layouts.AWQ_SLOTS)
    assert w.item() == u32(0x75316420)
    back = layouts.unpack_nibbles(w, 1, layouts.AWQ_SLOTS)
    assert back.tolist() == [list(range(8))]


@pytest.mark.parametrize("slots", [layouts.SEQ_SLOTS, layouts.AWQ_SLOTS])
@pytest.mark.parametrize("dim", [0, 1])
def test_round_trip(slots, dim):
    v = torch.randint(0, 16, (16, 24) if dim == 0 else (24, 16))
    assert torch.equal(layouts.unpack_nibbles(layouts.pack_nibbles(v, dim, slots), dim, slots).long(), v)


def test_gptq_v1_symmetric_zero_word():
    spec = W4Spec("gptq", "gptq", "int4", 4, 128, True, zero_plus_one=True)
    t = layouts.pack(spec, torch.randint(0, 16, (16, 128)), torch.rand(16, 1))
    assert (t["qzeros"] == u32(0x77777777)).all()          # stored zero-1 = 7, true zero 8
    qw = layouts.to_qweight(spec, t, 16, 128)
    assert qw.zeros is None   # every zero point 8: symmetric (the kernels' symmetric path, no zero * scale tensor)
    t["qzeros"][0, 0] = u32(0x77777776)
    assert layouts.to_qweight(spec, t, 16, 128).zeros[0, 0] == 7


def test_awq_symmetric_zero_word():
    spec = W4Spec("awq", "awq", "int4", 4, 128, True)
    t = layouts.pack(spec, torch.randint(0, 16, (16, 128)), torch.rand(16, 1))
    assert (t["qzeros"] == u32(0x88888888)).all()


def test_gptq_v1_zero_of_zero_borrows_from_the_next_slot():
    # GPTQModel stores v1 zeros as the true zeros' int32 word minus 0x11111111: a zero of 0 becomes nibble 15 and
    # the next slot one lower; read per nibble, that group would get zero 16 and its neighbour one too low
    spec = W4Spec("gptq", "gptq", "int4", 4, 16, False, zero_plus_one=True)
    z = torch.tensor([[0, 5, 0, 0, 9, 15, 1, 0]]).t()          # N = 8 columns, one group
    t = layouts.pack(spec, torch.randint(0, 16, (8, 16)), torch.rand(8, 1) + 0.5, z)
    assert t["qzeros"].item() == u32((0x01F9_0050 - 0x11111111) & 0xFFFFFFFF)
    assert torch.equal(layouts.to_qweight(spec, t, 8, 16).zeros, z.float())


def test_gptq_dequant_formula_v1_and_v2():
    n, k = 8, 16
    codes = torch.randint(0, 16, (n, k))
    s = torch.rand(n, 1) + 0.5
    z = torch.randint(1, 15, (n, 1))
    for v1 in (True, False):
        spec = W4Spec("gptq", "gptq", "int4", 4, 16, False, zero_plus_one=v1)
        t = layouts.pack(spec, codes, s, z)
        stored = layouts.unpack_nibbles(t["qzeros"], 1).long().t()
        assert torch.equal(stored, z - 1 if v1 else z)
        w = layouts.dequantize(layouts.to_qweight(spec, t, n, k))
        assert torch.equal(w, (codes - z).float() * s.half().float())


def test_ct_pack_offset_binary_and_zero_points():
    n, k = 8, 16
    spec = W4Spec("compressed-tensors", "ct_pack", "int4", 4, 8, False)
    codes = torch.randint(0, 16, (n, k))            # stored u = q + 8
    zeros = torch.randint(0, 16, (n, 2))            # stored uz = zp + 8
    s = torch.rand(n, 2)
    t = layouts.pack(spec, codes, s, zeros)
    assert t["weight_zero_point"].shape == (1, 2)   # packed along N
    assert t["weight_shape"].tolist() == [n, k]
    w = layouts.dequantize(layouts.to_qweight(spec, t, n, k))
    gi = torch.arange(k) // 8
    assert torch.equal(w, (codes - zeros[:, gi]).float() * s.bfloat16().float()[:, gi])


def test_nvfp4_low_nibble_is_even_column_and_values():
    spec = W4Spec("modelopt", "modelopt_nvfp4", "nvfp4", 4, 16, True)
    codes = torch.zeros(1, 16, dtype=torch.long)
    codes[0, 0], codes[0, 1] = 0x3, 0xA               # 1.5 and -1.0
    t = layouts.pack(spec, codes, torch.ones(1, 1, dtype=torch.float8_e4m3fn), global_scale=2.0)
    assert t["weight"][0, 0].item() == 0xA3
    assert t["weight_scale_2"].shape == ()
    w = layouts.dequantize(layouts.to_qweight(spec, t, 1, 16))
    assert w[0, 0].item() == 3.0 and w[0, 1].item() == -2.0


def test_ct_nvfp4_global_scale_divides():
    spec = W4Spec("compressed-tensors", "ct_nvfp4", "nvfp4", 4, 16, True)
    codes = torch.full((1, 16), 7)                    # 6.0
    t = layouts.pack(spec, codes, torch.full((1, 1), 448.0).to(torch.float8_e4m3fn), global_scale=7488.0)
    w = layouts.dequantize(layouts.to_qweight(spec, t, 1, 16))
    torch.testing.assert_close(w, torch.full((1, 16), 6.0 * 448 / 7488), rtol=1e-6, atol=0)


def test_e2m1_encode_decode():
    vals = torch.tensor(layouts.E2M1_VALUES)
    assert torch.equal(layouts.e2m1_decode(layouts.e2m1_encode(vals)), vals)
    # ties go to the even code: 0.25 -> 0, 0.75 -> 1.0 (code 2), 2.5 -> 2.0 (code 4), 5 -> 4.0 (code 6)
    assert layouts.e2m1_decode(layouts.e2m1_encode(torch.tensor([0.25, 0.75, 2.5, 5.0, -5.0, 7.0]))).tolist() == \
        [0.0, 1.0, 2.0, 4.0, -4.0, 6.0]


def test_act_order_perm():
    g = torch.tensor([1, 0, 1, 0])
    perm = layouts.act_order_perm(g, 2)
    assert perm.tolist() == [1, 3, 0, 2]
    assert layouts.act_order_perm(torch.tensor([0, 0, 1, 1]), 2) is None
    with pytest.raises(NotImplementedError, match="unequal"):
        layouts.act_order_perm(torch.tensor([0, 0, 0, 1]), 2)


def test_declare_rejects_group_not_dividing_k():
    spec = W4Spec("awq", "awq", "int4", 4, 128, True)
    with pytest.raises(layouts.LayoutError, match="K=576 is not divisible by group_size=128"):
        layouts.declare(spec, 192, 576, "model.layers.0.self_attn.k_proj")


def test_other_bits_not_implemented():
    spec = W4Spec("gptq", "gptq", "int4", 3, 128, True)
    with pytest.raises(NotImplementedError, match=r"supported bits: \[4\]"):
        layouts.declare(spec, 64, 128, "m")


def test_non_finite_scales_rejected():
    spec = W4Spec("awq", "awq", "int4", 4, 16, True)
    s = torch.rand(8, 1)
    s[3, 0] = float("nan")
    t = layouts.pack(spec, torch.randint(0, 16, (8, 16)), s)
    with pytest.raises(layouts.LayoutError, match=r"layer\.scales: 1 non-finite"):
        layouts.to_qweight(spec, t, 8, 16, "layer")
