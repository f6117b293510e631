"""Tests for dsv4.formats and the NVFP4 activation quantizer it encodes for
(dsv4.reference.quantize_nvfp4): hand-computed vectors first, round trips second."""

import math

import pytest
import torch

from dsv4 import formats as F
from dsv4 import reference
from dsv4.formats.nvfp4 import _quantize_nvfp4_weight_blocks


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def f32(values):
    return torch.tensor(values, dtype=torch.float32)


def codes_of(packed: torch.Tensor) -> list[int]:
    return F.unpack_fp4(packed).flatten().tolist()


def fp8_byte(scales: torch.Tensor) -> list[int]:
    return scales.view(torch.uint8).flatten().tolist()


# --------------------------------------------------------------------------------------
# e2m1 codes
# --------------------------------------------------------------------------------------


def test_e2m1_values_table():
    assert F.E2M1_VALUES == [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
    ]
    assert math.copysign(1.0, F.E2M1_VALUES[8]) == -1.0


def test_dequantize_every_code():
    # Scale 1.0 (e4m3 byte 0x38) and g = 1 decode each code to its table value.
    codes = torch.arange(16, dtype=torch.uint8)
    packed = F.pack_fp4(codes)
    scales = torch.tensor([0x38], dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = F.dequantize_nvfp4(packed, scales, 1.0)
    assert out.tolist() == F.E2M1_VALUES
    assert torch.signbit(out[8])
    # Decode = value * scale * g: scale 2.0 (0x40), g = 0.25.
    scales2 = torch.tensor([0x40], dtype=torch.uint8).view(torch.float8_e4m3fn)
    out2 = F.dequantize_nvfp4(packed, scales2, 0.25, dtype=torch.bfloat16)
    assert out2.dtype == torch.bfloat16
    assert out2.float().tolist() == [v * 0.5 for v in F.E2M1_VALUES]


def test_round_to_e2m1_grid_values_map_to_themselves():
    y = f32(F.E2M1_VALUES)
    expected = list(range(16))
    expected[8] = 0  # -0.0 is not < 0, so it gets code 0
    assert F.round_to_e2m1(y).tolist() == expected


@pytest.mark.parametrize(
    "y, code",
    [
        (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
    ],
)
def test_round_to_e2m1_ties_to_even(y, code):
    assert F.round_to_e2m1(f32([y])).tolist() == [code]
    assert F.round_to_e2m1(f32([-y])).tolist() == [code | 8]


@pytest.mark.parametrize(
    "bound, below, above",
    [(0.25, 0, 1), (0.75, 1, 2), (1.25, 2, 3), (1.75, 3, 4), (2.5, 4, 5), (3.5, 5, 6), (5.0, 6, 7)],
)
def test_round_to_e2m1_next_to_thresholds(bound, below, above):
    b = f32([bound])
    lo = torch.nextafter(b, f32([0.0]))
    hi = torch.nextafter(b, f32([10.0]))
    assert F.round_to_e2m1(lo).tolist() == [below]
    assert F.round_to_e2m1(hi).tolist() == [above]
    assert F.round_to_e2m1(-hi).tolist() == [above | 8]


def test_round_to_e2m1_saturation_sign_and_nan():
    y = f32([6.0, 6.0001, 7.0, 1e30, float("inf"), -6.5, -float("inf")])
    assert F.round_to_e2m1(y).tolist() == [7, 7, 7, 7, 7, 15, 15]
    # Sign bit is (y < 0) even when the magnitude rounds to 0; -0.0 and NaN give 0.
    y = f32([-0.1, -0.25, 0.1, -0.0, float("nan")])
    assert F.round_to_e2m1(y).tolist() == [8, 8, 0, 0, 0]


def test_round_to_e2m1_accepts_bf16_and_rejects_ints():
    y = torch.tensor([0.75, -3.5], dtype=torch.bfloat16)
    assert F.round_to_e2m1(y).tolist() == [2, 14]
    with pytest.raises(ValueError, match=r"^dsv4: round_to_e2m1: y must be a float32/.* tensor, got torch.int64"):
        F.round_to_e2m1(torch.tensor([1, 2]))


# --------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------


def test_pack_nibble_order_literal():
    packed = F.pack_fp4(torch.tensor([1, 2, 0xF, 0x0, 0x3, 0xA], dtype=torch.uint8))
    assert packed.tolist() == [0x21, 0x0F, 0xA3]
    assert F.unpack_fp4(torch.tensor([[0x21, 0xA3]], dtype=torch.uint8)).tolist() == [[1, 2, 3, 0xA]]


def test_pack_unpack_round_trip_and_errors():
    codes = torch.randint(0, 16, (3, 5, 32), dtype=torch.uint8, generator=gen(1))
    packed = F.pack_fp4(codes)
    assert packed.shape == (3, 5, 16)
    assert torch.equal(F.unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="codes"):
        F.pack_fp4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes"):
        F.pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="^dsv4: pack_fp4: codes must have dtype torch.uint8"):
        F.pack_fp4(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="^dsv4: unpack_fp4: packed must have dtype torch.uint8"):
        F.unpack_fp4(torch.zeros(4, dtype=torch.int8))
    with pytest.raises(TypeError, match="^dsv4: unpack_fp4: packed must be a torch.Tensor, got list"):
        F.unpack_fp4([1, 2])


# --------------------------------------------------------------------------------------
# quantize_nvfp4
# --------------------------------------------------------------------------------------

_BLOCK_Y = [6, -6, 0.25, 0.75, 1.25, -1.75, 2.5, 3.5, 5, -5, 0.1, -0.1, 3, 4, 1.5, 0]
_BLOCK_CODES = [7, 15, 0, 2, 2, 12, 4, 6, 6, 14, 0, 8, 5, 6, 3, 0]


@pytest.mark.parametrize("g", [1.0, 2.0, 0.125])
def test_quantize_hand_block_scale_one(g):
    # amax = 6g, G = 1/g (exact, a power of two): RN(1/6) = 1/6 * (1 + 2.98e-8), so
    # amax * RN(1/6) rounds back to g (half an ulp is 5.96e-8 relative), G * g = 1 ->
    # e4m3 byte 0x38;
    # r = 1 / (1 * (1 / G)) = 1/g exactly, so x * r = x / g: every tie below is exact.
    x = f32(_BLOCK_Y) * g
    packed, scales = reference.quantize_nvfp4(x, g)
    assert fp8_byte(scales) == [0x38]
    assert codes_of(packed) == _BLOCK_CODES
    deq = F.dequantize_nvfp4(packed, scales, g)
    assert deq.tolist() == [F.E2M1_VALUES[c] * g for c in _BLOCK_CODES]


def test_quantize_tensor_global_scale_matches_float():
    x = torch.randn(4, 64, generator=gen(2)) * 3
    a = reference.quantize_nvfp4(x, 0.37)
    b = reference.quantize_nvfp4(x, torch.tensor([0.37]))
    assert torch.equal(a[0], b[0])
    assert fp8_byte(a[1]) == fp8_byte(b[1])


def test_quantize_scale_saturates_at_448():
    # amax / 6 / g = 1000 > 448: the scale clamps to 448 (byte 0x7E) and y saturates.
    x = f32([6000, -6000, 224, 448 * 1.5, 448 * 3, 448 * 6, 448 * 7, -448 * 0.25] + [0.0] * 8)
    packed, scales = reference.quantize_nvfp4(x, 1.0)
    assert fp8_byte(scales) == [0x7E]
    assert codes_of(packed) == [7, 15, 1, 3, 5, 7, 7, 8] + [0] * 8


def test_quantize_zero_block_next_to_nonzero_block():
    x = torch.cat([torch.zeros(16), f32(_BLOCK_Y) * 4])
    packed, scales = reference.quantize_nvfp4(x, 4.0)
    assert fp8_byte(scales) == [0x00, 0x38]
    assert codes_of(packed) == [0] * 16 + _BLOCK_CODES
    assert not torch.isnan(F.dequantize_nvfp4(packed, scales, 4.0)).any()


def test_quantize_subnormal_scales():
    u = 2.0 ** -8
    # amax / 6 = 2^-8 = 2 * 2^-9: e4m3 subnormal byte 0x02; y = x / 2^-8.
    x = f32([6 * u, 3 * u, -u, 0.5 * u, 1.5 * u] + [0.0] * 11)
    packed, scales = reference.quantize_nvfp4(x, 1.0)
    assert fp8_byte(scales) == [0x02]
    assert codes_of(packed)[:5] == [7, 5, 10, 1, 3]

    # amax / 6 = 3 * 2^-10 = 1.5 * 2^-9: tie between bytes 1 and 2 -> even byte 0x02,
    # so the amax element becomes y = 18 * 2^-10 / 2^-8 = 4.5 -> 4 (code 6).
    x = f32([18 * 2.0 ** -10, -1.5 * u] + [0.0] * 14)
    packed, scales = reference.quantize_nvfp4(x, 1.0)
    assert fp8_byte(scales) == [0x02]
    assert codes_of(packed)[:2] == [6, 11]

    # Smallest subnormal 2^-9 (byte 0x01).
    x = f32([6 * 2.0 ** -9, 2.0 ** -9] + [0.0] * 14)
    packed, scales = reference.quantize_nvfp4(x, 1.0)
    assert fp8_byte(scales) == [0x01]
    assert codes_of(packed)[:2] == [7, 2]


@pytest.mark.parametrize("amax_over_6", [2.0 ** -10, 2.0 ** -11])
def test_quantize_scale_underflow_gives_zero_codes(amax_over_6):
    # 2^-10 is the tie between 0 and the smallest subnormal -> rounds to even (0).
    x = f32([6 * amax_over_6, -3 * amax_over_6] + [amax_over_6] * 14)
    packed, scales = reference.quantize_nvfp4(x, 1.0)
    assert fp8_byte(scales) == [0x00]
    assert codes_of(packed) == [0] * 16


# DESIGN section 2's ties, as (x * r, code): a block with amax = 6 and g = 1 has
# s = 1 and r = 1 exactly (see test_quantize_hand_block_scale_one), so x * r = x.
_DESIGN_TIES = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]


@pytest.mark.parametrize("tie, code", _DESIGN_TIES)
def test_quantize_design_ties(tie, code):
    # ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    x = f32([6.0, tie, -tie] + [0.0] * 13)
    packed, scales = reference.quantize_nvfp4(x, 1.0)
    assert fp8_byte(scales) == [0x38]
    assert codes_of(packed)[:3] == [7, code, code | 8]
    assert F.E2M1_VALUES[code] == {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}[tie]


def test_quantize_blackwell_rule_at_a_tie():
    # x = 1.171875 in a block with amax = 5.625, g = 2^-8, by hand:
    #   G = 1/g = 256 (exact).  RN(1/6) = 1/6 * (1 + 2.98e-8), so amax * RN(1/6) =
    #   0.9375 + 2.8e-8, which rounds to 0.9375 (half an ulp there is 2^-25 = 2.98e-8);
    #   s = e4m3(256 * 0.9375) = e4m3(240) = 240 (1.875 * 2^7, byte 0x77).
    #   rcp(G) = 2^-8 (exact), so d = 240 * 2^-8 = 0.9375 and r = RN(1 / 0.9375) =
    #   RN(16/15) = 1.0666667223 (0x3F888889) = 16/15 + 5.56e-8.
    #   x * r = 1.25 + 1.171875 * 5.56e-8 = 1.25 + 6.5e-8; half an ulp at 1.25 is
    #   2^-24 = 5.96e-8, so RN gives 1.25 + 2^-23 = 1.2500001 > 1.25: code 3 (1.5).
    # The earlier rule divides: x / (s * g) = 1.171875 / 0.9375 = 1.25 exactly, the tie
    # 1.25 -> 1.0 (code 2).  amax itself: 5.625 * r = 6.0000003 -> 6 (code 7) either way.
    x = f32([5.625, 1.171875, -1.171875] + [0.0] * 13)
    g = 2.0 ** -8
    packed, scales = reference.quantize_nvfp4(x, g)
    assert fp8_byte(scales) == [0x77]
    assert codes_of(packed)[:3] == [7, 3, 11]
    r = torch.tensor(1.0) / torch.tensor(0.9375)
    assert r.view(torch.int32).item() == 0x3F888889
    assert (f32([1.171875]) * r).item() == 1.25 + 2.0 ** -23
    old_packed, old_scales = _quantize_nvfp4_weight_blocks(x, torch.tensor(g))
    assert fp8_byte(old_scales) == [0x77] and codes_of(old_packed)[:3] == [7, 2, 10]
    assert F.dequantize_nvfp4(packed, scales, g)[1].item() == 1.5 * 0.9375  # the old rule: 1.0 * 0.9375


def test_quantize_scale_order():
    # s = e4m3(G * (amax * RN(1/6))) in that order: for this float32 amax and g the
    # other orders ((G * amax) * RN(1/6), the earlier (amax / 6) / g) round to another
    # e4m3 value, so the test tells them apart.
    g = torch.tensor(0.0123)
    one, six = torch.tensor(1.0), torch.tensor(6.0)
    amax = f32([31.881595611572266])
    G = one / g

    def byte(v):
        return v.clamp(max=448).to(torch.float8_e4m3fn).view(torch.uint8).item()

    expected = byte(G * (amax * (one / six)))
    assert expected != byte((G * amax) * (one / six))
    assert expected != byte((amax / six) / g)
    x = torch.cat([amax, torch.zeros(15)])
    _, scales = reference.quantize_nvfp4(x, g)
    assert fp8_byte(scales) == [expected]


def test_quantize_codes_follow_the_product():
    # codes = round_to_e2m1(x * r) with r = 1 / (s * (1 / G)), on random blocks of
    # every magnitude, against a direct float32 evaluation of the formula.
    x = torch.randn(256, 16, generator=gen(3)) * torch.exp(torch.randn(256, 1, generator=gen(4)) * 3)
    for gv in (0.37, 2.0 ** -8, 1e-3):
        g = torch.tensor(gv)
        packed, scales = reference.quantize_nvfp4(x, g)
        one = torch.tensor(1.0)
        sf = scales.float()[:, :1]
        r = torch.where(sf == 0, 0.0, one / (sf * (one / (one / g))))
        assert torch.equal(F.unpack_fp4(packed), F.round_to_e2m1(x * r))


def test_rcp_approx_codes():
    # The 9 candidates of a +-1 ulp rcp.approx: the exact code in the middle; the
    # tie of test_quantize_blackwell_rule_at_a_tie can go either way (x * r = 1.25 + 1 ulp
    # becomes 1.25 with r one ulp lower), a value far from any tie cannot.
    x = f32([5.625, 1.171875, 3.0, 0.4] + [0.0] * 12)
    cand = reference.nvfp4_rcp_approx_codes(x, 2.0 ** -8)
    assert cand.shape == (16, 9) and cand.dtype == torch.uint8
    assert torch.equal(cand[:, 4], F.unpack_fp4(reference.quantize_nvfp4(x, 2.0 ** -8)[0]))
    assert set(cand[1].tolist()) == {2, 3}
    assert set(cand[2].tolist()) == {5} and set(cand[3].tolist()) == {1}


def test_quantize_non_contiguous_and_leading_shapes():
    big = torch.randn(6, 96, generator=gen(5)) * 2
    x = big[:, :64]
    assert not x.is_contiguous()
    a = reference.quantize_nvfp4(x, 0.05)
    b = reference.quantize_nvfp4(x.contiguous(), 0.05)
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
    assert a[0].shape == (6, 32) and a[1].shape == (6, 4)

    x3 = torch.randn(2, 3, 5, 48, generator=gen(6))
    p3, s3 = reference.quantize_nvfp4(x3, 0.01)
    p2, s2 = reference.quantize_nvfp4(x3.reshape(30, 48), 0.01)
    assert p3.shape == (2, 3, 5, 24) and s3.shape == (2, 3, 5, 3)
    assert torch.equal(p3.reshape(30, 24), p2)
    assert torch.equal(s3.reshape(30, 3).view(torch.uint8), s2.view(torch.uint8))


def test_quantize_bf16_input_matches_its_float32_value():
    x = (torch.randn(4, 32, generator=gen(7)) * 5).to(torch.bfloat16)
    a = reference.quantize_nvfp4(x, 0.02)
    b = reference.quantize_nvfp4(x.float(), 0.02)
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))


def test_dequantize_error_within_half_grid_step():
    # Rows of different magnitudes, all with normal (not saturated) e4m3 scales: the
    # scale then rounds by at most 2^-4 relative, so y stays below 6.4.
    g = 0.05
    x = torch.randn(32, 128, generator=gen(8)) * (0.1 + torch.rand(32, 1, generator=gen(9))) * 10
    packed, scales = reference.quantize_nvfp4(x, g)
    deq = F.dequantize_nvfp4(packed, scales, g)
    sf = scales.float()
    assert (sf >= 2.0 ** -6).all() and (sf < 448).all()
    denom = (sf * g).repeat_interleave(16, dim=1)
    y = (x / denom).abs()
    # Grid spacing is 0.5 below 2, 1 below 4, 2 above; anything past 6 (the scale
    # rounding down) is at most 6.375 and so still within half of the last step.
    half_step = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
    err = (deq - x).abs()
    assert (err <= half_step * denom * (1 + 1e-6)).all()


def test_dequantize_nvfp4_argument_errors():
    packed, scales = reference.quantize_nvfp4(torch.randn(2, 32), 1.0)
    with pytest.raises(ValueError, match=r"^dsv4: dequantize_nvfp4: scales must have shape \[2, 2\] to match packed"):
        F.dequantize_nvfp4(packed, scales[:, :1], 1.0)
    with pytest.raises(ValueError, match="^dsv4: dequantize_nvfp4: scales must have dtype torch.float8_e4m3fn"):
        F.dequantize_nvfp4(packed, scales.float(), 1.0)
    with pytest.raises(ValueError, match="^dsv4: dequantize_nvfp4: packed must have a last dim"):
        F.dequantize_nvfp4(packed[:, :3], scales, 1.0)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="^dsv4: dequantize_nvfp4: global_scale must be finite and > 0"):
            F.dequantize_nvfp4(packed, scales, bad)
    with pytest.raises(ValueError, match="^dsv4: dequantize_nvfp4: global_scale must have exactly 1 element"):
        F.dequantize_nvfp4(packed, scales, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="^dsv4: dequantize_nvfp4: global_scale must have dtype torch.float32"):
        F.dequantize_nvfp4(packed, scales, torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(TypeError, match="^dsv4: dequantize_nvfp4: global_scale must be a python float"):
        F.dequantize_nvfp4(packed, scales, "1.0")


# --------------------------------------------------------------------------------------
# Weights and expert layouts
# --------------------------------------------------------------------------------------


def test_quantize_nvfp4_weight_2d_and_3d():
    w = torch.randn(32, 64, generator=gen(10)) * 0.02
    weight, weight_scale, weight_scale_2 = F.quantize_nvfp4_weight(w)
    assert weight.shape == (32, 32) and weight.dtype == torch.uint8
    assert weight_scale.shape == (32, 4) and weight_scale.dtype == torch.float8_e4m3fn
    assert weight_scale_2.shape == () and weight_scale_2.dtype == torch.float32
    assert weight_scale_2.item() == (w.abs().max() / torch.tensor(6 * 448.0)).item()
    a = _quantize_nvfp4_weight_blocks(w, weight_scale_2)
    assert torch.equal(a[0], weight) and torch.equal(a[1].view(torch.uint8), weight_scale.view(torch.uint8))

    # The largest block's scale lands at (or next to) 448.
    assert weight_scale.float().max().item() == 448.0

    w3 = torch.randn(3, 32, 64, generator=gen(11)) * torch.tensor([0.01, 0.1, 1.0]).reshape(3, 1, 1)
    w3[1] = 0
    weight, weight_scale, weight_scale_2 = F.quantize_nvfp4_weight(w3)
    assert weight.shape == (3, 32, 32) and weight_scale.shape == (3, 32, 4)
    assert weight_scale_2.shape == (3,)
    assert weight_scale_2[1].item() == 1.0
    assert (weight[1] == 0).all() and (weight_scale[1].float() == 0).all()
    for e in (0, 2):
        single = F.quantize_nvfp4_weight(w3[e])
        assert torch.equal(single[0], weight[e])
        assert torch.equal(single[1].view(torch.uint8), weight_scale[e].view(torch.uint8))
        assert single[2].item() == weight_scale_2[e].item()

    with pytest.raises(ValueError, match="w"):
        F.quantize_nvfp4_weight(torch.randn(64))


def _modelopt_expert(g: torch.Generator, N: int, K: int) -> dict:
    def proj(rows, cols, std):
        weight, weight_scale, weight_scale_2 = F.quantize_nvfp4_weight(
            torch.randn(rows, cols, generator=g) * std
        )
        return {
            "weight": weight,
            "weight_scale": weight_scale,
            "weight_scale_2": weight_scale_2,
            "input_scale": torch.rand((), generator=g) * 0.01 + 0.001,
        }

    return {"w1": proj(N, K, 0.02), "w3": proj(N, K, 0.05), "w2": proj(K, N, 0.03)}


def test_stack_modelopt_experts_and_dequantize():
    E, N, K = 3, 32, 48
    g = gen(12)
    experts = [_modelopt_expert(g, N, K) for _ in range(E)]
    st = F.stack_modelopt_experts(experts)
    assert st["w13"].shape == (E, 2 * N, K // 2) and st["w13"].dtype == torch.uint8
    assert st["w13_scale"].shape == (E, 2 * N, K // 16)
    assert st["w13_scale"].dtype == torch.float8_e4m3fn
    assert st["w13_scale_2"].shape == (E, 2) and st["w13_scale_2"].dtype == torch.float32
    assert st["w2"].shape == (E, K, N // 2) and st["w2_scale"].shape == (E, K, N // 16)
    assert st["w2_scale_2"].shape == (E,)
    assert st["w13_input_scale"].shape == (E, 2) and st["w2_input_scale"].shape == (E,)

    for e, ex in enumerate(experts):
        assert torch.equal(st["w13"][e, :N], ex["w1"]["weight"])
        assert torch.equal(st["w13"][e, N:], ex["w3"]["weight"])
        assert st["w13_scale_2"][e].tolist() == [
            ex["w1"]["weight_scale_2"].item(), ex["w3"]["weight_scale_2"].item()
        ]

    deq13 = F.dequantize_experts(st["w13"], st["w13_scale"], st["w13_scale_2"])
    deq2 = F.dequantize_experts(st["w2"], st["w2_scale"], st["w2_scale_2"])
    assert deq13.shape == (E, 2 * N, K) and deq13.dtype == torch.float32
    for e, ex in enumerate(experts):
        parts = [
            F.dequantize_nvfp4(ex[p]["weight"], ex[p]["weight_scale"], ex[p]["weight_scale_2"])
            for p in ("w1", "w3")
        ]
        assert torch.equal(deq13[e], torch.cat(parts))
        w2 = ex["w2"]
        assert torch.equal(
            deq2[e], F.dequantize_nvfp4(w2["weight"], w2["weight_scale"], w2["weight_scale_2"])
        )

    # [E] global scales apply to all rows.
    one = st["w13_scale_2"][:, 0].contiguous()
    deq_one = F.dequantize_experts(st["w13"], st["w13_scale"], one)
    assert torch.equal(deq_one[:, :N], deq13[:, :N])

    with pytest.raises(ValueError, match="w_scale_2"):
        F.dequantize_experts(st["w13"], st["w13_scale"], torch.ones(E, 3))
    with pytest.raises(ValueError, match="w_scale"):
        F.dequantize_experts(st["w13"], st["w2_scale"], one)
    bad = [dict(experts[0]), experts[1]]
    bad[0]["w3"] = experts[0]["w2"]
    with pytest.raises(ValueError, match=r"experts\[0\]\['w3'\]"):
        F.stack_modelopt_experts(bad)
    with pytest.raises(ValueError, match="w2"):
        F.stack_modelopt_experts([{"w1": experts[0]["w1"], "w3": experts[0]["w3"]}])


def test_random_nvfp4_moe_weights():
    E, N, K = 4, 32, 64
    m = F.random_nvfp4_moe_weights(E, N, K, generator=gen(13))
    shapes = {
        "w13": ((E, 2 * N, K // 2), torch.uint8),
        "w13_scale": ((E, 2 * N, K // 16), torch.float8_e4m3fn),
        "w13_scale_2": ((E,), torch.float32),
        "w2": ((E, K, N // 2), torch.uint8),
        "w2_scale": ((E, K, N // 16), torch.float8_e4m3fn),
        "w2_scale_2": ((E,), torch.float32),
        "w13_input_scale": ((E,), torch.float32),
        "w2_input_scale": ((E,), torch.float32),
    }
    assert set(m) == set(shapes)
    for key, (shape, dtype) in shapes.items():
        assert tuple(m[key].shape) == shape and m[key].dtype == dtype, key
    for key in ("w13_scale_2", "w2_scale_2", "w13_input_scale", "w2_input_scale"):
        assert (m[key] > 0).all()
    deq = F.dequantize_experts(m["w13"], m["w13_scale"], m["w13_scale_2"])
    assert 0.012 < deq.std().item() < 0.03

    again = F.random_nvfp4_moe_weights(E, N, K, generator=gen(13))
    assert torch.equal(again["w2"], m["w2"])
    with pytest.raises(ValueError, match="N"):
        F.random_nvfp4_moe_weights(E, 24, K)


# --------------------------------------------------------------------------------------
# prepared NVFP4 MoE layout (dsv4.formats.nvfp4_moe_layout)
# --------------------------------------------------------------------------------------


def test_nvfp4_moe_layout_by_hand():
    """The layout's rules read back from the bytes, element by element, on one expert:
    w13 row interleave, A-fragment order of the code words, _BIT_POS bit placement, the
    one-byte scale code; dsv4.prepare_nvfp4_moe_weights is this module's function."""
    import dsv4
    from dsv4.formats import nvfp4_moe_layout as L

    assert dsv4.prepare_nvfp4_moe_weights is L.prepare_nvfp4_moe_weights is F.prepare_nvfp4_moe_weights
    assert dsv4.Nvfp4MoeWeights is L.Nvfp4MoeWeights and dsv4.unprepare_nvfp4_moe_weights is \
        L.unprepare_nvfp4_moe_weights
    E, N, K = 1, 64, 128
    m = F.random_nvfp4_moe_weights(E, N, K, generator=gen(14))
    keys = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")
    p = L.prepare_nvfp4_moe_weights(*(m[k] for k in keys))
    assert L.check_prepared("t", p) == (E, N, K)
    codes = F.unpack_fp4(m["w13"][0]).int()  # [2N, K]
    scales = m["w13_scale"][0].float()  # [2N, K/16]
    pick = torch.Generator().manual_seed(15)
    for _ in range(300):
        rt, kt, w, hi, g, j, kh, t, i = (int(torch.randint(n, (1,), generator=pick))
                                         for n in (2 * N // 64, K // 64, 4, 2, 8, 4, 2, 4, 2))
        row = 32 * rt + 8 * w + g + (N if hi else 0)  # tile row 16w + 8hi + g: gate, then up
        k = 64 * kt + 16 * j + 8 * kh + 2 * t + i
        at = 16 * (32 * w + 4 * g + t) + 4 * j  # thread (w, g, t)'s word j
        q = sum(int(p.w13[0, rt, kt, at + b]) << (8 * b) for b in range(4))
        code = sum(((q >> pos) & 1) << b for b, pos in enumerate(L._BIT_POS[2 * kh + hi][i]))  # (m, e0, e1, s)
        s = float(scales[row, k // 16])
        assert code == (int(codes[row, k]) if s != 0 else 0), (rt, kt, w, hi, g, j, kh, t, i)
        b = int(p.w13_scale[0, rt, kt, 8 * (8 * w + g) + 2 * j + hi])
        if s == 0:
            assert b == 0
        else:
            X = math.floor(math.log2(s))
            assert b == ((X + 10) << 3 | round((s / 2.0 ** X - 1) * 8)), (s, b)
    back = L.unprepare_nvfp4_moe_weights(p)
    assert torch.equal(back["w2"], m["w2"]) and torch.equal(back["w2_scale"].view(torch.uint8),
                                                            m["w2_scale"].view(torch.uint8))


# --------------------------------------------------------------------------------------
# fp8_ds_mla cache
# --------------------------------------------------------------------------------------


def _storage_bytes(cache: torch.Tensor, n: int) -> torch.Tensor:
    """The first n bytes of the cache's storage, as a flat view."""
    return cache.as_strided((n,), (1,), 0)


def _fp8_grid_values(g: torch.Generator, shape) -> torch.Tensor:
    """Random finite float8_e4m3fn values with |v| <= 448, as float32."""
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    raw = torch.where((raw & 0x7F) == 0x7F, raw & 0xF0, raw)  # drop NaN patterns
    return raw.view(torch.float8_e4m3fn).float()


def _hand_row(g: torch.Generator) -> torch.Tensor:
    """A row whose no-rope group i is fp8-grid values * 2^(i-3) with amax 448 * 2^(i-3),
    so group i's exponent byte is 127 + i - 3 and every value is stored exactly."""
    nope = _fp8_grid_values(g, (7, 64))
    nope[:, 0] = 448.0
    nope[:, 1] = -1.0
    nope = nope * (2.0 ** (torch.arange(7, dtype=torch.float32) - 3)).reshape(7, 1)
    rope = torch.randn(64, generator=g).to(torch.bfloat16).float()
    rope[0], rope[1] = 1.0, -2.0
    return torch.cat([nope.reshape(448), rope])


def test_fp8_ds_mla_block_bytes():
    assert F.fp8_ds_mla_block_bytes(64) == 65 * 576 == 37440
    assert F.fp8_ds_mla_block_bytes(1) == 2 * 576
    assert F.fp8_ds_mla_block_bytes(4) == 5 * 576
    assert F.fp8_ds_mla_block_bytes(72) == 73 * 576  # 72 * 584 = 73 * 576 exactly
    with pytest.raises(ValueError, match="block_size"):
        F.fp8_ds_mla_block_bytes(0)


def test_new_fp8_ds_mla_cache_layout():
    c = F.new_fp8_ds_mla_cache(3, 64)
    assert c.shape == (3, 64, 584) and c.dtype == torch.uint8
    assert c.stride() == (37440, 584, 1)
    assert c.untyped_storage().nbytes() == 3 * 37440
    assert (c == 0).all()
    r1 = F.new_fp8_ds_mla_cache(2, 4, fill="random", generator=gen(14))
    r2 = F.new_fp8_ds_mla_cache(2, 4, fill="random", generator=gen(14))
    assert torch.equal(_storage_bytes(r1, 2 * 2880), _storage_bytes(r2, 2 * 2880))
    assert _storage_bytes(r1, 2 * 2880).float().std() > 50
    assert F.kv_cache_layout(c) == ("fp8_ds_mla", 64)
    with pytest.raises(ValueError, match="fill"):
        F.new_fp8_ds_mla_cache(1, 4, fill="ones")


def _padded_cache(num_blocks: int, B: int, extra: int, g: torch.Generator):
    stride0 = F.fp8_ds_mla_block_bytes(B) + extra
    flat = torch.randint(0, 256, (num_blocks * stride0,), dtype=torch.uint8, generator=g)
    return flat.as_strided((num_blocks, B, 584), (stride0, 584, 1)), stride0


@pytest.mark.parametrize("extra", [0, 576])
def test_fp8_ds_mla_raw_bytes_by_hand(extra):
    B, num_blocks = 4, 2
    g = gen(15 + extra)
    if extra == 0:
        cache = F.new_fp8_ds_mla_cache(num_blocks, B, fill="random", generator=g)
        stride0 = F.fp8_ds_mla_block_bytes(B)
    else:
        cache, stride0 = _padded_cache(num_blocks, B, extra, g)
    assert cache.stride(0) == stride0
    flat = _storage_bytes(cache, num_blocks * stride0)
    before = flat.clone()

    rows = torch.stack([_hand_row(g), _hand_row(g), torch.randn(512, generator=g)])
    slots = torch.tensor([6, 1, -1])  # block 1 offset 2, block 0 offset 1, skipped
    F.write_fp8_ds_mla(cache, slots, rows)

    # Token at slot 6: block 1, offset 2.
    data = 1 * stride0 + 2 * 576
    scale = 1 * stride0 + B * 576 + 2 * 8
    for grp in range(7):
        assert flat[data + grp * 64].item() == 0x7E  # 448 (x 2^(grp-3))
        assert flat[data + grp * 64 + 1].item() == 0xB8  # -1.0
    assert flat[scale:scale + 8].tolist() == [124, 125, 126, 127, 128, 129, 130, 0]
    assert flat[data + 448:data + 452].tolist() == [0x80, 0x3F, 0x00, 0xC0]  # bf16 1.0, -2.0
    expected_rope = rows[0, 448:].to(torch.bfloat16).view(torch.uint8)
    assert torch.equal(flat[data + 448:data + 576], expected_rope)
    expected_q = (rows[0, :448].reshape(7, 64) / (2.0 ** (torch.arange(7.0) - 3)).reshape(7, 1))
    assert torch.equal(flat[data:data + 448], expected_q.to(torch.float8_e4m3fn).view(torch.uint8).flatten())

    # Only the written token ranges changed (slot -1 was skipped).
    written = torch.zeros_like(flat, dtype=torch.bool)
    for blk, off in ((1, 2), (0, 1)):
        written[blk * stride0 + off * 576: blk * stride0 + off * 576 + 576] = True
        written[blk * stride0 + B * 576 + off * 8: blk * stride0 + B * 576 + off * 8 + 8] = True
    assert torch.equal(flat[~written], before[~written])

    out = F.read_fp8_ds_mla(cache, torch.tensor([6, 1], dtype=torch.int32))
    assert out.dtype == torch.bfloat16 and out.shape == (2, 512)
    assert torch.equal(out.float(), rows[:2])
    # 4-D FlashMLA view reads the same.
    assert torch.equal(F.read_fp8_ds_mla(cache.unsqueeze(2), torch.tensor([6, 1])), out)


def test_fp8_ds_mla_ue8m0_extremes():
    cache = F.new_fp8_ds_mla_cache(1, 4)
    g = gen(16)
    row = torch.randn(512, generator=g)
    row[0:64] = torch.randn(64, generator=g) * 1e-30   # floor: amax -> 1e-4
    row[64:128] = 0.0                                   # all-zero group, same floor
    row[128] = torch.finfo(torch.bfloat16).max          # largest finite input
    row[192:256] = _fp8_grid_values(g, (64,)) * 2.0 ** 100
    row[192] = 448 * 2.0 ** 100
    F.write_fp8_ds_mla(cache, torch.tensor([2]), row[None])

    floor_e = math.ceil(math.log2(1e-4 / 448))
    assert floor_e == -22
    scale = 4 * 576 + 2 * 8
    flat = _storage_bytes(cache, F.fp8_ds_mla_block_bytes(4))
    # Bytes 0 and 255 are unreachable from finite bf16 input (floor 1e-4, bf16 max).
    assert flat[scale:scale + 4].tolist() == [127 + floor_e, 127 + floor_e, 247, 227]
    data = 2 * 576
    # 1e-30 * 2^22 underflows to fp8 +-0 (0x00 / 0x80); the zero group stays 0x00.
    assert (flat[data:data + 64] & 0x7F == 0).all()
    assert (flat[data + 64:data + 128] == 0).all()
    assert flat[data + 128].item() == 0x78  # bf16 max * 2^-120 = 255.0 -> 256 in e4m3

    out = F.read_fp8_ds_mla(cache, torch.tensor([2]))[0].float()
    assert (out[:128] == 0).all()
    assert torch.equal(out[192:256], row[192:256])
    assert torch.equal(out[448:], row[448:].to(torch.bfloat16).float())


def test_fp8_ds_mla_random_round_trip_error():
    B, num_blocks = 8, 3
    cache = F.new_fp8_ds_mla_cache(num_blocks, B, fill="random", generator=gen(17))
    g = gen(18)
    rows = torch.randn(20, 512, generator=g) * torch.rand(20, 1, generator=g) * 30
    slots = torch.randperm(num_blocks * B, generator=g)[:20]
    F.write_fp8_ds_mla(cache, slots, rows.to(torch.bfloat16))
    out = F.read_fp8_ds_mla(cache, slots).float()
    x = rows.to(torch.bfloat16).float()
    assert torch.equal(out[:, 448:], x[:, 448:])
    nope = x[:, :448].reshape(20, 7, 64)
    scale = torch.exp2(torch.ceil(torch.log2(nope.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448)))
    # e4m3: relative half-ulp 2^-4 for normals, absolute 2^-10 * scale for subnormals.
    bound = torch.maximum(nope.abs() * 2.0 ** -4, scale * 2.0 ** -10)
    assert ((out[:, :448].reshape(20, 7, 64) - nope).abs() <= bound).all()

    full = F.dequantize_fp8_ds_mla_cache(cache)
    assert full.shape == (num_blocks * B, 512) and full.dtype == torch.bfloat16
    assert torch.equal(full[slots], out.to(torch.bfloat16))

    # Writes through the 4-D view land in the same place.
    view4 = cache.unsqueeze(2)
    F.write_fp8_ds_mla(view4, slots[:2], rows[:2].flip(0))
    assert torch.equal(F.read_fp8_ds_mla(cache, slots[:2]), out[:2].flip(0).to(torch.bfloat16))


def test_fp8_ds_mla_slot_errors():
    cache = F.new_fp8_ds_mla_cache(2, 4)
    rows = torch.randn(2, 512, generator=gen(19))
    with pytest.raises(ValueError, match="slots"):
        F.read_fp8_ds_mla(cache, torch.tensor([-1]))
    with pytest.raises(ValueError, match="slots"):
        F.read_fp8_ds_mla(cache, torch.tensor([8]))
    with pytest.raises(ValueError, match="slots"):
        F.write_fp8_ds_mla(cache, torch.tensor([0, 8]), rows)
    with pytest.raises(ValueError, match="^dsv4: write_fp8_ds_mla: slots must have dtype torch.int32 or torch.int64"):
        F.write_fp8_ds_mla(cache, torch.tensor([0.0, 1.0]), rows)
    with pytest.raises(ValueError, match="rows"):
        F.write_fp8_ds_mla(cache, torch.tensor([0, 1]), rows[:, :448])
    with pytest.raises(ValueError, match="cache"):
        F.write_fp8_ds_mla(F.new_bf16_cache(2, 4), torch.tensor([0, 1]), rows)


# --------------------------------------------------------------------------------------
# bf16 cache
# --------------------------------------------------------------------------------------


def test_bf16_cache_round_trip():
    B = 4
    cache = F.new_bf16_cache(3, B, fill="random", generator=gen(20))
    assert cache.shape == (3, B, 512) and cache.dtype == torch.bfloat16
    assert F.kv_cache_layout(cache) == ("bf16", B)
    before = cache.clone()
    rows = torch.randn(3, 512, generator=gen(21))
    F.write_bf16_cache(cache, torch.tensor([9, -1, 2]), rows)
    assert torch.equal(cache[2, 1], rows[0].to(torch.bfloat16))
    assert torch.equal(cache[0, 2], rows[2].to(torch.bfloat16))
    changed = (cache != before).any(-1)
    assert changed.nonzero().tolist() == [[0, 2], [2, 1]]
    out = F.read_bf16_cache(cache.unsqueeze(2), torch.tensor([9, 2]))
    assert torch.equal(out, rows[[0, 2]].to(torch.bfloat16))
    assert (F.new_bf16_cache(1, 2) == 0).all()
    with pytest.raises(ValueError, match="slots"):
        F.read_bf16_cache(cache, torch.tensor([12]))
    with pytest.raises(ValueError, match="cache"):
        F.read_bf16_cache(F.new_fp8_ds_mla_cache(1, 4), torch.tensor([0]))


# --------------------------------------------------------------------------------------
# Layout validation
# --------------------------------------------------------------------------------------


def test_kv_cache_layout_accepts_views():
    c = F.new_fp8_ds_mla_cache(2, 64)
    assert F.kv_cache_layout(c.unsqueeze(2)) == ("fp8_ds_mla", 64)
    assert F.kv_cache_layout(torch.zeros(2, 16, 584, dtype=torch.uint8)) == ("fp8_ds_mla", 16)
    padded, _ = _padded_cache(2, 4, 576, gen(22))
    assert F.kv_cache_layout(padded) == ("fp8_ds_mla", 4)
    assert F.kv_cache_layout(torch.zeros(2, 8, 1, 512, dtype=torch.bfloat16)) == ("bf16", 8)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torch.zeros(2, 4, 584, dtype=torch.float32), "dtype"),
        (lambda: torch.zeros(2, 4, 576, dtype=torch.uint8), "last dim 584"),
        (lambda: torch.zeros(2, 4, 584, dtype=torch.bfloat16), "last dim 512"),
        (lambda: torch.zeros(2, 4, 2, 584, dtype=torch.uint8), r"\[num_blocks, block_size, 1, D\]"),
        (lambda: torch.zeros(4, 584, dtype=torch.uint8), "cache must be"),
        (lambda: torch.zeros(2, 0, 584, dtype=torch.uint8), r"block_size \(dim 1\) > 0"),
        (lambda: torch.zeros(2, 4, 600, dtype=torch.uint8)[:, :, :584], "stride\\(1\\)"),
        (lambda: torch.zeros(584, 4, 2, dtype=torch.uint8).permute(2, 1, 0), "unit stride along its last dim"),
        (lambda: torch.zeros(4 * 584 + 8, dtype=torch.uint8).as_strided((2, 4, 584), (8, 584, 1)),
         "block stride"),
        (lambda: torch.zeros(2, 4, 1024, dtype=torch.bfloat16)[:, :, :512], "stride\\(1\\)"),
    ],
)
def test_kv_cache_layout_errors(make, match):
    with pytest.raises(ValueError, match="^dsv4: kv_cache_layout: cache") as info:
        F.kv_cache_layout(make())
    assert info.match(match)


def test_kv_cache_layout_type_error():
    with pytest.raises(TypeError, match="cache"):
        F.kv_cache_layout([[0] * 584])
