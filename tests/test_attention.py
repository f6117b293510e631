"""Tests for dsv4.sparse_mqa_decode / dsv4.sparse_mqa_prefill.

CPU tests (always): wrappers vs the float32 reference, every bad-input error, opcheck,
torch.compile(fullgraph). GPU tests (``-m gpu``; tests/conftest.py skips them without a
Hopper GPU and fails them on a Hopper GPU without the extension):
the CUDA kernels against the float32 reference on fresh random data with poisoned
outputs, CUDA-graph capture/replay, opcheck on CUDA, the same bad-input errors.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import dsv4
import dsv4._ops
from dsv4 import formats, reference
from dsv4.formats import kv_cache
from dsv4.formats.kv_cache import HEAD_DIM
from dsv4.attention import sparse_mqa_decode, sparse_mqa_prefill

SCALE = HEAD_DIM**-0.5

# ----------------------------------------------------------------------------------------
# data helpers
# ----------------------------------------------------------------------------------------


def _gen(seed, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


def make_cache(kind, num_blocks, block_size, device, seed):
    """A fully written random cache (every slot holds a real row) and its f32 rows."""
    g = _gen(seed)
    n = num_blocks * block_size
    rows = torch.randn(n, 512, generator=g) * 2.0
    slots = torch.arange(n)
    if kind == "fp8":
        cache = formats.new_fp8_ds_mla_cache(num_blocks, block_size, device=device, fill="random", generator=g)
        formats.write_fp8_ds_mla(cache, slots.to(device), rows.to(device))
        deq = formats.dequantize_fp8_ds_mla_cache(cache).float()
    else:
        cache = formats.new_bf16_cache(num_blocks, block_size, device=device, fill="random", generator=g)
        formats.write_bf16_cache(cache, slots.to(device), rows.to(device))
        deq = cache.reshape(-1, 512).float()
    return cache, deq


def make_indices(b, s_q, topk, num_slots, g, *, invalid=True, dups=True):
    idx = torch.randint(0, num_slots, (b, s_q, topk), generator=g, dtype=torch.int32)
    if topk and invalid:
        r = torch.rand(b, s_q, topk, generator=g)
        idx[r < 0.05] = -1
        idx[(r >= 0.05) & (r < 0.08)] = num_slots + 7  # out of range
        idx[(r >= 0.08) & (r < 0.09)] = 2**31 - 1
    if topk > 4 and dups:
        idx[..., 1] = idx[..., 0]
        idx[..., 3] = idx[..., 0]
    return idx


def make_lengths(b, topk, g, ragged):
    if not ragged:
        return None
    lens = torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32)
    lens[0] = topk
    if b > 2:
        lens[1] = 0
        lens[2] = topk + 5  # longer than topk: clamped
    return lens


def make_sink(kind, h, g):
    if kind is None:
        return None
    if kind == "finite":
        return torch.randn(h, generator=g) * 2.0
    s = torch.randn(h, generator=g)
    if kind == "-inf":
        s[:] = -math.inf
    elif kind == "+inf":
        s[::3] = math.inf  # some heads forced to zero, others finite
    return s.float()


def ref_decode(q, rows, idx, lens, sink, scale, rows2=None, idx2=None, lens2=None, chunk=256):
    """Float32 reference for [B, s_q, H, D] queries (chunked over tokens to bound memory)."""
    b, s_q, h, d = q.shape
    t = b * s_q
    qf = q.reshape(t, h, d)
    i1 = idx.reshape(t, -1)
    l1 = None if lens is None else lens.repeat_interleave(s_q)
    i2 = None if idx2 is None else idx2.reshape(t, -1)
    l2 = None if lens2 is None else lens2.repeat_interleave(s_q)
    outs, lses = [], []
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        o, l = reference.sparse_mqa(
            qf[s:e], rows, i1[s:e], None if l1 is None else l1[s:e], sink, scale,
            extra_kv=rows2, extra_indices=None if i2 is None else i2[s:e],
            extra_lengths=None if l2 is None else l2[s:e],
        )
        outs.append(o)
        lses.append(l)
    return torch.cat(outs).reshape(b, s_q, h, d), torch.cat(lses).reshape(b, s_q, h)


def assert_close(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any(), "NaN in out"
    assert not torch.isnan(lse).any(), "NaN in lse"
    of, rf = out.float(), ref_out.float()
    den = rf.norm().item()
    err = (of - rf).norm().item()
    if den > 0:
        assert err / den <= 3e-3, f"relative L2 error {err / den:.3e} > 3e-3"
    else:
        assert err == 0.0
    # rows the reference sets to exactly zero (no visible key / +inf sink) must be zero
    zero_rows = (rf == 0).all(dim=-1)
    assert (of[zero_rows] == 0).all(), "expected exact zero rows"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse -inf pattern differs"
    if fin.any():
        lerr = (lse[fin] - ref_lse[fin]).abs().max().item()
        assert lerr <= 1e-3, f"lse abs error {lerr:.3e} > 1e-3"


# ----------------------------------------------------------------------------------------
# CPU: wrappers = reference
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("extra", [False, True])
def test_decode_cpu_matches_reference(kind, extra):
    g = _gen(1)
    b, s_q, h, topk = 3, 2, 64, 70
    cache, rows = make_cache(kind, 4, 16, "cpu", 2)
    q = (torch.randn(b, s_q, h, 512, generator=g) * 2).bfloat16()
    idx = make_indices(b, s_q, topk, 64, g)
    lens = make_lengths(b, topk, g, True)
    sink = make_sink("finite", h, g)
    cache2 = idx2 = lens2 = rows2 = None
    if extra:
        cache2, rows2 = make_cache(kind, 2, 64, "cpu", 3)
        idx2 = make_indices(b, s_q, 33, 128, g)
        lens2 = make_lengths(b, 33, g, True)
    out, lse = sparse_mqa_decode(q, cache.unsqueeze(2), idx, lens, sink, SCALE, cache2, idx2, lens2)
    ro, rl = ref_decode(q, rows, idx, lens, sink, SCALE, rows2, idx2, lens2)
    assert out.shape == (b, s_q, h, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (b, s_q, h) and lse.dtype == torch.float32
    assert torch.equal(out, ro.bfloat16())
    assert torch.equal(lse, rl)


def test_prefill_cpu_matches_reference_and_vllm_shapes():
    g = _gen(4)
    t, h, n, topk = 5, 128, 90, 40
    q = torch.randn(t, h, 512, generator=g).bfloat16()
    kv = torch.randn(n, 512, generator=g).bfloat16()
    idx = make_indices(t, 1, topk, n, g)[:, 0]
    lens = make_lengths(t, topk, g, True)
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16)
    o1, l1 = sparse_mqa_prefill(q, kv.view(n, 1, 512), idx.unsqueeze(1), lens, None, SCALE, out=out)
    assert o1 is out
    ro, rl = reference.sparse_mqa(q, kv.float(), idx, lens, None, SCALE)
    assert torch.equal(o1, ro.bfloat16()) and torch.equal(l1, rl)
    o2, l2 = sparse_mqa_prefill(q, kv, idx, lens)  # default scale = HEAD_DIM ** -0.5
    assert torch.equal(o2, o1) and torch.equal(l2, l1)


def test_empty_and_infinite_sink_cpu():
    g = _gen(5)
    cache, _ = make_cache("fp8", 2, 64, "cpu", 6)
    q = torch.randn(2, 1, 64, 512, generator=g).bfloat16()
    idx = torch.full((2, 1, 8), -1, dtype=torch.int32)
    out, lse = sparse_mqa_decode(q, cache, idx, attn_sink=torch.zeros(64))
    assert (out == 0).all() and torch.isneginf(lse).all()
    idx = make_indices(2, 1, 8, 128, g, invalid=False)
    out, lse = sparse_mqa_decode(q, cache, idx, attn_sink=torch.full((64,), math.inf))
    assert (out == 0).all() and torch.isfinite(lse).all()


# ----------------------------------------------------------------------------------------
# skipped entries never reach the math: slots that no used entry names are poisoned
# ----------------------------------------------------------------------------------------

POISONS = [math.nan, math.inf, -math.inf]


def poison_slots(cache, kind, slots, value):
    """Overwrites the given slots of a cache, in place, with bytes that read as `value` (NaN,
    +inf or -inf) in every dim. fp8_ds_mla: e4m3 0x7F (NaN) or +-448 with the scale byte
    0xFF (e8m0 NaN; dequantized as 2^128, so 448 * 2^128 = inf), the bf16 rope part = value."""
    c3 = cache[:, :, 0] if cache.dim() == 4 else cache
    bs = c3.shape[1]
    blk, off = slots // bs, slots % bs
    if kind == "bf16":
        c3[blk, off] = value
        return
    data, scales = kv_cache._fp8_ds_mla_regions(c3)
    code = 0x7F if math.isnan(value) else (0x7E if value > 0 else 0xFE)
    data[blk, off, :448] = code
    data[blk, off, 448:] = torch.full((64,), value, dtype=torch.bfloat16).view(torch.uint8).to(cache.device)
    scales[blk, off] = 0xFF


def poisoned_copy(cache, kind, used_slots, value):
    """A copy of `cache` with every slot outside `used_slots` poisoned (slot 0 included)."""
    num_slots = cache.shape[0] * cache.shape[1]
    keep = torch.zeros(num_slots, dtype=torch.bool, device=cache.device)
    keep[used_slots.long()] = True
    bad = (~keep).nonzero().flatten()
    assert not keep[0] and bad.numel() > 0
    # a copy of the whole storage keeps the real block stride (and the bytes between blocks)
    storage = torch.empty(0, dtype=cache.dtype, device=cache.device).set_(cache.untyped_storage())
    out = storage.clone().as_strided(cache.shape, cache.stride(), cache.storage_offset())
    poison_slots(out, kind, bad, value)
    rows = formats.dequantize_fp8_ds_mla_cache(out) if kind == "fp8" else out.reshape(num_slots, 512)
    assert not torch.isfinite(rows[bad]).any(), "the poison must read as NaN / inf"
    return out


def skip_indices(b, s_q, topk, num_slots, lens, g):
    """Index lists whose used entries (before the length, in range) name slots in
    [1, num_slots / 2); entries past the length name the upper half; -1 and out-of-range ids
    are sprinkled in, and runs of them open tiles (64 entries) and fill one tile."""
    half = num_slots // 2
    idx = torch.randint(1, half, (b, s_q, topk), generator=g, dtype=torch.int32)
    pos = torch.arange(topk)
    if lens is not None:
        past = pos[None, None, :] >= lens.long()[:, None, None]
        idx[past.expand_as(idx)] = torch.randint(half, num_slots, (int(past.expand_as(idx).sum()),), generator=g,
                                                 dtype=torch.int32)
    r = torch.rand(b, s_q, topk, generator=g)
    idx[r < 0.1] = -1
    idx[(r >= 0.1) & (r < 0.15)] = num_slots + 3
    idx[(r >= 0.15) & (r < 0.17)] = 2**31 - 1
    for t0 in range(0, topk, 64):  # the first rows of every tile skipped
        idx[..., t0 : t0 + 5] = -1
    if topk >= 192:
        idx[..., 64:128] = -1  # a whole tile skipped
    return idx


def used_slots(idx, lens, num_slots):
    pos = torch.arange(idx.shape[-1], device=idx.device)
    ok = (idx >= 0) & (idx < num_slots)
    if lens is not None:
        ok &= pos < lens.long()[:, None, None]
    return idx[ok].unique()


def skip_lengths(b, topk, g):
    lens = torch.randint(1, topk + 1, (b,), generator=g, dtype=torch.int32)
    lens[0] = 0  # nothing visible: zero output, lse -inf
    lens[1] = topk + 9  # longer than the list: clamped
    lens[2] = topk // 3  # shorter than the list
    return lens


def assert_bitwise(out, lse, ref_out, ref_lse):
    assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16)), "out differs from the clean run"
    assert torch.equal(lse, ref_lse), "lse differs from the clean run"


def _skip_decode_case(kind, extra, value, device, b=4, s_q=2, topk=150, topk2=70, seed=40):
    g = _gen(seed)
    cache, _ = make_cache(kind, 6, 32, device, seed + 1)  # 192 slots
    lens = skip_lengths(b, topk, g)
    idx = skip_indices(b, s_q, topk, 192, lens, g)
    caches = [cache, poisoned_copy(cache, kind, used_slots(idx.to(device), lens.to(device), 192), value)]
    q = (torch.randn(b, s_q, 64, 512, generator=g) * 2).bfloat16().to(device)
    sink = make_sink("finite", 64, g).to(device)
    extras = [None, None]
    idx2 = lens2 = None
    if extra:
        cache2, _ = make_cache(kind, 2, 64, device, seed + 2)  # 128 slots
        lens2 = skip_lengths(b, topk2, g)
        idx2 = skip_indices(b, s_q, topk2, 128, lens2, g)
        extras = [cache2, poisoned_copy(cache2, kind, used_slots(idx2.to(device), lens2.to(device), 128), value)]
        idx2, lens2 = idx2.to(device), lens2.to(device)
    args = (q, idx.to(device), lens.to(device), sink, idx2, lens2)
    return caches, extras, args


@pytest.mark.parametrize("value", POISONS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_decode_skipped_entries_never_reach_the_math_cpu(kind, extra, value):
    caches, extras, (q, idx, lens, sink, idx2, lens2) = _skip_decode_case(kind, extra, value, "cpu")
    runs = [sparse_mqa_decode(q, c, idx, lens, sink, SCALE, e, idx2, lens2) for c, e in zip(caches, extras)]
    (clean_o, clean_l), (o, lse) = runs
    assert torch.isfinite(clean_o.float()).all()
    assert_bitwise(o, lse, clean_o, clean_l)
    assert (o[0] == 0).all() and torch.isneginf(lse[0]).all()  # lengths 0


@pytest.mark.parametrize("value", POISONS, ids=["nan", "inf", "-inf"])
def test_prefill_skipped_rows_never_reach_the_math_cpu(value):
    g = _gen(50)
    t, n, topk = 6, 256, 150
    q = torch.randn(t, 128, 512, generator=g).bfloat16()
    kv = torch.randn(n, 512, generator=g).bfloat16()
    lens = skip_lengths(t, topk, g)
    idx = skip_indices(t, 1, topk, n, lens, g)[:, 0]
    bad = kv.clone()
    keep = torch.zeros(n, dtype=torch.bool)
    keep[used_slots(idx.unsqueeze(1), lens, n).long()] = True
    bad[~keep] = value
    clean_o, clean_l = sparse_mqa_prefill(q, kv, idx, lens, None, SCALE)
    o, lse = sparse_mqa_prefill(q, bad, idx, lens, None, SCALE)
    assert_bitwise(o, lse, clean_o, clean_l)
    assert (o[0] == 0).all() and torch.isneginf(lse[0]).all()


def test_nan_sink_gives_nan_rows_where_a_key_is_seen_cpu():
    g = _gen(51)
    cache, _ = make_cache("bf16", 2, 64, "cpu", 52)
    q = torch.randn(2, 1, 64, 512, generator=g).bfloat16()
    idx = make_indices(2, 1, 8, 128, g, invalid=False)
    sink = torch.zeros(64)
    sink[5] = math.nan
    out, lse = sparse_mqa_decode(q, cache, idx, torch.tensor([8, 0], dtype=torch.int32), sink)
    assert torch.isnan(out[0, 0, 5]).all() and torch.isfinite(out[0, 0, :5].float()).all()
    assert (out[1] == 0).all() and torch.isfinite(lse[0]).all()


@pytest.mark.parametrize("shape", [(0, 1, 16), (0, 2, 0), (3, 0, 16), (2, 1, 0)])
def test_decode_empty_batch_cpu(shape):
    b, s_q, topk = shape
    cache, _ = make_cache("fp8", 2, 64, "cpu", 53)
    q = torch.randn(b, s_q, 64, 512).bfloat16()
    idx = torch.zeros(b, s_q, topk, dtype=torch.int32)
    out, lse = sparse_mqa_decode(q, cache, idx, torch.zeros(b, dtype=torch.int32), extra_kv_cache=cache,
                                 extra_indices=idx)
    assert out.shape == (b, s_q, 64, 512) and lse.shape == (b, s_q, 64)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_prefill_empty_cpu():
    out, lse = sparse_mqa_prefill(torch.randn(0, 64, 512).bfloat16(), torch.randn(5, 512).bfloat16(),
                                  torch.zeros(0, 7, dtype=torch.int32))
    assert out.shape == (0, 64, 512) and lse.shape == (0, 64)


# ----------------------------------------------------------------------------------------
# bad inputs: same messages from the CPU/fake checks and the CUDA launcher
# ----------------------------------------------------------------------------------------


def _decode_args(device):
    g = _gen(7)
    cache, _ = make_cache("fp8", 2, 64, device, 8)
    q = torch.randn(2, 1, 64, 512, generator=g).bfloat16().to(device)
    idx = make_indices(2, 1, 16, 128, g).to(device)
    return dict(
        q=q, kv_cache=cache, indices=idx, topk_length=torch.tensor([16, 3], dtype=torch.int32, device=device),
        attn_sink=torch.zeros(64, device=device), softmax_scale=SCALE, extra_kv_cache=None, extra_indices=None,
        extra_topk_length=None, out=torch.empty_like(q),
    )


def _call_decode(a):
    return dsv4._ops.op("sparse_mqa_decode")(
        a["q"], a["kv_cache"], a["indices"], a["topk_length"], a["attn_sink"], a["softmax_scale"],
        a["extra_kv_cache"], a["extra_indices"], a["extra_topk_length"], a["out"],
    )


def _set(**kw):
    def f(a):
        for k, v in kw.items():
            a[k] = v(a) if callable(v) else v
    return f


DECODE_BAD = [
    ("q_dtype", _set(q=lambda a: a["q"].float()), r"q must have dtype"),
    ("q_dim", _set(q=lambda a: a["q"][:, 0]), r"q must be 4-D"),
    ("q_headdim", _set(q=lambda a: a["q"][..., :256]), r"q head dim must be 512"),
    ("heads", _set(q=lambda a: a["q"][:, :, :32].contiguous(), out=lambda a: a["out"][:, :, :32].contiguous()),
     r"64 or 128 heads"),
    ("heads_96", _set(q=lambda a: torch.cat([a["q"], a["q"][:, :, :32]], 2),
                      out=lambda a: torch.cat([a["out"], a["out"][:, :, :32]], 2)), r"64 or 128 heads"),
    ("out_dtype", _set(out=lambda a: a["out"].float()), r"out must have dtype"),
    ("out_shape", _set(out=lambda a: a["out"][:1]), r"out must have the shape of q"),
    ("cache_dtype", _set(kv_cache=lambda a: a["kv_cache"].float()), r"kv_cache must be uint8 .* or bfloat16"),
    ("cache_lastdim", _set(kv_cache=lambda a: a["kv_cache"][..., :576]), r"kv_cache is a uint8 \(fp8_ds_mla\) cache and must have last dim 584"),
    ("cache_dim", _set(kv_cache=lambda a: a["kv_cache"][0]), r"kv_cache must be \[num_blocks, block_size, D\]"),
    ("cache_bf16_lastdim", _set(kv_cache=lambda a: torch.zeros(2, 64, 256, dtype=torch.bfloat16, device=a["q"].device)),
     r"kv_cache is a bf16 cache and must have last dim 512"),
    ("cache_row_stride", _set(kv_cache=lambda a: a["kv_cache"][:, ::2]), r"kv_cache must have stride\(1\) == 584"),
    ("idx_dtype", _set(indices=lambda a: a["indices"].long()), r"indices must have dtype (torch.int32|Int)"),
    ("idx_shape", _set(indices=lambda a: a["indices"][:, 0]), r"indices must be \[2, 1, topk\]"),
    ("len_dtype", _set(topk_length=lambda a: a["topk_length"].long()), r"topk_length must have dtype (torch.int32|Int)"),
    ("len_shape", _set(topk_length=lambda a: a["topk_length"][:1]), r"topk_length must be \[2\]"),
    ("sink_dtype", _set(attn_sink=lambda a: a["attn_sink"].double()), r"attn_sink must have dtype (torch.float32|Float)"),
    ("sink_shape", _set(attn_sink=lambda a: a["attn_sink"][:8]), r"attn_sink must be \[64\]"),
    ("scale", _set(softmax_scale=math.inf), r"softmax_scale must be finite and > 0, got inf"),
    ("scale_nan", _set(softmax_scale=math.nan), r"softmax_scale must be finite and > 0, got nan"),
    ("scale_zero", _set(softmax_scale=0.0), r"softmax_scale must be finite and > 0, got 0"),
    ("scale_negative", _set(softmax_scale=-SCALE), r"softmax_scale must be finite and > 0, got -0.04"),
    ("extra_alone", _set(extra_kv_cache=lambda a: a["kv_cache"]), r"extra_kv_cache and extra_indices must be given together"),
    ("extra_len_alone", _set(extra_topk_length=lambda a: a["topk_length"]), r"extra_topk_length given without"),
    ("extra_layout", _set(extra_kv_cache=lambda a: torch.zeros(2, 64, 512, dtype=torch.bfloat16, device=a["q"].device),
                          extra_indices=lambda a: a["indices"]), r"extra_kv_cache must have the same layout"),
    ("extra_idx_shape", _set(extra_kv_cache=lambda a: a["kv_cache"], extra_indices=lambda a: a["indices"][:1]),
     r"extra_indices must be \[2, 1, topk\]"),
]


def _check_bad(device, mutate, pattern):
    a = _decode_args(device)
    mutate(a)
    with pytest.raises((ValueError, RuntimeError), match=r"^dsv4: .*" + pattern):
        _call_decode(a)


@pytest.mark.parametrize("name,mutate,pattern", DECODE_BAD, ids=[c[0] for c in DECODE_BAD])
def test_decode_bad_inputs_cpu(name, mutate, pattern):
    _check_bad("cpu", mutate, pattern)


@pytest.mark.parametrize("name,mutate,pattern", DECODE_BAD, ids=[c[0] for c in DECODE_BAD])
@pytest.mark.gpu
def test_decode_bad_inputs_cuda(name, mutate, pattern):
    _check_bad("cuda", mutate, pattern)


def _prefill_args(device):
    g = _gen(9)
    q = torch.randn(3, 64, 512, generator=g).bfloat16().to(device)
    return dict(q=q, kv=torch.randn(50, 512, generator=g).bfloat16().to(device),
                indices=torch.randint(-1, 50, (3, 9), generator=g, dtype=torch.int32).to(device),
                topk_length=None, attn_sink=None, softmax_scale=SCALE, out=torch.empty_like(q))


PREFILL_BAD = [
    ("q_dim", _set(q=lambda a: a["q"][0]), r"q must be 3-D"),
    ("kv_dtype", _set(kv=lambda a: a["kv"].float()), r"kv must have dtype (torch.bfloat16|BFloat16)"),
    ("kv_shape", _set(kv=lambda a: a["kv"][:, :256]), r"kv head dim must be 512"),
    ("kv_dim", _set(kv=lambda a: a["kv"].view(50, 2, 256)), r"kv must be \[N, 512\] or \[N, 1, 512\]"),
    ("idx_shape", _set(indices=lambda a: a["indices"][:2]), r"indices must be \[3, 1, topk\]"),
    ("idx_dim", _set(indices=lambda a: a["indices"].view(3, 9, 1)), r"indices must be \[T, topk\] or \[T, 1, topk\]"),
    ("len_shape", _set(topk_length=lambda a: torch.zeros(2, dtype=torch.int32, device=a["q"].device)),
     r"topk_length must be \[3\]"),
    ("heads", _set(q=lambda a: a["q"][:, :32].contiguous(), out=lambda a: a["out"][:, :32].contiguous()),
     r"64 or 128 heads"),
    ("out_shape", _set(out=lambda a: a["out"][:1]), r"out must have the shape of q"),
    ("scale_zero", _set(softmax_scale=0.0), r"softmax_scale must be finite and > 0, got 0"),
]


def _check_bad_prefill(device, mutate, pattern):
    a = _prefill_args(device)
    mutate(a)
    with pytest.raises((ValueError, RuntimeError), match=r"^dsv4: .*" + pattern):
        dsv4._ops.op("sparse_mqa_prefill")(a["q"], a["kv"], a["indices"], a["topk_length"], a["attn_sink"],
                                           a["softmax_scale"], a["out"])


@pytest.mark.parametrize("name,mutate,pattern", PREFILL_BAD, ids=[c[0] for c in PREFILL_BAD])
def test_prefill_bad_inputs_cpu(name, mutate, pattern):
    _check_bad_prefill("cpu", mutate, pattern)


@pytest.mark.parametrize("name,mutate,pattern", PREFILL_BAD, ids=[c[0] for c in PREFILL_BAD])
@pytest.mark.gpu
def test_prefill_bad_inputs_cuda(name, mutate, pattern):
    _check_bad_prefill("cuda", mutate, pattern)


# ----------------------------------------------------------------------------------------
# opcheck / torch.compile on CPU
# ----------------------------------------------------------------------------------------


def _opcheck_args(device, extra):
    a = _decode_args(device)
    if extra:
        a["extra_kv_cache"] = a["kv_cache"]
        a["extra_indices"] = a["indices"][..., :5].contiguous()
        a["extra_topk_length"] = torch.tensor([5, 2], dtype=torch.int32, device=device)
    return a


@pytest.mark.parametrize("extra", [False, True])
def test_opcheck_cpu(extra):
    a = _opcheck_args("cpu", extra)
    torch.library.opcheck(torch.ops.dsv4.sparse_mqa_decode.default, tuple(a.values()))
    p = _prefill_args("cpu")
    torch.library.opcheck(torch.ops.dsv4.sparse_mqa_prefill.default, tuple(p.values()))


def test_torch_compile_fullgraph_cpu():
    a = _decode_args("cpu")
    p = _prefill_args("cpu")

    def f(q, cache, idx, lens, sink, q2, kv, idx2):
        o, l = sparse_mqa_decode(q, cache, idx, lens, sink)
        o2, l2 = sparse_mqa_prefill(q2, kv, idx2)
        return o.float() * 2, l, o2, l2

    args = (a["q"], a["kv_cache"], a["indices"], a["topk_length"], a["attn_sink"], p["q"], p["kv"], p["indices"])
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    for x, y in zip(eager, compiled):
        assert torch.equal(x, y)


# ----------------------------------------------------------------------------------------
# GPU: kernels vs the float32 reference
# ----------------------------------------------------------------------------------------

# (B, s_q, H, topk, extra_topk or None, cache kind, block_size, ragged, sink)
DECODE_CASES = [
    (1, 1, 64, 512, 128, "fp8", 64, False, "finite"),    # V4-Flash shape, split-KV
    (1, 2, 128, 1024, 128, "fp8", 64, True, "-inf"),
    (3, 1, 128, 127, 2048, "fp8", 16, True, None),
    (3, 2, 64, 0, 1, "fp8", 64, True, "finite"),
    (64, 1, 128, 1024, 128, "fp8", 64, True, "finite"),  # V4-Pro shape
    (64, 2, 64, 1, None, "bf16", 32, False, "+inf"),
    (133, 1, 64, 2048, None, "bf16", 64, True, "finite"),
    (133, 2, 128, 512, 127, "fp8", 64, True, "+inf"),
    (3, 1, 64, 0, None, "fp8", 64, False, "finite"),     # nothing visible at all
    (1, 1, 64, 1, None, "bf16", 64, False, None),
    # odd tile counts: the kernel takes tiles in pairs (last pair half empty), splits take
    # whole pairs, and a pair may straddle the two lists (15 + 1 tiles, 2 + 1 tiles)
    (2, 1, 64, 1088, None, "fp8", 64, True, "finite"),
    (1, 1, 128, 960, 64, "bf16", 64, False, "finite"),
    (5, 1, 64, 100, 30, "fp8", 64, False, None),
    (3, 1, 64, 40, 100, "fp8", 16, True, "finite"),  # round 0 straddles the lists (1 + 2 tiles)
    # persistent CTAs: many work items per CTA (1400 and 600 items on 132 SMs), with ragged
    # and empty tokens between them
    (700, 1, 128, 200, 64, "fp8", 64, True, "finite"),
    (300, 2, 64, 300, None, "bf16", 64, True, None),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[str(c) for c in DECODE_CASES])
@pytest.mark.gpu
def test_decode_gpu(case):
    b, s_q, h, topk, topk2, kind, bs, ragged, sink_kind = case
    dev = "cuda"
    g = _gen(zlib.crc32(str(case).encode()))
    nb = max(4, (max(topk, topk2 or 0) * 2) // bs + 1)
    cache, rows = make_cache(kind, nb, bs, dev, 11)
    q = (torch.randn(b, s_q, h, 512, generator=g) * 3).bfloat16().to(dev)
    idx = make_indices(b, s_q, topk, nb * bs, g).to(dev)
    lens = make_lengths(b, topk, g, ragged)
    lens = None if lens is None else lens.to(dev)
    sink = make_sink(sink_kind, h, g)
    sink = None if sink is None else sink.to(dev)
    cache2 = rows2 = idx2 = lens2 = None
    if topk2 is not None:
        nb2 = max(2, topk2 * 2 // 64 + 1)
        cache2, rows2 = make_cache(kind, nb2, 64, dev, 12)
        idx2 = make_indices(b, s_q, topk2, nb2 * 64, g).to(dev)
        lens2 = make_lengths(b, topk2, g, ragged)
        lens2 = None if lens2 is None else lens2.to(dev)
    out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    c4 = cache.unsqueeze(2)
    e4 = None if cache2 is None else cache2.unsqueeze(2)
    o, lse = sparse_mqa_decode(q, c4, idx, lens, sink, SCALE, e4, idx2, lens2, out=out)
    assert o is out
    ro, rl = ref_decode(q, rows, idx, lens, sink, SCALE, rows2, idx2, lens2)
    assert_close(o, lse, ro, rl)


@pytest.mark.gpu
def test_decode_fp8_dequant_exact():
    """One visible key per token: every head's output is exactly that key's dequantized row,
    for every e4m3 code but NaN and scale bytes from 2^-127 (results underflow into bf16
    subnormals) to 2^73, so the kernel's dequant must round like the reference."""
    dev = "cuda"
    nb, bs = 4, 16
    n = nb * bs
    g = _gen(5)
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)
    data = codes[torch.randint(0, codes.numel(), (n, 448), generator=g)]
    data[0, : codes.numel()] = codes
    data[1, : codes.numel()] = codes.flip(0)
    exps = torch.tensor([0, 1, 64, 120, 127, 134, 135, 200], dtype=torch.uint8)
    scl = exps[torch.randint(0, exps.numel(), (n, 7), generator=g)]
    scl[0], scl[1] = exps[:7], exps[1:]
    rope = torch.randn(n, 64, generator=g).bfloat16().view(torch.uint8).reshape(n, 128)
    cache = formats.new_fp8_ds_mla_cache(nb, bs, device=dev)
    data_view, scale_view = kv_cache._fp8_ds_mla_regions(cache)
    data_view.copy_(torch.cat([data, rope], 1).reshape(nb, bs, 576).to(dev))
    scale_view[..., :7] = scl.reshape(nb, bs, 7).to(dev)
    deq = formats.dequantize_fp8_ds_mla_cache(cache)
    q = torch.randn(n, 1, 64, 512, generator=g).bfloat16().to(dev)
    idx = torch.arange(n, dtype=torch.int32, device=dev).reshape(n, 1, 1)
    out, lse = sparse_mqa_decode(q, cache, idx, None, None, SCALE)
    assert torch.isfinite(lse).all()
    assert torch.equal(out[:, 0], deq[:, None, :].expand(n, 64, 512))


# (T, H, N, topk, ragged, sink)
PREFILL_CASES = [
    (1, 128, 3000, 1152, True, "finite"),
    (77, 64, 5000, 1152, True, None),
    (77, 128, 700, 128, False, "+inf"),
    (4096, 128, 20000, 256, True, "finite"),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[str(c) for c in PREFILL_CASES])
@pytest.mark.gpu
def test_prefill_gpu(case):
    t, h, n, topk, ragged, sink_kind = case
    dev = "cuda"
    g = _gen(zlib.crc32(str(case).encode()))
    q = (torch.randn(t, h, 512, generator=g) * 3).bfloat16().to(dev)
    kv = (torch.randn(n, 512, generator=g) * 2).bfloat16().to(dev)
    idx = make_indices(t, 1, topk, n, g)[:, 0].to(dev)
    lens = make_lengths(t, topk, g, ragged)
    lens = None if lens is None else lens.to(dev)
    sink = make_sink(sink_kind, h, g)
    sink = None if sink is None else sink.to(dev)
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    o, lse = sparse_mqa_prefill(q, kv.view(n, 1, 512), idx.unsqueeze(1), lens, sink, SCALE, out=out)
    ro, rl = ref_decode(q.unsqueeze(1), kv.float(), idx.unsqueeze(1), lens, sink, SCALE, chunk=64)
    assert_close(o, lse, ro.squeeze(1), rl.squeeze(1))


@pytest.mark.gpu
@pytest.mark.parametrize("b", [2, 200])  # split-KV + combine, and no split
def test_decode_cuda_graph(b):
    dev = "cuda"
    g = _gen(21)
    cache, rows = make_cache("fp8", 40, 64, dev, 22)
    cache2, rows2 = make_cache("fp8", 8, 64, dev, 23)
    q = torch.randn(b, 1, 64, 512, generator=g).bfloat16().to(dev)
    idx = make_indices(b, 1, 1024, 40 * 64, g).to(dev)
    idx2 = make_indices(b, 1, 128, 8 * 64, g).to(dev)
    lens = make_lengths(b, 1024, g, True).to(dev)
    sink = make_sink("finite", 64, g).to(dev)
    out = torch.empty_like(q)
    sparse_mqa_decode(q, cache, idx, lens, sink, SCALE, cache2, idx2, None, out=out)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse_g = sparse_mqa_decode(q, cache, idx, lens, sink, SCALE, cache2, idx2, None, out=out)
    # new inputs in the captured buffers, then replay
    q.copy_(torch.randn(b, 1, 64, 512, generator=g).bfloat16().to(dev))
    idx.copy_(make_indices(b, 1, 1024, 40 * 64, g).to(dev))
    lens.copy_(make_lengths(b, 1024, g, True).to(dev))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eo, el = sparse_mqa_decode(q, cache, idx, lens, sink, SCALE, cache2, idx2, None)
    assert torch.equal(out, eo)
    assert torch.equal(lse_g, el)
    ro, rl = ref_decode(q, rows, idx, lens, sink, SCALE, rows2, idx2, None)
    assert_close(out, lse_g, ro, rl)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("b", [2, 200])  # split-KV + combine, and no split
def test_decode_reads_what_the_kernels_before_it_write(b, graph):
    """The main kernel is launched with programmatic dependent launch (DSV4_ATTN_MAIN_PDL):
    its CTAs may start while the kernel before it runs. Kernels right before the call
    poison q, the indices and the lengths, rewrite them, and last a GEMM writes q (V4's q
    projection): the result must be that of the final values, eagerly and in a CUDA graph
    (every read of q, indices, lengths and caches comes after griddepcontrol.wait)."""
    dev = "cuda"
    g = _gen(90 + b)
    cache, rows = make_cache("fp8", 40, 64, dev, 91)
    cache2, rows2 = make_cache("fp8", 8, 64, dev, 92)
    x = (torch.randn(b, 256, generator=g) / 16).bfloat16().to(dev)  # q = x @ w ~ N(0, 1)
    w = torch.randn(256, 64 * 512, generator=g).bfloat16().to(dev)
    new_idx = make_indices(b, 1, 1024, 40 * 64, g).to(dev)
    new_lens = make_lengths(b, 1024, g, True).to(dev)
    idx2 = make_indices(b, 1, 128, 8 * 64, g).to(dev)
    sink = make_sink("finite", 64, g).to(dev)
    q = torch.empty(b, 1, 64, 512, dtype=torch.bfloat16, device=dev)
    idx, lens = torch.empty_like(new_idx), torch.empty_like(new_lens)
    out = torch.empty_like(q)

    def step():
        q.fill_(math.nan)
        idx.fill_(0)
        lens.fill_(0)
        torch.add(new_idx, 0, out=idx)
        torch.add(new_lens, 0, out=lens)
        torch.matmul(x, w, out=q.view(b, 64 * 512))
        return sparse_mqa_decode(q, cache, idx, lens, sink, SCALE, cache2, idx2, None, out=out)

    _, lse = step()
    if graph:
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            _, lse = step()
        out.fill_(math.nan)
        gr.replay()
    torch.cuda.synchronize()
    assert torch.equal(idx, new_idx) and torch.equal(lens, new_lens)
    ro, rl = ref_decode(q, rows, idx, lens, sink, SCALE, rows2, idx2, None)
    assert_close(out, lse, ro, rl)


@pytest.mark.gpu
def test_prefill_reads_what_the_kernel_before_it_writes():
    """As above for sparse_mqa_prefill: a GEMM right before the call writes q."""
    dev = "cuda"
    g = _gen(95)
    t, h, n, topk = 300, 128, 3000, 640
    x = (torch.randn(t, 256, generator=g) / 16).bfloat16().to(dev)
    w = torch.randn(256, h * 512, generator=g).bfloat16().to(dev)
    kv = torch.randn(n, 512, generator=g).bfloat16().to(dev)
    idx = make_indices(t, 1, topk, n, g)[:, 0].to(dev)
    lens = make_lengths(t, topk, g, True).to(dev)
    q = torch.empty(t, h, 512, dtype=torch.bfloat16, device=dev)
    q.fill_(math.nan)
    torch.matmul(x, w, out=q.view(t, h * 512))
    o, lse = sparse_mqa_prefill(q, kv, idx, lens, None, SCALE)
    ro, rl = ref_decode(q.unsqueeze(1), kv.float(), idx.unsqueeze(1), lens, None, SCALE, chunk=64)
    assert_close(o, lse, ro.squeeze(1), rl.squeeze(1))


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [False, True])
def test_opcheck_cuda(extra):
    a = _opcheck_args("cuda", extra)
    torch.library.opcheck(torch.ops.dsv4.sparse_mqa_decode.default, tuple(a.values()))
    p = _prefill_args("cuda")
    torch.library.opcheck(torch.ops.dsv4.sparse_mqa_prefill.default, tuple(p.values()))


@pytest.mark.gpu
def test_prefill_cuda_graph():
    dev = "cuda"
    g = _gen(31)
    t, h, n, topk = 77, 128, 3000, 1152
    q = torch.randn(t, h, 512, generator=g).bfloat16().to(dev)
    kv = torch.randn(n, 512, generator=g).bfloat16().to(dev)
    idx = make_indices(t, 1, topk, n, g)[:, 0].to(dev)
    lens = make_lengths(t, topk, g, True).to(dev)
    sink = make_sink("finite", h, g).to(dev)
    out = torch.empty_like(q)
    sparse_mqa_prefill(q, kv, idx, lens, sink, SCALE, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse_g = sparse_mqa_prefill(q, kv, idx, lens, sink, SCALE, out=out)
    q.copy_(torch.randn(t, h, 512, generator=g).bfloat16().to(dev))
    idx.copy_(make_indices(t, 1, topk, n, g)[:, 0].to(dev))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eo, el = sparse_mqa_prefill(q, kv, idx, lens, sink, SCALE)
    assert torch.equal(out, eo) and torch.equal(lse_g, el)


# ----------------------------------------------------------------------------------------
# GPU: skipped entries over poisoned caches and poisoned shared memory
# ----------------------------------------------------------------------------------------


def _cache_f32(cache, kind):
    if kind == "fp8":
        return formats.dequantize_fp8_ds_mla_cache(cache).float()
    return cache.reshape(-1, 512).float()


@pytest.mark.parametrize("value", POISONS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("b", [4, 200])  # split-KV + combine (8 tokens), one split (400 tokens)
@pytest.mark.gpu
def test_decode_skipped_entries_gpu(poison_smem, b, extra, kind, value):
    """Slots that no used entry names (slot 0 included) hold NaN / inf and every SM's shared
    memory holds NaN / inf bytes when the kernel starts: the output is bitwise that of a clean
    cache on zeroed shared memory, and tiles whose first rows are skipped see no stale bytes."""
    caches, extras, (q, idx, lens, sink, idx2, lens2) = _skip_decode_case(kind, extra, value, "cuda", b=b, seed=60 + b)
    runs = []
    for cache, extra_cache, smem in zip(caches, extras, (0.0, value)):
        out = torch.full(q.shape, math.nan, dtype=torch.bfloat16, device="cuda")
        poison_smem(smem)
        runs.append(sparse_mqa_decode(q, cache, idx, lens, sink, SCALE, extra_cache, idx2, lens2, out=out))
    (clean_o, clean_l), (o, lse) = runs
    rows2 = None if extras[0] is None else _cache_f32(extras[0], kind)
    ro, rl = ref_decode(q, _cache_f32(caches[0], kind), idx, lens, sink, SCALE, rows2, idx2, lens2)
    assert_close(clean_o, clean_l, ro, rl)
    assert_bitwise(o, lse, clean_o, clean_l)


@pytest.mark.parametrize("value", POISONS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("t", [3, 300])  # split-KV + combine, one split
@pytest.mark.gpu
def test_prefill_skipped_rows_gpu(poison_smem, t, value):
    """The bf16 workspace rows that no used entry names hold NaN / inf, and so does shared
    memory: bitwise the clean run."""
    g = _gen(70 + t)
    n, topk = 1024, 600
    q = torch.randn(t, 128, 512, generator=g).bfloat16().cuda()
    kv = torch.randn(n, 512, generator=g).bfloat16().cuda()
    lens = skip_lengths(t, topk, g).cuda()
    idx = skip_indices(t, 1, topk, n, lens.cpu(), g)[:, 0].cuda()
    keep = torch.zeros(n, dtype=torch.bool, device="cuda")
    keep[used_slots(idx.unsqueeze(1), lens, n).long()] = True
    bad = kv.clone()
    bad[~keep] = value
    runs = []
    for rows, smem in ((kv, 0.0), (bad, value)):
        out = torch.full(q.shape, math.nan, dtype=torch.bfloat16, device="cuda")
        poison_smem(smem)
        runs.append(sparse_mqa_prefill(q, rows, idx, lens, None, SCALE, out=out))
    (clean_o, clean_l), (o, lse) = runs
    ro, rl = ref_decode(q.unsqueeze(1), kv.float(), idx.unsqueeze(1), lens, None, SCALE, chunk=64)
    assert_close(clean_o, clean_l, ro.squeeze(1), rl.squeeze(1))
    assert_bitwise(o, lse, clean_o, clean_l)


@pytest.mark.gpu
def test_empty_batches_gpu():
    """B = 0, s_q = 0 and T = 0 return empty outputs without launching a kernel."""
    cache, _ = make_cache("fp8", 2, 64, "cuda", 80)
    for b, s_q in ((0, 1), (3, 0)):
        q = torch.randn(b, s_q, 64, 512, device="cuda").bfloat16()
        idx = torch.zeros(b, s_q, 16, dtype=torch.int32, device="cuda")
        out, lse = sparse_mqa_decode(q, cache, idx, torch.zeros(b, dtype=torch.int32, device="cuda"))
        assert out.shape == (b, s_q, 64, 512) and lse.shape == (b, s_q, 64)
    out, lse = sparse_mqa_prefill(torch.randn(0, 128, 512, device="cuda").bfloat16(),
                                  torch.randn(5, 512, device="cuda").bfloat16(),
                                  torch.zeros(0, 9, dtype=torch.int32, device="cuda"))
    assert out.shape == (0, 128, 512) and lse.shape == (0, 128)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("block", [1, 2, 69])
def test_gpu_single_block_caches(block):
    """A cache of one block has no block stride to align: [1, 69, 584] (shape-derived
    'stride' 40,296 bytes) is valid and must match the reference (scripts/gpu_fuzz.py found
    the launcher refusing it)."""
    g = torch.Generator().manual_seed(block)
    cache = formats.new_fp8_ds_mla_cache(1, block, fill="random", generator=g)
    formats.write_fp8_ds_mla(cache, torch.arange(block), torch.randn(block, 512, generator=g))
    cache = cache.contiguous()  # [1, block, 584], stride(0) = block * 584
    big = formats.new_fp8_ds_mla_cache(64, 64)
    formats.write_fp8_ds_mla(big, torch.arange(64 * 64), torch.randn(64 * 64, 512, generator=g))
    q = torch.randn(3, 1, 64, 512, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, block + 1, (3, 1, 16), generator=g, dtype=torch.int32)
    idx2 = torch.randint(0, 64 * 64, (3, 1, 64), generator=g, dtype=torch.int32)
    sink = torch.randn(64, generator=g)
    ro, rl = ref_decode(q, formats.dequantize_fp8_ds_mla_cache(cache).float(), idx, None, sink, SCALE,
                        formats.dequantize_fp8_ds_mla_cache(big).float(), idx2, None)
    o, lse = sparse_mqa_decode(q.cuda(), cache.cuda(), idx.cuda(), None, sink.cuda(), SCALE, big.cuda(), idx2.cuda())
    assert_close(o.cpu(), lse.cpu(), ro, rl)
    o2, lse2 = sparse_mqa_decode(q.cuda(), big.cuda(), idx2.cuda(), None, sink.cuda(), SCALE, cache.cuda(), idx.cuda())
    assert_close(o2.cpu(), lse2.cpu(), ro, rl)


# ----------------------------------------------------------------------------------------
# split count (csrc/attention/sparse_mqa_splits.h), through the test-only op
# dsv4_testing::sparse_mqa_num_splits: needs the extension, not a GPU
# ----------------------------------------------------------------------------------------

needs_ext = pytest.mark.skipif(not dsv4._ops.HAS_CUDA_EXTENSION, reason="needs the dsv4 CUDA extension")


def _splits(base_ctas, max_tiles, sms=132, priced=True, forced=None):
    return torch.ops.dsv4_testing.sparse_mqa_num_splits(base_ctas, max_tiles, sms, priced, forced)


# The benchmark's decode cases (dsv4.bench.inputs): per layer type, the index widths in
# 64-key tiles (window 128 + extra list) and H. Expected split counts on 132 SMs at
# B = 1, 2, 4, 8, 16, 32, 64, 128, 256: (priced rule, earlier rule where it differs).
SPLIT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SPLIT_CASES = {  # name: (H, max_tiles, priced, earlier)
    "V4-Flash SWA": (64, 2, (1,) * 9, None),
    "V4-Flash CSA": (64, 10, (5, 5, 5, 5, 5, 3, 2, 1, 1), None),
    "V4-Flash HCA 4K": (64, 4, (2, 2, 2, 2, 2, 2, 1, 1, 1), (2, 2, 2, 2, 2, 2, 2, 1, 1)),
    "V4-Flash HCA 32K": (64, 6, (3, 3, 3, 3, 3, 3, 1, 1, 1), (3, 3, 3, 3, 3, 3, 2, 1, 1)),
    "V4-Flash HCA 128K": (64, 18, (9, 9, 9, 9, 5, 3, 2, 1, 1), None),
    "V4-Pro SWA": (128, 2, (1,) * 9, None),
    "V4-Pro CSA": (128, 18, (9, 9, 9, 5, 3, 2, 1, 1, 1), None),
    "V4-Pro HCA 4K": (128, 4, (2, 2, 2, 2, 2, 1, 1, 1, 1), (2, 2, 2, 2, 2, 2, 1, 1, 1)),
    "V4-Pro HCA 32K": (128, 6, (3, 3, 3, 3, 3, 1, 1, 1, 1), (3, 3, 3, 3, 3, 2, 1, 1, 1)),
}


@needs_ext
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_count_of_the_benchmark_cases(name):
    h, tiles, priced, earlier = SPLIT_CASES[name]
    got = tuple(_splits(b * h // 64, tiles) for b in SPLIT_BATCHES)
    assert got == priced, name
    got = tuple(_splits(b * h // 64, tiles, priced=False) for b in SPLIT_BATCHES)
    assert got == (earlier or priced), name


@needs_ext
def test_split_count_rules():
    for priced in (True, False):
        for sms in (1, 78, 132):
            for base in (1, 2, 3, 7, 33, 64, 131, 132, 500):
                for tiles in (0, 1, 2, 3, 4, 5, 9, 18, 33, 200, 512):
                    s = _splits(base, tiles, sms, priced)
                    pairs = (tiles + 1) // 2
                    assert 1 <= s <= max(1, min(pairs, 64)), (base, tiles, sms, priced, s)
                    if base >= sms or pairs <= 1:
                        assert s == 1, (base, tiles, sms, priced, s)
    # priced: two tile pairs are not split once the partials outweigh the round saved
    # (tokens x heads >= 2944 on 132 SMs), never into a second wave
    assert _splits(45, 4) == 2 and _splits(46, 4) == 1
    for tiles in (4, 6, 10, 18, 33, 200):
        for base in range(1, 132):
            s = _splits(base, tiles)
            assert base * s <= 132 or s == 1, (base, tiles, s)
    with pytest.raises(RuntimeError, match="dsv4: sparse_mqa_num_splits takes"):
        _splits(0, 4)


@needs_ext
def test_forced_split_count():
    """DSV4_ATTN_SPLITS (the op's `forced`): that count, clamped to [1, tile pairs], at any
    batch (also past one wave, where the rule never splits), whatever the rule or `priced`."""
    for priced in (True, False):
        for sms in (1, 132):
            for base in (1, 7, 131, 132, 500):
                for tiles in (0, 1, 2, 3, 4, 5, 9, 10, 18, 33, 200):
                    assert _splits(base, tiles, sms, priced, None) == _splits(base, tiles, sms, priced)
                    for f in range(1, 17):  # DSV4_ATTN_SPLITS's values are among them
                        want = max(1, min(f, (tiles + 1) // 2))
                        assert _splits(base, tiles, sms, priced, f) == want, (base, tiles, sms, priced, f)
    # the benchmark's cases: V4-Pro CSA (18 tiles) splits at most 9 ways, HCA 4K 2, SWA never
    assert [_splits(512, 18, forced=f) for f in (1, 8, 9, 10, 16)] == [1, 8, 9, 9, 9]
    assert [_splits(2, 4, forced=f) for f in (1, 2, 3)] == [1, 2, 2]
    assert _splits(2, 2, forced=16) == 1
    assert _splits(1, 200, forced=64) == 64
    for bad in (0, -1, 65):
        with pytest.raises(RuntimeError, match="dsv4: sparse_mqa_num_splits takes forced"):
            _splits(1, 4, forced=bad)


def _ring32(max_tiles, num_splits, forced=None):
    return torch.ops.dsv4_testing.sparse_mqa_ring32(max_tiles, num_splits, forced)


@needs_ext
def test_ring32_rule():
    """DSV4_ATTN_RING32 unset (attention::pick_ring32): value 2 (the ring, loads ahead) where
    the longest work item, ceil(max_tiles / splits), has at most 9 tiles of 64 keys, else 0
    (today's kernel); set: that value. V4-Pro on 132 SMs with the priced split counts at
    B = 1..256: CSA (and HCA 128K, 18 tiles) on the ring up to B = 32 (9, 9, 9, 5, 3, 2 splits:
    items of 2-9 tiles), today's from B = 64 (unsplit, 18 tiles); HCA 4K / 32K and SWA on
    the ring at every B (docs/perf-history/2026-12-07-attention-ring32.md)."""
    want = {"V4-Pro SWA": (2,) * 9, "V4-Pro CSA": (2,) * 6 + (0,) * 3,
            "V4-Pro HCA 4K": (2,) * 9, "V4-Pro HCA 32K": (2,) * 9}
    for name, w in want.items():
        h, tiles, _, _ = SPLIT_CASES[name]
        got = tuple(_ring32(tiles, _splits(b * h // 64, tiles)) for b in SPLIT_BATCHES)
        assert got == w, name
    assert _ring32(4, _splits(32 * 2, 4)) == 2     # HCA 4K B = 32: the ring
    assert _ring32(18, _splits(128 * 2, 18)) == 0  # CSA 4K B = 128: today's
    assert _ring32(18, _splits(32 * 2, 18)) == 2   # CSA 4K B = 32: 2 splits of 9 tiles (the tie)
    for tiles in range(0, 40):
        for s in range(1, 17):
            assert _ring32(tiles, s) == (2 if -(-tiles // s) <= 9 else 0), (tiles, s)
            for f in (0, 1, 2):
                assert _ring32(tiles, s, f) == f
    for args in ((-1, 1), (4, 0), (4, 65), (4, 1, 3), (4, 1, -1)):
        with pytest.raises(RuntimeError, match="dsv4: sparse_mqa_ring32 takes"):
            _ring32(*args)


def _plan(base_ctas, max_tiles, sms=132, priced=True, forced_splits=None, forced_ring32=None):
    return tuple(torch.ops.dsv4_testing.sparse_mqa_ring32_plan(base_ctas, max_tiles, sms, priced, forced_splits,
                                                               forced_ring32))


@needs_ext
def test_ring32_plan_prices_whole_tile_splits():
    """attention::plan_ring32 (DSV4_ATTN_TILE_SPLITS=1; default mode, 128-head fp8, unpaired):
    where the ring runs at the pairs' split count, the count priced again with whole-tile splits (the ring's boundaries,
    token_tiles<kNumSrc, true>) and kept if the ring still runs at it. V4-Pro on 132 SMs,
    B = 1..256: CSA / HCA 128K (18 tiles) 9, 9, 9, 6, 4, 2 splits (the pairs' rule: 5 and 3 at
    B = 8 / 16, items of 4 and 6 tiles; now 3 and 5), then today's kernel unsplit; HCA 32K
    (6 tiles) 2 splits at B = 32 (was one item of 6 tiles); HCA 4K and SWA as the pairs' rule
    (docs/perf-history/2026-12-08-attention-ring32-tile-splits.md)."""
    want = {"V4-Pro CSA": ((9, 9, 9, 6, 4, 2, 1, 1, 1), (2,) * 6 + (0,) * 3),
            "V4-Pro HCA 4K": ((2, 2, 2, 2, 2, 1, 1, 1, 1), (2,) * 9),
            "V4-Pro HCA 32K": ((3, 3, 3, 3, 3, 2, 1, 1, 1), (2,) * 9),
            "V4-Pro SWA": ((1,) * 9, (2,) * 9)}
    for name, (splits, ring) in want.items():
        h, tiles, _, _ = SPLIT_CASES[name]
        got = [_plan(b * h // 64, tiles) for b in SPLIT_BATCHES]
        assert tuple(s for s, _ in got) == splits, name
        assert tuple(r for _, r in got) == ring, name
    for base in (1, 2, 3, 8, 16, 32, 37, 64, 66, 128, 300):
        for tiles in range(0, 40):
            s_pairs = _splits(base, tiles)
            s, r = _plan(base, tiles)
            if _ring32(tiles, s_pairs) == 0:
                assert (s, r) == (s_pairs, 0), (base, tiles)  # today's kernel: the pairs' count
            else:  # the ring, items of at most 9 tiles, never a second wave, no empty split
                assert r == 2 and -(-tiles // s) <= 9 and (s == 1 or base * s <= 132), (base, tiles, s)
                assert 1 <= s <= max(1, (tiles + 1) // 2), (base, tiles, s)
            # a forced or unpriced split count is kept; a forced kernel is kept
            assert _plan(base, tiles, forced_splits=3) == (_splits(base, tiles, forced=3),
                                                            _ring32(tiles, _splits(base, tiles, forced=3)))
            assert _plan(base, tiles, priced=False)[0] == _splits(base, tiles, priced=False)
            assert _plan(base, tiles, forced_ring32=0) == (s_pairs, 0)
            assert _plan(base, tiles, forced_ring32=1)[1] == 1
    for args, kw in (((0, 4), {}), ((1, -1), {}), ((1, 4, 0), {}), ((1, 4), {"forced_splits": 65}),
                     ((1, 4), {"forced_ring32": 3})):
        with pytest.raises(RuntimeError, match="dsv4: sparse_mqa_ring32_plan takes"):
            _plan(*args, **kw)


# ----------------------------------------------------------------------------------------
# GPU: the development switches of csrc/common/env.h (read once per process, so each
# setting runs in a child process) keep every result right
# ----------------------------------------------------------------------------------------

SWITCH_DECODE_CASES = [
    (1, 1, 64, 512, 128, "fp8", 64, False, "finite"),   # splits, two sources
    (32, 1, 128, 128, 128, "fp8", 64, True, "finite"),  # two tile pairs: 2 splits by the earlier rule, 1 priced
    (64, 1, 64, 256, 128, "fp8", 64, True, None),       # three pairs at B=64: 2 splits earlier, 1 priced
    (3, 2, 64, 128, None, "fp8", 64, True, "finite"),   # one source (SWA)
    (133, 2, 128, 512, 127, "fp8", 64, True, "+inf"),
    (64, 2, 64, 1, None, "bf16", 32, False, "+inf"),    # one source, bf16
    (2, 1, 64, 1088, None, "fp8", 64, True, "finite"),  # one source, splits
]


def child_switch_cases() -> None:
    for case in SWITCH_DECODE_CASES:
        test_decode_gpu(case)
    test_decode_cuda_graph(2)
    test_decode_reads_what_the_kernels_before_it_write(2, True)
    test_decode_reads_what_the_kernels_before_it_write(200, True)
    test_prefill_gpu(PREFILL_CASES[1])
    test_prefill_gpu(PREFILL_CASES[2])
    test_prefill_reads_what_the_kernel_before_it_writes()
    print("switch cases passed")


@pytest.mark.gpu
@pytest.mark.parametrize("env", [{"DSV4_ATTN_PRICED_SPLITS": "0"}, {"DSV4_ATTN_PDL": "0"},
                                 {"DSV4_ATTN_SPECIALIZE": "0"}, {"DSV4_ATTN_MAIN_PDL": "0"},
                                 {"DSV4_ATTN_COOP_ROUND": "0"}, {"DSV4_ATTN_PRODUCER_AHEAD": "0"},
                                 {"DSV4_ATTN_COOP_PREFETCH": "0"}, {"DSV4_ATTN_FIRST_PV_INIT": "0"},
                                 {"DSV4_ATTN_SPLITS": "3"}, {"DSV4_ATTN_SPLITS": "16"},
                                 {"DSV4_ATTN_CROSSOVER": "1"}, {"DSV4_ATTN_ROW_PREFETCH": "1"},
                                 {"DSV4_ATTN_RING32": "1"}, {"DSV4_ATTN_RING32": "2"}, {"DSV4_ATTN_TILE_SPLITS": "1"}],
                         ids=["splits0", "pdl0", "specialize0", "main_pdl0", "coop0", "producer_ahead0",
                              "coop_prefetch0", "first_pv_init0", "forced_splits3", "forced_splits16", "crossover1",
                              "row_prefetch1", "ring32_1", "ring32_2", "tile_splits1"])
def test_development_switches_keep_results(env):
    proc = _child(env, "child_switch_cases()")
    assert proc.returncode == 0 and "switch cases passed" in proc.stdout, \
        f"under {env} (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _child(env, call):
    """Runs test_attention.<call> in a child process with the DSV4_ATTN_* switches of `env` only."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    full = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_ATTN_")}
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(dsv4.__file__).parent.parent),
                                                       os.environ.get("PYTHONPATH")]))
    full.update(env)
    code = f"import sys; sys.path.insert(0, sys.argv[1]); import test_attention as t; t.{call}"
    return subprocess.run([sys.executable, "-c", code, str(tests)], env=full, capture_output=True, text=True,
                          timeout=900)


# The cooperative first round (csrc/attention/sparse_mqa_first_round.cuh): round 0 of each
# CTA's first work item gathered by all warpgroups must leave the KV buffers and masks the
# producer would: the outputs are bitwise those of DSV4_ATTN_COOP_ROUND=0. Cases: (B, s_q,
# H, topk, extra_topk or None, block_size, ragged), fp8 caches, skipped entries sprinkled in.
COOP_CASES = [
    (1, 1, 64, 128, None, 64, False),   # an SWA call: one round, one CTA
    (3, 1, 64, 40, 100, 16, True),      # round 0 = list 0's only tile + list 1's first
    (1, 1, 128, 512, 128, 64, False),   # split calls: every CTA's first item is a split
    (5, 2, 64, 100, 30, 2, True),       # HCA's block size 2, odd tile counts, empty tokens
    (140, 1, 64, 130, None, 1, True),   # block size 1; more items than SMs (later ones: the producer)
    (64, 1, 128, 256, 128, 64, True),   # V4-Pro-like, several rounds after the first
]


def _fp8_case_output(case, batch_invariant=False):
    """(out, lse) on the CPU of one decode case (B, s_q, H, topk, extra_topk or None,
    block_size, ragged) over fp8 caches, its output buffer poisoned with NaN."""
    dev = "cuda"
    b, s_q, h, topk, topk2, bs, ragged = case
    g = _gen(zlib.crc32(str(case).encode()))
    nb = max(4, (max(topk, topk2 or 0) * 2) // bs + 1)
    cache, _ = make_cache("fp8", nb, bs, dev, 13)
    q = (torch.randn(b, s_q, h, 512, generator=g) * 3).bfloat16().to(dev)
    idx = make_indices(b, s_q, topk, nb * bs, g).to(dev)
    lens = make_lengths(b, topk, g, ragged)
    lens = None if lens is None else lens.to(dev)
    sink = make_sink("finite", h, g).to(dev)
    extra = (None, None, None)
    if topk2 is not None:
        cache2, _ = make_cache("fp8", 8, 16, dev, 14)
        lens2 = make_lengths(b, topk2, g, ragged)
        extra = (cache2, make_indices(b, s_q, topk2, 128, g).to(dev), None if lens2 is None else lens2.to(dev))
    out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    o, lse = sparse_mqa_decode(q, cache, idx, lens, sink, SCALE, *extra, out=out, batch_invariant=batch_invariant)
    return o.cpu(), lse.cpu()


def coop_outputs():
    return [_fp8_case_output(case) for case in COOP_CASES]


def child_save(outputs, path):
    """In a child process: the (out, lse) pairs of test_attention.<outputs>() saved to path."""
    torch.save(globals()[outputs](), path)
    print(f"{outputs} saved")


def child_compare(outputs, path):
    """In a child process: test_attention.<outputs>() bitwise against the pairs saved to path
    (the first ones are COOP_CASES' or, for crossover_outputs / ring32_outputs,
    CROSSOVER_CASES' / RING32_CASES' twice, named in a failure)."""
    cases = {"crossover_outputs": 2 * CROSSOVER_CASES, "ring32_outputs": 2 * RING32_CASES}.get(outputs, COOP_CASES)
    for k, ((o1, l1), (o2, l2)) in enumerate(zip(torch.load(path), globals()[outputs]())):
        case = cases[k] if k < len(cases) else f"case {k}"
        assert torch.equal(o1.view(torch.int16), o2.view(torch.int16)), f"out differs: {case}"
        assert torch.equal(l1, l2), f"lse differs: {case}"
    print(f"{outputs} equal")


def _bitwise_across_processes(tmp_path, outputs, env_save, env_compare):
    """<outputs>() under the switches env_save, then again under env_compare, bitwise equal.
    DSV4_ATTN_RING32 is 0 (today's kernel) unless an env names it: unset, its rule would put
    the short 128-head fp8 cases on the ring, which the crossover, for one, never runs."""
    env_save = {"DSV4_ATTN_RING32": "0", **env_save}
    env_compare = {"DSV4_ATTN_RING32": "0", **env_compare}
    path = str(tmp_path / f"{outputs}.pt")
    proc = _child(env_save, f"child_save({outputs!r}, {path!r})")
    assert proc.returncode == 0 and f"{outputs} saved" in proc.stdout, proc.stderr[-6000:]
    proc = _child(env_compare, f"child_compare({outputs!r}, {path!r})")
    assert proc.returncode == 0 and f"{outputs} equal" in proc.stdout, proc.stderr[-6000:]


@pytest.mark.gpu
def test_cooperative_first_round_is_bitwise_the_producers(tmp_path):
    _bitwise_across_processes(tmp_path, "coop_outputs", {"DSV4_ATTN_COOP_ROUND": "1"}, {"DSV4_ATTN_COOP_ROUND": "0"})


# The code diet (docs/perf-history/2026-12-04-attention-code-diet.md): O set by each work item's
# first PV MMA (scale-d = 0) instead of cleared in registers, round 1's rows sent to L2 by the
# cooperative round, and that round gathered by the consumers alone (the producer ahead on round
# 1) must give bitwise the outputs of DSV4_ATTN_FIRST_PV_INIT=0 / DSV4_ATTN_COOP_PREFETCH=0 /
# DSV4_ATTN_PRODUCER_AHEAD=0. Cases: the cooperative round's (one and several rounds, split and
# unsplit, 64 and 128 heads, empty tokens, more items than SMs: a CTA's later items start with
# the earlier item's O in the registers), a bf16 decode with several items per CTA and a
# prefill with several tokens per CTA (the producer-only instances).
def diet_outputs():
    dev = "cuda"
    outs = coop_outputs()
    g = _gen(34)
    cache, _ = make_cache("bf16", 40, 16, dev, 35)
    q = (torch.randn(300, 1, 64, 512, generator=g) * 3).bfloat16().to(dev)
    idx = make_indices(300, 1, 200, 40 * 16, g).to(dev)
    lens = make_lengths(300, 200, g, True).to(dev)
    o, lse = sparse_mqa_decode(q, cache, idx, lens, make_sink("finite", 64, g).to(dev), SCALE)
    outs.append((o.cpu(), lse.cpu()))
    t, n = 400, 900
    q = (torch.randn(t, 128, 512, generator=g) * 3).bfloat16().to(dev)
    kv = (torch.randn(n, 512, generator=g) * 2).bfloat16().to(dev)
    idx = make_indices(t, 1, 192, n, g)[:, 0].to(dev)
    o, lse = sparse_mqa_prefill(q, kv.view(n, 1, 512), idx.unsqueeze(1), make_lengths(t, 192, g, True).to(dev),
                                make_sink("finite", 128, g).to(dev), SCALE)
    outs.append((o.cpu(), lse.cpu()))
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("env", [{"DSV4_ATTN_FIRST_PV_INIT": "0", "DSV4_ATTN_COOP_PREFETCH": "0",
                                  "DSV4_ATTN_PRODUCER_AHEAD": "0"},
                                 {"DSV4_ATTN_FIRST_PV_INIT": "0", "DSV4_ATTN_COOP_ROUND": "0"}],
                         ids=["diet0", "diet0_coop0"])
def test_code_diet_is_bitwise_the_register_clears(tmp_path, env):
    _bitwise_across_processes(tmp_path, "diet_outputs", {}, env)


# The bf16 producer's L2 prefetch of the next round's rows (DSV4_ATTN_ROW_PREFETCH=1, off by
# default) moves no byte of the results: diet_outputs' bf16 decode and prefill run that
# producer with several rounds per item.
@pytest.mark.gpu
def test_row_prefetch_is_bitwise_none(tmp_path):
    _bitwise_across_processes(tmp_path, "diet_outputs", {"DSV4_ATTN_ROW_PREFETCH": "1"},
                              {"DSV4_ATTN_ROW_PREFETCH": "0"})


# The crossover at 128 heads (DSV4_ATTN_CROSSOVER=1, sparse_mqa.cuh kPair): each CTA of a
# two-CTA cluster dequantizes half of every tile into both CTAs, by the same arithmetic, and
# the consumers are unchanged, so outputs and LSE are bitwise those of today's kernel (the
# cooperative first round's, itself bitwise the producer's). Cases: (B, s_q, H, topk,
# extra_topk or None, block_size, ragged), fp8 caches with skipped and out-of-range entries:
# split calls, odd tile counts and lists straddled by a round, V4-Pro CSA and HCA-like shapes,
# one source, more items than clusters with empty tokens between them; then the same calls in
# batch-invariant mode and, under DSV4_ATTN_SPLITS, forced splits.
CROSSOVER_CASES = [
    (1, 1, 128, 2048, 128, 64, False),   # one token: many splits, every cluster one item
    (1, 2, 128, 1024, 128, 64, True),
    (3, 1, 128, 127, 2048, 16, True),    # odd tile counts on both lists
    (3, 1, 128, 40, 100, 16, True),      # round 0 straddles the lists
    (64, 1, 128, 1024, 128, 64, True),   # V4-Pro CSA-like
    (32, 1, 128, 512, 64, 2, True),      # HCA-like: block size 2
    (128, 1, 128, 128, None, 64, False),  # SWA: one source, one round
    (133, 2, 128, 512, 127, 64, True),   # more items than clusters
    (700, 1, 128, 200, 64, 64, True),    # several items per cluster, empty tokens between them
    (5, 2, 128, 100, 30, 1, True),       # block size 1
]


def crossover_outputs():
    return [_fp8_case_output(case, invariant) for invariant in (False, True) for case in CROSSOVER_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("env", [{}, {"DSV4_ATTN_SPLITS": "3"}], ids=["rule", "forced_splits3"])
def test_crossover_is_bitwise_todays(tmp_path, env):
    _bitwise_across_processes(tmp_path, "crossover_outputs", {**env, "DSV4_ATTN_CROSSOVER": "0"},
                              {**env, "DSV4_ATTN_CROSSOVER": "1"})


# The two-round ring of 32-key tiles (DSV4_ATTN_RING32=1, csrc/attention/sparse_mqa_ring32.cuh;
# fp8 caches at 128 heads). Its online softmax takes 32-key sub-tiles, so its rounding is not
# today's: the outputs are checked against the float32 reference (test_decode_gpu's
# tolerances), not bitwise. Cases: (B, s_q, topk, extra_topk or None, block_size, extra
# block_size), 128 heads: V4-Pro CSA 4K-like (window 128 + 1024 compressed entries) and
# HCA-like (window + a short list in a block-size-2 cache) at B = 1, 3, 37, 128, and the
# one-source (SWA) instance. Lengths are ragged and include 0, values on both sides of the
# 32- and 64-key boundaries (a tile with < 32 valid keys leaves consumer 1's sub-tile empty;
# odd counts of 32-key sub-tiles and of tiles) and values past the list (clamped); skipped
# (-1) and out-of-range entries are sprinkled in, open every tile, fill a whole tile and a
# whole 32-key sub-tile, over caches whose every unused slot reads as NaN; outputs start as
# NaN. Under DSV4_ATTN_TILE_SPLITS=1 the splits start at odd tiles too (ragged lengths, and
# 18 tiles in 4 forced splits: 4, 5, 4, 5).
RING32_CASES = [
    (1, 1, 128, 1024, 64, 64),    # CSA 4K, one token: many splits
    (3, 1, 128, 1024, 64, 64),
    (37, 1, 128, 1024, 64, 64),
    (128, 1, 128, 1024, 64, 64),  # CSA 4K B=128: several rounds per item, items per CTA
    (1, 1, 128, 64, 64, 2),       # HCA-like
    (3, 1, 128, 64, 64, 2),
    (37, 2, 128, 64, 64, 2),
    (128, 1, 128, 64, 64, 2),
    (37, 1, 128, None, 64, None),  # one source (SWA)
]
RING32_LENGTHS = [0, 1, 31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 129, 161, 200, 511, 1000, 1023, 1024, 1029]


def _ring32_lengths(b, topk, g):
    """Lengths [b]: for one token topk - 23; else the boundary values of RING32_LENGTHS that
    fit (up to topk + 5, clamped by the kernel) in a random order, then random ones."""
    if b == 1:
        return torch.tensor([topk - 23], dtype=torch.int32)
    fixed = torch.tensor([n for n in RING32_LENGTHS if n <= topk + 5], dtype=torch.int32)
    fixed = fixed[torch.randperm(fixed.numel(), generator=g)]
    lens = torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32)
    n = min(b, fixed.numel())
    lens[:n] = fixed[:n]
    return lens


def _ring32_list(b, s_q, topk, bs, g, seed):
    """(poisoned cache, clean f32 rows, indices, lengths) of one list, on the GPU."""
    dev = "cuda"
    nb = max(8, 4 * topk // bs)
    cache, rows = make_cache("fp8", nb, bs, dev, seed)
    lens = _ring32_lengths(b, topk, g)
    idx = skip_indices(b, s_q, topk, nb * bs, lens, g)
    if topk >= 256:
        idx[..., 160:192] = -1  # a whole 32-key sub-tile (consumer 1's of tile 2) skipped
    idx, lens = idx.to(dev), lens.to(dev)
    bad = poisoned_copy(cache, "fp8", used_slots(idx, lens, nb * bs), math.nan)
    return bad, rows, idx, lens


def ring32_case_run(case, batch_invariant):
    """One RING32_CASES case: the kernel over the poisoned caches against the float32
    reference over the clean rows; returns (out, lse) on the CPU."""
    dev = "cuda"
    b, s_q, topk, topk2, bs, bs2 = case
    g = _gen(zlib.crc32(str(case).encode()))
    cache, rows, idx, lens = _ring32_list(b, s_q, topk, bs, g, 21)
    cache2 = rows2 = idx2 = lens2 = None
    if topk2 is not None:
        cache2, rows2, idx2, lens2 = _ring32_list(b, s_q, topk2, bs2, g, 22)
    q = (torch.randn(b, s_q, 128, 512, generator=g) * 3).bfloat16().to(dev)
    sink = make_sink("finite", 128, g).to(dev)
    out = torch.full((b, s_q, 128, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    o, lse = sparse_mqa_decode(q, cache, idx, lens, sink, SCALE, cache2, idx2, lens2, out=out,
                               batch_invariant=batch_invariant)
    ro, rl = ref_decode(q, rows, idx, lens, sink, SCALE, rows2, idx2, lens2)
    try:
        assert_close(o, lse, ro, rl)
    except AssertionError as e:
        raise AssertionError(f"{case} batch_invariant={batch_invariant}: {e}") from None
    return o.cpu(), lse.cpu()


def child_ring32_cases(batch_invariant):
    """In a child process (DSV4_ATTN_RING32=1): every RING32_CASES case, and a check that the
    ring's kernel is the one that ran (where the profiler sees kernels)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ring32_case_run(RING32_CASES[3], batch_invariant)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    if any("sparse_mqa" in n for n in names):
        assert any("sparse_mqa_fwd_ring32_kernel" in n for n in names), "the ring32 kernel did not run"
    for case in RING32_CASES:
        ring32_case_run(case, batch_invariant)
    print("ring32 cases passed")


@pytest.mark.gpu
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "invariant"])
@pytest.mark.parametrize("env", [{}, {"DSV4_ATTN_SPLITS": "3"}, {"DSV4_ATTN_FIRST_PV_INIT": "0"},
                                 {"DSV4_ATTN_TILE_SPLITS": "1"}, {"DSV4_ATTN_TILE_SPLITS": "1", "DSV4_ATTN_SPLITS": "4"}],
                         ids=["rule", "forced_splits3", "first_pv_init0", "tile_splits1", "tile_splits1_forced4"])
def test_ring32_matches_reference(env, batch_invariant):
    proc = _child({**env, "DSV4_ATTN_RING32": "1"}, f"child_ring32_cases({batch_invariant})")
    assert proc.returncode == 0 and "ring32 cases passed" in proc.stdout, \
        f"under {env} (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


# DSV4_ATTN_RING32=2: the same kernel with the producer's global loads one 32-row half ahead
# (issued before the previous half's dequant; the same loads, arithmetic and stores in
# another order), so outputs and LSE are bitwise those of DSV4_ATTN_RING32=1: every
# RING32_CASES case, default and batch-invariant (each also against the reference), with
# the split rule and under DSV4_ATTN_SPLITS=3.
def ring32_outputs():
    return [ring32_case_run(case, invariant) for invariant in (False, True) for case in RING32_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("env", [{}, {"DSV4_ATTN_SPLITS": "3"}, {"DSV4_ATTN_TILE_SPLITS": "1"}],
                         ids=["rule", "forced_splits3", "tile_splits1"])
def test_ring32_loads_ahead_bitwise(tmp_path, env):
    _bitwise_across_processes(tmp_path, "ring32_outputs", {**env, "DSV4_ATTN_RING32": "1"},
                              {**env, "DSV4_ATTN_RING32": "2"})
