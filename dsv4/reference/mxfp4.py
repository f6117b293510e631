"""Float32 reference of the MXFP4 MoE op (``dsv4::mxfp4_moe``, W4A8, and the W4A16 path
of ``dsv4.routed_moe``) and of its FP8 activation quantizers.

FP8 activations (W4A8), per token and per group of 128 along K
-------------------------------------------------------------
* GEMM1's input, as vLLM 0.33.0 quantizes it on an H200 (``fused_moe/utils.py``
  ``_fp8_quantize`` -> ``fp8_utils.per_token_group_quant_fp8``, group 128, eps 1e-10, its
  CUDA kernel): ``s = max(amax, 1e-10) / 448``; with UE8M0 scales (vLLM's default on Hopper,
  ``VLLM_USE_DEEP_GEMM_E8M0=1``, and DeepSeek's reference) ``s = 2^ceil(log2 s)``;
  ``q = e4m3_rne(clamp(x / s, -448, 448))``. See :func:`quantize_fp8_gemm1`.
* GEMM2's input, the clamped SwiGLU output in fp32 (not rounded to bf16), as Humming's
  input processing quantizes it (``process_input/quantization.cuh`` ``quant_group``,
  Float32 group scales, IEEE arithmetic): ``s = max(amax / 448, 1e-30)``,
  ``q = cvt.rn.satfinite.e4m3(a * (1 / s))``. See :func:`quantize_fp8_gemm2`.
* A last group shorter than 128 (GEMM2's K = N = 288 of V4.1-Flash at TP 8) is a group of
  its own, as if zero-padded to 128 (vLLM and Humming pad N with zeros).

Divisions are always between two tensors on the same device (on CUDA, ``tensor /
python_scalar`` is computed as ``tensor * (1 / scalar)``, not the correctly rounded quotient).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats._float import E4M3_MAX, ceil_log2, pow2
from ..formats.mxfp4 import FP8_GROUP, dequantize_mxfp4_experts
from .moe import _routed_moe, swiglu


GEMM1_EPS = 1e-10  # vLLM per_token_group_quant_fp8's eps (floor of the group amax)
GEMM2_SCALE_FLOOR = 1e-30  # Humming quant_group's floor of the raw scale


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [..., K] -> [..., ceil(K/group), group], the last group zero-padded."""
    K = x.shape[-1]
    G = -(-K // group)
    xf = x.float()
    if G * group != K:
        xf = torch.nn.functional.pad(xf, (0, G * group - K))
    return xf.reshape(*x.shape[:-1], G, group)


def _to_e4m3_saturating(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest even e4m3, saturating at +-448 (``cvt.rn.satfinite``; clamping
    first is the same: every value in (448, 464] rounds to 448 anyway)."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_gemm1(x: torch.Tensor, *, ue8m0: bool = True, group: int = FP8_GROUP):
    """GEMM1's input, as vLLM's ``per_token_group_quant_fp8`` (CUDA kernel, eps 1e-10).

    Per group of ``group`` along the last dim, in float32::

        amax = max(max|x|, 1e-10)
        s    = amax / 448                     # IEEE division
        s    = 2^ceil(log2(s))                # ue8m0=True (vLLM's Hopper default)
        q    = e4m3_rne(clamp(x / s, -448, 448))

    The power of two is the exact ceil (vLLM's kernel takes ``exp2f(ceilf(log2f(s)))``,
    which agrees except possibly when s is within an ulp of a power of two).

    Args:
        x: float ``[..., K]`` (bf16 activations; any float dtype).
        ue8m0: round the scales up to powers of two (UE8M0) or keep them fp32.
        group: elements per scale (128).

    Returns:
        ``(q float8_e4m3fn [..., K], s float32 [..., ceil(K / group)])``.
    """
    xb = _groups(x, group)
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp(min=GEMM1_EPS)
    s = amax / torch.tensor(E4M3_MAX, dtype=torch.float32, device=x.device)
    if ue8m0:
        s = pow2(ceil_log2(s))
    q = _to_e4m3_saturating(xb / s)
    K = x.shape[-1]
    return q.reshape(*x.shape[:-1], -1)[..., :K], s.squeeze(-1)


def quantize_fp8_gemm2(a: torch.Tensor, *, group: int = FP8_GROUP):
    """GEMM2's input (the fp32 clamped SwiGLU output), as Humming's ``quant_group``
    (dynamic group scales in float32, IEEE arithmetic).

    Per group, in float32::

        amax = max|a|
        s    = max(amax / 448, 1e-30)
        r    = 1 / s                          # IEEE reciprocal
        q    = cvt.rn.satfinite.e4m3(a * r)

    Returns:
        ``(q float8_e4m3fn [..., K], s float32 [..., ceil(K / group)])``.
    """
    ab = _groups(a, group)
    amax = ab.abs().amax(dim=-1, keepdim=True)
    s = (amax / torch.tensor(E4M3_MAX, dtype=torch.float32, device=a.device)).clamp(min=GEMM2_SCALE_FLOOR)
    r = torch.ones_like(s) / s
    q = _to_e4m3_saturating(ab * r)
    K = a.shape[-1]
    return q.reshape(*a.shape[:-1], -1)[..., :K], s.squeeze(-1)


def dequantize_fp8_groups(q: torch.Tensor, s: torch.Tensor, *, group: int = FP8_GROUP) -> torch.Tensor:
    """``float(q) * s`` per group (float32 [..., K]); the inverse view of the quantizers above."""
    K = q.shape[-1]
    scale = s.float().repeat_interleave(group, dim=-1)[..., :K]
    return q.float() * scale


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
            128 with :func:`dsv4.quantize_fp8_gemm1`, the SwiGLU output h with
            :func:`dsv4.quantize_fp8_gemm2`, each dequantized before its GEMM).
        ue8m0: fp8 mode: power-of-two (UE8M0) GEMM1 input scales (vLLM's default on
            Hopper, DeepSeek's reference) or plain fp32 ones.
        expert_map: [E_global] integer or None, global -> local id, -1 = not local.

    The weights are dequantized exactly (``code * 2^(e - 127)``); GEMMs and SwiGLU are
    float32. (vLLM's Humming kernels also round GEMM1's output and each expert's GEMM2
    output to bf16; the dsv4 kernels keep GEMM1's fp32 accumulators for the epilogue.)

    Returns:
        float32 [M, K].
    """

    E, N = w13.shape[0], w13.shape[1] // 2
    def qdq(t: torch.Tensor, gemm: int) -> torch.Tensor:
        if gemm == 1:
            q, s = quantize_fp8_gemm1(t, ue8m0=ue8m0)
        else:
            q, s = quantize_fp8_gemm2(t)
        return dequantize_fp8_groups(q, s)

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        sl = slice(e, e + 1)
        w13_e = dequantize_mxfp4_experts(w13[sl], w13_scale[sl])[0]
        w2_e = dequantize_mxfp4_experts(w2[sl], w2_scale[sl])[0]
        if activation == "fp8":
            xe = qdq(xe, 1)
        h = swiglu(xe @ w13_e[:N].T, xe @ w13_e[N:].T, swiglu_limit)
        if activation == "fp8":
            h = qdq(h, 2)
        return h @ w2_e.T

    return _routed_moe(x, topk_ids, topk_weights, E, expert_map, expert)
