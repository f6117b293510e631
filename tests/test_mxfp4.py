"""MXFP4 experts (DeepSeek V4's native checkpoints): formats and FP8 activation quantizers
(dsv4.formats.mxfp4), the float32 references (dsv4.reference.mxfp4_moe) against independently
written per-element / per-token formulations, the prepare step and the op chain
(dsv4.prepare_moe_weights, dsv4.routed_moe, dsv4.mxfp4_moe, dsv4::mxfp4_moe) on CPU, the
wrappers' one normalisation of the routing arguments (both formats), and on the GPU the
W4A16 path (MXFP4 folded into the bf16 kernels' NVFP4 operand) and the W4A8 kernels
(csrc/moe/mxfp4_moe.cu) against the references."""

import math
import struct

import pytest
import torch

import dsv4
from dsv4 import formats, reference
from dsv4.formats import mxfp4
from dsv4.moe import (
    MoeWeights,
    Mxfp4MoeWeights,
    Nvfp4MoeWeights,
    mxfp4_moe,
    prepare_moe_weights,
    prepare_mxfp4_moe_weights,
    prepare_nvfp4_moe_weights,
    routed_moe,
)

MX = ("w13", "w13_scale", "w2", "w2_scale")


# ------------------------------------------------ independent formulations ---------


def _f32(v: float) -> float:
    """Round a python float (double) to the nearest float32."""
    return struct.unpack("f", struct.pack("f", v))[0]


def _e2m1(code: int) -> float:
    """e2m1 value from its bits: sign, 2 exponent bits, 1 mantissa bit (OCP MX spec)."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


def _decode_mx(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [..., K] from packed bytes and e8m0 bytes, element by element bytes ->
    nibbles (even element = low nibble) -> value table built from the bit formula."""
    table = torch.tensor([_e2m1(c) for c in range(16)], dtype=torch.float64)
    b = packed.to(torch.int64)
    codes = torch.empty(*b.shape[:-1], b.shape[-1] * 2, dtype=torch.int64)
    codes[..., 0::2] = b % 16
    codes[..., 1::2] = b // 16
    sc = torch.tensor([math.ldexp(1.0, int(v) - 127) if v != 255 else math.nan for v in range(256)],
                      dtype=torch.float64)[scales.view(torch.uint8).to(torch.int64)]
    return table[codes] * sc.repeat_interleave(32, dim=-1)


def _e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite non-negative e4m3 value (sorted) and whether its byte is even."""
    vals = []
    for b in range(127):  # 127 = 0x7F is NaN
        ex, man = b >> 3, b & 7
        vals.append((man / 8 * 2.0**-6) if ex == 0 else (1 + man / 8) * 2.0 ** (ex - 7))
    return torch.tensor(vals, dtype=torch.float64), torch.arange(127) % 2 == 0


def _round_e4m3(v: float, grid=_e4m3_grid()) -> float:
    """Round to nearest e4m3, ties to the even byte, saturating at +-448."""
    vals, even = grid
    a = min(abs(v), 448.0)
    i = int(torch.searchsorted(vals, torch.tensor(a, dtype=torch.float64)))
    if i < len(vals) and vals[i] == a:
        r = a
    else:
        lo, hi = float(vals[i - 1]), float(vals[i])
        r = lo if (a - lo < hi - a or (a - lo == hi - a and bool(even[i - 1]))) else hi
    return -r if v < 0 else r


def _quant_gemm1_loop(row: list, ue8m0: bool, group=128):
    """vLLM per_token_group_quant_fp8 on one token, element by element."""
    q, scales = [], []
    for g0 in range(0, len(row), group):
        chunk = row[g0:g0 + group]
        amax = max(max(abs(v) for v in chunk), 1e-10) if chunk else 1e-10
        s = _f32(_f32(amax) / 448.0)
        if ue8m0:
            m, e = math.frexp(s)
            s = math.ldexp(1.0, e - 1 if m == 0.5 else e)
        scales.append(s)
        q += [_round_e4m3(_f32(v / s)) for v in chunk]
    return q, scales


def _quant_gemm2_loop(row: list, group=128):
    """Humming's quant_group (Float32 scales) on one row, element by element."""
    q, scales = [], []
    for g0 in range(0, len(row), group):
        chunk = row[g0:g0 + group]
        s = max(_f32(max(abs(v) for v in chunk) / 448.0), 1e-30)
        s = _f32(s)
        r = _f32(1.0 / s)
        scales.append(s)
        q += [_round_e4m3(_f32(v * r)) for v in chunk]
    return q, scales


def _moe_loop(x, ids, tw, w, limit, activation, ue8m0=True, emap=None):
    """Per-token, per-slot MoE in float64 from the independent decoders."""
    M, K = x.shape
    N = w["w13"].shape[1] // 2
    w13 = _decode_mx(w["w13"], w["w13_scale"])
    w2 = _decode_mx(w["w2"], w["w2_scale"])
    out = torch.zeros(M, K, dtype=torch.float64)
    for m in range(M):
        xm = [float(v) for v in x[m].float()]
        if activation == "fp8":
            q, s = _quant_gemm1_loop(xm, ue8m0)
            xm = [qi * s[i // 128] for i, qi in enumerate(q)]
        xv = torch.tensor(xm, dtype=torch.float64)
        for j in range(ids.shape[1]):
            e = int(ids[m, j]) if emap is None else int(emap[int(ids[m, j])])
            if e < 0:
                continue
            g, u = w13[e, :N] @ xv, w13[e, N:] @ xv
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            h = g / (1 + torch.exp(-g)) * u
            if activation == "fp8":
                hq, hs = _quant_gemm2_loop([_f32(float(v)) for v in h])
                h = torch.tensor([qi * hs[i // 128] for i, qi in enumerate(hq)], dtype=torch.float64)
            out[m] += float(tw[m, j]) * (w2[e] @ h)
    return out


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _weights(E, N, K, seed, device="cpu", **kw):
    gen = torch.Generator(device=device).manual_seed(seed)
    return mxfp4.random_mxfp4_moe_weights(E, N, K, generator=gen, device=device, **kw)


def _routing(M, k, E_ids, gen, device="cpu"):
    ids = torch.stack([torch.randperm(E_ids, generator=gen)[:k] for _ in range(M)]) if M else torch.zeros(0, k)
    w = torch.rand(M, k, generator=gen) + 0.1
    return ids.to(torch.int32).to(device), (w / w.sum(-1, keepdim=True)).float().to(device)


# ---------------------------------------------------------------- formats ----------


def test_e8m0_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = mxfp4.e8m0_to_float(b)
    for v in range(255):
        assert got[v].item() == math.ldexp(1.0, v - 127), v
    assert math.isnan(got[255].item())
    # torch's own e8m0 dtype agrees, byte 0 (2^-127) and 255 (NaN) included
    viewed = b.view(torch.float8_e8m0fnu)
    assert torch.equal(mxfp4.e8m0_to_float(viewed)[:255], viewed.float()[:255])
    assert math.isnan(viewed.float()[255].item())


def test_nibble_order_and_dequantize_matches_bitwise_decode():
    # element 0 = code 1 (0.5) in the low nibble, element 1 = code 10 (-1.0) in the high one
    packed = torch.tensor([[0xA1] + [0] * 15], dtype=torch.uint8)
    d = mxfp4.dequantize_mxfp4(packed, torch.tensor([[128]], dtype=torch.uint8))
    assert d[0, :3].tolist() == [1.0, -2.0, 0.0]
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 5, 64), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 253, (3, 5, 4), generator=gen, dtype=torch.uint8)
    scales[0, 0, :2] = torch.tensor([0, 252], dtype=torch.uint8)  # the extreme exponents whose values fit fp32
    got = mxfp4.dequantize_mxfp4(packed, scales)
    assert torch.equal(got.double(), _decode_mx(packed, scales))
    assert torch.equal(mxfp4.dequantize_mxfp4(packed, scales.view(torch.float8_e8m0fnu)), got)
    # exact in bf16
    assert torch.equal(mxfp4.dequantize_mxfp4(packed, scales, torch.bfloat16).float(), got)
    scales[1, 2, 3] = 255
    nan = mxfp4.dequantize_mxfp4(packed, scales)
    assert nan[1, 2, 96:].isnan().all() and not nan[1, 2, :96].isnan().any()


def test_quantize_mxfp4():
    gen = torch.Generator().manual_seed(1)
    # representable values come back exactly
    codes = torch.randint(0, 16, (4, 96), generator=gen, dtype=torch.uint8)
    codes[:, ::32] = 7  # each block's max is 6 * 2^e
    e = torch.randint(100, 140, (4, 3), generator=gen, dtype=torch.uint8)
    x = mxfp4.dequantize_mxfp4(formats.pack_fp4(codes), e)
    p, s = mxfp4.quantize_mxfp4(x)
    assert torch.equal(s, e) and torch.equal(mxfp4.dequantize_mxfp4(p, s), x)
    # random values: nothing saturates, the error is within half an e2m1 step
    x = torch.randn(8, 128, generator=gen) * 0.03
    p, s = mxfp4.quantize_mxfp4(x)
    d = mxfp4.dequantize_mxfp4(p, s)
    step = mxfp4.e8m0_to_float(s).repeat_interleave(32, -1)  # the largest e2m1 step (4 -> 6) is 2 * step
    assert ((d - x).abs() <= step + 1e-12).all()
    assert (x.abs().reshape(8, 4, 32).amax(-1) <= 6 * mxfp4.e8m0_to_float(s)).all()
    # a zero block gets the smallest scale and zero codes
    p, s = mxfp4.quantize_mxfp4(torch.zeros(1, 32))
    assert s.item() == 0 and p.eq(0).all()


def test_check_mxfp4_moe_weights_errors():
    w = _weights(2, 64, 128, seed=2)
    assert mxfp4.check_mxfp4_moe_weights(*(w[k] for k in MX)) == (2, 64, 128)
    bad = [
        (dict(w13=w["w13"].to(torch.int8)), "w13 must be a 3-D torch.uint8"),
        (dict(w13_scale=w["w13_scale"].float()), "w13_scale must hold MXFP4 e8m0 scales"),
        (dict(w13_scale=w["w13_scale"].float().to(torch.float8_e4m3fn)), "w13_scale must hold MXFP4 e8m0"),
        (dict(w13_scale=w["w13_scale"][:, :, :2]), "w13_scale must have shape"),
        (dict(w2=w["w2"][:, :, :16]), "w2 must have shape"),
        (dict(w2_scale=w["w2_scale"][:, :64]), "w2_scale must have shape"),
        (dict(w13=w["w13"][:, :, :40]), "multiples of 32"),  # K = 80
        (dict(w13=w["w13"][:, :80]), "multiples of 32"),  # N = 40
    ]
    for change, match in bad:
        args = {k: w[k] for k in MX}
        args.update(change)
        with pytest.raises(ValueError, match=match):
            mxfp4.check_mxfp4_moe_weights(*(args[k] for k in MX))


def test_pad_keeps_values():
    w = _weights(2, 96, 128, seed=3)
    p = mxfp4.pad_mxfp4_moe_weights(*(w[k] for k in MX), multiple=64)
    assert p["w13"].shape == (2, 256, 64) and p["w2"].shape == (2, 128, 64) and p["w2_scale"].shape == (2, 128, 4)
    d13 = mxfp4.dequantize_mxfp4_experts(p["w13"], p["w13_scale"]).reshape(2, 2, 128, 128)
    ref13 = mxfp4.dequantize_mxfp4_experts(w["w13"], w["w13_scale"]).reshape(2, 2, 96, 128)
    assert torch.equal(d13[:, :, :96], ref13) and d13[:, :, 96:].eq(0).all()
    d2 = mxfp4.dequantize_mxfp4_experts(p["w2"], p["w2_scale"])
    assert torch.equal(d2[..., :96], mxfp4.dequantize_mxfp4_experts(w["w2"], w["w2_scale"]))
    assert d2[..., 96:].eq(0).all()
    same = mxfp4.pad_mxfp4_moe_weights(*(w[k] for k in MX), multiple=32)
    assert same["w13"] is w["w13"]


# ------------------------------------------------------ FP8 activations ------------


def _special_rows(K, gen):
    x = (torch.randn(6, K, generator=gen) * 3).to(torch.bfloat16).float()
    x[1, :128] = 0  # all-zero group: eps / floor
    x[2, :128] = 1e-12  # amax below GEMM1's eps
    x[3, :128] *= 1e-3
    x[4, 5] = 448.0 * 4  # amax / 448 an exact power of two
    x[5, 0] = -2.0**-130  # a subnormal
    return x.to(torch.bfloat16).float()


@pytest.mark.parametrize("ue8m0", [True, False])
def test_quantize_fp8_gemm1_vs_elementwise(ue8m0):
    gen = torch.Generator().manual_seed(4)
    x = _special_rows(300, gen)  # 300: a last group of 44
    q, s = reference.quantize_fp8_gemm1(x.to(torch.bfloat16), ue8m0=ue8m0)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (6, 300) and s.shape == (6, 3)
    for m in range(6):
        wq, ws = _quant_gemm1_loop([float(v) for v in x[m]], ue8m0)
        assert s[m].tolist() == ws
        assert q[m].float().tolist() == wq
    if ue8m0:
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert s[4, 0].item() == 4.0 and q[4, 5].item() == 448.0


def test_quantize_fp8_gemm2_vs_elementwise():
    gen = torch.Generator().manual_seed(5)
    a = _special_rows(288, gen) * 1.7  # fp32, not bf16 values; 288: V4.1-Flash at TP 8
    a[0, 200] = 1e30  # huge
    q, s = reference.quantize_fp8_gemm2(a)
    assert q.shape == (6, 288) and s.shape == (6, 3)
    assert s[1, 0].item() == _f32(1e-30) and q[1, :128].float().eq(0).all()
    for m in range(6):
        wq, ws = _quant_gemm2_loop([float(v) for v in a[m]])
        assert s[m].tolist() == ws
        assert q[m].float().tolist() == wq
    back = reference.dequantize_fp8_groups(q, s)
    assert ((back - a).abs() <= a.abs() * 2.0**-4 + s.repeat_interleave(128, -1)[:, :288] * 2.0**-9).all()


# ------------------------------------------ folding into the kernels' operands -----


def test_mxfp4_to_nvfp4_exact_in_window_and_counts_the_rest():
    gen = torch.Generator().manual_seed(6)
    w = _weights(3, 64, 256, seed=6)["w13"]  # [3, 128, 128]
    s = torch.randint(112, 128, (3, 128, 8), generator=gen, dtype=torch.uint8)
    s[0, 0, 7] = 128  # the largest block of expert 0's gate half
    s[0, 3, 2] = 128 - 17  # exactly 17 binades below it: fits
    s[0, 5, 0] = 128 - 18  # one binade further: re-rounded
    s[1, 70, 4] = 2  # an up row far below: re-rounded
    s[2, :64] = 126  # expert 2's gate half two binades lower than its up half
    s[2, 64:] = 128
    w[0, 3, 32:48] = 0x77  # a block of 6s: exact at the window's bottom
    w[0, 5, 0:16] = 0x71  # 0.5 and 6 alternating, 18 binades below: 0.5 * 2^-1 rounds to 0, 6 -> 3
    w[1, 9, 16:32] = 0x00  # an all-zero block with a tiny scale: fits (scale 0)
    s[1, 9, 1] = 0
    want = mxfp4.dequantize_mxfp4_experts(w, s)
    codes, sc, g, inexact = mxfp4.mxfp4_to_nvfp4(w, s, halves=2)
    assert inexact == 2
    assert g.shape == (3, 2) and g[2, 0].item() == 2.0 ** (126 - 127 - 8) and g[2, 1].item() == 2.0 ** (128 - 135)
    got = formats.dequantize_experts(codes, sc, g)
    exact = torch.ones_like(want, dtype=torch.bool)
    exact[0, 5, 0:32] = False
    exact[1, 70, 128:160] = False
    assert torch.equal(got[exact], want[exact])
    gmat = g.repeat_interleave(64, dim=1)[:, :, None]  # per-row global scale
    assert ((got - want).abs() <= 2.0**-11 * gmat).all()
    assert got[0, 5, 0:32:2].eq(0).all() and torch.equal(got[0, 5, 1:32:2], want[0, 5, 1:32:2])
    assert sc.view(torch.uint8)[1, 9, 2:4].eq(0).all()  # zero block: scale 0
    s[2, 7, 7] = 255
    with pytest.raises(ValueError, match="w_scale holds 1 block scale"):
        mxfp4.mxfp4_to_nvfp4(w, s, halves=2)


def test_fit_fp8_operand():
    gen = torch.Generator().manual_seed(7)
    w = torch.randint(0, 256, (2, 8, 128), generator=gen, dtype=torch.uint8)  # Kd = 256: two groups per row
    s = torch.randint(118, 124, (2, 8, 8), generator=gen, dtype=torch.uint8)
    s[0, 0, :4] = torch.tensor([130, 130 - 14, 120, 121], dtype=torch.uint8)  # 14 below the group's max: fits
    s[0, 1, 4:] = torch.tensor([125, 125 - 15, 125, 125], dtype=torch.uint8)  # 15 below: re-expressed
    w[0, 1, 80:96] = 0x11  # ... all 0.5: 0.5 * 2^-1 ties to even: 0 (inexact)
    s[1, 2, 0:4] = torch.tensor([140, 125, 124, 140], dtype=torch.uint8)
    w[1, 2, 16:32] = 0x77  # 15 below, all 6: 6 * 2^-1 = 3 (exact)
    w[1, 2, 32:48] = 0x11  # 16 below, all 0.5: 0.5 * 2^-2 rounds to 0 (inexact)
    c, sb, n = mxfp4.fit_fp8_operand(w, s)
    assert n == 2
    want = mxfp4.dequantize_mxfp4_experts(w, s)
    got = mxfp4.dequantize_mxfp4_experts(c, sb)
    moved = (got != want).reshape(2, 8, 8, 32).any(-1)
    assert moved.sum() == 2 and moved[0, 1, 5] and moved[1, 2, 2]
    assert got[0, 1, 160:192].eq(0).all() and got[1, 2, 64:96].eq(0).all()
    assert sb[1, 2, 1] == 126 and sb[0, 0, 1] == 116  # re-expressed exactly / left alone
    # every block is now exact e4m3 relative to its group's base 2^(gmax - 6)
    gmax = sb.to(torch.int32).reshape(2, 8, 2, 4).amax(-1).repeat_interleave(128, -1) - 127
    rel = got * torch.exp2(-(gmax - 6).float())
    assert torch.equal(rel.to(torch.float8_e4m3fn).float(), rel)
    c2, sb2, n2 = mxfp4.fit_fp8_operand(c, sb)
    assert n2 == 0 and c2 is c


# ------------------------------------------------------------ references -----------


REF_CASES = [  # (M, topk, E, N, K, limit, activation, ue8m0, expert_map)
    (5, 2, 4, 64, 128, 10.0, "bf16", True, False),
    (6, 3, 4, 64, 256, None, "fp8", True, True),
    (4, 2, 3, 96, 128, 10.0, "fp8", False, False),
    (3, 2, 4, 32, 160, 7.0, "fp8", True, True),  # N = 32 (one partial GEMM2 group), K = 160 (128 + 32)
    (1, 1, 2, 288, 64, 10.0, "fp8", True, False),  # V4.1-Flash's TP-8 intermediate size
]


@pytest.mark.parametrize("M,topk,E,N,K,limit,activation,ue8m0,use_map", REF_CASES)
def test_reference_vs_per_token_loop(M, topk, E, N, K, limit, activation, ue8m0, use_map):
    gen = torch.Generator().manual_seed(M * 100 + K)
    w = _weights(E, N, K, seed=K + N)
    x = (torch.randn(M, K, generator=gen) * 2).to(torch.bfloat16)
    emap = None
    if use_map:
        emap = torch.full((E + 3,), -1, dtype=torch.int32)
        emap[torch.randperm(E + 3, generator=gen)[:E]] = torch.arange(E, dtype=torch.int32)
    ids, tw = _routing(M, topk, E + 3 if use_map else E, gen)
    got = reference.mxfp4_moe(x, ids, tw, *(w[k] for k in MX), swiglu_limit=limit, activation=activation,
                              ue8m0=ue8m0, expert_map=emap)
    want = _moe_loop(x, ids, tw, w, limit, activation, ue8m0, emap)
    assert got.dtype == torch.float32 and got.shape == (M, K)
    # fp8: the fp32 vs fp64 GEMM1 output may flip an FP8 rounding of h now and then
    assert _rel_l2(got, want) <= (1e-6 if activation == "bf16" else 2e-3)


def test_reference_fp8_differs_from_bf16_and_ue8m0_matters():
    gen = torch.Generator().manual_seed(8)
    w = _weights(2, 64, 256, seed=8)
    x = (torch.randn(4, 256, generator=gen) * 2).to(torch.bfloat16)
    ids, tw = _routing(4, 2, 2, gen)
    out = {(a, u): reference.mxfp4_moe(x, ids, tw, *(w[k] for k in MX), activation=a, ue8m0=u)
           for a, u in (("bf16", True), ("fp8", True), ("fp8", False))}
    e1 = _rel_l2(out["fp8", True], out["bf16", True])
    e2 = _rel_l2(out["fp8", False], out["bf16", True])
    assert 1e-3 < e1 < 0.1 and 1e-3 < e2 < 0.1 and not torch.equal(out["fp8", True], out["fp8", False])
    limited = reference.mxfp4_moe(x * 40, ids, tw, *(w[k] for k in MX), swiglu_limit=1.0, activation="bf16")
    assert not torch.equal(limited, reference.mxfp4_moe(x * 40, ids, tw, *(w[k] for k in MX), activation="bf16"))


def test_reference_matches_nvfp4_reference_on_folded_weights():
    """The MXFP4 bf16 reference and the NVFP4 one on mxfp4_to_nvfp4's (exact) output agree."""
    gen = torch.Generator().manual_seed(9)
    w = _weights(3, 64, 128, seed=9)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
    ids, tw = _routing(5, 2, 3, gen)
    c13, s13, g13, n13 = mxfp4.mxfp4_to_nvfp4(w["w13"], w["w13_scale"], halves=2)
    c2, s2, g2, n2 = mxfp4.mxfp4_to_nvfp4(w["w2"], w["w2_scale"])
    assert n13 == n2 == 0
    a = reference.mxfp4_moe(x, ids, tw, *(w[k] for k in MX), swiglu_limit=10.0, activation="bf16")
    b = reference.nvfp4_moe(x, ids, tw, c13, s13, g13, c2, s2, g2, swiglu_limit=10.0)
    assert torch.equal(a, b)


# ---------------------------------------------------------- prepare and the op -----


@pytest.fixture(scope="module")
def small():
    """E 4, N 96 (padded to 128), K 128."""
    return _weights(4, 96, 128, seed=11)


@pytest.mark.parametrize("activation", ["bf16", "fp8"])
def test_prepare_shapes_and_report(small, activation):
    p = prepare_moe_weights(*(small[k] for k in MX), activation=activation)
    assert isinstance(p, MoeWeights) and p.format == "mxfp4" and p.activation == activation
    # N padded to the kernels' granularity: 64 for the NVFP4 (bf16) kernels, 32 for W4A8
    Np = 128 if activation == "bf16" else 96
    assert p.report["N"] == 96 and p.report["N_padded"] == Np and p.report["inexact_blocks"] == 0
    assert p.report["blocks"] == 4 * (2 * Np * 128 + 128 * Np) // 32
    if activation == "bf16":
        assert isinstance(p.tensors, Nvfp4MoeWeights) and p.tensors.w13.shape == (4, 4, 2, 2048)
    else:
        assert isinstance(p.tensors, Mxfp4MoeWeights)
        # the W4A8 tiles (dsv4.formats.mxfp4_w4a8): 64 rows x 128 K, three for 2N = 192 rows;
        # w2's K = N = 96: one chunk (zero-padded to 128)
        assert p.tensors.w13.shape == (4, 3, 1, 4096) and p.tensors.w2_scale.shape == (4, 2, 1, 256)
    # float8_e8m0fnu scales (the checkpoint's dtype) are the same bytes
    q = prepare_moe_weights(small["w13"], small["w13_scale"].view(torch.float8_e8m0fnu), small["w2"],
                            small["w2_scale"].view(torch.float8_e8m0fnu), activation=activation)
    assert all(torch.equal(a, b) for a, b in zip(p.tensors, q.tensors))


def test_prepare_detects_nvfp4():
    w = formats.random_nvfp4_moe_weights(2, 64, 128, generator=torch.Generator().manual_seed(12))
    p = prepare_moe_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], w13_scale_2=w["w13_scale_2"],
                            w2_scale_2=w["w2_scale_2"])
    assert p.format == "nvfp4" and p.activation == "bf16"
    ref = prepare_nvfp4_moe_weights(*(w[k] for k in ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale",
                                                     "w2_scale_2")))
    assert all(torch.equal(a, b) for a, b in zip(p.tensors, ref))
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    ids, tw = _routing(3, 2, 2, gen)
    assert torch.equal(routed_moe(x, ids, tw, p, swiglu_limit=10.0),
                       reference.nvfp4_moe(x, ids, tw, *(w[k] for k in ("w13", "w13_scale", "w13_scale_2", "w2",
                                                                        "w2_scale", "w2_scale_2")),
                                           swiglu_limit=10.0).to(torch.bfloat16))


def _case(M, k, E, K, seed, use_map=True):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=gen) * 2).to(torch.bfloat16)
    emap = None
    if use_map:
        emap = torch.full((E + 5,), -1, dtype=torch.int32)
        emap[torch.randperm(E + 5, generator=gen)[:E]] = torch.arange(E, dtype=torch.int32)
    ids, tw = _routing(M, k, E + 5 if use_map else E, gen)
    return x, ids, tw, emap


@pytest.mark.parametrize("activation,ue8m0", [("bf16", True), ("fp8", True), ("fp8", False)])
def test_cpu_op_is_the_reference(small, activation, ue8m0):
    p = prepare_moe_weights(*(small[k] for k in MX), activation=activation)
    x, ids, tw, emap = _case(6, 3, 4, 128, seed=14)
    kw = dict(swiglu_limit=10.0, expert_map=emap)
    got = routed_moe(x, ids, tw, p, ue8m0=ue8m0, **kw)
    assert got.dtype == torch.bfloat16 and got.shape == (6, 128)
    ref = reference.mxfp4_moe(x, ids, tw, *(small[k] for k in MX), activation=activation, ue8m0=ue8m0, **kw)
    # N = 96 runs padded to 128 (zero columns): equal up to the fp32 summation order
    assert _rel_l2(got, ref) <= 4e-3  # bf16 output rounding
    assert _rel_l2(got.float(), ref.to(torch.bfloat16).float()) <= 1e-5
    # unpadded N: the CPU op is exactly the reference
    w = _weights(3, 64, 128, seed=15)
    p = prepare_moe_weights(*(w[k] for k in MX), activation=activation)
    x, ids, tw, emap = _case(5, 2, 3, 128, seed=16)
    got = routed_moe(x, ids, tw, p, ue8m0=ue8m0, swiglu_limit=10.0, expert_map=emap)
    ref = reference.mxfp4_moe(x, ids, tw, *(w[k] for k in MX), activation=activation, ue8m0=ue8m0,
                              swiglu_limit=10.0, expert_map=emap)
    assert torch.equal(got, ref.to(torch.bfloat16))


@pytest.mark.parametrize("activation", ["bf16", "fp8"])
def test_cpu_op_empty_and_remote(small, activation):
    p = prepare_moe_weights(*(small[k] for k in MX), activation=activation)
    x = torch.zeros(0, 128, dtype=torch.bfloat16)
    ids = torch.zeros(0, 6, dtype=torch.int32)
    assert routed_moe(x, ids, ids.float(), p).shape == (0, 128)
    x, ids, tw, _ = _case(4, 2, 4, 128, seed=17, use_map=False)
    emap = torch.full((4,), -1, dtype=torch.int32)
    out = torch.full_like(x, float("nan"))  # poisoned
    assert torch.equal(routed_moe(x, ids, tw, p, expert_map=emap, out=out), torch.zeros_like(x))
    # experts 1..3 get no token
    ids = torch.zeros(4, 2, dtype=torch.int32)
    got = routed_moe(x, ids, tw, p)
    ref = reference.mxfp4_moe(x, ids, tw, *(small[k] for k in MX), activation=activation)
    assert _rel_l2(got, ref) <= 4e-3


@pytest.mark.parametrize("K,N", [(4096, 2048), (7168, 3072), (5120, 2304), (5120, 288)])
def test_cpu_op_model_shapes(K, N):
    """V4-Flash, V4-Pro, V4.1-Flash (TP 1 and 8) at M = 2, E = 1 (random code and scale
    bytes: quantizing float weights of these sizes would take most of the time; the
    NVFP4 tiling of bf16 mode costs seconds per expert on CPU)."""
    w = _weights(1, N, K, seed=K + N, quantize=False)
    x, ids, tw, _ = _case(2, 1, 1, K, seed=N, use_map=False)
    for activation in ("bf16", "fp8"):
        p = prepare_moe_weights(*(w[k] for k in MX), activation=activation)
        multiple = 64 if activation == "bf16" else 32  # the NVFP4 kernels' tile; W4A8's N granularity
        assert p.report["N_padded"] == -(-N // multiple) * multiple and p.report["inexact_blocks"] == 0
        got = routed_moe(x, ids, tw, p, swiglu_limit=10.0)
        ref = reference.mxfp4_moe(x, ids, tw, *(w[k] for k in MX), activation=activation, swiglu_limit=10.0)
        assert torch.isfinite(got).all() and _rel_l2(got, ref) <= 4e-3


def test_prepare_counts_and_warns_inexact_blocks():
    w = _weights(2, 64, 256, seed=18)
    w["w13_scale"][0, 0, 0] = 10  # far below the matrix's largest and its group's
    w["w13"][0, 0, :16] = 0x77
    w["w2_scale"][1, 5, 1] = 0  # w2: N = 64 = 2 blocks in one group of 128
    w["w2"][1, 5, 16:32] = 0x66
    for activation in ("bf16", "fp8"):
        with pytest.warns(UserWarning, match="2 of .* MXFP4 blocks"):
            p = prepare_moe_weights(*(w[k] for k in MX), activation=activation)
        assert p.report["w13_inexact_blocks"] == 1 and p.report["w2_inexact_blocks"] == 1


def _bad_prepare():
    w = _weights(2, 64, 128, seed=19)
    nan = w["w2_scale"].clone()
    nan[1, 3, 0] = 255
    base = {k: w[k] for k in MX}
    return [
        (dict(base, w2_scale=nan), {}, "w2_scale holds 1 block scale"),
        (dict(base, w13=w["w13"][:, :, :40]), {}, "multiples of 32"),  # K = 80
        (dict(base), dict(activation="nvfp4"), 'activation must be "bf16" .* or "fp8"'),
        (dict(base), dict(w13_scale_2=torch.ones(2)), "MXFP4 weights have no global scales"),
        (dict(base), dict(format="int4"), "format must be"),
        (dict(base, w13_scale=w["w13_scale"].float()), {}, "cannot tell the weight format"),
        (dict(base), dict(format="nvfp4", w13_scale_2=torch.ones(2), w2_scale_2=torch.ones(2)),
         "w13_scale must be a 3-D torch.float8_e4m3fn"),
        (dict(base, w13=w["w13"][:, :, :48], w13_scale=w["w13_scale"][:, :, :3], w2=w["w2"][:, :96]),
         {}, "must have shape"),
    ]


@pytest.mark.parametrize("tensors,kw,match", _bad_prepare())
def test_prepare_errors(tensors, kw, match):
    with pytest.raises(ValueError, match=match):
        prepare_moe_weights(*(tensors[k] for k in MX), **kw)


def test_prepare_errors_k_tile():
    w = _weights(2, 64, 96, seed=20)  # K = 96: MXFP4 blocks fit, the kernels' 64-wide K tiles do not
    with pytest.raises(ValueError, match="K = 96 must be a multiple of 64"):
        prepare_mxfp4_moe_weights(*(w[k] for k in MX))


def test_call_errors(small):
    p8 = prepare_moe_weights(*(small[k] for k in MX), activation="fp8")
    p16 = prepare_moe_weights(*(small[k] for k in MX), activation="bf16")
    x, ids, tw, _ = _case(3, 2, 4, 128, seed=21, use_map=False)
    with pytest.raises(ValueError, match="a13_scale / a2_scale"):
        routed_moe(x, ids, tw, p8, a13_scale=1.0)
    with pytest.raises(ValueError, match="must be the MoeWeights"):
        routed_moe(x, ids, tw, p8.tensors)
    with pytest.raises(ValueError, match="not a supported pair"):
        routed_moe(x, ids, tw, p8._replace(activation="nvfp4"))
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        routed_moe(x, ids + 4, tw, p8)
    for p in (p8, p16):
        with pytest.raises(ValueError, match="x must have dtype"):
            routed_moe(x.float(), ids, tw, p)
        with pytest.raises(ValueError, match="topk_weights must have shape"):
            routed_moe(x, ids, tw[:, :1], p)
        with pytest.raises(ValueError, match="swiglu_limit must be positive"):
            routed_moe(x, ids, tw, p, swiglu_limit=0.0)
        with pytest.raises(ValueError, match="K = 64"):
            routed_moe(x[:, :64].contiguous(), ids, tw, p)
    op = torch.ops.dsv4.mxfp4_moe.default
    w = p8.tensors
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match='runs activation "fp8"'):
        op(x, ids, tw, *w, None, None, "bf16", True, out)
    with pytest.raises(ValueError, match="w13_scale must have dtype torch.uint8"):
        op(x, ids, tw, w.w13, w.w13_scale.view(torch.float8_e8m0fnu), w.w2, w.w2_scale, None, None, "fp8", True,
           out)
    with pytest.raises(ValueError, match="w13 must be 4-D"):  # vLLM's layout, not the prepared one
        op(x, ids, tw, *(small[k] for k in MX), None, None, "fp8", True, out)
    with pytest.raises(ValueError, match="w2_scale must have shape"):
        op(x, ids, tw, w.w13, w.w13_scale, w.w2, w.w2_scale[:, :, :, :128], None, None, "fp8", True, out)
    with pytest.raises(ValueError, match="out must be"):
        op(x, ids, tw, *w, None, None, "fp8", True, out[:, :64])


def _op_args(w, x, ids, tw, emap=None, limit=None, ue8m0=True):
    return (x, ids, tw, *w, emap, limit, "fp8", ue8m0, torch.empty(x.shape, dtype=torch.bfloat16))


def test_opcheck_cpu(small):
    p = prepare_moe_weights(*(small[k] for k in MX), activation="fp8")
    x, ids, tw, emap = _case(4, 2, 4, 128, seed=22)
    torch.library.opcheck(torch.ops.dsv4.mxfp4_moe.default, _op_args(p.tensors, x, ids, tw, emap, 10.0))
    torch.library.opcheck(torch.ops.dsv4.mxfp4_moe.default, _op_args(p.tensors, x, ids, tw, emap, ue8m0=False))


@pytest.mark.parametrize("activation", ["bf16", "fp8"])
def test_torch_compile_fullgraph_cpu(small, activation):
    p = prepare_moe_weights(*(small[k] for k in MX), activation=activation)
    x, ids, tw, emap = _case(3, 2, 4, 128, seed=23)

    @torch.compile(fullgraph=True)
    def f(x, ids, tw):
        return routed_moe(x, ids, tw, p, swiglu_limit=10.0, expert_map=emap, check_ids=False) * 2

    assert torch.equal(f(x, ids, tw), routed_moe(x, ids, tw, p, swiglu_limit=10.0, expert_map=emap) * 2)


# ------------------------------- the wrappers: dsv4.mxfp4_moe, routing normalisation ---


def test_mxfp4_moe_wrapper_is_the_op(small):
    """dsv4.mxfp4_moe takes the Mxfp4MoeWeights (or the W4A8 MoeWeights holding them) and
    is routed_moe's W4A8 path: the same bits."""
    assert dsv4.mxfp4_moe is mxfp4_moe
    p = prepare_moe_weights(*(small[k] for k in MX), activation="fp8")
    x, ids, tw, emap = _case(5, 2, 4, 128, seed=31)
    for ue8m0 in (True, False):
        want = routed_moe(x, ids, tw, p, swiglu_limit=10.0, expert_map=emap, ue8m0=ue8m0)
        for w in (p.tensors, p):
            assert torch.equal(mxfp4_moe(x, ids, tw, w, swiglu_limit=10.0, expert_map=emap, ue8m0=ue8m0), want)
    out = torch.full_like(x, float("nan"))
    assert mxfp4_moe(x, ids, tw, p.tensors, expert_map=emap, out=out) is out
    assert torch.equal(out, routed_moe(x, ids, tw, p, expert_map=emap))


def test_mxfp4_moe_wrapper_errors(small):
    p8 = prepare_moe_weights(*(small[k] for k in MX), activation="fp8")
    p16 = prepare_moe_weights(*(small[k] for k in MX), activation="bf16")
    x, ids, tw, emap = _case(3, 2, 4, 128, seed=32)
    for w in (p16, p16.tensors, tuple(p8.tensors)):
        with pytest.raises(TypeError, match="dsv4: mxfp4_moe: weights must be the Mxfp4MoeWeights of "
                                            r"dsv4.prepare_moe_weights\(..., activation='fp8'\), got"):
            mxfp4_moe(x, ids, tw, w)
    with pytest.raises(ValueError, match=r"dsv4: mxfp4_moe: topk_ids must lie in \[0, 9\) \(expert_map size\)"):
        mxfp4_moe(x, ids + 9, tw, p8, expert_map=emap)
    with pytest.raises(ValueError, match=r"dsv4: mxfp4_moe: expert_map values must lie in \[-1, 4\)"):
        mxfp4_moe(x, ids, tw, p8, expert_map=emap + 4)
    with pytest.raises(ValueError, match="dsv4: mxfp4_moe: x must have dtype torch.bfloat16"):
        mxfp4_moe(x.float(), ids, tw, p8, expert_map=emap)
    with pytest.raises(ValueError, match=r"dsv4: mxfp4_moe: topk_weights must have shape \[M=3, k=2\]"):
        mxfp4_moe(x, ids, tw[:, :1], p8, expert_map=emap)
    with pytest.raises(ValueError, match="dsv4: mxfp4_moe: swiglu_limit must be positive"):
        mxfp4_moe(x, ids, tw, p8, expert_map=emap, swiglu_limit=-1.0)
    with pytest.raises(ValueError, match=r"dsv4: mxfp4_moe: out must be torch.bfloat16 \[M=3, K=128\]"):
        mxfp4_moe(x, ids, tw, p8, expert_map=emap, out=torch.empty(3, 128))
    with pytest.raises(ValueError, match="dsv4: mxfp4_moe: topk_ids must be an integer tensor"):
        mxfp4_moe(x, ids.float(), tw, p8, expert_map=emap)
    with pytest.raises(ValueError, match="dsv4: mxfp4_moe: topk_weights must be a float32/float16/bfloat16/float64"):
        mxfp4_moe(x, ids, tw.to(torch.int32), p8, expert_map=emap)
    with pytest.raises(TypeError, match="dsv4: mxfp4_moe: topk_ids must be a torch.Tensor"):
        mxfp4_moe(x, ids.tolist(), tw, p8, expert_map=emap)


def test_mxfp4_moe_fake_kernel(small):
    """The fake kernel checks what the CPU and CUDA kernels check and allocates nothing:
    under FakeTensorMode a good call passes, a bad one fails with the same message; the
    wrapper traces into one graph (torch.compile fullgraph, the fake kernel for shapes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = prepare_moe_weights(*(small[k] for k in MX), activation="fp8")
    x, ids, tw, emap = _case(4, 2, 4, 128, seed=33)
    with FakeTensorMode() as mode:
        fx, fids, ftw, femap = (mode.from_tensor(t) for t in (x, ids, tw, emap))
        fw = Mxfp4MoeWeights(*(mode.from_tensor(t) for t in p.tensors))
        out = mxfp4_moe(fx, fids, ftw, fw, expert_map=femap, swiglu_limit=10.0, check_ids=False)
        assert out.shape == (4, 128) and out.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="dsv4: mxfp4_moe: w13 has K = 128 but x has K = 64"):
            torch.ops.dsv4.mxfp4_moe(fx[:, :64], fids, ftw, *fw, femap, None, "fp8", True, out[:, :64])
        with pytest.raises(ValueError, match='dsv4: mxfp4_moe: dsv4::mxfp4_moe runs activation "fp8"'):
            torch.ops.dsv4.mxfp4_moe(fx, fids, ftw, *fw, femap, None, "bf16", True, out)
    torch.library.opcheck(torch.ops.dsv4.mxfp4_moe.default, _op_args(p.tensors, x, ids, tw, None, 10.0))
    empty = _case(0, 2, 4, 128, seed=34)
    torch.library.opcheck(torch.ops.dsv4.mxfp4_moe.default, _op_args(p.tensors, *empty))

    @torch.compile(fullgraph=True)
    def f(x, ids, tw):
        return mxfp4_moe(x, ids, tw, p.tensors, swiglu_limit=10.0, expert_map=emap, check_ids=False) + 1

    assert torch.equal(f(x, ids, tw), mxfp4_moe(x, ids, tw, p.tensors, swiglu_limit=10.0, expert_map=emap) + 1)


def _prepared(fmt_act):
    if fmt_act == "nvfp4":
        w = formats.random_nvfp4_moe_weights(4, 64, 128, generator=torch.Generator().manual_seed(35))
        return prepare_moe_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], w13_scale_2=w["w13_scale_2"],
                                   w2_scale_2=w["w2_scale_2"])
    return prepare_moe_weights(*(_weights(4, 64, 128, seed=36)[k] for k in MX), activation=fmt_act.split("-")[1])


@pytest.mark.parametrize("fmt_act", ["nvfp4", "mxfp4-bf16", "mxfp4-fp8"])
def test_routed_moe_normalises_the_routing_arguments(fmt_act):
    """One normalisation for both formats (dsv4.moe._routing.normalize): any integer ids
    and map (checked before narrowing to int32), any float weights, strided views, an
    allocated or a given out. The result is that of the plain int32 / float32 /
    contiguous call."""
    p = _prepared(fmt_act)
    op = "mxfp4_moe" if p.activation == "fp8" else "nvfp4_moe"
    x, ids, tw, emap = _case(6, 3, 4, 128, seed=37)
    want = routed_moe(x, ids, tw, p, expert_map=emap)
    strided = lambda t: torch.stack([t, t], dim=-1)[..., 0]  # noqa: E731  same values, not contiguous
    for conv_ids, conv_tw, conv_map in [(torch.int64, torch.float64, torch.int64), (torch.int16, torch.float32,
                                                                                    torch.int64)]:
        a_ids, a_tw, a_map = strided(ids.to(conv_ids)), strided(tw.to(conv_tw)), strided(emap.to(conv_map))
        assert not (a_ids.is_contiguous() or a_tw.is_contiguous() or a_map.is_contiguous())
        assert torch.equal(routed_moe(x, a_ids, a_tw, p, expert_map=a_map), want)
        out = torch.full_like(x, float("nan"))
        assert routed_moe(x, a_ids, a_tw, p, expert_map=a_map, out=out) is out and torch.equal(out, want)
    # bf16 weights: converted to float32, so the result is that of their float32 values
    assert torch.equal(routed_moe(x, ids, tw.bfloat16(), p, expert_map=emap),
                       routed_moe(x, ids, tw.bfloat16().float(), p, expert_map=emap))
    # an int64 id past 2^31 is refused, not wrapped onto a valid int32 id
    wrap = ids.long().clone()
    wrap[0, 0] = 2**32 + int(ids[0, 0])
    with pytest.raises(ValueError, match=rf"dsv4: {op}: topk_ids must lie in \[0, 9\)"):
        routed_moe(x, wrap, tw, p, expert_map=emap)
    with pytest.raises(ValueError, match=rf"dsv4: {op}: expert_map values must lie in \[-1, 4\)"):
        routed_moe(x, ids, tw, p, expert_map=emap.long() + 2**32)
    with pytest.raises(ValueError, match=rf"dsv4: {op}: topk_ids must be an integer tensor"):
        routed_moe(x, ids.float(), tw, p, expert_map=emap)
    with pytest.raises(ValueError, match=rf"dsv4: {op}: expert_map must be an integer tensor"):
        routed_moe(x, ids, tw, p, expert_map=emap.float())
    # check_ids=False skips the host check (no sync); the kernels drop bad ids
    routed_moe(x, ids, tw, p, expert_map=emap, check_ids=False)


# ------------------------------------------------------------------- GPU -----------
# The W4A16 path: MXFP4 folded exactly into the bf16 kernels' NVFP4 operand, against
# the float32 MXFP4 reference on the original weights; the W4A8 path below.

SHAPES = {  # K, N, E_global, E_local (a slice of the experts: the kernels do not depend on E)
    "flash": (4096, 2048, 256, 16),
    "pro": (7168, 3072, 384, 12),
    "v41": (5120, 2304, 384, 12),
    "v41_tp8": (5120, 288, 384, 24),
}
_GPU = {}


def _gpu_model(name, activation="bf16"):
    if (name, activation) not in _GPU:
        _GPU.clear()
        torch.cuda.empty_cache()
        K, N, _, E = SHAPES[name]
        w = _weights(E, N, K, seed=K + N, device="cuda")
        _GPU[name, activation] = (w, prepare_moe_weights(*(w[k] for k in MX), activation=activation))
    return _GPU[name, activation]


def _gpu_case(name, M, seed, routing="uniform", use_map=True):
    K, _, E_global, E = SHAPES[name]
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=gen) * 2).to(torch.bfloat16).cuda()
    E_ids = E_global if use_map else E
    if routing == "uniform":
        ids, tw = _routing(M, 6, E_ids, gen, "cuda")
    else:  # skewed: every slot of every token to one of two experts, the others empty
        ids = torch.randint(0, 2, (M, 6), generator=gen).to(torch.int32).cuda() * 3
        tw = torch.rand(M, 6, generator=gen).cuda()
    emap = None
    if use_map:
        m = torch.full((E_global,), -1, dtype=torch.int32)
        m[torch.randperm(E_global, generator=gen)[:E]] = torch.arange(E, dtype=torch.int32)
        if routing != "uniform":
            m[0], m[3] = 0, 1
        else:  # token 0 gets one local expert, so that no case is an all-zero output (where
            # "closer to W4A8 than to W4A16" cannot be told: both distances are 0)
            row = ids[0].cpu()
            if not bool((m[row.long()] >= 0).any()):
                free = [e for e in torch.nonzero(m >= 0).view(-1).tolist() if e not in row.tolist()]
                ids[0, 0] = free[0]
        emap = m.cuda()
    return x, ids, tw, emap


GPU_CASES = [  # (shape, M, routing, expert_map, swiglu_limit)
    ("flash", 1, "uniform", True, 10.0),
    ("flash", 7, "uniform", False, None),
    ("flash", 64, "skewed", True, 10.0),
    ("flash", 512, "uniform", True, 10.0),
    ("pro", 1, "uniform", True, 10.0),
    ("pro", 64, "uniform", False, 10.0),
    ("pro", 512, "skewed", False, None),
    ("v41", 7, "uniform", True, 10.0),
    ("v41", 512, "uniform", True, 10.0),
    ("v41_tp8", 1, "uniform", True, 10.0),
    ("v41_tp8", 7, "skewed", True, 10.0),
    ("v41_tp8", 64, "uniform", False, None),
    ("v41_tp8", 512, "uniform", True, 10.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,M,routing,use_map,limit", GPU_CASES)
def test_gpu_w4a16_vs_reference(name, M, routing, use_map, limit):
    w, p = _gpu_model(name)
    assert p.report["inexact_blocks"] == 0
    x, ids, tw, emap = _gpu_case(name, M, seed=M + 3, routing=routing, use_map=use_map)
    out = torch.full_like(x, float("nan"))  # poisoned
    got = routed_moe(x, ids, tw, p, swiglu_limit=limit, expert_map=emap, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    ref = reference.mxfp4_moe(x, ids, tw, *(w[k] for k in MX), swiglu_limit=limit, activation="bf16",
                              expert_map=emap)
    err = _rel_l2(got, ref)
    assert err <= 5e-3, f"relative L2 {err:.3e}"
    assert torch.equal(routed_moe(x, ids, tw, p, swiglu_limit=limit, expert_map=emap), got)  # deterministic


def _check_graph_replay(name, activation, seed):
    """One routed_moe call captured in a CUDA graph, replayed on two fresh inputs copied
    into the captured buffers: each replay equals an eager call on the same inputs."""
    w, p = _gpu_model(name, activation)
    x, ids, tw, emap = _gpu_case(name, 64, seed=seed)
    out = torch.empty_like(x)
    routed_moe(x, ids, tw, p, swiglu_limit=10.0, expert_map=emap, out=out)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        routed_moe(x, ids, tw, p, swiglu_limit=10.0, expert_map=emap, out=out, check_ids=False)
    for s in (seed + 1, seed + 2):
        x2, ids2, tw2, _ = _gpu_case(name, 64, seed=s)
        x.copy_(x2)
        ids.copy_(ids2)
        tw.copy_(tw2)
        graph.replay()
        assert torch.equal(out, routed_moe(x, ids, tw, p, swiglu_limit=10.0, expert_map=emap))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flash", "v41_tp8"])
def test_gpu_w4a16_cuda_graph_replay(name):
    _check_graph_replay(name, "bf16", seed=31)


@pytest.mark.gpu
def test_gpu_opcheck():
    w = _weights(4, 96, 128, seed=40, device="cuda")
    p = prepare_moe_weights(*(w[k] for k in MX), activation="bf16")
    gen = torch.Generator().manual_seed(41)
    x = torch.randn(6, 128, generator=gen).to(torch.bfloat16).cuda()
    ids, tw = _routing(6, 2, 4, gen, "cuda")
    out = torch.empty_like(x)
    torch.library.opcheck(torch.ops.dsv4.nvfp4_moe.default,
                          (x, ids, tw, *p.tensors, None, None, None, 10.0, "bf16", 0, out))
    ref = reference.mxfp4_moe(x, ids, tw, *(w[k] for k in MX), swiglu_limit=10.0, activation="bf16")
    assert _rel_l2(routed_moe(x, ids, tw, p, swiglu_limit=10.0), ref) <= 5e-3
    p8 = prepare_moe_weights(*(w[k] for k in MX), activation="fp8")
    for ue8m0 in (True, False):
        torch.library.opcheck(torch.ops.dsv4.mxfp4_moe.default,
                              (x, ids, tw, *p8.tensors, None, 10.0, "fp8", ue8m0, torch.empty_like(x)))


# The W4A8 path (csrc/moe/mxfp4_moe.cu: FP8 mma.sync, the small-batch kernels at every M
# for now) against the float32 W4A8 reference on the original weights. Tolerance: the
# kernel's fp32 accumulation order and fast silu move GEMM1's output by ulps, which now
# and then flips an FP8 rounding of h (one e4m3 step, 2^-4 relative, of one element).

W4A8_CASES = [  # (shape, M, routing, expert_map, swiglu_limit, ue8m0)
    ("flash", 1, "uniform", True, 10.0, True),
    ("flash", 7, "uniform", False, None, True),
    ("flash", 64, "skewed", True, 10.0, False),
    ("flash", 512, "uniform", True, 10.0, True),
    ("flash", 8192, "uniform", True, 10.0, True),
    ("pro", 1, "uniform", True, 10.0, True),
    ("pro", 64, "uniform", False, 10.0, False),
    ("pro", 512, "skewed", False, None, True),
    ("v41", 7, "uniform", True, 10.0, True),
    ("v41", 512, "uniform", True, 10.0, True),
    ("v41_tp8", 1, "uniform", True, 10.0, True),
    ("v41_tp8", 7, "skewed", True, 10.0, True),
    ("v41_tp8", 64, "uniform", False, None, False),
    ("v41_tp8", 8192, "uniform", True, 10.0, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,M,routing,use_map,limit,ue8m0", W4A8_CASES)
def test_gpu_w4a8_vs_reference(name, M, routing, use_map, limit, ue8m0):
    w, p = _gpu_model(name, "fp8")
    assert p.report["inexact_blocks"] == 0
    x, ids, tw, emap = _gpu_case(name, M, seed=M + 5, routing=routing, use_map=use_map)
    out = torch.full_like(x, float("nan"))  # poisoned
    got = routed_moe(x, ids, tw, p, swiglu_limit=limit, ue8m0=ue8m0, expert_map=emap, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    ref = reference.mxfp4_moe(x, ids, tw, *(w[k] for k in MX), swiglu_limit=limit, activation="fp8", ue8m0=ue8m0,
                              expert_map=emap)
    err = _rel_l2(got, ref)
    assert err <= 1e-2, f"relative L2 {err:.3e}"
    bf16 = reference.mxfp4_moe(x, ids, tw, *(w[k] for k in MX), swiglu_limit=limit, activation="bf16",
                               expert_map=emap)
    assert bool(ref.abs().max() > 0), "degenerate case: no local route, nothing to compare"
    assert err < _rel_l2(got, bf16)  # closer to the W4A8 numerics than to W4A16's
    assert torch.equal(routed_moe(x, ids, tw, p, swiglu_limit=limit, ue8m0=ue8m0, expert_map=emap), got)


@pytest.mark.gpu
def test_gpu_w4a8_empty_and_all_remote():
    w, p = _gpu_model("flash", "fp8")
    x = torch.zeros(0, 4096, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(0, 6, dtype=torch.int32, device="cuda")
    assert routed_moe(x, ids, ids.float(), p).shape == (0, 4096)
    x, ids, tw, _ = _gpu_case("flash", 5, seed=7)
    out = torch.full_like(x, float("nan"))
    emap = torch.full((256,), -1, dtype=torch.int32, device="cuda")
    assert torch.equal(routed_moe(x, ids, tw, p, expert_map=emap, out=out), torch.zeros_like(x))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flash", "v41_tp8"])
def test_gpu_w4a8_cuda_graph_replay(name):
    _check_graph_replay(name, "fp8", seed=51)


@pytest.mark.gpu
def test_gpu_w4a8_bad_inputs():
    w, p = _gpu_model("flash", "fp8")
    x, ids, tw, emap = _gpu_case("flash", 4, seed=8)
    op = torch.ops.dsv4.mxfp4_moe
    out = torch.empty_like(x)
    with pytest.raises(RuntimeError, match="x must have dtype"):
        op(x.float(), ids, tw, *p.tensors, emap, None, "fp8", True, out)
    with pytest.raises(RuntimeError, match="topk_weights must have shape"):
        op(x, ids, tw[:, :2].contiguous(), *p.tensors, emap, None, "fp8", True, out)
    with pytest.raises(RuntimeError, match="multiple of 128"):
        op(x[:, :64].contiguous(), ids, tw, *p.tensors, emap, None, "fp8", True, out[:, :64].contiguous())
    with pytest.raises(RuntimeError, match="w2_scale must have shape"):
        t = p.tensors
        op(x, ids, tw, t.w13, t.w13_scale, t.w2, t.w2_scale[:, :, :1].contiguous(), emap, None, "fp8", True, out)
