"""Batch-invariant decode (sparse_mqa_decode(..., batch_invariant=True)): a sequence's
output and lse are bitwise the same alone and inside any batch."""

from __future__ import annotations

import pytest
import torch

from dsv4 import formats
from dsv4.attention import sparse_mqa_decode

SCALE = 512**-0.5


def _pools(device, gen):
    swa = formats.new_fp8_ds_mla_cache(256, 64, device=device)
    comp = formats.new_fp8_ds_mla_cache(512, 64, device=device)
    for c in (swa, comp):
        n = c.shape[0] * c.shape[1]
        formats.write_fp8_ds_mla(c, torch.arange(n, device=device), torch.randn(n, 512, generator=gen, device=device))
    return swa, comp


def _batch(B, H, width, swa, comp, gen, device, lens=None):
    q = torch.randn(B, 1, H, 512, generator=gen, device=device).to(torch.bfloat16)
    win = torch.randint(0, swa.shape[0] * 64, (B, 1, 128), generator=gen, device=device, dtype=torch.int32)
    cidx = torch.randint(0, comp.shape[0] * 64, (B, 1, width), generator=gen, device=device, dtype=torch.int32)
    clen = lens if lens is not None else torch.randint(0, width + 1, (B,), generator=gen, device=device,
                                                       dtype=torch.int32)
    return q, win, torch.full((B,), 128, dtype=torch.int32, device=device), cidx, clen


def _run(q, swa, win, wlen, comp, cidx, clen, sink, inv=True):
    return sparse_mqa_decode(q, swa, win, wlen, sink, SCALE, extra_kv_cache=comp, extra_indices=cidx,
                             extra_topk_length=clen, batch_invariant=inv)


def test_flag_on_cpu_matches_default():
    gen = torch.Generator().manual_seed(0)
    swa, comp = _pools("cpu", gen)
    q, win, wlen, cidx, clen = _batch(2, 64, 256, swa, comp, gen, "cpu")
    sink = torch.randn(64, generator=gen)
    a = _run(q, swa, win, wlen, comp, cidx, clen, sink, inv=False)
    b = _run(q, swa, win, wlen, comp, cidx, clen, sink, inv=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("width", [512, 1024, 2048])
def test_same_bits_alone_and_in_any_batch(H, width):
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(H + width)
    swa, comp = _pools(dev, gen)
    sink = torch.randn(H, generator=gen, device=dev)
    q1, win1, wlen1, cidx1, clen1 = _batch(1, H, width, swa, comp, gen, dev,
                                           lens=torch.tensor([width - 37], dtype=torch.int32, device=dev))
    alone_o, alone_l = _run(q1, swa, win1, wlen1, comp, cidx1, clen1, sink)
    default_o, _ = _run(q1, swa, win1, wlen1, comp, cidx1, clen1, sink, inv=False)
    # the invariant result is a correct result: within a few bf16 ulps of the default path
    torch.testing.assert_close(alone_o.float(), default_o.float(), atol=8e-3, rtol=1.6e-2)
    for B in (1, 2, 7, 64, 128, 256):
        for pos in sorted({0, B // 2, B - 1}):
            q, win, wlen, cidx, clen = _batch(B, H, width, swa, comp, gen, dev)
            q[pos], win[pos], cidx[pos], clen[pos] = q1[0], win1[0], cidx1[0], clen1[0]
            o, l = _run(q, swa, win, wlen, comp, cidx, clen, sink)
            assert torch.equal(o[pos], alone_o[0]), (B, pos)
            assert torch.equal(l[pos], alone_l[0]), (B, pos)
    # a wider index row (more -1 padding, as vLLM's C128A rows grow with the batch's longest
    # context) changes nothing either
    wide = torch.full((1, 1, 2 * width), -1, dtype=torch.int32, device=dev)
    wide[..., :width] = cidx1
    o, l = _run(q1, swa, win1, wlen1, comp, wide, clen1, sink)
    assert torch.equal(o, alone_o) and torch.equal(l, alone_l)


@pytest.mark.gpu
def test_too_long_lists_are_refused():
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    swa, comp = _pools(dev, gen)
    q, win, wlen, cidx, clen = _batch(1, 64, 33000, swa, comp, gen, dev)
    with pytest.raises(RuntimeError, match="dsv4: batch_invariant decode takes index lists of at most 32768"):
        _run(q, swa, win, wlen, comp, cidx, clen, None)
