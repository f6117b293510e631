"""Float32 reference of the NVFP4 MoE op (``dsv4.nvfp4_moe``; its CPU kernel, on the
un-prepared weights): clamped SwiGLU, routing and the weighted combine, shared with the
MXFP4 reference (``dsv4.reference.mxfp4``)."""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from .. import formats
from .quantize import quantize_nvfp4


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

    packed, scales = quantize_nvfp4(x, global_scale)
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
            dsv4.reference.quantize_nvfp4: Blackwell's rule, exact reciprocals).
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
