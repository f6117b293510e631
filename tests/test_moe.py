"""dsv4 NVFP4 MoE: prepare layout, the op chain (schema, fake, CPU, CUDA), errors,
and the CUDA kernels against the float32 reference (dsv4.reference.nvfp4_moe)."""

import pytest
import torch

import dsv4._ops
from dsv4 import formats, reference
from dsv4.moe import (
    Nvfp4MoeWeights,
    _gemm1_debug,
    nvfp4_moe,
    prepare_nvfp4_moe_weights,
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
    dequant_kstep / scale_pair_bf16x2 (csrc/moe/moe_device.cuh), give every weight times
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
            xe = formats.dequantize_nvfp4(*formats.quantize_nvfp4(xe, g), g)
        w13 = formats.dequantize_experts(w["w13"][e:e + 1], w["w13_scale"][e:e + 1], w["w13_scale_2"][e:e + 1])[0]
        h[rows] = reference.swiglu(xe @ w13[:N].T, xe @ w13[N:].T, limit)
    return h, flat


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
@pytest.mark.parametrize("M", [3, 300, 2048])
def test_gpu_gemm1_epilogue(activation, M):
    """GEMM1 alone vs the fp32 reference; in nvfp4 mode the epilogue's NVFP4 output is
    bit-exact vs dsv4.formats.quantize_nvfp4 of the same (fp32) GEMM1 output."""
    w, p = _gpu_model(FLASH)
    x, ids, _, emap = _case(FLASH, M, "uniform", True, seed=M)
    a13, a2 = w["w13_input_scale"], w["w2_input_scale"]
    h, hq, hs, local = _gemm1_debug(x, ids, p, swiglu_limit=10.0, activation=activation, a13_scale=a13,
                                    a2_scale=a2, expert_map=emap)
    ref_h, flat = _ref_gemm1(x, ids, w, emap, 10.0, activation, a13)
    assert torch.equal(local, flat >= 0)
    assert _rel_l2(h, ref_h) <= (2e-3 if activation == "bf16" else 1e-2)
    if activation == "nvfp4":
        for e in flat.unique().tolist():
            if e < 0:
                continue
            rows = (flat == e).nonzero().squeeze(1)
            codes, scales = formats.quantize_nvfp4(h[rows], a2[e:e + 1])
            assert torch.equal(hq[rows], codes)
            assert torch.equal(hs.view(torch.uint8)[rows], scales.view(torch.uint8))


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


# Split-K (persistent grid, items cut into K chunks, the last-arriving chunk's CTA adds
# the partials in chunk order) against the classic grid, forced either way with
# DSV4_MOE_SPLITK for every token tile: decode tiles of 8 and 16 tokens (the default
# when the classic grid would not fill one wave; M=512 gives 16-token tiles), the
# prefill tiles (64 and the cta_mode=2 128: one chunk per item, persistent), items split
# 6-8 ways (M=1, 2: chunks of odd length at M=2) and odd K-step counts. The determinism
# check in test_gpu_vs_reference matters here: routing places rows in tiles in atomics
# order, and a row's sums must not depend on it.
SPLITK_CASES = [
    (FLASH, 1, "uniform", True, 10.0, "bf16", "auto"),
    (FLASH, 2, "uniform", True, 10.0, "nvfp4", "auto"),
    (FLASH, 64, "uniform", True, 10.0, "nvfp4", "auto"),
    (FLASH, 512, "uniform", True, 10.0, "bf16", "auto"),
    (FLASH, 3, "skewed", False, None, "bf16", "auto"),
    (FLASH, 2048, "uniform", False, 10.0, "nvfp4", 1),
    (FLASH, 4096, "uniform", False, 10.0, "bf16", 2),
    (PRO, 64, "uniform", True, 10.0, "nvfp4", "auto"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("splitk", ["0", "1"])
@pytest.mark.parametrize("shape,M,routing,use_map,limit,activation,cta", SPLITK_CASES)
def test_gpu_splitk_forced(monkeypatch, splitk, shape, M, routing, use_map, limit, activation, cta):
    monkeypatch.setenv("DSV4_MOE_SPLITK", splitk)
    test_gpu_vs_reference(shape, M, routing, use_map, limit, activation, cta)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_gpu_splitk_odd_k_steps(monkeypatch, activation):
    monkeypatch.setenv("DSV4_MOE_SPLITK", "1")
    for M in (5, 20, 200):
        test_gpu_odd_k_steps(activation, M)


# Prefill sizes run the warp-specialized kernel (moe_gemm_ws.cuh): units of 32 to 192
# token rows x 192 weight rows, one or two CTAs per cluster. Both cluster modes and
# the previous one-warpgroup kernel (DSV4_MOE_WS=0) on the same inputs: each against
# the reference, and the two cluster modes bit-identical (same per-row math). Skewed
# routing gives one expert many full groups, the ladder every tail size (32 .. 160
# rows) and experts of several groups; the odd-K test (test_gpu_odd_k_steps) covers
# consumers and whole CTAs without weight rows (2N or K not a multiple of 192 / 384).
WS_CASES = [
    (FLASH, 2048, "uniform", True, 10.0, "bf16"),
    (FLASH, 2048, "skewed", False, None, "nvfp4"),
    (FLASH, 1024, "ladder", False, 10.0, "bf16"),
    (PRO, 1024, "ladder", False, None, "nvfp4"),
    (PRO, 2048, "uniform", True, 10.0, "bf16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,M,routing,use_map,limit,activation", WS_CASES)
def test_gpu_prefill_kernels_agree(monkeypatch, shape, M, routing, use_map, limit, activation):
    w, p = _gpu_model(shape)
    x, ids, tw, emap = _case(shape, M, routing, use_map, seed=M + 29)
    kw = _call_kwargs(w, activation, limit, emap)
    ref = _ref(x, ids, tw, w, **kw)
    tol = 5e-3 if activation == "bf16" else 2e-2
    got = {}
    for cta in (1, 2):
        out = torch.full((M, shape["K"]), float("nan"), dtype=torch.bfloat16, device="cuda")
        got[cta] = nvfp4_moe(x, ids, tw, p, cta_mode=cta, out=out, **kw)
        assert torch.isfinite(got[cta]).all()
        assert _rel_l2(got[cta], ref) <= tol
    assert torch.equal(got[1], got[2])
    monkeypatch.setenv("DSV4_MOE_WS", "0")
    old = nvfp4_moe(x, ids, tw, p, **kw)
    assert _rel_l2(old, ref) <= tol
    assert _rel_l2(old, got[2]) <= 1e-2  # same math, different fp32 summation order only


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


@pytest.mark.gpu
def test_gpu_without_pdl(monkeypatch):
    """The chain launched without programmatic dependent launch (DSV4_MOE_PDL=0)."""
    monkeypatch.setenv("DSV4_MOE_PDL", "0")
    test_gpu_vs_reference(FLASH, 64, "uniform", True, 10.0, "bf16", "auto")
    test_gpu_vs_reference(FLASH, 4096, "uniform", False, 10.0, "nvfp4", 1)
    test_gpu_cuda_graph_replay("bf16")


@pytest.mark.gpu
def test_gpu_gather_kernel_bf16_decode(monkeypatch):
    """bf16 decode tiles with the gather kernel instead of GEMM1's direct x loads."""
    monkeypatch.setenv("DSV4_MOE_DIRECT_X", "0")
    test_gpu_vs_reference(FLASH, 64, "uniform", True, 10.0, "bf16", "auto")
    test_gpu_vs_reference(FLASH, 1, "uniform", True, None, "bf16", "auto")
    test_gpu_odd_k_steps("bf16", 5)
