"""Dense masked FMHA over ``[compressed | window]`` KV per sequence: ``dsv4.fmha``.

Semantics are those of :func:`dsv4.reference.dense_fmha` (docs/design.md 3B): per
sequence the kv rows are ``[n_comp compressed entries | L_w window entries]``; query i of
a sequence with ``Tq_s`` queries sits at position ``p = start + L_w - Tq_s + i``
(bottom-right aligned to the window part), window entry j at ``start + j``. Causal: the
query sees window entries in ``[p - window + 1, p]`` and compressed entry w iff
``w < (p + 1) // ratio``. Per-head sink in the denominator; lse excludes the sink; a query
with nothing visible gets zeros and lse = -inf.

CUDA: two kernels behind one call.

* Head dims 64, 128, 256 (any GQA/MQA grouping, K and V of the same head dim): the dense
  kernel ``dsv4::dense_fmha`` (csrc/fmha/): masks computed in the kernel from positions,
  KV read as contiguous tiles; split-KV plus a combine pass (sink applied once) when
  the query tiles alone would leave SMs idle (decode).
* Head dim 512 with one KV head that is both K and V and 64 or 128 query heads
  (DeepSeek V4): the visible rows of each query are two contiguous ranges, written as an
  index list on the device (no host sync) and run through the sparse MQA prefill kernel,
  which has the wgmma pipeline for that shape.

Anything else raises a clear error on CUDA (the CPU path runs every shape).

Rows a query does not see (DESIGN section 1: their bytes must never reach the math): the
head-dim-512 path and the CPU path never let them into that query's result, whatever
they hold. The dense kernel reads whole 64-row tiles of the union of the visible ranges
of 64 queries: rows that none of those queries sees are never read, but a NaN or inf in
a row that one of them sees reaches the others as 0 * NaN inside the tile's P V product
(as in any tiled attention kernel; valid rows are expected to be finite).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from . import reference
from ._ops import op
from .attention import HEAD_DIM, sparse_mqa_prefill

__all__ = ["fmha", "index_width", "visible_rows"]

DENSE_HEAD_DIMS = (64, 128, 256)


def _check_softmax_scale(softmax_scale: float) -> None:
    # same rule and wording as csrc/fmha/dense_fmha.cu
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"dsv4: softmax_scale must be finite and > 0, got {softmax_scale}")


@torch.library.register_fake("dsv4::dense_fmha")
def _(q, k, v, cu_seqlens_q, cu_seqlens_kv, n_comp, seq_start_pos, attn_sink, softmax_scale, window, causal,
      ratio, max_seqlen_q, max_seqlen_kv, num_splits, out):
    _check_softmax_scale(softmax_scale)
    return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


@torch.library.impl("dsv4::dense_fmha", "CPU")
def _(q, k, v, cu_seqlens_q, cu_seqlens_kv, n_comp, seq_start_pos, attn_sink, softmax_scale, window, causal,
      ratio, max_seqlen_q, max_seqlen_kv, num_splits, out):
    _check_softmax_scale(softmax_scale)
    o, lse = reference.dense_fmha(q, k, v, cu_seqlens_q, cu_seqlens_kv, n_comp, window=window, causal=causal,
                                  ratio=ratio, seq_start_pos=seq_start_pos, sink=attn_sink, scale=softmax_scale)
    out.copy_(o)
    return lse


def visible_rows(
    num_rows: int,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    n_comp: torch.Tensor,
    *,
    width: int,
    window: int,
    causal: bool,
    ratio: int = 1,
    seq_start_pos: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index list of the kv rows each query row sees, for the sparse kernels.

    ``num_rows`` is Tq (q.shape[0]), passed on the host so nothing reads device memory.
    Returns ``(indices int32 [Tq, width], lengths int32 [Tq])``: row t lists its visible
    compressed rows, then its visible window rows (global kv row ids), -1 after
    ``lengths[t]``. ``width`` must be >= the longest visible set (``max_seqlen_kv`` is
    always enough). Device-side only: usable under CUDA graphs and torch.compile.
    """
    dev = cu_seqlens_q.device
    cq, ckv, nc = cu_seqlens_q.long(), cu_seqlens_kv.long(), n_comp.long()
    rows = torch.arange(num_rows, device=dev)
    seq = torch.searchsorted(cq[1:], rows, right=True)
    i = rows - cq[seq]
    tq_s = cq[seq + 1] - cq[seq]
    kv0 = ckv[seq]
    n_c = nc[seq]
    l_w = ckv[seq + 1] - kv0 - n_c
    start = seq_start_pos.long()[seq] if seq_start_pos is not None else torch.zeros_like(rows)
    if causal:
        p = start + l_w - tq_s + i
        n_vis = torch.div(p + 1, ratio, rounding_mode="floor").clamp(min=0)
        n_vis = torch.minimum(n_vis, n_c)
        lo = (p - window + 1 - start).clamp(min=0) if window > 0 else torch.zeros_like(p)
        hi = torch.minimum(p - start, l_w - 1)
    else:
        n_vis, lo, hi = n_c, torch.zeros_like(rows), l_w - 1
    n_win = (hi - lo + 1).clamp(min=0)
    lengths = (n_vis + n_win).to(torch.int32)
    # The [Tq, width] part is the costly one (Tq x ~1152 for a 4K prefill): int32 throughout
    # and four passes. Column c is kv0 + c, shifted past the invisible compressed rows and the
    # window rows before lo once c reaches n_vis, and -1 from lengths on. Row ids fit in
    # int32 (the kernels take int32 indices).
    col = torch.arange(width, device=dev, dtype=torch.int32)[None, :]
    shift = (n_c + lo - n_vis).to(torch.int32)[:, None]
    idx = (col >= n_vis.to(torch.int32)[:, None]).to(torch.int32) * shift
    idx += col + kv0.to(torch.int32)[:, None]
    return idx.masked_fill_(col >= lengths[:, None], -1), lengths


def index_width(max_seqlen_kv: int, *, window: int, causal: bool, ratio: int, has_start_pos: bool) -> int:
    """Host-side upper bound on any query's visible row count, the index list width.

    Causal, positions starting at 0: a query at position p < L_w sees at most
    min((p + 1) // ratio, n_comp) compressed entries, and n * (ratio + 1) <= n_comp + L_w
    <= max_seqlen_kv bounds that by max_seqlen_kv // (ratio + 1); the window part adds
    at most ``window``. For DeepSeek V4 (ratio 4, window 128) this is ~1/5 of
    max_seqlen_kv, which keeps the index list (and its memory traffic) small. Otherwise
    (not causal, or sequences starting at arbitrary positions) max_seqlen_kv.
    """
    if not causal or has_start_pos or ratio < 1:
        return max_seqlen_kv
    win = min(window, max_seqlen_kv) if window > 0 else max_seqlen_kv
    return min(max_seqlen_kv, max_seqlen_kv // (ratio + 1) + win)


def fmha(
    q: torch.Tensor,
    kv: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    n_comp: torch.Tensor,
    *,
    max_seqlen_kv: int,
    window: int = 128,
    causal: bool = True,
    ratio: int = 1,
    seq_start_pos: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense masked attention over a ragged batch (see the module docstring for the masks).

    Args:
        q: ``[Tq, Hq, D]`` queries of all sequences concatenated (bf16 on CUDA).
        kv: ``[Nkv, Hkv, D]`` rows that are both key and value, or a ``(k, v)`` pair
            (``k [Nkv, Hkv, D]``, ``v [Nkv, Hkv, Dv]``); query head h uses kv head
            ``h // (Hq // Hkv)``.
        cu_seqlens_q, cu_seqlens_kv: int ``[S+1]`` cumulative query / kv row counts.
        n_comp: int ``[S]`` compressed entries at the front of each sequence's kv rows.
        max_seqlen_kv: host int >= every sequence's kv length (sizes the index list
            without reading device memory, so the call can be graph-captured).
        window: sliding window (<= 0: unlimited). causal: apply the position masks.
        ratio: compression ratio of the compressed entries. seq_start_pos: int ``[S]``
            absolute position of each sequence's first window entry (default 0).
        attn_sink: fp32 ``[Hq]`` or None. softmax_scale: default ``D ** -0.5``; finite and
            > 0, checked on the host.
        out: optional output buffer ``[Tq, Hq, Dv]`` of q's dtype.
        max_seqlen_q: host int >= every sequence's query count (sizes the dense kernel's
            grid; default Tq, always safe). A smaller value leaves rows unwritten.
        num_splits: dense kernel only: split each query tile's KV walk over this many
            CTAs plus a combine pass (0 = choose from the shapes: splits when the query
            tiles alone would leave SMs idle, as in decode).

    Returns:
        ``(out [Tq, Hq, Dv], lse fp32 [Tq, Hq])``.

    CUDA supports D in {64, 128, 256} with Dv = D (dense kernel, any Hq multiple of Hkv)
    and D = 512 with K = V shared by one KV head and Hq in {64, 128} (DeepSeek V4);
    anything else raises ValueError there (the CPU path runs every shape).
    """
    # checked on every device, so a call that works on CPU tensors works on CUDA ones
    if isinstance(max_seqlen_kv, bool) or not isinstance(max_seqlen_kv, int) or max_seqlen_kv < 0:
        raise ValueError(f"dsv4: max_seqlen_kv must be a non-negative int, got {max_seqlen_kv!r}")
    if max_seqlen_q is None:
        max_seqlen_q = q.shape[0]
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise ValueError(f"dsv4: max_seqlen_q must be a non-negative int, got {max_seqlen_q!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= 64:
        raise ValueError(f"dsv4: num_splits must be an int in [0, 64] (0 = choose), got {num_splits!r}")
    k, v = kv if isinstance(kv, tuple) else (kv, kv)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    _check_softmax_scale(scale)
    if q.device.type != "cuda":
        o, lse = reference.dense_fmha(
            q, k, v, cu_seqlens_q, cu_seqlens_kv, n_comp, window=window, causal=causal, ratio=ratio,
            seq_start_pos=seq_start_pos, sink=attn_sink, scale=scale,
        )
        if out is None:
            out = torch.empty(o.shape, dtype=q.dtype, device=q.device)
        out.copy_(o)
        return out, lse
    d = q.shape[-1] if q.dim() == 3 else None
    if d in DENSE_HEAD_DIMS and k.dim() == 3 and v.dim() == 3 and k.shape[-1] == d and v.shape[-1] == d:
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        ints = [t.to(torch.int32) for t in (cu_seqlens_q, cu_seqlens_kv, n_comp)]
        start = seq_start_pos.to(torch.int32) if seq_start_pos is not None else None
        lse = op("dense_fmha")(q, k, v, *ints, start, attn_sink, scale, int(window), bool(causal), int(ratio),
                               max_seqlen_q, max_seqlen_kv, int(num_splits), out)
        return out, lse
    if not (v is k and k.dim() == 3 and k.shape[1] == 1 and q.dim() == 3 and q.shape[-1] == HEAD_DIM
            and k.shape[-1] == HEAD_DIM and q.shape[1] in (64, 128)):
        raise ValueError(
            "dsv4.fmha on CUDA supports head dims 64/128/256 (k and v of the same head dim) and head dim 512 "
            "with one KV head that is both K and V and 64 or 128 query heads (DeepSeek V4); got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {'= k' if v is k else tuple(v.shape)}. "
            "Other shapes run on CPU tensors only."
        )
    width = max(1, index_width(max_seqlen_kv, window=window, causal=causal, ratio=ratio,
                               has_start_pos=seq_start_pos is not None))
    indices, lengths = visible_rows(q.shape[0], cu_seqlens_q, cu_seqlens_kv, n_comp, width=width,
                                    window=window, causal=causal, ratio=ratio, seq_start_pos=seq_start_pos)
    return sparse_mqa_prefill(q, k.reshape(k.shape[0], HEAD_DIM), indices, lengths, attn_sink, scale, out=out)
