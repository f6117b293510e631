"""dsv4.fmha: dense masked attention over [compressed | window] KV.

The CUDA path is visible_rows() + the sparse MQA prefill kernel. On the CPU the same
composition runs through the sparse op's CPU kernel (the float32 sparse reference), so
the index construction is checked here against the independently written dense
reference (dsv4.reference.dense_fmha) on every mask corner case.
"""

import pytest
import torch

from dsv4 import reference
from dsv4.attention import sparse_mqa_prefill
from dsv4.fmha import fmha, visible_rows

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
                                            ratio=ratio, seq_start_pos=start, sink=sink, scale=512**-0.5)
    width = max(1, int((cu_kv[1:] - cu_kv[:-1]).max()))
    idx, lengths = visible_rows(q.shape[0], cu_q, cu_kv, nc, width=width, window=window, causal=causal,
                                ratio=ratio, seq_start_pos=start)
    assert idx.dtype == torch.int32 and idx.shape == (q.shape[0], width)
    # everything past a row's length is padding
    col = torch.arange(width)[None, :]
    assert bool((idx[col >= lengths[:, None]] == -1).all())
    out, lse = sparse_mqa_prefill(q, kv.reshape(-1, 512) if kv.shape[0] else torch.zeros(1, 512).bfloat16(),
                                  idx, lengths, sink, 512**-0.5)
    torch.testing.assert_close(out.float(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


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
    got, lse = fmha(q, (k, v), cu_q, cu_kv, nc, max_seqlen_kv=15, window=4, ratio=4, out=out)
    ref, ref_lse = reference.dense_fmha(q, k, v, cu_q, cu_kv, nc, window=4, causal=True, ratio=4,
                                        scale=64**-0.5)
    assert got is out
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("bad", [-1, 2.5, True, None])
def test_max_seqlen_kv_must_be_a_host_int(bad):
    q, kv, cu_q, cu_kv, nc, *_ = _inputs(CASES[1])
    with pytest.raises(ValueError, match="max_seqlen_kv must be a non-negative int"):
        fmha(q, kv, cu_q, cu_kv, nc, max_seqlen_kv=bad)


def test_visible_rows_compiles():
    f = torch.compile(visible_rows, fullgraph=True, backend="eager", dynamic=False)
    args = (4, torch.tensor([0, 4]), torch.tensor([0, 10]), torch.tensor([3]))
    kw = dict(width=10, window=3, causal=True, ratio=2)
    a, b = f(*args, **kw), visible_rows(*args, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------- GPU ---------


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [64, 128])
def test_gpu_vs_reference(case, heads):
    q, kv, cu_q, cu_kv, nc, window, causal, ratio, start, sink = _inputs(case, heads, seed=heads)
    if kv.shape[0] == 0:
        pytest.skip("the CUDA path needs at least one kv row in the buffer")
    ref_out, ref_lse = reference.dense_fmha(q, kv, kv, cu_q, cu_kv, nc, window=window, causal=causal,
                                            ratio=ratio, seq_start_pos=start, sink=sink, scale=512**-0.5)
    dev = [t.cuda() if t is not None else None for t in (q, kv, cu_q, cu_kv, nc, start, sink)]
    qd, kvd, cqd, ckd, ncd, sd, sinkd = dev
    out = torch.full_like(qd, float("nan"))
    got, lse = fmha(qd, kvd, cqd, ckd, ncd, max_seqlen_kv=int((cu_kv[1:] - cu_kv[:-1]).max()), window=window,
                    causal=causal, ratio=ratio, seq_start_pos=sd, attn_sink=sinkd, out=out)
    assert not torch.isnan(got).any()
    err = (got.float().cpu() - ref_out).norm() / ref_out.norm().clamp(min=1e-30)
    assert err <= 3e-3
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=0)


@pytest.mark.gpu
def test_gpu_unsupported_shape_is_a_clear_error():
    q = torch.randn(4, 64, 128, device="cuda").bfloat16()
    kv = torch.randn(10, 1, 128, device="cuda").bfloat16()
    cu = torch.tensor([0, 4], device="cuda")
    with pytest.raises(ValueError, match="head dim 512"):
        fmha(q, kv, cu, torch.tensor([0, 10], device="cuda"), torch.tensor([2], device="cuda"), max_seqlen_kv=10)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    q, kv, cu_q, cu_kv, nc, window, causal, ratio, start, sink = _inputs(CASES[0], 64, seed=5)
    q, kv, cu_q, cu_kv, nc, sink = (t.cuda() for t in (q, kv, cu_q, cu_kv, nc, sink))
    kw = dict(max_seqlen_kv=40, window=window, causal=causal, ratio=ratio, attn_sink=sink)
    out = torch.empty_like(q)
    fmha(q, kv, cu_q, cu_kv, nc, out=out, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fmha(q, kv, cu_q, cu_kv, nc, out=out, **kw)
    q.copy_(torch.randn_like(q.float()).bfloat16())
    graph.replay()
    eager, _ = fmha(q, kv, cu_q, cu_kv, nc, **kw)
    assert torch.equal(out, eager)
