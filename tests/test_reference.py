"""Tests for dsv4.reference against independent second formulations.

Each library function is checked on fresh seeded random data against a
formulation written differently on purpose (dense multiplicity softmax,
per-query Python loops, per-token expert loops), plus the error paths.
"""

import math

import pytest
import torch
import torch.nn.functional as F

INF = float("inf")


from dsv4 import formats
from dsv4.reference import dense_fmha, nvfp4_moe, quantize_nvfp4, sparse_mqa, swiglu


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def _close(actual, expected, atol=1e-4, rtol=1e-4):
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------
# sparse_mqa vs a dense multiplicity-weighted softmax over all keys
# ---------------------------------------------------------------------------


def _multiplicity(indices, lengths, n_keys):
    """[T, n_keys] float64 count of each key among a token's used slots."""
    T, topk = indices.shape
    counts = torch.zeros(T, n_keys, dtype=torch.float64)
    for t in range(T):
        used = topk if lengths is None else max(0, min(topk, int(lengths[t])))
        for i in range(used):
            j = int(indices[t, i])
            if 0 <= j < n_keys:
                counts[t, j] += 1
    return counts


def _dense_sparse_mqa(q, kv, indices, lengths, sink, scale, extra=None):
    """Softmax over every key with weight count * exp(s), in float64."""
    keys = kv.double()
    counts = _multiplicity(indices, lengths, kv.shape[0])
    if extra is not None:
        ekv, eidx, elen = extra
        keys = torch.cat([keys, ekv.double()])
        counts = torch.cat([counts, _multiplicity(eidx, elen, ekv.shape[0])], dim=1)
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.full((T, H), -INF, dtype=torch.float64)
    for t in range(T):
        seen = counts[t] > 0
        if not seen.any():
            continue  # empty set: zero output, lse -inf, whatever the sink
        s = scale * (keys[seen] @ q[t].double().T)  # [n_seen, H]
        c = counts[t, seen].unsqueeze(1)
        m = s.max(0).values  # [H]
        z = (c * torch.exp(s - m)).sum(0)
        lse[t] = m + torch.log(z)
        denom = z.clone()
        if sink is not None:
            denom = denom + torch.exp(sink.double() - m)  # inf for sink=+inf
        out[t] = ((c * torch.exp(s - m)) / denom).T @ keys[seen]
    return out, lse


def _rand_indices(gen, T, topk, N, p_pad=0.15, p_oob=0.1):
    """Random index lists with -1 padding, out-of-range ids and duplicates."""
    idx = torch.randint(0, max(N, 1), (T, topk), generator=gen)
    r = torch.rand(T, topk, generator=gen)
    idx = torch.where(r < p_pad, torch.full_like(idx, -1), idx)
    idx = torch.where((r >= p_pad) & (r < p_pad + p_oob), N + idx % 3, idx)  # N is the first bad id
    if topk >= 2:
        idx[:, 1] = idx[:, 0]  # guaranteed duplicates
    return idx.to(torch.int32)


_SINK_MIX = torch.tensor([-INF, 0.7, INF, -1.5])


@pytest.mark.parametrize(
    "T,H,D,N,topk,use_lengths,sink_kind,seed",
    [
        (6, 4, 64, 50, 16, True, "mix", 0),
        (5, 4, 512, 40, 8, False, "none", 1),
        (1, 4, 64, 10, 4, True, "finite", 2),  # T = 1
        (4, 4, 32, 30, 0, True, "mix", 3),  # topk = 0
        (8, 4, 64, 7, 24, True, "mix", 4),  # many duplicates (topk > N)
        (3, 4, 64, 0, 5, False, "finite", 5),  # empty cache
    ],
)
def test_sparse_mqa_matches_dense(T, H, D, N, topk, use_lengths, sink_kind, seed):
    gen = _gen(seed)
    q = _randn(gen, T, H, D)
    kv = _randn(gen, N, D)
    idx = _rand_indices(gen, T, topk, N)
    lengths = None
    if use_lengths:
        lengths = torch.randint(0, topk + 2, (T,), generator=gen)
        lengths[0] = 0  # a token with nothing visible
    sink = {"none": None, "mix": _SINK_MIX, "finite": _randn(gen, H)}[sink_kind]
    scale = 1.0 / math.sqrt(D)
    out, lse = sparse_mqa(q, kv, idx, lengths, sink, scale)
    ref_out, ref_lse = _dense_sparse_mqa(q, kv, idx, lengths, sink, scale)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    _close(out, ref_out)
    _close(lse, ref_lse)


@pytest.mark.parametrize("seed", [10, 11])
def test_sparse_mqa_extra_cache(seed):
    gen = _gen(seed)
    T, H, D, N, N2 = 7, 4, 64, 33, 12
    q = _randn(gen, T, H, D)
    kv = _randn(gen, N, D)
    ekv = _randn(gen, N2, D)
    idx = _rand_indices(gen, T, 10, N)
    eidx = _rand_indices(gen, T, 6, N2)
    lengths = torch.randint(0, 11, (T,), generator=gen)
    elengths = torch.randint(0, 7, (T,), generator=gen)
    lengths[0], elengths[0] = 0, 0  # both empty: zero output
    lengths[1], elengths[2] = 0, 0  # only one list contributes
    for sink in (None, _SINK_MIX):
        out, lse = sparse_mqa(q, kv, idx, lengths, sink, 0.125, ekv, eidx, elengths)
        ref_out, ref_lse = _dense_sparse_mqa(q, kv, idx, lengths, sink, 0.125, (ekv, eidx, elengths))
        _close(out, ref_out)
        _close(lse, ref_lse)
    # extra_lengths None = whole extra list
    out, lse = sparse_mqa(q, kv, idx, lengths, None, 0.125, ekv, eidx)
    ref_out, ref_lse = _dense_sparse_mqa(q, kv, idx, lengths, None, 0.125, (ekv, eidx, None))
    _close(out, ref_out)
    _close(lse, ref_lse)


def test_sparse_mqa_special_rows():
    gen = _gen(20)
    T, H, D, N = 3, 4, 64, 16
    q = _randn(gen, T, H, D)
    kv = _randn(gen, N, D)
    idx = torch.full((T, 5), -1, dtype=torch.int64)  # all padding
    out, lse = sparse_mqa(q, kv, idx, None, _SINK_MIX, 0.1)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()

    idx = torch.randint(0, N, (T, 5), generator=gen)
    out, lse = sparse_mqa(q, kv, idx, None, _SINK_MIX, 0.1)
    assert torch.equal(out[:, 2], torch.zeros(T, D))  # sink +inf -> exactly zero
    assert torch.isfinite(lse).all()  # lse excludes the sink
    out_nosink, lse_nosink = sparse_mqa(q, kv, idx, None, None, 0.1)
    _close(out[:, 0], out_nosink[:, 0], atol=0, rtol=0)  # sink -inf == no sink
    _close(lse, lse_nosink, atol=0, rtol=0)

    # duplicates weigh twice: [a, a, b] == softmax over {a, b} with a counted twice
    idx = torch.tensor([[3, 3, 5]])
    out, _ = sparse_mqa(q[:1], kv, idx, None, None, 0.1)
    s = 0.1 * (q[0] @ kv[[3, 5]].T)  # [H, 2]
    w = torch.softmax(s + torch.log(torch.tensor([2.0, 1.0])), dim=-1)
    _close(out[0], w @ kv[[3, 5]])


def test_sparse_mqa_bf16_inputs():
    gen = _gen(21)
    q = _randn(gen, 4, 4, 64, dtype=torch.bfloat16)
    kv = _randn(gen, 20, 64, dtype=torch.bfloat16)
    idx = _rand_indices(gen, 4, 8, 20)
    out, lse = sparse_mqa(q, kv, idx, None, None, 0.125)
    ref_out, ref_lse = _dense_sparse_mqa(q.float(), kv.float(), idx, None, None, 0.125)
    assert out.dtype == torch.float32
    _close(out, ref_out)
    _close(lse, ref_lse)


@pytest.mark.parametrize("value", [float("nan"), INF, -INF])
def test_sparse_mqa_skipped_rows_are_not_read(value):
    """Rows that no used entry names (row 0, rows named only past a list's length or by
    nothing) hold NaN / inf: the result is bitwise that of finite rows there."""
    gen = _gen(23)
    T, H, D, N, topk = 5, 4, 64, 40, 12
    q = _randn(gen, T, H, D)
    kv, ekv = _randn(gen, N, D), _randn(gen, 20, D)
    idx = _rand_indices(gen, T, topk, N)
    idx[(idx == 0)] = 1
    lengths = torch.tensor([topk, 0, 5, topk + 3, 7])
    idx[:, 7:] = torch.randint(30, N, (T, topk - 7), generator=gen)  # past length 7: unused for t = 2, 4
    eidx = torch.randint(1, 10, (T, 6), generator=gen)
    eidx[:, 0] = -1
    sink = _randn(gen, H)
    used = torch.zeros(N, dtype=torch.bool)
    pos = torch.arange(topk)
    ok = (idx >= 0) & (idx < N) & (pos < lengths[:, None])
    used[idx[ok].long()] = True
    bad, ebad = kv.clone(), ekv.clone()
    bad[~used] = value
    ebad[0] = value
    ebad[10:] = value
    assert not used[0] and (~used).sum() > 10
    clean = sparse_mqa(q, kv, idx, lengths, sink, 0.3, ekv, eidx)
    got = sparse_mqa(q, bad, idx, lengths, sink, 0.3, ebad, eidx)
    for a, b in zip(got, clean):
        assert torch.equal(a, b)
    assert torch.isfinite(clean[0]).all()


@pytest.mark.parametrize("value", [float("nan"), INF, -INF])
def test_dense_fmha_rows_a_query_does_not_see_are_not_read(value):
    """Per query, not per sequence: rows that query 0..2 of a sequence do not see hold NaN /
    inf (later queries see some of them); those queries' results are bitwise the clean ones."""
    gen = _gen(301)
    q_lens, kv_lens, n_comp, window, ratio = [6, 0], [20, 5], [4, 2], 3, 2
    q, k, v, cu_q, cu_kv = _make_batch(gen, q_lens, kv_lens, 4, 2, 64, 32)
    seen_early = set()
    for i in range(3):
        seen_early.update(_visible_rows(6, i, 4, 16, 0, window, True, ratio))
    rows = torch.tensor([r not in seen_early for r in range(25)])
    kb, vb = k.clone(), v.clone()
    kb[rows], vb[rows] = value, value
    args = (torch.tensor(cu_q), torch.tensor(cu_kv), torch.tensor(n_comp))
    kw = dict(window=window, causal=True, ratio=ratio, sink=_randn(gen, 4), scale=0.2)
    clean_o, clean_l = dense_fmha(q, k, v, *args, **kw)
    o, lse = dense_fmha(q, kb, vb, *args, **kw)
    assert torch.equal(o[:3], clean_o[:3]) and torch.equal(lse[:3], clean_l[:3])
    assert not torch.isfinite(o[3:]).all()  # later queries see poisoned rows


def test_nan_sink_gives_nan_where_a_key_is_seen():
    gen = _gen(24)
    q, kv = _randn(gen, 2, 4, 64), _randn(gen, 10, 64)
    idx = torch.tensor([[1, 2, 3], [-1, -1, -1]])
    out, lse = sparse_mqa(q, kv, idx, None, torch.tensor([0.0, float("nan"), 1.0, -INF]), 0.1)
    assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[0, [0, 2, 3]]).all()
    assert torch.equal(out[1], torch.zeros(4, 64)) and torch.isfinite(lse[0]).all()


# ---------------------------------------------------------------------------
# dense_fmha vs a per-query loop, and vs sparse_mqa
# ---------------------------------------------------------------------------


def _visible_rows(tq, i, n_comp, n_win, start, window, causal, ratio):
    """Sequence-local kv rows query i may see, from the rules in plain Python."""
    if not causal:
        return list(range(n_comp + n_win))
    p = start + n_win - tq + i
    rows = [w for w in range(n_comp) if w < (p + 1) // ratio]
    for j in range(n_win):
        u = start + j
        if u <= p and (window <= 0 or u >= p - window + 1):
            rows.append(n_comp + j)
    return rows


def _loop_fmha(q, k, v, cu_q, cu_kv, n_comp, window, causal, ratio, starts, sink, scale):
    Tq, Hq, _ = q.shape
    Hkv = k.shape[1]
    out = torch.zeros(Tq, Hq, v.shape[2], dtype=torch.float64)
    lse = torch.full((Tq, Hq), -INF, dtype=torch.float64)
    for s in range(len(n_comp)):
        tq = cu_q[s + 1] - cu_q[s]
        n_win = cu_kv[s + 1] - cu_kv[s] - n_comp[s]
        for i in range(tq):
            t = cu_q[s] + i
            rows = [cu_kv[s] + r for r in
                    _visible_rows(tq, i, n_comp[s], n_win, starts[s], window, causal, ratio)]
            if not rows:
                continue
            for h in range(Hq):
                kh = h // (Hq // Hkv)
                sc = scale * (k[rows, kh].double() @ q[t, h].double())
                lse[t, h] = torch.logsumexp(sc, 0)
                if sink is not None:
                    sc = torch.cat([sc, sink[h:h + 1].double()])
                if sink is not None and sink[h] == INF:
                    continue  # all mass on the sink
                p = torch.softmax(sc, 0)[: len(rows)]
                out[t, h] = p @ v[rows, kh].double()
    return out, lse


def _make_batch(gen, q_lens, kv_lens, Hq, Hkv, D, Dv):
    cu_q = [0]
    cu_kv = [0]
    for a, b in zip(q_lens, kv_lens):
        cu_q.append(cu_q[-1] + a)
        cu_kv.append(cu_kv[-1] + b)
    q = _randn(gen, cu_q[-1], Hq, D)
    k = _randn(gen, cu_kv[-1], Hkv, D)
    v = _randn(gen, cu_kv[-1], Hkv, Dv)
    return q, k, v, cu_q, cu_kv


_FMHA_CASES = [
    # q_lens, kv_lens, n_comp, starts, window, causal, ratio, Hq, Hkv, D, Dv, sink
    # ragged batch of 3, prefill / chunked / decode mix, MQA
    ([5, 9, 1], [12, 9, 20], [3, 0, 6], None, 4, True, 4, 4, 1, 64, 64, "mix"),
    # window larger than every sequence, n_comp 0
    ([6, 3], [6, 8], [0, 0], None, 100, True, 1, 4, 1, 64, 64, None),
    # single-token sequences
    ([1, 1, 1], [1, 4, 7], [0, 1, 2], [0, 5, 12], 3, True, 4, 4, 1, 64, 64, "finite"),
    # ratio 128 with large start positions: 7 of 9 compressed entries visible,
    # and a sequence whose queries straddle p + 1 = 9 * 128
    ([4, 2], [13, 12], [9, 9], [1000, 1149], 2, True, 128, 4, 1, 64, 64, "mix"),
    # non-causal, GQA Hq=8 Hkv=2, Dv != D
    ([5, 7, 2], [9, 7, 3], [2, 0, 3], None, 2, False, 4, 8, 2, 64, 32, "finite"),
    # causal GQA, unlimited window, head dim 512
    ([4, 6], [7, 10], [2, 3], [3, 0], 0, True, 4, 8, 2, 512, 512, None),
    # empty query sequence in the middle, an empty kv sequence at the end
    ([3, 0, 0], [6, 4, 0], [2, 1, 0], None, 2, True, 2, 4, 1, 64, 64, "mix"),
]


@pytest.mark.parametrize("case", range(len(_FMHA_CASES)))
def test_dense_fmha_matches_loop(case):
    q_lens, kv_lens, n_comp, starts, window, causal, ratio, Hq, Hkv, D, Dv, sink_kind = _FMHA_CASES[case]
    gen = _gen(100 + case)
    q, k, v, cu_q, cu_kv = _make_batch(gen, q_lens, kv_lens, Hq, Hkv, D, Dv)
    sink = {None: None, "finite": _randn(gen, Hq),
            "mix": torch.tensor([-INF, 0.5, INF, -2.0] * (Hq // 4))}[sink_kind]
    scale = 1.0 / math.sqrt(D)
    out, lse = dense_fmha(
        q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_kv, dtype=torch.int32),
        torch.tensor(n_comp, dtype=torch.int32), window=window, causal=causal, ratio=ratio,
        seq_start_pos=None if starts is None else torch.tensor(starts), sink=sink, scale=scale,
    )
    ref_out, ref_lse = _loop_fmha(q, k, v, cu_q, cu_kv, n_comp, window, causal, ratio,
                                  starts or [0] * len(n_comp), sink, scale)
    assert out.shape == (q.shape[0], Hq, Dv) and out.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    _close(out, ref_out)
    _close(lse, ref_lse)


@pytest.mark.parametrize("case", [0, 1, 2, 3, 6])
def test_dense_fmha_matches_sparse_mqa(case):
    """MQA with v = k: dense_fmha must equal sparse_mqa over the visible rows."""
    q_lens, kv_lens, n_comp, starts, window, causal, ratio, Hq, _, D, _, _ = _FMHA_CASES[case]
    gen = _gen(200 + case)
    q, k, _, cu_q, cu_kv = _make_batch(gen, q_lens, kv_lens, Hq, 1, D, D)
    sink = _randn(gen, Hq)
    starts = starts or [0] * len(n_comp)
    lists = []
    for s in range(len(n_comp)):
        tq = cu_q[s + 1] - cu_q[s]
        n_win = cu_kv[s + 1] - cu_kv[s] - n_comp[s]
        for i in range(tq):
            rows = _visible_rows(tq, i, n_comp[s], n_win, starts[s], window, causal, ratio)
            lists.append([cu_kv[s] + r for r in rows])
    topk = max([len(r) for r in lists] + [1]) + 2
    indices = torch.full((len(lists), topk), -1, dtype=torch.int32)
    for t, rows in enumerate(lists):
        indices[t, : len(rows)] = torch.tensor(rows, dtype=torch.int32)
        indices[t, len(rows):] = 0  # cut off by lengths, must be ignored
    lengths = torch.tensor([len(r) for r in lists], dtype=torch.int32)

    out, lse = dense_fmha(
        q, k, k, torch.tensor(cu_q), torch.tensor(cu_kv), torch.tensor(n_comp),
        window=window, causal=causal, ratio=ratio, seq_start_pos=torch.tensor(starts),
        sink=sink, scale=0.1,
    )
    sp_out, sp_lse = sparse_mqa(q, k[:, 0], indices, lengths, sink, 0.1)
    _close(out, sp_out, atol=1e-5, rtol=1e-5)
    _close(lse, sp_lse, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# nvfp4_moe vs a per-token loop over dequantized experts
# ---------------------------------------------------------------------------


def test_swiglu_hand_values():
    g = torch.tensor([-20.0, -1.0, 0.0, 2.0, 15.0])
    u = torch.tensor([-30.0, 3.0, 5.0, -12.0, 11.0])
    silu = lambda z: z / (1.0 + math.exp(-z))  # noqa: E731
    expect = torch.tensor([silu(-20.0) * -10.0, silu(-1.0) * 3.0, 0.0, silu(2.0) * -10.0,
                           silu(10.0) * 10.0])
    _close(swiglu(g, u, 10.0), expect, atol=1e-6, rtol=1e-6)
    expect_plain = torch.tensor([silu(a) * b for a, b in zip(g.tolist(), u.tolist())])
    _close(swiglu(g, u, None), expect_plain, atol=1e-6, rtol=1e-6)
    _close(swiglu(g, u, torch.tensor(10.0)), expect, atol=1e-6, rtol=1e-6)
    assert swiglu(g.bfloat16(), u.bfloat16(), None).dtype == torch.float32


def _qdq(x, g):
    return formats.dequantize_nvfp4(*quantize_nvfp4(x, g), g, dtype=torch.float32)


def _pick(scale, e):
    if isinstance(scale, torch.Tensor) and scale.numel() > 1:
        return scale[e : e + 1]
    return scale


def _loop_moe(x, ids, weights, wts, limit, activation, a13, a2, expert_map):
    """One token and one slot at a time, on the fully dequantized stack."""
    w13 = formats.dequantize_experts(wts["w13"], wts["w13_scale"], wts["w13_scale_2"]).double()
    w2 = formats.dequantize_experts(wts["w2"], wts["w2_scale"], wts["w2_scale_2"]).double()
    N = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for m in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[m, j])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            row = x[m : m + 1].float()
            if activation == "nvfp4":
                row = _qdq(row, _pick(a13, e))
            row = row.double()[0]
            g, u = w13[e, :N] @ row, w13[e, N:] @ row
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            h = F.silu(g) * u
            if activation == "nvfp4":
                h = _qdq(h.float().unsqueeze(0), _pick(a2, e)).double()[0]
            out[m] += float(weights[m, j]) * (w2[e] @ h)
    return out


def _hidden_amax(x, wts, limit):
    """max |h| over all tokens and experts, to pick a sensible a2 scale."""
    w13 = formats.dequantize_experts(wts["w13"], wts["w13_scale"], wts["w13_scale_2"])
    N = w13.shape[1] // 2
    gu = torch.einsum("mk,erk->emr", x.float(), w13)
    return swiglu(gu[..., :N], gu[..., N:], limit).abs().max()


def _moe_case(seed, M, topk, E, N, K, routing="random", x_dtype=torch.bfloat16):
    gen = _gen(seed)
    wts = formats.random_nvfp4_moe_weights(E, N, K, generator=gen)
    # The random weights are ~N(0, 0.02^2); a large x makes |g|, |u| exceed
    # the swiglu limit of 10 so the clamps are exercised.
    x = (100.0 * _randn(gen, M, K)).to(x_dtype)
    if routing == "skewed":
        ids = torch.zeros(M, topk, dtype=torch.int64)  # every slot to expert 0
    else:
        # experts E-1 and E-2 never chosen: experts that get no tokens
        ids = torch.stack([torch.randperm(E - 2, generator=gen)[:topk] for _ in range(M)])
    weights = torch.softmax(_randn(gen, M, topk), dim=-1)
    return gen, wts, x, ids, weights


def _run_moe(x, ids, weights, wts, **kw):
    return nvfp4_moe(x, ids, weights, wts["w13"], wts["w13_scale"], wts["w13_scale_2"],
                     wts["w2"], wts["w2_scale"], wts["w2_scale_2"], **kw)


def _assert_moe_close(out, ref):
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert ref.abs().max() > 0
    tol = 1e-4 * float(ref.abs().max())
    _close(out, ref, atol=tol, rtol=1e-4)


@pytest.mark.parametrize(
    "seed,M,topk,E,N,K,routing,limit",
    [
        (0, 16, 2, 4, 32, 64, "random", None),
        (1, 12, 3, 8, 64, 128, "random", 10.0),
        (2, 9, 4, 6, 32, 128, "skewed", 10.0),
        (3, 1, 1, 4, 64, 64, "random", None),
    ],
)
def test_nvfp4_moe_bf16_matches_loop(seed, M, topk, E, N, K, routing, limit):
    _, wts, x, ids, weights = _moe_case(seed, M, topk, E, N, K, routing)
    out = _run_moe(x, ids, weights, wts, swiglu_limit=limit)
    ref = _loop_moe(x, ids, weights, wts, limit, "bf16", None, None, None)
    _assert_moe_close(out, ref)


def test_nvfp4_moe_limit_matters():
    _, wts, x, ids, weights = _moe_case(11, 8, 2, 4, 32, 64)
    clamped = _run_moe(x, ids, weights, wts, swiglu_limit=10.0)
    plain = _run_moe(x, ids, weights, wts)
    assert (clamped - plain).abs().max() > 0.05 * plain.abs().max()


def test_nvfp4_moe_expert_map():
    gen, wts, x, _, weights = _moe_case(4, 10, 3, 4, 32, 64)
    # 10 global experts; 4 are local (one of them, local 3, gets no tokens)
    expert_map = torch.tensor([-1, 2, -1, 0, -1, 1, -1, -1, 3, -1])
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(10)])
    ids[0] = torch.tensor([0, 2, 4])  # a token with no local expert at all
    out = _run_moe(x, ids, weights, wts, swiglu_limit=10.0, expert_map=expert_map)
    ref = _loop_moe(x, ids, weights, wts, 10.0, "bf16", None, None, expert_map)
    _assert_moe_close(out, ref)
    assert torch.equal(out[0], torch.zeros(x.shape[1]))


def test_nvfp4_moe_w13_scale_2_pairs():
    _, wts, x, ids, weights = _moe_case(5, 8, 2, 4, 32, 64)
    wts = dict(wts)
    wts["w13_scale_2"] = torch.stack([wts["w13_scale_2"], 1.7 * wts["w13_scale_2"]], dim=1)
    out = _run_moe(x, ids, weights, wts)
    ref = _loop_moe(x, ids, weights, wts, None, "bf16", None, None, None)
    _assert_moe_close(out, ref)


@pytest.mark.parametrize("per_expert", [False, True])
@pytest.mark.parametrize("limit", [None, 10.0])
def test_nvfp4_moe_nvfp4_activation(per_expert, limit):
    gen, wts, x, ids, weights = _moe_case(6 + per_expert, 12, 2, 6, 32, 64)
    a13 = float(x.float().abs().max()) / (6 * 448)
    a2 = float(_hidden_amax(x, wts, limit)) / (6 * 448)
    if per_expert:
        a13 = a13 * (1 + torch.rand(6, generator=gen))
        a2 = a2 * (1 + torch.rand(6, generator=gen))
    else:
        a13 = torch.tensor([a13])  # 1-element tensor; a2 stays a float
    kw = dict(swiglu_limit=limit, activation="nvfp4", a13_scale=a13, a2_scale=a2)
    out = _run_moe(x, ids, weights, wts, **kw)
    ref = _loop_moe(x, ids, weights, wts, limit, "nvfp4", a13, a2, None)
    _assert_moe_close(out, ref)
    # the emulation must actually change the result, by a few percent
    plain = _run_moe(x, ids, weights, wts, swiglu_limit=limit)
    rel = (out - plain).abs().max() / plain.abs().max()
    assert 1e-3 < rel < 0.3


def test_nvfp4_moe_float32_input():
    _, wts, x, ids, weights = _moe_case(8, 6, 2, 4, 32, 64, x_dtype=torch.float32)
    out = _run_moe(x, ids, weights, wts)
    ref = _loop_moe(x, ids, weights, wts, None, "bf16", None, None, None)
    _assert_moe_close(out, ref)


def test_nvfp4_moe_drops_slots_without_a_local_expert():
    """Ids outside [0, E) (no map), outside the map, or mapped outside [0, E) contribute
    nothing, as in the kernels (the op wrappers refuse them unless check_ids=False)."""
    _, wts, x, ids, weights = _moe_case(9, 4, 2, 4, 32, 64)
    bad = ids.clone()
    bad[0, 0], bad[1, 1], bad[2, 0] = 4, -1, 1000
    dropped = weights.clone()
    dropped[0, 0] = dropped[1, 1] = dropped[2, 0] = 0
    torch.testing.assert_close(_run_moe(x, bad, weights, wts), _run_moe(x, ids, dropped, wts))
    # with a map: global id 5 is outside it, global id 4 maps to 7 (not a local expert)
    emap = torch.tensor([0, 1, 2, 3, 7])
    gbad = ids.clone()
    gbad[0, 0], gbad[3, 1] = 5, 4
    dropped = weights.clone()
    dropped[0, 0] = dropped[3, 1] = 0
    torch.testing.assert_close(_run_moe(x, gbad, weights, wts, expert_map=emap),
                               _run_moe(x, ids, dropped, wts, expert_map=emap))
