"""Float32 reference of the sparse MQA ops (``dsv4.sparse_mqa_decode`` /
``dsv4.sparse_mqa_prefill``; their CPU kernels run it on the dequantized cache).

Attention convention (DeepSeek V4), for query token t, head h and visible key
set I(t) with a per-head learned sink logit ``sink[h]``::

    s_j     = scale * <q[t, h], k_j>
    o[t, h] = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink[h] - m))
    lse     = log(sum_j exp(s_j))          # natural log, EXCLUDES the sink

``sink = -inf`` means no sink, ``sink = +inf`` forces the output to exactly
zero, and an empty visible set gives a zero output with ``lse = -inf``. No
combination of these produces NaN.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


_NEG_INF = float("-inf")


def _softmax_with_sink(
    s: torch.Tensor, sink: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sink-aware softmax over the last axis.

    Args:
        s: float32 [..., H, K] scores, ``-inf`` at masked keys.
        sink: float32 [H] sink logits or None.

    Returns:
        (p [..., H, K], lse [..., H]) where ``p`` are the normalized key weights
        (the sink's share is simply not returned) and ``lse`` excludes the sink.
    """
    lse = torch.logsumexp(s, dim=-1)  # -inf for an all-masked (or K=0) row
    total = lse if sink is None else torch.logaddexp(lse, sink)
    # Subtract the full log-denominator unless it is infinite: -inf means every
    # s is -inf (weights are exp(-inf) = 0 either way), +inf means an infinite
    # sink that takes all the mass (weights forced to 0 below). A NaN (NaN sink
    # logit) stays: rows with a visible key become NaN, empty rows stay zero, as
    # on CUDA.
    shift = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    p = torch.exp(s - shift.unsqueeze(-1))
    zero = torch.isposinf(total) | torch.isneginf(lse)
    p = torch.where(zero.unsqueeze(-1), torch.zeros_like(p), p)
    return p, lse


def _gather_scores(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lengths: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scores and values for one (cache, index list) pair.

    Returns (s [T, H, topk] with -inf at unused slots, values [T, topk, D], zero at
    unused slots).
    """
    T, topk = indices.shape
    N = kv.shape[0]
    slot = torch.arange(topk, device=indices.device)
    valid = (indices >= 0) & (indices < N)
    if lengths is not None:
        valid &= slot.unsqueeze(0) < lengths.long().unsqueeze(1)
    if N == 0:
        vals = kv.new_zeros(T, topk, kv.shape[1], dtype=torch.float32)
    else:
        safe = torch.where(valid, indices, torch.zeros_like(indices)).long()
        # Row 0 stands in for skipped entries; selecting zeros (not weighting by 0) keeps
        # its bytes out of the math when it holds NaN or inf (0 * NaN is NaN).
        vals = torch.where(valid.unsqueeze(-1), kv[safe].float(), 0.0)  # [T, topk, D]
    s = torch.einsum("thd,tkd->thk", q, vals)
    s = s.masked_fill(~valid.unsqueeze(1), _NEG_INF)
    return s, vals


def sparse_mqa(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lengths: Optional[torch.Tensor],
    sink: Optional[torch.Tensor],
    scale: float,
    extra_kv: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_lengths: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse multi-query attention over per-token index lists (K == V).

    Args:
        q: [T, H, D] float (any float dtype), queries.
        kv: [N, D] float, already-dequantized cache rows; each row is both the
            key and the value (one shared KV head).
        indices: [T, topk] integer, kv row ids per query token.
        lengths: [T] integer or None. Entry i of token t's list is used iff
            ``i < lengths[t]`` (None = all topk) and ``0 <= indices[t, i] < N``;
            so -1 padding and out-of-range ids are skipped. Duplicated ids count
            as separate keys.
        sink: [H] float32 sink logits or None (no sink).
        scale: softmax scale applied to q.k.
        extra_kv: [N2, D] float or None, a second cache.
        extra_indices: [T, topk2] integer, required iff extra_kv is given;
            same rules as ``indices`` against ``extra_kv``.
        extra_lengths: [T] integer or None, lengths for ``extra_indices``.

    Both key sets share one softmax (and one sink).

    Returns:
        out: float32 [T, H, D].
        lse: float32 [T, H], natural-log sum of exp(scores) excluding the sink;
            -inf for tokens with no visible key (whose output is zero).
    """
    sink = None if sink is None else sink.float()
    qs = q.float() * scale
    s, vals = _gather_scores(qs, kv, indices, lengths)
    if extra_kv is not None:
        s2, vals2 = _gather_scores(qs, extra_kv, extra_indices, extra_lengths)
        s = torch.cat([s, s2], dim=-1)
        vals = torch.cat([vals, vals2], dim=1)

    p, lse = _softmax_with_sink(s, sink)
    out = torch.einsum("thk,tkd->thd", p, vals)
    return out, lse
