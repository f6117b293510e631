"""dsv4.dense_fmha: dense masked attention over [compressed | window] KV.

The CUDA path is visible_rows() + the sparse MQA prefill kernel. On the CPU the same
composition runs through the sparse op's CPU kernel (the float32 sparse reference), so
the index construction is checked here against the independently written dense
reference (dsv4.reference.dense_fmha) on every mask corner case.
"""

import pytest
import torch

from dsv4 import reference
from dsv4.attention import sparse_mqa_prefill
from dsv4.formats.kv_cache import HEAD_DIM
from dsv4.fmha import dense_fmha, dense_fmha_kernel, index_width, visible_rows
from dsv4.reference.fmha import _visible_mask

SCALE = HEAD_DIM**-0.5

# (q lengths, kv lengths, n_comp, window, causal, ratio, start positions)
CASES = [
    ([5, 1, 9], [40, 3, 30], [8, 0, 12], 128, True, 4, None),  # ragged, window > sequence
    ([7], [20], [0], 4, True, 1, None),  # no compressed entries, small window
    ([1, 1, 1], [1, 2, 200], [0, 1, 60], 128, True, 128, [0, 5, 9000]),  # single tokens, ratio 128
    ([6, 4], [6, 40], [2, 30], 3, False, 4, [3, 7]),  # not causal: everything visible
    ([12], [16], [4], 0, True, 4, [100]),  # window <= 0: unlimited
    ([3, 0, 2], [10, 5, 0], [3, 5, 0], 8, True, 2, None),  # an empty query set, an empty kv set
]


def _inputs(case, heads=64, seed=0):
    qlens, kvlens, ncomp, window, causal, ratio, starts = case
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    cu_kv = torch.tensor([0] + list(torch.tensor(kvlens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, 512, generator=gen).bfloat16()
    kv = torch.randn(max(1, int(cu_kv[-1])), 1, 512, generator=gen).bfloat16()[: int(cu_kv[-1])]
    sink = torch.randn(heads, generator=gen)
    start = torch.tensor(starts, dtype=torch.int32) if starts is not None else None
    return q, kv, cu_q, cu_kv, torch.tensor(ncomp, dtype=torch.int32), window, causal, ratio, start, sink


@pytest.mark.parametrize("case", CASES)
def test_index_lists_match_dense_reference(case):
    q, kv, cu_q, cu_kv, nc, window, causal, ratio, start, sink = _inputs(case)
    ref_out, ref_lse = reference.dense_fmha(q, kv, kv, cu_q, cu_kv, nc, window=window, causal=causal,
                                            ratio=ratio, seq_start_pos=start, sink=sink, scale=SCALE)
    width = max(1, int((cu_kv[1:] - cu_kv[:-1]).max()))
    idx, lengths = visible_rows(q.shape[0], cu_q, cu_kv, nc, width=width, window=window, causal=causal,
                                ratio=ratio, seq_start_pos=start)
    assert idx.dtype == torch.int32 and idx.shape == (q.shape[0], width)
    # everything past a row's length is padding
    col = torch.arange(width)[None, :]
    assert bool((idx[col >= lengths[:, None]] == -1).all())
    out, lse = sparse_mqa_prefill(q, kv.reshape(-1, 512) if kv.shape[0] else torch.zeros(1, 512).bfloat16(),
                                  idx, lengths, sink, SCALE)
    torch.testing.assert_close(out.float(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(20))
def test_index_width_bounds_every_visible_set(seed):
    # random ragged causal batches starting at position 0: the host-side width that the
    # CUDA path sizes its index list with must cover every query's visible rows
    gen = torch.Generator().manual_seed(seed)
    S = int(torch.randint(1, 6, (1,), generator=gen))
    ratio = int(torch.randint(1, 9, (1,), generator=gen))
    window = int(torch.randint(-1, 40, (1,), generator=gen))
    lw = torch.randint(0, 300, (S,), generator=gen)
    nc = torch.minimum(torch.randint(0, 120, (S,), generator=gen), lw // ratio + torch.randint(0, 3, (S,), generator=gen))
    tq = torch.minimum(lw, torch.randint(0, 300, (S,), generator=gen))
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), tq.cumsum(0)])
    cu_kv = torch.cat([torch.zeros(1, dtype=torch.long), (nc + lw).cumsum(0)])
    max_kv = int((nc + lw).max())
    width = index_width(max_kv, window=window, causal=True, ratio=ratio, has_start_pos=False)
    _, lengths = visible_rows(int(cu_q[-1]), cu_q, cu_kv, nc, width=max(1, max_kv), window=window, causal=True,
                              ratio=ratio)
    assert (int(lengths.max()) if lengths.numel() else 0) <= width <= max_kv
    assert index_width(max_kv, window=window, causal=False, ratio=ratio, has_start_pos=False) == max_kv
    assert index_width(max_kv, window=window, causal=True, ratio=ratio, has_start_pos=True) == max_kv


def test_visible_rows_hand_example():
    # one sequence: 2 compressed entries (ratio 2), 4 window entries at positions 0..3,
    # 2 queries at positions 2 and 3, window 2
    idx, lengths = visible_rows(2, torch.tensor([0, 2]), torch.tensor([0, 6]), torch.tensor([2]), width=6,
                                window=2, causal=True, ratio=2)
    # p=2: compressed w < 3 // 2 = 1 -> row 0; window positions 1..2 -> rows 2+1, 2+2
    # p=3: compressed w < 4 // 2 = 2 -> rows 0, 1; window positions 2..3 -> rows 4, 5
    assert lengths.tolist() == [3, 4]
    assert idx.tolist() == [[0, 3, 4, -1, -1, -1], [0, 1, 4, 5, -1, -1]]


def test_cpu_path_is_the_reference_for_any_shape():
    # GQA and head dim 64 are served on the CPU (the CUDA path covers D=512 MQA only)
    gen = torch.Generator().manual_seed(3)
    cu_q, cu_kv, nc = torch.tensor([0, 3, 7]), torch.tensor([0, 10, 25]), torch.tensor([2, 5])
    q = torch.randn(7, 8, 64, generator=gen)
    k = torch.randn(25, 2, 64, generator=gen)
    v = torch.randn(25, 2, 32, generator=gen)
    out = torch.full((7, 8, 32), float("nan"))
    got, lse = dense_fmha(q, (k, v), cu_q, cu_kv, nc, max_seqlen_kv=15, window=4, ratio=4, out=out)
    ref, ref_lse = reference.dense_fmha(q, k, v, cu_q, cu_kv, nc, window=4, causal=True, ratio=4,
                                        scale=64**-0.5)
    assert got is out
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("bad", [-1, 2.5, True, None])
def test_max_seqlen_kv_must_be_a_host_int(bad):
    q, kv, cu_q, cu_kv, nc, *_ = _inputs(CASES[1])
    with pytest.raises(ValueError, match="max_seqlen_kv must be a non-negative int"):
        dense_fmha(q, kv, cu_q, cu_kv, nc, max_seqlen_kv=bad)


@pytest.mark.parametrize("kw, match", [
    (dict(max_seqlen_q=-1), "max_seqlen_q must be a non-negative int"),
    (dict(max_seqlen_q=3.0), "max_seqlen_q must be a non-negative int"),
    (dict(num_splits=-1), "num_splits must be an int in"),
    (dict(num_splits=65), "num_splits must be an int in"),
    (dict(num_splits=True), "num_splits must be an int in"),
])
def test_bad_host_arguments(kw, match):
    q, kv, cu_q, cu_kv, nc, *_ = _inputs(CASES[1])
    with pytest.raises(ValueError, match=match):
        dense_fmha(q, kv, cu_q, cu_kv, nc, max_seqlen_kv=20, **kw)


def test_visible_rows_compiles():
    f = torch.compile(visible_rows, fullgraph=True, backend="eager", dynamic=False)
    args = (4, torch.tensor([0, 4]), torch.tensor([0, 10]), torch.tensor([3]))
    kw = dict(width=10, window=3, causal=True, ratio=2)
    a, b = f(*args, **kw), visible_rows(*args, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------- rows a query does not see ---------

# a sequence without queries (its rows are never seen), windows that leave early rows unseen
SKIP_CASE = ([9, 0, 70], [60, 30, 200], [12, 6, 40], 8, True, 4, [0, 0, 33])
POISONS = [float("nan"), float("inf"), float("-inf")]


def _visibility(cu_q, cu_kv, nc, window, causal, ratio, start):
    """[Tq, Nkv] bool: kv row j is visible to query row t (_visible_mask per sequence)."""
    vis = torch.zeros(int(cu_q[-1]), int(cu_kv[-1]), dtype=torch.bool)
    for s in range(nc.shape[0]):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_kv[s]), int(cu_kv[s + 1])
        if q1 > q0:
            st = int(start[s]) if start is not None else 0
            vis[q0:q1, k0:k1] = _visible_mask(q1 - q0, int(nc[s]), k1 - k0 - int(nc[s]), st, window,
                                                        causal, ratio, torch.device("cpu"))
    return vis


def _early_queries(cu_q):
    """The first half of every sequence's queries."""
    a = torch.zeros(int(cu_q[-1]), dtype=torch.bool)
    for s in range(cu_q.shape[0] - 1):
        q0, q1 = int(cu_q[s]), int(cu_q[s + 1])
        a[q0 : q0 + (q1 - q0) // 2] = True
    return a


def _poisoned(t, rows, value):
    bad = t.clone()
    bad[rows] = value
    return bad


@pytest.mark.parametrize("value", POISONS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("d, hq, hkv", [(512, 64, 1), (64, 8, 2)])
def test_cpu_rows_a_query_does_not_see_never_reach_it(d, hq, hkv, value):
    """Rows that the early half of each sequence's queries do not see hold NaN / inf: those
    queries' outputs are bitwise the clean run's (the late queries see some of them)."""
    q, k, v, cu_q, cu_kv, nc, window, causal, ratio, start, sink = _dense_inputs(SKIP_CASE, d, hq, hkv, 90, d != HEAD_DIM)
    early = _early_queries(cu_q)
    vis = _visibility(cu_q, cu_kv, nc, window, causal, ratio, start)
    rows = ~vis[early].any(0)
    sees = (vis & rows).any(1)
    assert sees.any() and not sees[early].any()
    kw = dict(max_seqlen_kv=200, window=window, causal=causal, ratio=ratio, seq_start_pos=start, attn_sink=sink)
    kv_clean = k if d == HEAD_DIM else (k, v)
    kv_bad = _poisoned(k, rows, value) if d == HEAD_DIM else (_poisoned(k, rows, value), _poisoned(v, rows, value))
    clean_o, clean_l = dense_fmha(q, kv_clean, cu_q, cu_kv, nc, **kw)
    o, lse = dense_fmha(q, kv_bad, cu_q, cu_kv, nc, **kw)
    assert torch.isfinite(clean_o.float()).all()
    assert torch.equal(o[early].view(torch.int16), clean_o[early].view(torch.int16))
    assert torch.equal(lse[early], clean_l[early])
    assert not torch.isfinite(o[sees].float()).all()  # the poison is live where a query sees it


@pytest.mark.parametrize("bad", [0.0, -0.125, float("nan"), float("inf")])
def test_softmax_scale_must_be_finite_and_positive(bad):
    q, kv, cu_q, cu_kv, nc, *_ = _inputs(CASES[1])
    with pytest.raises(ValueError, match=r"^dsv4: dense_fmha: softmax_scale must be finite and > 0"):
        dense_fmha(q, kv, cu_q, cu_kv, nc, max_seqlen_kv=20, softmax_scale=bad)
    with pytest.raises(ValueError, match=r"^dsv4: dense_fmha: softmax_scale must be finite and > 0"):  # the CPU kernel
        torch.ops.dsv4.dense_fmha(q, kv, kv, cu_q.int(), cu_kv.int(), nc, None, None, bad, 4, True, 1, 7, 20, 0,
                                  torch.empty_like(q))


def _set(**kw):
    def f(a):
        a.update({k: v(a) if callable(v) else v for k, v in kw.items()})
    return f


# the CPU kernel's rules (the C++ entry's wording where it has the same rule)
CPU_BAD = [
    (_set(q=lambda a: a["q"][:, :3]), r"q heads \(3\) must be a multiple of k/v heads \(2\)"),
    (_set(q=lambda a: a["q"].int()), r"q must be a float32/float16/bfloat16/float64 tensor, got torch.int32"),
    (_set(v=lambda a: a["v"][:-1]), r"v must have shape \[9, 2, Dv\] like k"),
    (_set(k=lambda a: a["k"][..., :32]), r"k must have head_dim 64 like q"),
    (_set(k=lambda a: a["k"][0]), r"k must be 3-D \[rows, heads, head_dim\]"),
    (_set(cu_q=torch.tensor([0, 3, 4])), r"cu_seqlens_q must start at 0 and end at 5, got \[0, 3, 4\]"),
    (_set(cu_kv=torch.tensor([0, 4])), r"cu_seqlens_kv must have shape \[3\], got \[2\]"),
    (_set(cu_kv=torch.tensor([0, 10, 9])), r"cu_seqlens_kv must be non-decreasing"),
    (_set(nc=torch.tensor([5, 0])), r"n_comp\[0\] = 5 must lie in \[0, kv length 4\]"),
    (_set(nc=torch.tensor([1.0, 0.0])), r"n_comp must be an integer tensor, got torch.float32"),
    (_set(kw=dict(ratio=0)), r"ratio must be >= 1, got 0"),
    (_set(kw=dict(seq_start_pos=torch.tensor([0]))), r"seq_start_pos must have shape \[2\]"),
    (_set(kw=dict(attn_sink=torch.zeros(2))), r"attn_sink must have shape \[4\]"),
    (_set(kw=dict(attn_sink=torch.zeros(4).double())), r"attn_sink must have dtype torch.float32"),
    (_set(kw=dict(out=torch.empty(5, 4, 32))), r"out must have shape \[5, 4, 64\]"),
]


@pytest.mark.parametrize("mutate, match", CPU_BAD)
def test_cpu_bad_inputs(mutate, match):
    gen = torch.Generator().manual_seed(300)
    a = dict(q=torch.randn(5, 4, 64, generator=gen), k=torch.randn(9, 2, 64, generator=gen),
             v=torch.randn(9, 2, 64, generator=gen), cu_q=torch.tensor([0, 3, 5]), cu_kv=torch.tensor([0, 4, 9]),
             nc=torch.tensor([1, 0]), kw={})
    # the valid baseline
    dense_fmha(a["q"], (a["k"], a["v"]), a["cu_q"], a["cu_kv"], a["nc"], max_seqlen_kv=5, window=2)
    mutate(a)
    with pytest.raises(ValueError, match=r"^dsv4: dense_fmha: " + match):
        dense_fmha(a["q"], (a["k"], a["v"]), a["cu_q"], a["cu_kv"], a["nc"], max_seqlen_kv=5, window=2, **a["kw"])


def test_dense_fmha_kernel_names_the_cuda_kernel():
    q64, k64 = torch.empty(3, 8, 64), torch.empty(5, 2, 64)
    assert dense_fmha_kernel(q64, k64, k64) == "dense_fmha"
    assert dense_fmha_kernel(q64, k64, torch.empty(5, 2, 32)) is None  # Dv != D: CPU only
    q512, kv = torch.empty(3, 64, 512), torch.empty(5, 1, 512)
    assert dense_fmha_kernel(q512, kv, kv) == "sparse_mqa_prefill"
    assert dense_fmha_kernel(q512, kv, kv.clone()) is None  # K = V must be the one tensor
    assert dense_fmha_kernel(torch.empty(3, 32, 512), kv, kv) is None  # 32 heads
    assert dense_fmha_kernel(q512, torch.empty(5, 2, 512), torch.empty(5, 2, 512)) is None  # two KV heads


@pytest.mark.parametrize("tq, hq", [(0, 64), (0, 8), (5, 0)])
def test_cpu_empty(tq, hq):
    d = 512 if hq == 64 else 64
    cu_q = torch.tensor([0, tq], dtype=torch.int32)
    cu_kv = torch.tensor([0, 10], dtype=torch.int32)
    kv = torch.randn(10, max(1, hq // 8), d).bfloat16()
    out, lse = dense_fmha(torch.randn(tq, hq, d).bfloat16(), kv, cu_q, cu_kv, torch.tensor([2], dtype=torch.int32),
                          max_seqlen_kv=10, window=4, ratio=2)
    assert out.shape == (tq, hq, d) and lse.shape == (tq, hq)


# ---------------------------------------------------------------- GPU ---------


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [64, 128])
def test_gpu_vs_reference(case, heads):
    q, kv, cu_q, cu_kv, nc, window, causal, ratio, start, sink = _inputs(case, heads, seed=heads)
    if kv.shape[0] == 0:
        pytest.skip("the CUDA path needs at least one kv row in the buffer")
    sink[0], sink[-1] = float("-inf"), float("inf")  # no sink / output forced to zero
    ref_out, ref_lse = reference.dense_fmha(q, kv, kv, cu_q, cu_kv, nc, window=window, causal=causal,
                                            ratio=ratio, seq_start_pos=start, sink=sink, scale=SCALE)
    dev = [t.cuda() if t is not None else None for t in (q, kv, cu_q, cu_kv, nc, start, sink)]
    qd, kvd, cqd, ckd, ncd, sd, sinkd = dev
    out = torch.full_like(qd, float("nan"))
    got, lse = dense_fmha(qd, kvd, cqd, ckd, ncd, max_seqlen_kv=int((cu_kv[1:] - cu_kv[:-1]).max()), window=window,
                          causal=causal, ratio=ratio, seq_start_pos=sd, attn_sink=sinkd, out=out)
    assert not torch.isnan(got).any()
    assert bool((got[:, -1].float() == 0).all())  # sink = +inf
    err = (got.float().cpu() - ref_out).norm() / ref_out.norm().clamp(min=1e-30)
    assert err <= 3e-3
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=0)


@pytest.mark.gpu
def test_gpu_unsupported_shape_is_a_clear_error():
    cu, ckv, nc = (torch.tensor(v, device="cuda") for v in ([0, 4], [0, 10], [2]))
    kv = torch.randn(10, 1, 96, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="head dims 64/128/256"):
        dense_fmha(torch.randn(4, 8, 96, device="cuda").bfloat16(), kv, cu, ckv, nc, max_seqlen_kv=10)
    # D = 512 through the sparse kernel needs one shared K = V head
    kv2 = torch.randn(10, 2, 512, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="head dim 512"):
        dense_fmha(torch.randn(4, 64, 512, device="cuda").bfloat16(), kv2, cu, ckv, nc, max_seqlen_kv=10)


# dense kernel (head dims 64-256): ragged batches, GQA, long sequences (many KV and query
# tiles), sink variants, separate k and v
LONG = ([300, 77], [1000, 260], [200, 40], 128, True, 4, [0, 33])
DENSE_CASES = CASES + [LONG, ([130], [700], [0], 0, True, 1, None), ([65], [400], [100], 64, False, 4, None)]


def _dense_inputs(case, d, hq, hkv, seed, separate_v):
    qlens, kvlens, ncomp, window, causal, ratio, starts = case
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    cu_kv = torch.tensor([0] + list(torch.tensor(kvlens).cumsum(0)), dtype=torch.int32)
    n_kv = max(1, int(cu_kv[-1]))
    q = torch.randn(int(cu_q[-1]), hq, d, generator=gen).bfloat16()
    k = torch.randn(n_kv, hkv, d, generator=gen).bfloat16()
    v = torch.randn(n_kv, hkv, d, generator=gen).bfloat16() if separate_v else k
    sink = torch.randn(hq, generator=gen)
    sink[0], sink[-1] = float("-inf"), float("inf")  # no sink / output forced to zero
    start = torch.tensor(starts, dtype=torch.int32) if starts is not None else None
    return q, k, v, cu_q, cu_kv, torch.tensor(ncomp, dtype=torch.int32), window, causal, ratio, start, sink


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(DENSE_CASES)))
@pytest.mark.parametrize("d, hq, hkv", [(64, 8, 2), (128, 4, 4), (256, 6, 1)])
def test_gpu_dense_vs_reference(case, d, hq, hkv):
    q, k, v, cu_q, cu_kv, nc, window, causal, ratio, start, sink = _dense_inputs(
        DENSE_CASES[case], d, hq, hkv, seed=case * 7 + d, separate_v=case % 2 == 0)
    nkv = int(cu_kv[-1])
    ref_out, ref_lse = reference.dense_fmha(q, k[:nkv], v[:nkv], cu_q, cu_kv, nc, window=window, causal=causal,
                                            ratio=ratio, seq_start_pos=start, sink=sink, scale=0.3 / d**0.5)
    dev = [t.cuda() if t is not None else None for t in (q, k, v, cu_q, cu_kv, nc, start, sink)]
    qd, kd, vd, cqd, ckd, ncd, sd, sinkd = dev
    out = torch.full_like(qd, float("nan"))  # poisoned: every row must be written
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) if case % 3 else None  # exact bound, or the default (Tq)
    got, lse = dense_fmha(qd, (kd, vd), cqd, ckd, ncd, max_seqlen_kv=max(1, int((cu_kv[1:] - cu_kv[:-1]).max())),
                          window=window, causal=causal, ratio=ratio, seq_start_pos=sd, attn_sink=sinkd,
                          softmax_scale=0.3 / d**0.5, out=out, max_seqlen_q=max_q)
    assert got is out and not torch.isnan(got).any()
    if q.shape[0]:
        err = (got.float().cpu() - ref_out).norm() / ref_out.norm().clamp(min=1e-30)
        assert err <= 3e-3, err
        assert bool((got[:, -1].float() == 0).all())  # sink = +inf
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=0)


@pytest.mark.gpu
def test_gpu_dense_opcheck():
    q, k, v, cu_q, cu_kv, nc, window, causal, ratio, start, sink = _dense_inputs(CASES[0], 64, 4, 2, 3, True)
    args = [t.cuda() for t in (q, k, v, cu_q, cu_kv, nc)] + [None, sink.cuda(), 0.125, window, causal, ratio,
                                                             int(q.shape[0]), 40, 3, torch.empty_like(q.cuda())]
    torch.library.opcheck(torch.ops.dsv4.dense_fmha.default, args)


@pytest.mark.gpu
def test_gpu_dense_bad_inputs():
    q, k, v, cu_q, cu_kv, nc, *_ = _dense_inputs(CASES[0], 64, 6, 4, 3, True)
    q, k, v, cu_q, cu_kv, nc = (t.cuda() for t in (q, k, v, cu_q, cu_kv, nc))
    with pytest.raises(RuntimeError, match="multiple of k/v heads"):
        dense_fmha(q, (k, v), cu_q, cu_kv, nc, max_seqlen_kv=40)
    with pytest.raises(RuntimeError, match="must have dtype"):
        dense_fmha(q[:, :4].float(), (k[:, :2].float(), v[:, :2].float()), cu_q, cu_kv, nc, max_seqlen_kv=40)
    with pytest.raises(RuntimeError, match="n_comp must have shape"):
        dense_fmha(q[:, :4], (k[:, :2], v[:, :2]), cu_q, cu_kv, nc[:2], max_seqlen_kv=40)
    with pytest.raises(RuntimeError, match="ratio must be >= 1"):
        dense_fmha(q[:, :4], (k[:, :2], v[:, :2]), cu_q, cu_kv, nc, max_seqlen_kv=40, ratio=0)
    with pytest.raises(RuntimeError, match="attn_sink must have shape"):
        dense_fmha(q[:, :4], (k[:, :2], v[:, :2]), cu_q, cu_kv, nc, max_seqlen_kv=40,
                   attn_sink=torch.zeros(3, device="cuda"))


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    q, kv, cu_q, cu_kv, nc, window, causal, ratio, start, sink = _inputs(CASES[0], 64, seed=5)
    q, kv, cu_q, cu_kv, nc, sink = (t.cuda() for t in (q, kv, cu_q, cu_kv, nc, sink))
    kw = dict(max_seqlen_kv=40, window=window, causal=causal, ratio=ratio, attn_sink=sink)
    out = torch.empty_like(q)
    dense_fmha(q, kv, cu_q, cu_kv, nc, out=out, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dense_fmha(q, kv, cu_q, cu_kv, nc, out=out, **kw)
    q.copy_(torch.randn_like(q.float()).bfloat16())
    graph.replay()
    eager, _ = dense_fmha(q, kv, cu_q, cu_kv, nc, **kw)
    assert torch.equal(out, eager)


@pytest.mark.gpu
def test_gpu_dense_cuda_graph_replay():
    q, k, v, cu_q, cu_kv, nc, window, causal, ratio, start, sink = _dense_inputs(LONG, 128, 8, 2, 9, True)
    q, k, v, cu_q, cu_kv, nc, start, sink = (t.cuda() for t in (q, k, v, cu_q, cu_kv, nc, start, sink))
    kw = dict(max_seqlen_kv=1000, window=window, causal=causal, ratio=ratio, seq_start_pos=start, attn_sink=sink,
              max_seqlen_q=300)
    out = torch.empty_like(q)
    dense_fmha(q, (k, v), cu_q, cu_kv, nc, out=out, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dense_fmha(q, (k, v), cu_q, cu_kv, nc, out=out, **kw)
    q.copy_(torch.randn_like(q.float()).bfloat16())
    graph.replay()
    eager, _ = dense_fmha(q, (k, v), cu_q, cu_kv, nc, **kw)
    assert torch.equal(out, eager)


DECODE = ([1, 1, 2, 1, 3], [700, 2000, 64, 1300, 900], [150, 400, 10, 300, 0], 128, True, 4, [0, 0, 7, 100, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [0, 1, 3, 7, 64])  # 0 = chosen from the shapes; 64 > tiles: empty splits
@pytest.mark.parametrize("d", [64, 256])
def test_gpu_dense_split_kv(splits, d):
    q, k, v, cu_q, cu_kv, nc, window, causal, ratio, start, sink = _dense_inputs(DECODE, d, 8, 1, d + splits, True)
    ref_out, ref_lse = reference.dense_fmha(q, k, v, cu_q, cu_kv, nc, window=window, causal=causal, ratio=ratio,
                                            seq_start_pos=start, sink=sink, scale=d**-0.5)
    qd, kd, vd, cqd, ckd, ncd, sd, sinkd = (t.cuda() for t in (q, k, v, cu_q, cu_kv, nc, start, sink))
    out = torch.full_like(qd, float("nan"))
    got, lse = dense_fmha(qd, (kd, vd), cqd, ckd, ncd, max_seqlen_kv=2000, window=window, causal=causal, ratio=ratio,
                          seq_start_pos=sd, attn_sink=sinkd, out=out, max_seqlen_q=3, num_splits=splits)
    assert not torch.isnan(got).any()
    err = (got.float().cpu() - ref_out).norm() / ref_out.norm()
    assert err <= 3e-3, err
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("value", POISONS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("heads", [64, 128])
def test_gpu_rows_a_query_does_not_see_never_reach_it(poison_smem, heads, value):
    """Head dim 512 (index lists + the sparse prefill kernel): rows that the early half of each
    sequence's queries do not see hold NaN / inf, and so does every SM's shared memory: those
    queries' outputs are bitwise the clean run's."""
    q, k, _, cu_q, cu_kv, nc, window, causal, ratio, start, sink = _dense_inputs(SKIP_CASE, 512, heads, 1, 91, False)
    early = _early_queries(cu_q)
    vis = _visibility(cu_q, cu_kv, nc, window, causal, ratio, start)
    rows = ~vis[early].any(0)
    qd, cqd, ckd, ncd, sd, sinkd = (t.cuda() for t in (q, cu_q, cu_kv, nc, start, sink))
    kw = dict(max_seqlen_kv=200, window=window, causal=causal, ratio=ratio, seq_start_pos=sd, attn_sink=sinkd)
    runs = []
    for kv, smem in ((k, 0.0), (_poisoned(k, rows, value), value)):
        out = torch.full_like(qd, float("nan"))
        kvd = kv.cuda()
        poison_smem(smem)
        runs.append(dense_fmha(qd, kvd, cqd, ckd, ncd, out=out, **kw))
    (clean_o, clean_l), (o, lse) = runs
    ref_out, ref_lse = reference.dense_fmha(q, k, k, cu_q, cu_kv, nc, window=window, causal=causal, ratio=ratio,
                                            seq_start_pos=start, sink=sink, scale=SCALE)
    assert (clean_o.float().cpu() - ref_out).norm() / ref_out.norm() <= 3e-3
    e = early.cuda()
    assert torch.equal(o[e].view(torch.int16), clean_o[e].view(torch.int16))
    assert torch.equal(lse[e], clean_l[e])


@pytest.mark.gpu
@pytest.mark.parametrize("value", POISONS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("splits", [0, 3])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_dense_rows_no_query_sees_are_never_read(poison_smem, d, splits, value):
    """Dense kernel: rows that no query of their sequence sees (all rows of a sequence without
    queries) hold NaN / inf in k and v, and so does shared memory: bitwise the clean run. (Rows
    that another query of the same 64-query tile sees do reach a query as 0 * value: see the
    dsv4.fmha module docstring.)"""
    q, k, v, cu_q, cu_kv, nc, window, causal, ratio, start, sink = _dense_inputs(SKIP_CASE, d, 8, 2, 92 + d, True)
    rows = ~_visibility(cu_q, cu_kv, nc, window, causal, ratio, start).any(0)
    assert rows.any()
    qd, cqd, ckd, ncd, sd, sinkd = (t.cuda() for t in (q, cu_q, cu_kv, nc, start, sink))
    kw = dict(max_seqlen_kv=200, window=window, causal=causal, ratio=ratio, seq_start_pos=sd, attn_sink=sinkd,
              num_splits=splits)
    runs = []
    for kk, vv, smem in ((k, v, 0.0), (_poisoned(k, rows, value), _poisoned(v, rows, value), value)):
        out = torch.full_like(qd, float("nan"))
        kd, vd = kk.cuda(), vv.cuda()
        poison_smem(smem)
        runs.append(dense_fmha(qd, (kd, vd), cqd, ckd, ncd, out=out, **kw))
    (clean_o, clean_l), (o, lse) = runs
    ref_out, _ = reference.dense_fmha(q, k, v, cu_q, cu_kv, nc, window=window, causal=causal, ratio=ratio,
                                      seq_start_pos=start, sink=sink, scale=d**-0.5)
    assert (clean_o.float().cpu() - ref_out).norm() / ref_out.norm() <= 3e-3
    assert torch.equal(o.view(torch.int16), clean_o.view(torch.int16))
    assert torch.equal(lse, clean_l)


@pytest.mark.gpu
def test_gpu_empty_and_bad_scale():
    """No tokens or no heads: empty outputs and no 0-size grid; softmax_scale checked like on CPU."""
    for tq, hq, d in ((0, 64, 512), (0, 8, 64), (5, 0, 64)):
        cu_q = torch.tensor([0, tq], dtype=torch.int32, device="cuda")
        cu_kv = torch.tensor([0, 10], dtype=torch.int32, device="cuda")
        kv = torch.randn(10, 1, d, device="cuda").bfloat16()
        out, lse = dense_fmha(torch.randn(tq, hq, d, device="cuda").bfloat16(), kv, cu_q, cu_kv,
                              torch.tensor([2], dtype=torch.int32, device="cuda"), max_seqlen_kv=10, window=4, ratio=2)
        assert out.shape == (tq, hq, d) and lse.shape == (tq, hq)
    torch.cuda.synchronize()
    q, k, v, cu_q, cu_kv, nc, *_ = _dense_inputs(CASES[0], 64, 4, 2, 3, True)
    args = [t.cuda() for t in (q, k, v, cu_q, cu_kv, nc)]
    with pytest.raises(RuntimeError, match=r"^dsv4: softmax_scale must be finite and > 0"):
        torch.ops.dsv4.dense_fmha(*args, None, None, 0.0, 4, True, 1, 9, 40, 0, torch.empty_like(args[0]))
