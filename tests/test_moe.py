"""dsv4 NVFP4 MoE: prepare layout, the op chain (schema, fake, CPU, CUDA), errors,
and the CUDA kernels against the float32 reference (dsv4.reference.nvfp4_moe)."""

import pytest
import torch

import dsv4._ops
from dsv4 import formats, reference
from dsv4.formats.nvfp4_moe_layout import check_prepared, pad_nvfp4_moe_weights
from dsv4.moe import (
    Nvfp4MoeWeights,
    nvfp4_moe,
    prepare_moe_weights,
    prepare_nvfp4_moe_weights,
    routed_moe,
    unprepare_nvfp4_moe_weights,
)

KEYS = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")


def _weights(E, N, K, seed, device="cpu", chunk=8):
    """Random NVFP4 weights (vLLM layout), generated `chunk` experts at a time."""
    parts = []
    for i, e0 in enumerate(range(0, E, chunk)):
        gen = torch.Generator(device=device).manual_seed(seed * 1000 + i)
        parts.append(formats.random_nvfp4_moe_weights(min(chunk, E - e0), N, K, generator=gen, device=device))
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _routing(M, k, E_ids, gen, device="cpu", kind="uniform"):
    if kind == "uniform":
        ids = torch.stack([torch.randperm(E_ids, generator=gen)[:k] for _ in range(M)]) if M else torch.zeros(0, k)
    elif kind == "skewed":  # every slot of every token to one expert
        ids = torch.full((M, k), 3 % E_ids)
    elif kind == "sparse":  # only experts 0 and 5 (and 2): the others get no token
        ids = torch.tensor([0, 5, 2])[torch.randint(0, 3, (M, k), generator=gen)]
    elif kind == "ladder":  # expert j gets LADDER[j] slots, one stays empty, the rest spread evenly; shuffled
        others = E_ids - len(LADDER) - 1
        q, r = divmod(M * k - sum(LADDER), others)
        assert q >= 0 and others >= 2
        counts = LADDER + [0] + [q + (i < r) for i in range(others)]
        flat = torch.repeat_interleave(torch.arange(E_ids), torch.tensor(counts))
        ids = flat[torch.randperm(M * k, generator=gen)].view(M, k)
    else:
        raise ValueError(kind)
    w = torch.rand(M, k, generator=gen) + 0.1
    return ids.to(torch.int32).to(device), (w / w.sum(-1, keepdim=True)).float().to(device)


# Slot counts around every 32-row boundary of the prefill kernel's groups (tails of 1..5
# halves, full 192-row groups, several groups per expert).
LADDER = [1, 17, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129, 159, 160, 161, 191, 192, 193, 224, 257, 385, 450]


def _expert_map(E_global, E_local, gen, device):
    """E_local random global experts are local (ids 0..E_local-1), the others -1."""
    m = torch.full((E_global,), -1, dtype=torch.int32)
    m[torch.randperm(E_global, generator=gen)[:E_local]] = torch.arange(E_local, dtype=torch.int32)
    return m.to(device)


def _ref(x, ids, tw, w, **kw):
    return reference.nvfp4_moe(x, ids, tw, *(w[k] for k in KEYS), **kw)


def _call_kwargs(w, activation, limit, emap=None):
    """nvfp4_moe keyword arguments of one case; nvfp4 mode adds the checkpoint's input scales."""
    kw = dict(swiglu_limit=limit, activation=activation, expert_map=emap)
    if activation == "nvfp4":
        kw.update(a13_scale=w["w13_input_scale"], a2_scale=w["w2_input_scale"])
    return kw


def _rel_l2(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- CPU ---------


@pytest.fixture(scope="module")
def small():
    w = _weights(4, 64, 128, seed=1)
    return w, prepare_nvfp4_moe_weights(*(w[k] for k in KEYS))


def test_prepare_roundtrip_and_idempotent(small):
    w, p = small
    assert isinstance(p, Nvfp4MoeWeights)
    assert p.w13.shape == (4, 2, 2, 2048) and p.w2.shape == (4, 2, 1, 2048)
    assert p.w13_scale_2.shape == (4, 2)
    again = prepare_nvfp4_moe_weights(*p)
    assert all(a is b for a, b in zip(again, p))
    back = unprepare_nvfp4_moe_weights(p)
    for k in ("w13", "w2"):
        assert torch.equal(back[k], w[k])
    for k in ("w13_scale", "w2_scale"):
        assert torch.equal(back[k].view(torch.uint8), w[k].view(torch.uint8))
    assert torch.equal(back["w13_scale_2"], w["w13_scale_2"].unsqueeze(1).expand(4, 2))


def _bf16_halves(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 words holding two bf16 -> their (low, high) values as float32."""
    lo = ((words & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
    hi = (words & 0xFFFF0000).to(torch.int32).view(torch.float32)
    return lo, hi


def test_prepared_codes_expand_with_the_kernel_integer_ops(small):
    """The prepared w2 tiles, expanded with exactly the integer and bf16 steps of
    dequant_kstep / scale_pair_bf16x2 (csrc/moe/dequant.cuh), give every weight times
    2^-7: the Python bit layout (_BIT_POS) and the kernel's extraction agree."""
    w, p = small
    E, RT, KT, _ = p.w2.shape
    q = p.w2.reshape(E, RT, KT, 128, 4, 4).to(torch.int64)  # [.., thread T, word j, byte]
    q = q[..., 0] | q[..., 1] << 8 | q[..., 2] << 16 | q[..., 3] << 24
    mask = 0x81C081C0

    def rotl(v, r):  # __funnelshift_l(v, v, r)
        return ((v << r) | (v >> (32 - r))) & 0xFFFFFFFF

    pairs = [q & mask, rotl(q, 10) & mask, rotl(q, 13) & mask, (((q & 0x001B001B) * 0x4108) & 0xFFFFFFFF) & mask]
    sb = p.w2_scale.reshape(E, RT, KT, 4, 8, 4, 2).to(torch.int64)  # [.., w, g, j, row g / g+8]
    sw = sb[..., 0] | sb[..., 1] << 16  # one PRMT: row g's byte low, row g+8's byte high
    s_lo, s_hi = _bf16_halves(sw * 16 + 0x76007600)  # [.., w, g, j]
    got = torch.empty(E, RT, KT, 64, 64)
    T = torch.arange(128)
    wq, g, t = T // 32, (T // 4) % 8, T % 4
    for j in range(4):
        for pr in range(4):
            kh, hi = pr // 2, pr % 2
            scale = (s_hi if hi else s_lo)[..., wq, g, j]  # [E, RT, KT, 128]
            for i, v in enumerate(_bf16_halves(pairs[pr][..., j])):
                got[..., 16 * wq + 8 * hi + g, 16 * j + 8 * kh + 2 * t + i] = v * scale
    got = got.permute(0, 1, 3, 2, 4).reshape(E, RT * 64, KT * 64)
    want = formats.dequantize_experts(w["w2"], w["w2_scale"], torch.ones(E)) * 2.0**-7
    assert torch.equal(got, want)


@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_cpu_wrapper_is_the_reference(small, activation):
    w, p = small
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
    emap = _expert_map(9, 4, gen, "cpu")
    emap[0] = 1
    ids, tw = _routing(5, 3, 9, gen)
    kw = _call_kwargs(w, activation, 10.0, emap)
    got = nvfp4_moe(x, ids, tw, p, **kw)
    assert got.dtype == torch.bfloat16 and got.shape == (5, 128)
    assert torch.equal(got, _ref(x, ids, tw, w, **kw).to(torch.bfloat16))
    # the un-prepared dict is accepted too, with a warning about the per-call conversion
    with pytest.warns(UserWarning, match="prepare_nvfp4_moe_weights once"):
        assert torch.equal(nvfp4_moe(x, ids, tw, w, **kw), got)


def _bad_cases():
    def base():
        x = torch.randn(3, 128).to(torch.bfloat16)
        ids = torch.tensor([[0, 1], [2, 3], [1, 1]], dtype=torch.int32)
        tw = torch.full((3, 2), 0.5)
        return x, ids, tw, {}

    def mod(fn):
        def make():
            x, ids, tw, kw = base()
            return fn(x, ids, tw, kw)
        return make

    return [
        (mod(lambda x, i, t, kw: (x.float(), i, t, kw)), "x must have dtype"),
        (mod(lambda x, i, t, kw: (x[0], i, t, kw)), "x must be 2-D"),
        (mod(lambda x, i, t, kw: (x[:2], i, t, kw)), "topk_ids must have shape"),
        (mod(lambda x, i, t, kw: (x, i, t[:, :1], kw)), "topk_weights must have shape"),
        (mod(lambda x, i, t, kw: (x, i.clone().fill_(4), t, kw)), "topk_ids must lie in"),
        (mod(lambda x, i, t, kw: (x, i.clone().fill_(-1), t, kw)), "topk_ids must lie in"),
        (mod(lambda x, i, t, kw: (x, i, t, dict(expert_map=torch.tensor([0, 1, 2], dtype=torch.int32)))),
         "topk_ids must lie in"),
        (mod(lambda x, i, t, kw: (x, i, t, dict(expert_map=torch.tensor([0, 1, 2, 7], dtype=torch.int32)))),
         "expert_map values must lie in"),
        (mod(lambda x, i, t, kw: (x, i, t, dict(activation="nvfp4"))), "a13_scale is required"),
        (mod(lambda x, i, t, kw: (x, i, t, dict(activation="nvfp4", a13_scale=1.0))), "a2_scale is required"),
        (mod(lambda x, i, t, kw: (x, i, t, dict(activation="fp8"))), "activation must be"),
        (mod(lambda x, i, t, kw: (x, i, t, dict(cta_mode=3))), "cta_mode must be"),
        (mod(lambda x, i, t, kw: (x, i, t, dict(swiglu_limit=-1.0))), "swiglu_limit must be positive"),
        (mod(lambda x, i, t, kw: (x[:, :64].contiguous(), i, t, kw)), "K = 64"),
    ]


@pytest.mark.parametrize("make,match", _bad_cases())
def test_cpu_bad_inputs(small, make, match):
    _, p = small
    x, ids, tw, kw = make()
    with pytest.raises(ValueError, match=match):
        nvfp4_moe(x, ids, tw, p, **kw)


def test_cpu_bad_weights(small):
    w, p = small
    x = torch.randn(2, 128).to(torch.bfloat16)
    ids = torch.zeros(2, 1, dtype=torch.int32)
    tw = torch.ones(2, 1)
    with pytest.raises(ValueError, match="w13_scale must have"):
        nvfp4_moe(x, ids, tw, p._replace(w13_scale=p.w13_scale[:, :, :1].contiguous()))
    with pytest.raises(ValueError, match="w2_scale_2 must have"):
        nvfp4_moe(x, ids, tw, p._replace(w2_scale_2=p.w2_scale_2[:2]))
    with pytest.raises(ValueError, match="w2 must have shape"):
        prepare_nvfp4_moe_weights(w["w13"], w["w13_scale"], w["w13_scale_2"], w["w2"][:, :64], w["w2_scale"],
                                  w["w2_scale_2"])
    with pytest.raises(ValueError, match="w13 must be a 3-D"):
        prepare_nvfp4_moe_weights(w["w13"].float(), w["w13_scale"], w["w13_scale_2"], w["w2"], w["w2_scale"],
                                  w["w2_scale_2"])


def _op_args(p, x, ids, tw, activation="bf16", a13=None, a2=None, emap=None, limit=None, cta=0, out=None):
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device) if out is None else out
    return (x, ids, tw, *p, a13, a2, emap, limit, activation, cta, out)


def test_opcheck_cpu(small):
    w, p = small
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 128, generator=gen).to(torch.bfloat16)
    ids, tw = _routing(4, 2, 4, gen)
    torch.library.opcheck(torch.ops.dsv4.nvfp4_moe.default, _op_args(p, x, ids, tw, limit=10.0))
    a = torch.tensor([0.01])
    torch.library.opcheck(torch.ops.dsv4.nvfp4_moe.default, _op_args(p, x, ids, tw, "nvfp4", a, a * 2))


def test_torch_compile_fullgraph_cpu(small):
    w, p = small
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    ids, tw = _routing(3, 2, 4, gen)

    @torch.compile(fullgraph=True)
    def f(x, ids, tw, p):
        return nvfp4_moe(x, ids, tw, p, swiglu_limit=10.0) * 2

    assert torch.equal(f(x, ids, tw, p), nvfp4_moe(x, ids, tw, p, swiglu_limit=10.0) * 2)


def _e2m1_from_bits(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 values from the code bits (sign, 2 exponent bits, 1 mantissa bit), not
    from dsv4.formats' table."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).float()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).float()) * (1 + m / 2))
    return torch.where((c & 8) != 0, -mag, mag)


def _dequant_rows(packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K/2] (low nibble = even element), e4m3 [R, K/16], float32 [R] -> [R, K]."""
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
    return _e2m1_from_bits(codes) * scale.float().repeat_interleave(16, 1) * row_scale[:, None]


def _moe_independent(x, ids, tw, w, limit):
    """The MoE in float32, token by token, from the raw vLLM-layout bytes: gate rows
    dequantized with w13_scale_2[e, 0], up rows with w13_scale_2[e, 1] (or both with
    w13_scale_2[e] when it is [E])."""
    x, ids, tw = x.float().cpu(), ids.cpu(), tw.float().cpu()
    w = {k: v.cpu() for k, v in w.items()}
    E, two_n, _ = w["w13"].shape
    N, K = two_n // 2, x.shape[1]
    out = torch.zeros(x.shape)
    for e in range(E):
        s2 = w["w13_scale_2"][e].reshape(-1).expand(2)
        rows = torch.cat([s2[0].expand(N), s2[1].expand(N)])
        w13 = _dequant_rows(w["w13"][e], w["w13_scale"][e], rows)
        w2 = _dequant_rows(w["w2"][e], w["w2_scale"][e], w["w2_scale_2"][e].expand(K))
        for m, j in (ids == e).nonzero().tolist():
            gate, up = (w13 @ x[m]).split(N)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            out[m] += tw[m, j] * (w2 @ (gate * torch.sigmoid(gate) * up))
    return out


def _modelopt_weights(E, N, K, seed, up_ratio, device="cpu"):
    """vLLM-layout weights stacked from ModelOpt per-expert tensors; w1 (gate) and w3
    (up) are quantized separately, so each has its own weight_scale_2 (w3's about
    up_ratio times w1's); w13_scale_2 is [E, 2]."""
    gen = torch.Generator().manual_seed(seed)

    def proj(rows, cols, std):
        weight, scale, scale_2 = formats.quantize_nvfp4_weight(torch.randn(rows, cols, generator=gen) * std)
        return {"weight": weight, "weight_scale": scale, "weight_scale_2": scale_2}

    experts = [{"w1": proj(N, K, 0.05), "w3": proj(N, K, 0.05 * up_ratio), "w2": proj(K, N, 0.05)}
               for _ in range(E)]
    return {k: v.to(device) for k, v in formats.stack_modelopt_experts(experts).items()}


def _gate_scale_for_both(w):
    """What vLLM 0.33.0's ModelOpt NVFP4 MoE runs (ModelOptNvFp4FusedMoE.
    process_weights_after_loading): w13_scale_2[:, 0] for gate and up."""
    return {**w, "w13_scale_2": w["w13_scale_2"][:, 0].contiguous()}


def test_cpu_gate_and_up_global_scales():
    """ModelOpt checkpoints may give w1 and w3 different weight_scale_2: dsv4 applies
    each to its own rows. vLLM's ModelOpt path would use the gate's for both, which is
    a different answer: the test tells the two apart."""
    E, N, K, M = 3, 64, 128, 9
    w = _modelopt_weights(E, N, K, seed=5, up_ratio=4.0)
    s2 = w["w13_scale_2"]
    assert s2.shape == (E, 2) and bool((s2[:, 1] > 2 * s2[:, 0]).all())
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    ids, tw = _routing(M, 2, E, gen)
    want = _moe_independent(x, ids, tw, w, 10.0)
    ref = _ref(x, ids, tw, w, swiglu_limit=10.0)
    assert _rel_l2(ref, want) <= 1e-5
    p = prepare_nvfp4_moe_weights(*(w[k] for k in KEYS))
    assert torch.equal(p.w13_scale_2, s2)
    got = nvfp4_moe(x, ids, tw, p, swiglu_limit=10.0)
    assert torch.equal(got, ref.to(torch.bfloat16))
    vllm_like = _ref(x, ids, tw, _gate_scale_for_both(w), swiglu_limit=10.0)
    assert _rel_l2(vllm_like, want) > 0.5
    assert _rel_l2(_moe_independent(x, ids, tw, _gate_scale_for_both(w), 10.0), vllm_like) <= 1e-5


def test_cpu_equal_gate_and_up_global_scales():
    """One weight_scale_2 for both halves, given as [E] or as equal [E, 2] columns:
    the same answer, and the independent float32 one."""
    E, N, K, M = 3, 64, 128, 9
    w = _weights(E, N, K, seed=7)
    assert w["w13_scale_2"].shape == (E,)
    both = {**w, "w13_scale_2": w["w13_scale_2"][:, None].expand(E, 2).contiguous()}
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    ids, tw = _routing(M, 2, E, gen)
    ref = _ref(x, ids, tw, w, swiglu_limit=10.0)
    assert torch.equal(_ref(x, ids, tw, both, swiglu_limit=10.0), ref)
    assert _rel_l2(ref, _moe_independent(x, ids, tw, w, 10.0)) <= 1e-5
    p1 = prepare_nvfp4_moe_weights(*(w[k] for k in KEYS))
    p2 = prepare_nvfp4_moe_weights(*(both[k] for k in KEYS))
    assert torch.equal(p1.w13_scale_2, p2.w13_scale_2)
    assert torch.equal(nvfp4_moe(x, ids, tw, p1, swiglu_limit=10.0), ref.to(torch.bfloat16))


# ------------------------------------------- N not a multiple of 64: padding ---------
# V4.1-Flash at tensor parallel 8: N = 2304 / 8 = 288 per gate / up half; prepare pads it
# to 320 (dsv4.formats.nvfp4_moe_layout.pad_nvfp4_moe_weights). 80 = one 64-row tile and
# one NVFP4 block. (N must be a multiple of 16, the NVFP4 block: w2_scale is [E, K, N/16].)
PAD = ("w13", "w13_scale", "w2", "w2_scale")


def _padded(w):
    """``w`` with its four code / scale tensors padded, global and input scales as they are."""
    return {**w, **pad_nvfp4_moe_weights(*(w[k] for k in PAD))}


@pytest.mark.parametrize("N,Np", [(288, 320), (80, 128)])
def test_pad_keeps_values(N, Np):
    """Padded, then dequantized: the original values bitwise in the original rows and
    columns (gate rows 0..N-1, up rows Np..Np+N-1 under their own global scale), exact
    zeros in the padded ones."""
    E, K = 2, 128
    w = _modelopt_weights(E, N, K, seed=N, up_ratio=4.0)  # w1 / w3 global scales differ
    p = pad_nvfp4_moe_weights(*(w[k] for k in PAD))
    assert {k: tuple(v.shape) for k, v in p.items()} == {
        "w13": (E, 2 * Np, K // 2), "w13_scale": (E, 2 * Np, K // 16), "w2": (E, K, Np // 2),
        "w2_scale": (E, K, Np // 16)}
    assert p["w13_scale"].dtype == p["w2_scale"].dtype == torch.float8_e4m3fn
    d13 = formats.dequantize_experts(p["w13"], p["w13_scale"], w["w13_scale_2"]).reshape(E, 2, Np, K)
    ref13 = formats.dequantize_experts(w["w13"], w["w13_scale"], w["w13_scale_2"]).reshape(E, 2, N, K)
    assert torch.equal(d13[:, :, :N], ref13) and ref13.abs().amax() > 0
    assert torch.equal(d13[:, :, N:], torch.zeros_like(d13[:, :, N:]))  # +0.0: codes 0, scales 0
    d2 = formats.dequantize_experts(p["w2"], p["w2_scale"], w["w2_scale_2"])
    assert torch.equal(d2[..., :N], formats.dequantize_experts(w["w2"], w["w2_scale"], w["w2_scale_2"]))
    assert torch.equal(d2[..., N:], torch.zeros_like(d2[..., N:]))
    # N already a multiple: the inputs themselves
    same = pad_nvfp4_moe_weights(*(p[k] for k in PAD))
    assert all(same[k] is p[k] for k in PAD)
    assert pad_nvfp4_moe_weights(*(w[k] for k in PAD), multiple=16)["w13"] is w["w13"]


def test_prepare_pads_n():
    """prepare_nvfp4_moe_weights pads N = 288 to 320 itself: the prepared set is the
    padded one (its unprepare gives the padded tensors back bitwise), prepare_moe_weights
    reports both sizes, and a prepared set passes through unchanged."""
    E, N, K = 2, 288, 128
    w = _weights(E, N, K, seed=31)
    p = prepare_nvfp4_moe_weights(*(w[k] for k in KEYS))
    assert check_prepared("t", p) == (E, 320, K) and p.w13.shape == (E, 10, 2, 2048) and p.w2.shape == (E, 2, 5, 2048)
    back, want = unprepare_nvfp4_moe_weights(p), _padded(w)
    for k in PAD:
        assert torch.equal(back[k].view(torch.uint8), want[k].view(torch.uint8)), k
    m = prepare_moe_weights(*(w[k] for k in PAD), w13_scale_2=w["w13_scale_2"], w2_scale_2=w["w2_scale_2"])
    assert (m.report["N"], m.report["N_padded"]) == (288, 320)
    again = prepare_moe_weights(*(p[i] for i in (0, 1, 3, 4)), w13_scale_2=p.w13_scale_2, w2_scale_2=p.w2_scale_2,
                                format="nvfp4")  # prepared scale bytes are uint8: name the format
    assert all(a is b for a, b in zip(again.tensors, p)) and again.report["N"] == again.report["N_padded"] == 320


@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
@pytest.mark.parametrize("N", [288, 80])
def test_padded_moe_is_the_unpadded_math(N, activation):
    """The float32 reference MoE on padded vs unpadded weights, fresh random data: the
    padded columns' SwiGLU outputs are exact zeros (and in W4A4 whole zero NVFP4
    blocks), so the outputs agree up to the order of the fp32 sums (GEMM2 sums Np
    terms, the extra ones 0; torch's matmul blocks K = Np and K = N differently); the
    CPU op on the prepared (padded) weights, through routed_moe, is the reference on
    them bitwise."""
    E, K, M = 4, 256, 37
    w = _modelopt_weights(E, N, K, seed=N + 1, up_ratio=2.0)
    gen = torch.Generator().manual_seed(N + 2)
    x = (torch.randn(M, K, generator=gen) * 2).to(torch.bfloat16)
    ids, tw = _routing(M, 3, E, gen)
    kw = dict(swiglu_limit=10.0, activation=activation)
    if activation == "nvfp4":
        kw.update(a13_scale=torch.tensor([0.004]), a2_scale=torch.tensor([0.001]))
    wp = _padded(w)
    want = _ref(x, ids, tw, w, **kw)
    got = _ref(x, ids, tw, wp, **kw)
    assert torch.isfinite(want).all() and want.abs().amax() > 1e-3  # fresh data, not zeros
    assert _rel_l2(got, want) <= 1e-6 and (got - want).abs().amax() <= 1e-6 * want.abs().amax()
    # the padded columns' SwiGLU output: exact zeros
    d13 = formats.dequantize_experts(wp["w13"], wp["w13_scale"], wp["w13_scale_2"])
    Np = d13.shape[1] // 2
    h = reference.swiglu(x.float() @ d13[0, :Np].T, x.float() @ d13[0, Np:].T, 10.0)
    assert h[:, :N].abs().amax() > 0 and torch.equal(h[:, N:], torch.zeros_like(h[:, N:]))
    # the CPU op, from the unpadded vLLM-layout tensors
    m = prepare_moe_weights(*(w[k] for k in PAD), w13_scale_2=w["w13_scale_2"], w2_scale_2=w["w2_scale_2"],
                            activation=activation)
    assert m.report["N_padded"] == Np
    out = routed_moe(x, ids, tw, m, **{k: v for k, v in kw.items() if k != "activation"})  # m knows its mode
    assert out.shape == (M, K) and torch.equal(out, got.to(torch.bfloat16))
    assert _rel_l2(out, want) <= 4e-3  # bf16 output rounding


def test_pad_and_prepare_errors():
    """N not a multiple of 16 (V4.1-Flash at tensor parallel 32: 72), K not a multiple
    of 64, a padding multiple that is not whole NVFP4 blocks: dsv4: errors naming them."""
    w = _weights(2, 64, 128, seed=33)
    args = [w[k] for k in KEYS]
    # N = 72 (w13 [E, 144, K/2]): not whole NVFP4 blocks
    w128 = _weights(2, 128, 128, seed=35)
    n72 = dict(w13=w128["w13"][:, :144].contiguous(), w13_scale=w128["w13_scale"][:, :144].contiguous(),
               w2=w128["w2"][:, :, :36].contiguous(), w2_scale=w128["w2_scale"][:, :, :4].contiguous())
    for fn, a in ((prepare_nvfp4_moe_weights, [n72["w13"], n72["w13_scale"], w["w13_scale_2"], n72["w2"],
                                               n72["w2_scale"], w["w2_scale_2"]]),
                  (pad_nvfp4_moe_weights, [n72[k] for k in PAD])):
        with pytest.raises(ValueError, match=rf"^dsv4: {fn.__name__}: w13 \[E, 2N, K/2\] needs the intermediate "
                                             r"size N and the hidden size K to be positive multiples of 16"):
            fn(*a)
    # K = 96: whole NVFP4 blocks, not whole 64-wide K tiles (padding only pads N)
    k96 = _weights(2, 64, 96, seed=34)
    with pytest.raises(ValueError, match=r"^dsv4: prepare_nvfp4_moe_weights: the hidden size K = 96 must be a "
                                         r"multiple of 64 \(the MoE kernels' K tile\)"):
        prepare_nvfp4_moe_weights(*(k96[k] for k in KEYS))
    with pytest.raises(ValueError, match=r"^dsv4: prepare_nvfp4_moe_weights: the hidden size K = 96 must be"):
        prepare_moe_weights(*(k96[k] for k in PAD), w13_scale_2=k96["w13_scale_2"], w2_scale_2=k96["w2_scale_2"])
    assert pad_nvfp4_moe_weights(*(k96[k] for k in PAD))["w13"] is k96["w13"]  # K is not pad's business
    with pytest.raises(ValueError, match=r"^dsv4: pad_nvfp4_moe_weights: multiple must be a multiple of 16"):
        pad_nvfp4_moe_weights(*(w[k] for k in PAD), multiple=24)
    with pytest.raises(ValueError, match=r"^dsv4: pad_nvfp4_moe_weights: multiple must be a positive int"):
        pad_nvfp4_moe_weights(*(w[k] for k in PAD), multiple=0)
    with pytest.raises(ValueError, match=r"^dsv4: pad_nvfp4_moe_weights: w2 must have shape \[2, 128, 32\] to "
                                         r"match w13"):
        pad_nvfp4_moe_weights(w["w13"], w["w13_scale"], w["w2"][:, :, :16], w["w2_scale"])
    with pytest.raises(ValueError, match=r"^dsv4: pad_nvfp4_moe_weights: w13_scale must be a 3-D "
                                         r"torch.float8_e4m3fn tensor"):
        pad_nvfp4_moe_weights(w["w13"], w["w13_scale"].float(), w["w2"], w["w2_scale"])
    assert prepare_nvfp4_moe_weights(*args).w13.shape == (2, 2, 2, 2048)  # the base case is fine


# ---------------------------------------------------------------- GPU ---------

FLASH = dict(K=4096, N=2048, E_global=256, E_local=32)
PRO = dict(K=7168, N=3072, E_global=384, E_local=48)
_CACHE = {}


def _gpu_model(shape):
    key = shape["K"]
    if key not in _CACHE:
        _CACHE.clear()
        torch.cuda.empty_cache()
        w = _weights(shape["E_local"], shape["N"], shape["K"], seed=shape["K"], device="cuda")
        _CACHE[key] = (w, prepare_nvfp4_moe_weights(*(w[k] for k in KEYS)))
    return _CACHE[key]


# (shape, M, routing, expert_map?, swiglu_limit, activation, cta_mode)
GPU_MATRIX = [
    (FLASH, 1, "uniform", True, 10.0, "bf16", "auto"),
    (FLASH, 2, "uniform", True, None, "nvfp4", 1),
    (FLASH, 7, "uniform", False, 10.0, "bf16", "auto"),
    (FLASH, 64, "uniform", True, 10.0, "bf16", "auto"),
    (FLASH, 64, "uniform", True, 10.0, "nvfp4", "auto"),
    (FLASH, 512, "skewed", False, 10.0, "bf16", "auto"),
    (FLASH, 512, "sparse", True, None, "nvfp4", 2),
    (FLASH, 4096, "uniform", False, 10.0, "bf16", 1),
    (FLASH, 4096, "uniform", False, 10.0, "nvfp4", 2),
    (FLASH, 16384, "uniform", True, 10.0, "bf16", "auto"),
    (PRO, 1, "uniform", True, 10.0, "nvfp4", "auto"),
    (PRO, 64, "uniform", True, 10.0, "bf16", "auto"),
    (PRO, 512, "uniform", False, None, "bf16", "auto"),
    (PRO, 4096, "uniform", False, 10.0, "bf16", 2),
    (PRO, 16384, "uniform", True, None, "nvfp4", 1),
]


def _case(shape, M, routing, use_map, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, shape["K"], generator=gen) * 2.0).to(torch.bfloat16).cuda()
    E_ids = shape["E_global"] if use_map else shape["E_local"]
    ids, tw = _routing(M, 6, E_ids, gen, "cuda", routing)
    emap = _expert_map(shape["E_global"], shape["E_local"], gen, "cuda") if use_map else None
    if use_map and routing != "uniform":
        emap = torch.arange(shape["E_global"], dtype=torch.int32, device="cuda") % shape["E_local"]
        emap[1::2] = -1
    return x, ids, tw, emap


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_gpu_partial_tiles_bitwise(activation):
    """A token's output does not depend on how full its 64-token tile is: a tile of at most
    32 rows runs m64n32 wgmmas (moe_gemm_kernel, tile_mma_rows), whose sums are the 64-row
    ones of the same columns (docs/perf-history/2026-12-06-mxfp4-w4a8-remainder-tiles.md).
    Every token on the same 6 of V4-Flash's 32 local experts (of 256: 64-token tiles from
    1025 tokens, the one-warpgroup kernel below 2560), calls of 16 full tiles + 16 or 32
    rows, 17 and 18 full tiles: each call's rows equal the same tokens' rows of the
    largest call, bitwise."""
    w, p = _gpu_model(FLASH)
    kw = _call_kwargs(w, activation, 10.0, torch.full((256,), -1, dtype=torch.int32, device="cuda"))
    kw["expert_map"][:32] = torch.arange(32, dtype=torch.int32, device="cuda")
    gen = torch.Generator().manual_seed(78)
    x = (torch.randn(1152, FLASH["K"], generator=gen) * 2.0).to(torch.bfloat16).cuda()
    tw = torch.rand(1152, 6, generator=gen).cuda()
    ids = torch.arange(6, dtype=torch.int32).repeat(1152, 1).cuda()
    ref = nvfp4_moe(x, ids, tw, p, **kw)
    assert torch.isfinite(ref).all() and ref.abs().amax() > 0
    for M in (1040, 1056, 1088):
        assert torch.equal(nvfp4_moe(x[:M], ids[:M], tw[:M], p, **kw), ref[:M]), M


@pytest.mark.gpu
def test_gpu_opcheck():
    w = _weights(4, 64, 128, seed=9, device="cuda")
    p = prepare_nvfp4_moe_weights(*(w[k] for k in KEYS))
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, 128, generator=gen).to(torch.bfloat16).cuda()
    ids, tw = _routing(6, 2, 4, gen, "cuda")
    torch.library.opcheck(torch.ops.dsv4.nvfp4_moe.default, _op_args(p, x, ids, tw, limit=10.0))
    a = w["w13_input_scale"]
    torch.library.opcheck(torch.ops.dsv4.nvfp4_moe.default,
                          _op_args(p, x, ids, tw, "nvfp4", a, w["w2_input_scale"][:1].contiguous()))


def _ref_gemm1(x, ids, w, emap, limit, activation, a13):
    """fp32 reference SwiGLU output per flattened slot (zeros for non-local slots)."""
    M, k = ids.shape
    N = w["w13"].shape[1] // 2
    local = ids.long() if emap is None else emap.long()[ids.long()]
    flat = local.reshape(-1)
    h = torch.zeros(M * k, N, device=x.device)
    for e in flat.unique().tolist():
        if e < 0:
            continue
        rows = (flat == e).nonzero().squeeze(1)
        xe = x.float()[rows // k]
        if activation == "nvfp4":
            g = a13[e:e + 1]
            xe = formats.dequantize_nvfp4(*reference.quantize_nvfp4(xe, g), g)
        w13 = formats.dequantize_experts(w["w13"][e:e + 1], w["w13_scale"][e:e + 1], w["w13_scale_2"][e:e + 1])[0]
        h[rows] = reference.swiglu(xe @ w13[:N].T, xe @ w13[N:].T, limit)
    return h, flat


def _explained_code_differences(codes, x, g) -> int:
    """NVFP4 codes from the GPU (packed) vs dsv4.reference.quantize_nvfp4 of x (exact
    reciprocals): equal, except codes that the kernels' rcp.approx explains
    (reference.nvfp4_rcp_approx_codes); returns how many differ."""
    got = formats.unpack_fp4(codes)
    cand = reference.nvfp4_rcp_approx_codes(x, g)
    differ = got != cand[..., 4]
    unexplained = differ & ~(got.unsqueeze(-1) == cand).any(-1)
    assert not unexplained.any(), (f"{int(unexplained.sum())} NVFP4 codes differ from dsv4.formats beyond "
                                   f"rcp.approx rounding, first at {unexplained.nonzero()[:3].tolist()}")
    return int(differ.sum())


def _gemm1_debug(x, topk_ids, weights: Nvfp4MoeWeights, *, swiglu_limit=None, activation="bf16", a13_scale=None,
                 a2_scale=None, expert_map=None, cta_mode=0):
    """The test-only op dsv4_testing::nvfp4_moe_gemm1_debug (csrc/moe/nvfp4_moe.cu): the
    chain up to GEMM1's epilogue. Returns per (token, slot), flattened to M*k rows: the
    fp32 SwiGLU output [M*k, N] as the epilogue computed it, its NVFP4 codes [M*k, N/2]
    and e4m3 scales [M*k, N/16] (nvfp4 mode; zeros otherwise), and a bool [M*k] mask of
    local slots. Scales are float32 tensors ([1] or [E])."""
    nvfp4 = activation == "nvfp4"
    a13 = a13_scale.float().reshape(-1).contiguous() if nvfp4 else None
    a2 = a2_scale.float().reshape(-1).contiguous() if nvfp4 else None
    return torch.ops.dsv4_testing.nvfp4_moe_gemm1_debug(
        x, topk_ids.to(torch.int32), weights.w13, weights.w13_scale, weights.w13_scale_2, a13, a2,
        None if expert_map is None else expert_map.to(torch.int32),
        None if swiglu_limit is None else float(swiglu_limit), activation, cta_mode)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
@pytest.mark.parametrize("M", [3, 300, 2048])
def test_gpu_gemm1_epilogue(activation, M):
    """GEMM1 alone vs the fp32 reference; in nvfp4 mode the epilogue's NVFP4 output
    matches dsv4.reference.quantize_nvfp4 of the same (fp32) GEMM1 output: scales bit
    for bit, codes too except where rcp.approx rounding moves a tie (counted)."""
    w, p = _gpu_model(FLASH)
    x, ids, _, emap = _case(FLASH, M, "uniform", True, seed=M)
    a13, a2 = w["w13_input_scale"], w["w2_input_scale"]
    h, hq, hs, local = _gemm1_debug(x, ids, p, swiglu_limit=10.0, activation=activation, a13_scale=a13,
                                    a2_scale=a2, expert_map=emap)
    ref_h, flat = _ref_gemm1(x, ids, w, emap, 10.0, activation, a13)
    assert torch.equal(local, flat >= 0)
    assert _rel_l2(h, ref_h) <= (2e-3 if activation == "bf16" else 1e-2)
    if activation == "nvfp4":
        explained = 0
        for e in flat.unique().tolist():
            if e < 0:
                continue
            rows = (flat == e).nonzero().squeeze(1)
            _, scales = reference.quantize_nvfp4(h[rows], a2[e:e + 1])
            assert torch.equal(hs.view(torch.uint8)[rows], scales.view(torch.uint8))
            explained += _explained_code_differences(hq[rows], h[rows], a2[e:e + 1])
        print(f"GEMM1 epilogue M={M}: {explained} of {hq.numel() * 2} codes differ from dsv4.formats, each at a tie "
              "that rcp.approx rounding moves")


def _one_hot_w13(K: int) -> dict:
    """One expert, N = K: gate row n reads x[:, 0], up row n reads x[:, n] (code 1.0,
    block scales 1.0, global scales 1.0); w2 is zero. GEMM1 then gives
    h[m, n] = silu(xq[m, 0]) * xq[m, n]: every element of the quantized GEMM1 input."""
    N = K
    codes = torch.zeros(2 * N, K, dtype=torch.uint8)
    codes[:N, 0] = 2
    codes[torch.arange(N, 2 * N), torch.arange(N)] = 2
    one = torch.ones((), dtype=torch.float32)
    return {"w13": formats.pack_fp4(codes)[None], "w13_scale": torch.ones(1, 2 * N, K // 16).to(torch.float8_e4m3fn),
            "w13_scale_2": one.expand(1, 2).contiguous(), "w2": torch.zeros(1, K, N // 2, dtype=torch.uint8),
            "w2_scale": torch.ones(1, K, N // 16).to(torch.float8_e4m3fn), "w2_scale_2": one.expand(1).contiguous()}


def _near_ties(M, K, g, gen):
    """bf16 [M, K]: blocks of every magnitude whose elements sit on or next to the
    rounding ties of their own block (t * d, d the reference's divisor), a zero block
    and a block whose scale underflows; x[:, 0] is its block's amax (> 0)."""
    x = torch.randn(M, K, generator=gen) * torch.exp(torch.randn(M, K // 16, generator=gen) * 1.5).repeat_interleave(16, 1)
    x[:, :16] *= 3.0 / x[:, :16].abs().amax(1, keepdim=True)
    x = x.to(torch.bfloat16)
    _, scales = reference.quantize_nvfp4(x, g)
    d = (scales.float() * g).repeat_interleave(16, 1)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])[torch.randint(0, 7, (M, K), generator=gen)]
    near = (ties * d).to(torch.bfloat16).view(torch.int16)
    near = (near + torch.randint(-1, 2, (M, K), generator=gen).to(torch.int16)).view(torch.bfloat16)
    pick = (torch.rand(M, K, generator=gen) < 0.5) & (near.float().abs() < x.float().abs().reshape(M, -1, 16)
                                                      .amax(-1).repeat_interleave(16, 1))
    x = torch.where(pick, near * torch.sign(x.float()).to(torch.bfloat16), x)
    if K >= 48:
        x[:, 16:32] = 0.0
        x[:, 32:48] *= 1e-30
    x[:, 0] = x[:, :16].float().abs().amax(1).to(torch.bfloat16)
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("M", [5, 40, 300])  # decode, one-warpgroup and prefill GEMM1 kernels
@pytest.mark.parametrize("g", [2.0**-8, 0.01, 0.0173])  # 0.01: many bf16 x / (s * g) land on ties
def test_gpu_gemm1_input_quantizer(M, g):
    """The MoE's NVFP4 quantization of GEMM1's input (moe_gather_kernel) element by
    element: with one-hot weights GEMM1 returns silu(xq[:, 0]) * xq, so xq is read back
    from the debug output and must be, per element, one of the dequantized values
    that dsv4.formats (with rcp.approx's +-1 ulp) allows: the exact one except at ties
    that rcp.approx rounding moves (counted). A wrong block scale or code shows as a
    value off by at least a sixteenth."""
    K = 128
    w = {k: v.cuda() for k, v in _one_hot_w13(K).items()}
    p = prepare_nvfp4_moe_weights(*(w[k] for k in KEYS))
    x = _near_ties(M, K, g, torch.Generator().manual_seed(M))
    ids = torch.zeros(M, 1, dtype=torch.int32, device="cuda")
    a = torch.tensor([g], device="cuda")
    h, _, _, local = _gemm1_debug(x.cuda(), ids, p, activation="nvfp4", a13_scale=a, a2_scale=a)
    assert bool(local.all())
    packed, scales = reference.quantize_nvfp4(x, g)
    step = scales.float().repeat_interleave(16, 1) * g  # value of one e2m1 unit per element
    xq = formats.dequantize_nvfp4(packed, scales, g)
    gate = xq[:, :1].double()
    up = h.cpu().double() / (gate * torch.sigmoid(gate))
    table = torch.tensor(formats.E2M1_VALUES, dtype=torch.float64)
    values = table[reference.nvfp4_rcp_approx_codes(x, g).long()] * step.double().unsqueeze(-1)
    close = (up.unsqueeze(-1) - values).abs() <= 2e-3 * step.double().unsqueeze(-1)
    assert bool(close.any(-1).all()), f"GEMM1 input: {int((~close.any(-1)).sum())} elements match no allowed value"
    moved = int((~close[..., 4]).sum())
    print(f"GEMM1 input quantizer M={M} g={g}: {moved} of {x.numel()} values differ from the exact-reciprocal "
          "reference, each at a tie that rcp.approx rounding moves")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [7, 300])
def test_gpu_gate_and_up_global_scales(M):
    """test_cpu_gate_and_up_global_scales on the GPU kernels: w1 and w3 with different
    weight_scale_2, bf16 mode against the independent float32 MoE, nvfp4 mode against
    the reference; vLLM's gate-for-both answer is far from both."""
    E, N, K = 4, 128, 256
    w = _modelopt_weights(E, N, K, seed=11, up_ratio=4.0, device="cuda")
    p = prepare_nvfp4_moe_weights(*(w[k] for k in KEYS))
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).cuda()
    ids, tw = _routing(M, 2, E, gen, "cuda")
    want = _moe_independent(x, ids, tw, w, 10.0)
    got = nvfp4_moe(x, ids, tw, p, swiglu_limit=10.0).float().cpu()
    assert _rel_l2(got, want) <= 5e-3
    assert _rel_l2(_moe_independent(x, ids, tw, _gate_scale_for_both(w), 10.0), want) > 0.5
    # a scale far from round numbers: with 0.01 many products x * r sit on e2m1 ties
    # that rcp.approx moves (test_gpu_gemm1_input_quantizer counts them), which
    # moves these outputs by a few percent against the exact-reciprocal reference
    a = torch.tensor([0.0173], device="cuda")
    kw = dict(swiglu_limit=10.0, activation="nvfp4", a13_scale=a, a2_scale=a)
    got = nvfp4_moe(x, ids, tw, p, **kw)
    assert _rel_l2(got, _ref(x, ids, tw, w, **kw)) <= 2e-2
    assert _rel_l2(got, _ref(x, ids, tw, _gate_scale_for_both(w), **kw)) > 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("shape,M,routing,use_map,limit,activation,cta", GPU_MATRIX)
def test_gpu_vs_reference(shape, M, routing, use_map, limit, activation, cta):
    w, p = _gpu_model(shape)
    x, ids, tw, emap = _case(shape, M, routing, use_map, seed=M + 17)
    kw = _call_kwargs(w, activation, limit, emap)
    out = torch.full((M, shape["K"]), float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned
    got = nvfp4_moe(x, ids, tw, p, cta_mode=cta, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    ref = _ref(x, ids, tw, w, **kw)
    assert torch.isfinite(got).all()
    err = _rel_l2(got, ref)
    assert err <= (5e-3 if activation == "bf16" else 2e-2), f"relative L2 {err:.3e}"
    again = nvfp4_moe(x, ids, tw, p, cta_mode=cta, **kw)
    assert torch.equal(again, got)  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
@pytest.mark.parametrize("shape,M", [(FLASH, 1500), (FLASH, 5)])  # 64-token tiles, partly filled; 8-token tiles
def test_gpu_padding_rows_never_read(shape, M, activation):
    """The gather writes no padding rows of GEMM1's input for the one-warpgroup GEMMs (which
    zero-fill them as they copy): a workspace left full of NaN by an earlier allocation must
    not reach the output. M = 1500 at V4-Flash is 35 tokens per expert: 64-token tiles on
    the one-warpgroup kernel; M = 5 the decode tiles (nvfp4 mode: gathered too)."""
    poison = torch.full((256 << 20,), float("nan"), dtype=torch.float32, device="cuda")  # 1 GiB
    del poison  # back in the caching allocator: the op's workspace comes from it
    test_gpu_vs_reference(shape, M, "uniform", True, 10.0 if activation == "bf16" else None, activation, "auto")


@pytest.mark.gpu
def test_gpu_empty_and_all_remote():
    w, p = _gpu_model(FLASH)
    x = torch.randn(0, 4096, device="cuda").to(torch.bfloat16)
    ids = torch.zeros(0, 6, dtype=torch.int32, device="cuda")
    assert nvfp4_moe(x, ids, ids.float(), p).shape == (0, 4096)
    x, ids, tw, _ = _case(FLASH, 5, "uniform", True, seed=5)
    emap = torch.full((256,), -1, dtype=torch.int32, device="cuda")
    out = torch.full_like(x, float("nan"))  # poisoned: rows without a local slot must be written (zeros)
    got = nvfp4_moe(x, ids, tw, p, expert_map=emap, out=out)
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.gpu
def test_gpu_bad_inputs():
    w, p = _gpu_model(FLASH)
    x, ids, tw, emap = _case(FLASH, 4, "uniform", True, seed=6)
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        nvfp4_moe(x, ids, tw, p)  # global ids without the map
    with pytest.raises(ValueError, match="a13_scale is required"):
        nvfp4_moe(x, ids, tw, p, expert_map=emap, activation="nvfp4")
    with pytest.raises(RuntimeError, match="x must have dtype"):
        torch.ops.dsv4.nvfp4_moe(*_op_args(p, x.float(), ids, tw, emap=emap, out=torch.empty_like(x)))
    with pytest.raises(RuntimeError, match="topk_weights must have shape"):
        torch.ops.dsv4.nvfp4_moe(*_op_args(p, x, ids, tw[:, :2].contiguous(), emap=emap))
    with pytest.raises(RuntimeError, match="a2_scale is required"):
        torch.ops.dsv4.nvfp4_moe(*_op_args(p, x, ids, tw, "nvfp4", w["w13_input_scale"], None, emap))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_gpu_cuda_graph_replay(activation):
    w, p = _gpu_model(FLASH)
    x, ids, tw, emap = _case(FLASH, 64, "uniform", True, seed=11)
    kw = _call_kwargs(w, activation, 10.0, emap)
    out = torch.empty_like(x)
    nvfp4_moe(x, ids, tw, p, out=out, **kw)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nvfp4_moe(x, ids, tw, p, out=out, check_ids=False, **kw)
    for seed in (12, 13):
        x2, ids2, tw2, _ = _case(FLASH, 64, "uniform", True, seed=seed)
        x.copy_(x2)
        ids.copy_(ids2)
        tw.copy_(tw2)
        graph.replay()
        assert torch.equal(out, nvfp4_moe(x, ids, tw, p, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
@pytest.mark.parametrize("M", [5, 20, 200])
def test_gpu_odd_k_steps(activation, M):
    """K/64 and N/64 odd (the K loop's last, partial ring slot), every token tile size
    (M=5: 8 tokens, 20: 16, 200: 64)."""
    w = _weights(3, 192, 320, seed=21, device="cuda")
    p = prepare_nvfp4_moe_weights(*(w[k] for k in KEYS))
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, 320, generator=gen).to(torch.bfloat16).cuda()
    ids, tw = _routing(M, 2, 3, gen, "cuda")
    kw = _call_kwargs(w, activation, 10.0)
    for cta in ("auto", 2):
        got = nvfp4_moe(x, ids, tw, p, cta_mode=cta, **kw)
        err = _rel_l2(got, _ref(x, ids, tw, w, **kw))
        assert err <= (5e-3 if activation == "bf16" else 2e-2), f"relative L2 {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 8, 9, 12])
def test_gpu_combine_topk(k):
    """moe_combine_kernel reads a token's slot positions and weights once and all its y rows
    of a chunk together up to 8 slots (kCombineSlots), and keeps its per-slot loop above:
    both against the reference, with an expert map that leaves some slots remote (-1
    positions among the loaded ones), at 8-token and 64-token tiles."""
    w = _weights(12, 192, 320, seed=23, device="cuda")
    p = prepare_nvfp4_moe_weights(*(w[k_] for k_ in KEYS))
    emap = torch.tensor([0, 1, 2, 3, -1, 4, 5, 6, 7, -1, 8, 9, 10, 11], dtype=torch.int32, device="cuda")
    for M in (5, 300):
        gen = torch.Generator().manual_seed(100 * k + M)
        x = torch.randn(M, 320, generator=gen).to(torch.bfloat16).cuda()
        ids, tw = _routing(M, k, 14, gen, "cuda")
        kw = _call_kwargs(w, "bf16", 10.0, emap)
        got = nvfp4_moe(x, ids, tw, p, **kw)
        assert torch.isfinite(got).all()
        err = _rel_l2(got, _ref(x, ids, tw, w, **kw))
        assert err <= 5e-3, f"M={M}: relative L2 {err:.3e}"


# Prefill sizes run the warp-specialized kernel (csrc/moe/nvfp4_gemm_ws.cuh): units of 32 to 192
# token rows x 192 weight rows, one or two CTAs per cluster. Both cluster modes on the
# same inputs: each against the reference, and the two bit-identical (same per-row
# math); tests/test_moe_config.py runs the same cases on the previous one-warpgroup
# kernel (DSV4_MOE_WS=0, in a child process) and compares. Skewed routing gives one
# expert many full groups, the ladder every tail size (32 .. 160 rows) and experts of
# several groups; the odd-K test (test_gpu_odd_k_steps) covers consumers and whole
# CTAs without weight rows (2N or K not a multiple of 192 / 384).
WS_CASES = [
    (FLASH, 2048, "uniform", True, 10.0, "bf16"),
    (FLASH, 2048, "skewed", False, None, "nvfp4"),
    (FLASH, 1024, "ladder", False, 10.0, "bf16"),
    (PRO, 1024, "ladder", False, None, "nvfp4"),
    (PRO, 2048, "uniform", True, 10.0, "bf16"),
]


def _prefill_case(shape, M, routing, use_map, limit, activation):
    """(inputs, call kwargs, reference, tolerance) of one WS_CASES case."""
    w, p = _gpu_model(shape)
    x, ids, tw, emap = _case(shape, M, routing, use_map, seed=M + 29)
    kw = _call_kwargs(w, activation, limit, emap)
    return (x, ids, tw, p), kw, _ref(x, ids, tw, w, **kw), 5e-3 if activation == "bf16" else 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("shape,M,routing,use_map,limit,activation", WS_CASES)
def test_gpu_prefill_kernels_agree(shape, M, routing, use_map, limit, activation):
    args, kw, ref, tol = _prefill_case(shape, M, routing, use_map, limit, activation)
    got = {}
    for cta in (1, 2):
        out = torch.full((M, shape["K"]), float("nan"), dtype=torch.bfloat16, device="cuda")
        got[cta] = nvfp4_moe(*args, cta_mode=cta, out=out, **kw)
        assert torch.isfinite(got[cta]).all()
        assert _rel_l2(got[cta], ref) <= tol
    assert torch.equal(got[1], got[2])


@pytest.mark.gpu
@pytest.mark.parametrize("cta", [1, 2])
def test_gpu_prefill_cuda_graph_replay(cta):
    w, p = _gpu_model(FLASH)
    x, ids, tw, emap = _case(FLASH, 2048, "uniform", True, seed=31)
    kw = dict(swiglu_limit=10.0, expert_map=emap, cta_mode=cta)
    out = torch.empty_like(x)
    nvfp4_moe(x, ids, tw, p, out=out, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nvfp4_moe(x, ids, tw, p, out=out, check_ids=False, **kw)
    for seed in (32, 33):
        x2, ids2, tw2, _ = _case(FLASH, 2048, "uniform", True, seed=seed)
        if seed == 33:  # every slot to one local expert: other tile and unit counts, same graph
            ids2.fill_(int((emap >= 0).nonzero()[0]))
        x.copy_(x2)
        ids.copy_(ids2)
        tw.copy_(tw2)
        graph.replay()
        assert torch.equal(out, nvfp4_moe(x, ids, tw, p, **kw))


def _tp8_inputs(activation, M):
    """V4.1-Flash at tensor parallel 8 (K = 5120, N = 2304 / 8 = 288, all 384 experts),
    24 experts standing in for the 384 (routing over all of them as global ids, the map
    keeping 24; every token's first route local): the tiles per expert are the same, memory
    is not. Returns (w, m, x, ids, tw, kw, call): the UNPADDED weights, their prepared
    (padded) set, the inputs, the reference's keyword arguments and routed_moe's."""
    K, N, E_global, E_local = 5120, 288, 384, 24
    w = _weights(E_local, N, K, seed=288, device="cuda")
    m = prepare_moe_weights(*(w[k] for k in ("w13", "w13_scale", "w2", "w2_scale")), w13_scale_2=w["w13_scale_2"],
                            w2_scale_2=w["w2_scale_2"], activation=activation)
    assert (m.report["N"], m.report["N_padded"]) == (288, 320) and m.tensors.w13.shape[1] == 10
    gen = torch.Generator().manual_seed(M)
    x = (torch.randn(M, K, generator=gen) * 2.0).to(torch.bfloat16).cuda()
    ids, tw = _routing(M, 6, E_global, gen, "cuda")
    emap = _expert_map(E_global, E_local, gen, "cuda")
    ids[:, 0] = (emap >= 0).nonzero()[torch.randint(0, E_local, (M,), generator=gen)].squeeze(1).to(torch.int32)
    kw = _call_kwargs(w, activation, 10.0, emap)
    call = {k: v for k, v in kw.items() if k != "activation"}  # m knows its mode
    return w, m, x, ids, tw, kw, call


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
@pytest.mark.parametrize("M", [5, 200, 2500, 3000])  # decode, one-warpgroup (GEMM2 resident at 2500, 3000) kernels
def test_gpu_tp8_n288_padded(activation, M):
    """prepare pads N to 320 (the kernels read N from the prepared shapes: hf / h buffers
    and GEMM2's K are 320 wide); routed_moe against the float32 reference on the UNPADDED
    weights (_tp8_inputs)."""
    w, m, x, ids, tw, kw, call = _tp8_inputs(activation, M)
    out = torch.full((M, x.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")  # poisoned
    got = routed_moe(x, ids, tw, m, out=out, **call)
    ref = _ref(x, ids, tw, w, **kw)
    assert torch.isfinite(got).all() and ref.abs().amax() > 0
    err = _rel_l2(got, ref)
    assert err <= (5e-3 if activation == "bf16" else 2e-2), f"relative L2 {err:.3e}"
    assert torch.equal(routed_moe(x, ids, tw, m, **call), got)  # deterministic
