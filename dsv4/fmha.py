"""Dense masked FMHA over ``[compressed | window]`` KV per sequence: ``dsv4.fmha``.

Semantics are those of :func:`dsv4.reference.dense_fmha` (DESIGN section 3B): per
sequence the kv rows are ``[n_comp compressed entries | L_w window entries]``; query i of
a sequence with ``Tq_s`` queries sits at position ``p = start + L_w - Tq_s + i``
(bottom-right aligned to the window part), window entry j at ``start + j``. Causal: the
query sees window entries in ``[p - window + 1, p]`` and compressed entry w iff
``w < (p + 1) // ratio``. Per-head sink in the denominator; lse excludes the sink; a query
with nothing visible gets zeros and lse = -inf.

CUDA today: the visible rows of each query are two contiguous ranges, so they are written
as an index list (on the device, no host sync) and run through the sparse MQA prefill
kernel, which covers DeepSeek V4's case (head dim 512, one shared KV head = K = V, 64 or
128 query heads, bf16). Other head dims and GQA run on the CPU reference only and raise a
clear error on CUDA; a dedicated dense kernel (contiguous tiles instead of gathered rows,
head dims 64-256) is the open part of this op.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import reference
from .attention import HEAD_DIM, sparse_mqa_prefill

__all__ = ["fmha"]


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
    col = torch.arange(width, device=dev)[None, :]
    n_vis, lo, kv0, n_c = n_vis[:, None], lo[:, None], kv0[:, None], n_c[:, None]
    idx = torch.where(col < n_vis, kv0 + col, kv0 + n_c + lo + (col - n_vis))
    lengths = n_vis[:, 0] + n_win
    idx = torch.where(col < lengths[:, None], idx, -1)
    return idx.to(torch.int32), lengths.to(torch.int32)


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
        attn_sink: fp32 ``[Hq]`` or None. softmax_scale: default ``D ** -0.5``.
        out: optional output buffer ``[Tq, Hq, Dv]`` of q's dtype.

    Returns:
        ``(out [Tq, Hq, Dv], lse fp32 [Tq, Hq])``.

    CUDA supports D = 512 with K = V shared by one KV head and Hq in {64, 128} (DeepSeek
    V4); anything else raises ValueError there (the CPU path runs every shape).
    """
    # checked on every device, so a call that works on CPU tensors works on CUDA ones
    if isinstance(max_seqlen_kv, bool) or not isinstance(max_seqlen_kv, int) or max_seqlen_kv < 0:
        raise ValueError(f"dsv4: max_seqlen_kv must be a non-negative int, got {max_seqlen_kv!r}")
    k, v = kv if isinstance(kv, tuple) else (kv, kv)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    if q.device.type != "cuda":
        o, lse = reference.dense_fmha(
            q, k, v, cu_seqlens_q, cu_seqlens_kv, n_comp, window=window, causal=causal, ratio=ratio,
            seq_start_pos=seq_start_pos, sink=attn_sink, scale=scale,
        )
        if out is None:
            out = torch.empty(o.shape, dtype=q.dtype, device=q.device)
        out.copy_(o)
        return out, lse
    if not (v is k and k.dim() == 3 and k.shape[1] == 1 and q.dim() == 3 and q.shape[-1] == HEAD_DIM
            and k.shape[-1] == HEAD_DIM and q.shape[1] in (64, 128)):
        raise ValueError(
            "dsv4.fmha on CUDA supports head dim 512 with one KV head that is both K and V and 64 or "
            f"128 query heads (DeepSeek V4); got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {'= k' if v is k else tuple(v.shape)}. Other shapes run on CPU tensors only for now."
        )
    indices, lengths = visible_rows(q.shape[0], cu_seqlens_q, cu_seqlens_kv, n_comp, width=max(1, max_seqlen_kv),
                                    window=window, causal=causal, ratio=ratio, seq_start_pos=seq_start_pos)
    return sparse_mqa_prefill(q, k.reshape(k.shape[0], HEAD_DIM), indices, lengths, attn_sink, scale, out=out)
