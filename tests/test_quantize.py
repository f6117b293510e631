"""dsv4.quantize_nvfp4: the chain (schema, fake, CPU, CUDA) and its numerics against dsv4.formats."""

import pytest
import torch

import dsv4
from dsv4 import formats, reference


def _activations(m, k, gen, device="cpu", outliers=True):
    x = torch.randn(m, k, generator=gen) * 3.0
    if outliers and m * k >= 64:
        # a few large-magnitude outliers, some tiny blocks and an all-zero block
        idx = torch.randint(0, m * k, (max(1, m * k // 97),), generator=gen)
        x.view(-1)[idx] *= torch.empty(idx.numel()).uniform_(50, 3000, generator=gen)
        x[0, :16] *= 1e-6
        if k >= 32:
            x[-1, 16:32] = 0.0
    return x.to(torch.bfloat16).to(device)


def _gscale(value, device="cpu"):
    return torch.tensor([value], dtype=torch.float32, device=device)


# ---------------------------------------------------------------- CPU ---------


def test_cpu_kernel_is_the_reference():
    gen = torch.Generator().manual_seed(1)
    x = _activations(37, 96, gen)
    codes, scales = dsv4.quantize_nvfp4(x, _gscale(0.01))
    ref_codes, ref_scales = reference.quantize_nvfp4(x, 0.01)
    assert codes.shape == (37, 48) and codes.dtype == torch.uint8
    assert scales.shape == (37, 6) and scales.dtype == torch.float8_e4m3fn
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))


def test_python_float_global_scale():
    x = _activations(4, 32, torch.Generator().manual_seed(2))
    a = dsv4.quantize_nvfp4(x, 0.5)
    b = dsv4.quantize_nvfp4(x, _gscale(0.5))
    assert torch.equal(a[0], b[0])


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.zeros(4, 32), _gscale(1.0)), "x must have dtype torch.bfloat16"),
        (lambda: (torch.zeros(2, 4, 32, dtype=torch.bfloat16), _gscale(1.0)), r"x must be 2-D \[M, K\]"),
        (lambda: (torch.zeros(4, 24, dtype=torch.bfloat16), _gscale(1.0)), "multiple of 16, got 24"),
        (lambda: (torch.zeros(4, 0, dtype=torch.bfloat16), _gscale(1.0)), "multiple of 16, got 0"),
        (lambda: (torch.zeros(4, 32, dtype=torch.bfloat16), _gscale(1.0).double()), "global_scale must have dtype torch.float32"),
        (lambda: (torch.zeros(4, 32, dtype=torch.bfloat16), torch.ones(2)), "global_scale must hold exactly 1 element"),
    ],
)
def test_cpu_bad_inputs(make, match):
    x, g = make()
    with pytest.raises((ValueError, RuntimeError), match=match):
        dsv4.quantize_nvfp4(x, g)


def test_opcheck_cpu():
    x = _activations(8, 64, torch.Generator().manual_seed(3))
    torch.library.opcheck(torch.ops.dsv4.quantize_nvfp4.default, (x, _gscale(0.02)))


def test_torch_compile_fullgraph_cpu():
    x = _activations(8, 64, torch.Generator().manual_seed(4))
    g = _gscale(0.02)

    @torch.compile(fullgraph=True, backend="eager")
    def f(x, g):
        codes, scales = dsv4.quantize_nvfp4(x, g)
        return codes, scales.float() * 2

    codes, s2 = f(x, g)
    ref_codes, ref_scales = reference.quantize_nvfp4(x, g)
    assert torch.equal(codes, ref_codes) and torch.equal(s2, ref_scales.float() * 2)


_BOUNDARIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _divisors(x, g):
    """Per block (of x [n, 16]): the reference's d = s * (1 / G), G = 1 / g."""
    one = torch.tensor(1.0)
    _, scales = reference.quantize_nvfp4(x, g)
    return scales.float() * (one / (one / torch.tensor(g, dtype=torch.float32)))


def _hard_blocks(g, gen, n=4000):
    """Blocks whose elements sit on and next to every rounding boundary of their own
    block (t_k * d +- 2 bf16 ulps), every bf16 magnitude below a few block maxima
    (subnormals included), signed zeros, tiny negatives and infinities."""
    x = torch.randn(n, 16, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen) * 2)
    x = x.to(torch.bfloat16)
    amax = x.float().abs().amax(-1, keepdim=True)
    d = _divisors(x, g)
    pick = _BOUNDARIES[torch.randint(0, 7, (n, 15), generator=gen)]
    near = (pick * d).to(torch.bfloat16).view(torch.int16)
    near = (near + torch.randint(-2, 3, (n, 15), generator=gen).to(torch.int16)).view(torch.bfloat16)
    near = torch.where(near.float().abs() <= amax, near, x[:, 1:])
    sign = torch.where(torch.rand(n, 15, generator=gen) < 0.5, -1.0, 1.0).to(torch.bfloat16)
    blocks = [torch.cat([amax.to(torch.bfloat16), near * sign], 1)]
    every = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for top in (1.0, 6.0, 2688.0, 0.01):
        top_b = torch.tensor([top * g]).to(torch.bfloat16)
        vals = every[every.float() <= top_b.float()]
        vals = torch.cat([vals, vals[: (-vals.numel()) % 15]]).reshape(-1, 15)
        sign = torch.where(torch.rand(vals.shape, generator=gen) < 0.5, -1.0, 1.0).to(torch.bfloat16)
        blocks.append(torch.cat([top_b.expand(vals.shape[0], 1), vals * sign], 1))
    special = torch.full((4, 16), 1.0).to(torch.bfloat16)
    special[0, 1:] = -0.0
    special[1, 1:] = -1e-40  # negative bf16 subnormals: code 8 (y < 0), not 0
    special[2, 1:] = float("-inf")
    special[3, 1::2] = 0.0
    blocks.append(special)
    return torch.cat(blocks)


def _f32_step(t, k):
    return (t.view(torch.int32) + k).view(torch.float32)


def _threshold_codes(x, d, r):
    """Model of the CUDA kernel's threshold rule (csrc/common/nvfp4.cuh,
    nvfp4_thresholds) for blocks x [n, 16] with divisor d and reciprocal r [n, 1]
    (float32): T_k = V or the bf16 value above V, with V = c rounded to 8 significant
    bits by Veltkamp's split of c = RN(t_k * d) (float32 steps as in nvfp4_bound),
    whichever is the least to pass (RN(V * r) > t_k, ties down, or >= t_k, ties up);
    the magnitude code counts the T_k <= |x|. Returns (codes, mask of the blocks the
    kernel encodes this way: 2^-100 <= d <= 2^16)."""
    mag = x.float().abs()
    code = torch.zeros(x.shape, dtype=torch.int32)
    for k, t in enumerate(_BOUNDARIES.tolist()):
        c = torch.tensor(t) * d
        big = c * torch.tensor(65537.0)
        v = big - (big - c)
        assert torch.equal(v, v.to(torch.bfloat16).float())  # an 8-bit value
        y = v * r
        passes = y > t if k % 2 == 0 else y >= t
        T = (v.view(torch.int32) + (~passes).to(torch.int32) * 0x10000).view(torch.float32)
        code += (mag >= T).to(torch.int32)
    code |= (x.float() < 0).to(torch.int32) << 3
    fast = ((d >= 2.0 ** -100) & (d <= 2.0 ** 16))[:, 0]
    return code.to(torch.uint8), fast


@pytest.mark.parametrize("g", [1.0, 0.37, 1e-3, 2.0 ** -8, 2.0 ** -60, 123.0])
def test_threshold_rule_matches_the_product_cpu(g):
    # The CUDA encoder replaces RN(x * r) + e2m1 rounding by comparisons against
    # per-block bf16 bounds built from d and r = rcp(d); check that construction
    # against round_to_e2m1(x * r) on the hardest inputs we have, for r the exact
    # reciprocal and one float32 ulp either side (rcp.approx is within 1 ulp), and d
    # itself one ulp either side (it depends on rcp(G)).
    g = float(torch.tensor(g, dtype=torch.float32))
    x = _hard_blocks(g, torch.Generator().manual_seed(11), n=2000)
    d0 = _divisors(x, g)[:, :1]
    nonzero = (d0 > 0)[:, 0]
    x, d0 = x[nonzero], d0[nonzero]
    for kd in (-1, 0, 1):
        d = _f32_step(d0, kd)
        for kr in (-1, 0, 1):
            r = _f32_step(torch.tensor(1.0) / d, kr)
            code, fast = _threshold_codes(x, d, r)
            assert fast.float().mean() > 0.5
            ref = formats.round_to_e2m1(x.float() * r)
            assert torch.equal(code[fast], ref[fast]), (kd, kr)


def _check_codes(codes, x, g, what):
    """GPU codes (packed) vs dsv4.formats (exact reciprocals): equal, except codes
    that rcp.approx rounding explains (reference.nvfp4_rcp_approx_codes: x * r within
    a float32 ulp or so of a tie). Prints and returns how many were explained."""
    got = formats.unpack_fp4(codes.cpu())
    cand = reference.nvfp4_rcp_approx_codes(x, g)
    differ = got != cand[..., 4]
    unexplained = differ & ~(got.unsqueeze(-1) == cand).any(-1)
    where = unexplained.nonzero()[:3].tolist()
    assert not unexplained.any(), (f"{what}: {int(unexplained.sum())} codes differ from dsv4.formats and are not "
                                   f"explained by rcp.approx rounding, first at {where}")
    n = int(differ.sum())
    print(f"{what}: {n} of {got.numel()} codes differ from the exact-reciprocal reference, each at a tie that "
          f"rcp.approx rounding moves ({int((cand != cand[..., 4:5]).any(-1).sum())} elements are that close)")
    return n


# ---------------------------------------------------------------- GPU ---------

SHAPES = [(1, 16), (3, 48), (127, 512), (1000, 7168), (4096, 2048), (77, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("m, k", SHAPES)
@pytest.mark.parametrize("g", [1.0, 0.01, 0.0173, 1e-4, 3e-3 / 448])
def test_gpu_vs_reference(m, k, g, poison_allocator):
    gen = torch.Generator().manual_seed(m * 131 + k)
    x = _activations(m, k, gen)
    poison_allocator(m * k)
    codes, scales = dsv4.quantize_nvfp4(x.cuda(), _gscale(g, "cuda"))
    _, ref_scales = reference.quantize_nvfp4(x, g)
    assert torch.equal(scales.cpu().view(torch.uint8), ref_scales.view(torch.uint8)), "scales differ"
    _check_codes(codes, x, g, f"quantize_nvfp4 {m}x{k} g={g}")


@pytest.mark.gpu
def test_gpu_saturating_and_subnormal_scales():
    # amax/6/g spans e4m3 subnormals (< 2^-6) up to far beyond 448 (saturation)
    gen = torch.Generator().manual_seed(5)
    mags = torch.logspace(-12, 6, 64, base=2.0)
    x = (torch.randn(64, 16, generator=gen) * mags[:, None]).to(torch.bfloat16)
    for g in (1.0, 1e-3, 2.0**-10):
        codes, scales = dsv4.quantize_nvfp4(x.cuda(), g)
        _, ref_scales = reference.quantize_nvfp4(x, g)
        assert torch.equal(scales.cpu().view(torch.uint8), ref_scales.view(torch.uint8))
        _check_codes(codes, x, g, f"saturating/subnormal scales g={g}")


@pytest.mark.gpu
@pytest.mark.parametrize("g", [1.0, 0.37, 1e-3, 2.0**-8, 2.0**-60, 123.0, 7000.0])
def test_gpu_rounding_boundaries(g):
    # every rounding boundary of the block's own scale +- 2 ulps, every bf16
    # magnitude under a few maxima, signed zeros, negative subnormals, infinities;
    # g = 7000 sends many blocks down the per-element path (d > 2^16). Powers of two
    # put many products x * r within an ulp of a tie, where rcp.approx may move them.
    g = float(torch.tensor(g, dtype=torch.float32))
    x = _hard_blocks(g, torch.Generator().manual_seed(12))
    codes, scales = dsv4.quantize_nvfp4(x.cuda(), g)
    _, ref_scales = reference.quantize_nvfp4(x, g)
    assert torch.equal(scales.cpu().view(torch.uint8), ref_scales.view(torch.uint8))
    _check_codes(codes, x, g, f"rounding boundaries g={g}")


@pytest.mark.gpu
def test_gpu_tie_of_design_section_2():
    # the hand-computed tie of tests/test_formats.py: x * r = 1.25 + 1 ulp -> 1.5
    # with r = RN(16/15), which rcp.approx(0.9375) also gives on the H200 (measured:
    # 0x3F888889); the earlier division rule gave 1.0
    x = torch.tensor([[5.625, 1.171875, -1.171875] + [0.0] * 13], dtype=torch.bfloat16)
    codes, scales = dsv4.quantize_nvfp4(x.cuda(), 2.0**-8)
    assert scales.view(torch.uint8).tolist() == [[0x77]]
    assert formats.unpack_fp4(codes.cpu())[0, :3].tolist() == [7, 3, 11]


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, pad", [(50, 1024, 64), (33, 7168, 16), (5, 48, 8), (1, 16, 8)])
def test_gpu_row_strided_input(m, k, pad):
    gen = torch.Generator().manual_seed(6)
    big = _activations(m, k + pad, gen).cuda()
    x = big[:, pad:]  # row stride k + pad (a multiple of 8), 16-byte aligned start
    codes, scales = dsv4.quantize_nvfp4(x, 0.05)
    _, ref_scales = reference.quantize_nvfp4(x.cpu().contiguous(), 0.05)
    assert torch.equal(scales.cpu().view(torch.uint8), ref_scales.view(torch.uint8))
    _check_codes(codes, x.cpu().contiguous(), 0.05, f"row-strided {m}x{k}")


@pytest.mark.gpu
def test_gpu_empty():
    codes, scales = dsv4.quantize_nvfp4(torch.empty(0, 64, dtype=torch.bfloat16, device="cuda"), 1.0)
    assert codes.shape == (0, 32) and scales.shape == (0, 4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda")[:, 1:33], _gscale(1.0, "cuda")), "16-byte aligned"),
        (lambda: (torch.zeros(64, 4, dtype=torch.bfloat16, device="cuda").t(), _gscale(1.0, "cuda")), "unit stride along K"),
        (lambda: (torch.zeros(4, 68, dtype=torch.bfloat16, device="cuda")[:, :64], _gscale(1.0, "cuda")), "row stride must be a multiple of 8"),
        (lambda: (torch.zeros(4, 32, dtype=torch.bfloat16, device="cuda"), _gscale(1.0)), "global_scale is on cpu"),
        (lambda: (torch.zeros(4, 32, dtype=torch.float16, device="cuda"), _gscale(1.0, "cuda")), "x must have dtype"),
    ],
)
def test_gpu_bad_inputs(make, match):
    x, g = make()
    with pytest.raises((ValueError, RuntimeError), match=match):
        torch.ops.dsv4.quantize_nvfp4(x, g)


@pytest.mark.gpu
def test_gpu_opcheck():
    x = _activations(64, 256, torch.Generator().manual_seed(7)).cuda()
    torch.library.opcheck(torch.ops.dsv4.quantize_nvfp4.default, (x, _gscale(0.01, "cuda")))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    gen = torch.Generator().manual_seed(8)
    x = _activations(300, 1024, gen).cuda()
    g = _gscale(0.02, "cuda")
    dsv4.quantize_nvfp4(x, g)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        codes, scales = dsv4.quantize_nvfp4(x, g)
    for seed in (9, 10):
        x.copy_(_activations(300, 1024, torch.Generator().manual_seed(seed)).cuda())
        g.fill_(0.01 * seed)
        graph.replay()
        ref_codes, ref_scales = dsv4.quantize_nvfp4(x, g)
        assert torch.equal(codes, ref_codes)
        assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))
