"""Float32 reference implementations of the dsv4 ops.

These are the ground truth the CUDA kernels are tested against and double as
the CPU implementations. They favour clarity over speed, work on CPU and CUDA
tensors alike, and do all arithmetic in float32. They check nothing: the ops'
CPU kernels check their arguments first (dsv4._checks), and a direct call must
pass arguments those kernels would accept (any float dtype and shape where the
docstring says so).

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

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

__all__ = ["sparse_mqa", "dense_fmha", "swiglu", "nvfp4_moe", "mxfp4_moe"]

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------
# softmax with an attention sink
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# sparse MQA
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# dense (ragged, windowed, compressed-prefix) FMHA
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# NVFP4 MoE
# ---------------------------------------------------------------------------


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: Optional[float] = None) -> torch.Tensor:
    """Clamped SwiGLU: ``silu(min(g, L)) * clamp(u, -L, L)``.

    Args:
        g: float [..., N], gate projection.
        u: float [..., N], up projection (same shape as g).
        limit: clamp limit L > 0, or None for plain ``silu(g) * u``.

    Returns:
        float32 [..., N].
    """
    g = g.float()
    u = u.float()
    if limit is not None:
        limit = float(limit)
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return F.silu(g) * u


def _expert_global_scale(scale, e: int):
    """Global (dequant) scale for local expert e: float, 1-elem or [E] tensor."""
    if isinstance(scale, torch.Tensor):
        # formats wants a float32 1-element tensor; accept any float dtype here.
        flat = scale.reshape(-1).float()
        return flat[e : e + 1] if flat.numel() > 1 else flat
    return float(scale)


def _qdq_nvfp4(x: torch.Tensor, global_scale) -> torch.Tensor:
    """Round-trip x through NVFP4 (W4A4 activation emulation), float32 out."""
    from dsv4 import formats

    packed, scales = formats.quantize_nvfp4(x, global_scale)
    return formats.dequantize_nvfp4(packed, scales, global_scale, dtype=torch.float32)


def nvfp4_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_scale_2: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_scale_2: torch.Tensor,
    *,
    swiglu_limit: Optional[float] = None,
    activation: str = "bf16",
    a13_scale: Union[float, torch.Tensor, None] = None,
    a2_scale: Union[float, torch.Tensor, None] = None,
    expert_map: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Routed SwiGLU MoE with NVFP4 expert weights (vLLM stacked layout).

    Args:
        x: [M, K] bf16/float token activations.
        topk_ids: [M, k] integer expert ids per token slot.
        topk_weights: [M, k] float routing weights.
        w13: [E, 2N, K/2] uint8 packed FP4; rows 0..N-1 are the gate (w1),
            rows N..2N-1 the up projection (w3).
        w13_scale: [E, 2N, K/16] float8_e4m3fn block scales.
        w13_scale_2: [E] or [E, 2] float32 global scales (for [E, 2], the gate
            rows use [:, 0] and the up rows [:, 1], ModelOpt's w1 and w3
            weight_scale_2; vLLM 0.33.0 would use [:, 0] for both).
        w2: [E, K, N/2] uint8 packed FP4 down projection.
        w2_scale: [E, K, N/16] float8_e4m3fn block scales.
        w2_scale_2: [E] float32 global scales.
        swiglu_limit: clamp limit for :func:`swiglu`, or None.
        activation: "bf16" (x used as given in float32, h kept float32) or
            "nvfp4" (W4A4 emulation: x and h are NVFP4 quantize-dequantized
            before GEMM1 / GEMM2 with global scales a13_scale / a2_scale, by
            dsv4.formats.quantize_nvfp4: Blackwell's rule, exact reciprocals).
        a13_scale, a2_scale: NVFP4 activation global (dequant) scales: a float,
            a 1-element tensor, or a per-local-expert [E] tensor. Required for
            activation="nvfp4", ignored otherwise.
        expert_map: [E_global] integer or None. Maps global expert id to local
            id, -1 = not on this rank (that slot contributes nothing). Without
            it topk_ids are local ids.

    Per slot (m, j) with local expert e:
    ``y = (swiglu(x W1_e^T, x W3_e^T) W2_e^T)``; output ``sum_j w[m, j] y``.

    Returns:
        float32 [M, K].
    """
    from dsv4 import formats

    E, N = w13.shape[0], w13.shape[1] // 2

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        # Dequantize one expert at a time so full-size models fit in memory.
        sl = slice(e, e + 1)
        w13_e = formats.dequantize_experts(w13[sl], w13_scale[sl], w13_scale_2[sl])[0]
        w2_e = formats.dequantize_experts(w2[sl], w2_scale[sl], w2_scale_2[sl])[0]
        if activation == "nvfp4":
            xe = _qdq_nvfp4(xe, _expert_global_scale(a13_scale, e))
        h = swiglu(xe @ w13_e[:N].T, xe @ w13_e[N:].T, swiglu_limit)
        if activation == "nvfp4":
            h = _qdq_nvfp4(h, _expert_global_scale(a2_scale, e))
        return h @ w2_e.T

    return _routed_moe(x, topk_ids, topk_weights, E, expert_map, expert)


# ---------------------------------------------------------------------------
# routing and combine (shared by the NVFP4 and MXFP4 references)
# ---------------------------------------------------------------------------


def _routed_moe(x, topk_ids, topk_weights, E: int, expert_map, expert) -> torch.Tensor:
    """``out[m] = sum_j topk_weights[m, j] * expert(e, x[m])`` over the slots whose local
    expert e = (expert_map[id] or id) is >= 0.

    ``expert(e, xe)`` maps the float32 rows ``xe`` [n, K] of the tokens routed to local
    expert e to their float32 outputs [n, K]; it is called once per expert with tokens.
    A slot whose id lies outside [0, E) (without a map) or [0, E_global) (with one), or
    whose mapped id lies outside [0, E), contributes nothing, as in the kernels (the op
    wrappers refuse such ids unless told not to check). Returns float32 [M, K].
    """
    M, K = x.shape
    device = x.device
    topk = topk_ids.shape[1]
    ids = topk_ids.long()
    if expert_map is not None:
        known = (ids >= 0) & (ids < expert_map.shape[0])
        ids = torch.where(known, expert_map.long()[torch.where(known, ids, 0)], -1)

    # Flatten the (token, slot) pairs; each expert then sees its rows at once.
    flat_expert = ids.reshape(-1)
    flat_token = torch.arange(M, device=device).repeat_interleave(topk)
    flat_weight = topk_weights.float().reshape(-1)
    xf = x.float()

    out = torch.zeros(M, K, dtype=torch.float32, device=device)
    for e in range(E):
        pairs = (flat_expert == e).nonzero(as_tuple=True)[0]
        if pairs.numel() == 0:
            continue
        tokens = flat_token[pairs]
        y = expert(e, xf[tokens])
        out.index_add_(0, tokens, y * flat_weight[pairs].unsqueeze(1))
    return out


# ---------------------------------------------------------------------------
# MXFP4 MoE
# ---------------------------------------------------------------------------


def mxfp4_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    *,
    swiglu_limit: Optional[float] = None,
    activation: str = "fp8",
    ue8m0: bool = True,
    expert_map: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Routed SwiGLU MoE with MXFP4 expert weights (vLLM stacked layout, DeepSeek V4's
    native checkpoints), routing and combine as :func:`nvfp4_moe`.

    Args:
        x: [M, K] bf16/float token activations (K a multiple of 32).
        topk_ids, topk_weights: [M, k] expert ids (local, or global with expert_map)
            and routing weights.
        w13: [E, 2N, K/2] uint8 packed e2m1 (gate rows, then up rows).
        w13_scale: [E, 2N, K/32] e8m0 block scales (uint8 or float8_e8m0fnu).
        w2: [E, K, N/2] uint8; w2_scale: [E, K, N/32] e8m0.
        swiglu_limit: clamp limit of :func:`swiglu`, or None.
        activation: "bf16" (W4A16: x used as given in float32, h kept in float32) or
            "fp8" (W4A8, vLLM 0.33.0's Hopper numerics: x quantized per token and per
            128 with :func:`dsv4.mxfp4.quantize_fp8_gemm1`, the SwiGLU output h with
            :func:`dsv4.mxfp4.quantize_fp8_gemm2`, each dequantized before its GEMM).
        ue8m0: fp8 mode: power-of-two (UE8M0) GEMM1 input scales (vLLM's default on
            Hopper, DeepSeek's reference) or plain fp32 ones.
        expert_map: [E_global] integer or None, global -> local id, -1 = not local.

    The weights are dequantized exactly (``code * 2^(e - 127)``); GEMMs and SwiGLU are
    float32. (vLLM's Humming kernels also round GEMM1's output and each expert's GEMM2
    output to bf16; the dsv4 kernels keep GEMM1's fp32 accumulators for the epilogue.)

    Returns:
        float32 [M, K].
    """
    from dsv4 import mxfp4

    E, N = w13.shape[0], w13.shape[1] // 2
    def qdq(t: torch.Tensor, gemm: int) -> torch.Tensor:
        if gemm == 1:
            q, s = mxfp4.quantize_fp8_gemm1(t, ue8m0=ue8m0)
        else:
            q, s = mxfp4.quantize_fp8_gemm2(t)
        return mxfp4.dequantize_fp8_groups(q, s)

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        sl = slice(e, e + 1)
        w13_e = mxfp4.dequantize_mxfp4_experts(w13[sl], w13_scale[sl])[0]
        w2_e = mxfp4.dequantize_mxfp4_experts(w2[sl], w2_scale[sl])[0]
        if activation == "fp8":
            xe = qdq(xe, 1)
        h = swiglu(xe @ w13_e[:N].T, xe @ w13_e[N:].T, swiglu_limit)
        if activation == "fp8":
            h = qdq(h, 2)
        return h @ w2_e.T

    return _routed_moe(x, topk_ids, topk_weights, E, expert_map, expert)
