"""Float32 reference of the dense masked FMHA op (``dsv4.dense_fmha``; its CPU kernel):
ragged batches over per-sequence [compressed | window] kv rows, the sink convention of
``dsv4.reference.attention``."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .attention import _NEG_INF, _softmax_with_sink


def _visible_mask(
    tq: int,
    n_comp: int,
    n_win: int,
    start: int,
    window: int,
    causal: bool,
    ratio: int,
    device: torch.device,
) -> torch.Tensor:
    """[tq, n_comp + n_win] bool mask of kv rows each query may see."""
    if not causal:
        return torch.ones(tq, n_comp + n_win, dtype=torch.bool, device=device)
    # Queries are bottom-right aligned to the window part of the kv rows.
    p = start + n_win - tq + torch.arange(tq, device=device)  # [tq]
    u = start + torch.arange(n_win, device=device)  # [n_win]
    win = u.unsqueeze(0) <= p.unsqueeze(1)
    if window > 0:
        win &= u.unsqueeze(0) >= (p - window + 1).unsqueeze(1)
    # Floor division; for p + 1 <= 0 it is <= 0, i.e. no compressed entry.
    n_vis = torch.div(p + 1, ratio, rounding_mode="floor")
    w = torch.arange(n_comp, device=device)
    comp = w.unsqueeze(0) < n_vis.unsqueeze(1)
    return torch.cat([comp, win], dim=1)


def dense_fmha(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    n_comp: torch.Tensor,
    *,
    window: int,
    causal: bool,
    ratio: int = 1,
    seq_start_pos: Optional[torch.Tensor] = None,
    sink: Optional[torch.Tensor] = None,
    scale: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ragged-batch attention over [compressed | sliding-window] kv rows.

    Args:
        q: [Tq, Hq, D] float, queries of all sequences concatenated.
        k: [Nkv, Hkv, D] float, keys of all sequences concatenated.
        v: [Nkv, Hkv, Dv] float, values (same rows as k).
        cu_seqlens_q: [S+1] integer, cumulative query counts (0 first, Tq last).
        cu_seqlens_kv: [S+1] integer, cumulative kv counts (0 first, Nkv last).
        n_comp: [S] integer. Sequence s's kv rows are laid out as
            ``[n_comp[s] compressed entries | L_w window entries]`` with
            ``L_w = kv_len[s] - n_comp[s]``.
        window: sliding-window size; ``<= 0`` means unlimited.
        causal: apply the position rules below; False = every row visible
            (window and ratio ignored).
        ratio: compression ratio (>= 1) of the compressed entries.
        seq_start_pos: [S] integer or None (zeros), absolute position of the
            first window entry of each sequence.
        sink: [Hq] float32 sink logits or None.
        scale: softmax scale applied to q.k.

    GQA/MQA: query head h uses kv head ``h // (Hq // Hkv)``.

    Positions (causal): query i of sequence s (``0 <= i < Tq_s``) sits at
    ``p = start + L_w - Tq_s + i`` (bottom-right aligned to the window part);
    window entry j sits at ``start + j``. The query sees window entry at
    position u iff ``p - window + 1 <= u <= p`` (no lower bound if window <= 0)
    and compressed entry w iff ``w < (p + 1) // ratio`` (floor division).

    Returns:
        out: float32 [Tq, Hq, Dv]; zero for queries with nothing visible.
        lse: float32 [Tq, Hq], log-sum-exp of the visible scores excluding the
            sink; -inf for queries with nothing visible.
    """
    Tq, Hq, _ = q.shape
    _, Hkv, Dv = v.shape
    device = q.device
    sink = None if sink is None else sink.float()
    # Host copies of the small per-sequence metadata drive the Python loop.
    S = cu_seqlens_q.shape[0] - 1
    cq = cu_seqlens_q.tolist()
    ckv = cu_seqlens_kv.tolist()
    nc = n_comp.tolist()
    starts = seq_start_pos.tolist() if seq_start_pos is not None else [0] * S

    group = Hq // Hkv
    out = torch.zeros(Tq, Hq, Dv, dtype=torch.float32, device=device)
    lse = torch.full((Tq, Hq), _NEG_INF, dtype=torch.float32, device=device)
    for s in range(S):
        q0, q1, k0, k1 = cq[s], cq[s + 1], ckv[s], ckv[s + 1]
        tq = q1 - q0
        if tq == 0:
            continue
        mask = _visible_mask(
            tq, nc[s], (k1 - k0) - nc[s], starts[s], window, causal, ratio, device
        )
        qs = q[q0:q1].float() * scale  # [tq, Hq, D]
        ks = k[k0:k1].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        vs = v[k0:k1].float().repeat_interleave(group, dim=1)  # [L, Hq, Dv]
        scores = torch.einsum("thd,lhd->thl", qs, ks)
        scores = scores.masked_fill(~mask.unsqueeze(1), _NEG_INF)
        p, seq_lse = _softmax_with_sink(scores, sink)
        out[q0:q1] = _visible_pv(p, vs, mask)
        lse[q0:q1] = seq_lse
    return out, lse


def _visible_pv(p: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_l p[t, h, l] v[l, h]`` over the rows query t sees (``mask[t, l]``) only.

    A row a query does not see has p = 0, but 0 * NaN is NaN: rows holding a non-finite
    value are left out of the product and added back, by a select, for the queries that
    see them. Rows with finite values go through one einsum as they are (0 * finite is 0),
    so a query's result does not depend on the bytes of rows it does not see.
    """
    bad = ~torch.isfinite(v).flatten(1).all(dim=1)  # [L]
    if not bad.any():
        return torch.einsum("thl,lhd->thd", p, v)
    out = torch.einsum("thl,lhd->thd", p, v.masked_fill(bad[:, None, None], 0.0))
    for row in bad.nonzero().flatten().tolist():
        seen = mask[:, row, None, None]  # [tq, 1, 1]
        if seen.any():
            out += torch.where(seen, p[:, :, row, None] * v[row], 0.0)
    return out
