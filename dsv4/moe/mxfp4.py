"""dsv4::mxfp4_moe (CUDA: csrc/moe/mxfp4_moe.cu): the routed-expert MoE with MXFP4
weights (DeepSeek V4's native checkpoints) in W4A8, vLLM 0.33.0's Hopper numerics. Its
weights type :class:`Mxfp4MoeWeights`, argument rules (the CPU and fake kernels check
what the C++ entry checks), fake kernel, CPU kernel (the float32 reference
``dsv4.reference.mxfp4_moe``, activation "fp8", on the un-tiled weights) and the wrapper
:func:`mxfp4_moe`.

Numerics (docs/design.md section 2): GEMM1's input x quantized to FP8 e4m3 per token and
per 128 along K (vLLM's ``per_token_group_quant_fp8``, power-of-two scales with ``ue8m0``),
the weights exact in FP8 relative to a base per row and 128 of K (prepare fits every
block: ``dsv4.formats.mxfp4.fit_fp8_operand``), the clamped SwiGLU in fp32 quantized to
FP8 per token and per 128 columns (Humming's rule) before GEMM2, the weighted combine in
fp32. CUDA: the decode kernels (8- or 16-token tiles, FP8 ``wgmma`` with the weights
from registers, split-K or classic grid) at every M for now (csrc/moe/mxfp4_gemm.cuh; no
prefill kernel yet). MXFP4 W4A16 is not this op: it
runs on dsv4::nvfp4_moe after ``dsv4.prepare_moe_weights(..., activation="bf16")``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _checks as C
from .. import reference
from .._ops import op
from ..formats import mxfp4_w4a8
from . import _routing

__all__ = ["Mxfp4MoeWeights", "mxfp4_moe"]


class Mxfp4MoeWeights(NamedTuple):
    """MXFP4 expert weights as dsv4::mxfp4_moe (W4A8) reads them: N padded to a multiple
    of 64 (zero rows / columns), every block fitted to the exact FP8 operand rule
    (dsv4.formats.mxfp4.fit_fp8_operand), then cut into the kernels' 64-row x 128-K tiles
    (dsv4.formats.mxfp4_w4a8: codes in MMA fragment order, one scale word per row and 128
    of K). Internal to the build that made it: prepare at load time.

    w13 uint8 [E, 2N/64, K/128, 4096], w13_scale uint8 [E, 2N/64, K/128, 256], w2 uint8
    [E, K/64, ceil(N/128), 4096], w2_scale uint8 [E, K/64, ceil(N/128), 256].
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor




def _check_mxfp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_map, swiglu_limit,
                     activation, out) -> None:
    """The rules of csrc/moe/mxfp4_moe.cu (section (a)), for the CPU and fake kernels."""
    op = "mxfp4_moe"
    M, K, _ = _routing.check_tokens(op, x, topk_ids, topk_weights)
    _, _, Kw = mxfp4_w4a8.check_w4a8_layout(op, w13, w13_scale, w2, w2_scale, _MX_HINT)
    C.same_device(op, "w13", w13, "x", x)
    if Kw != K:
        raise C.error(op, f"w13 has K = {Kw} but x has K = {K}")
    if activation != "fp8":
        raise C.error(op, f'dsv4::mxfp4_moe runs activation "fp8" (W4A8), got "{activation}" (MXFP4 W4A16 runs on '
                          'dsv4::nvfp4_moe: prepare with activation="bf16")')
    if swiglu_limit is not None and not swiglu_limit > 0:
        raise C.error(op, f"swiglu_limit must be positive, got {swiglu_limit}")
    _routing.check_map_and_out(op, x, expert_map, out, M, K)


_MX_HINT = " (pass the output of dsv4.prepare_moe_weights(..., activation='fp8'))"


@torch.library.register_fake("dsv4::mxfp4_moe")
def _(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_map, swiglu_limit, activation, ue8m0, out):
    _check_mxfp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_map, swiglu_limit, activation,
                     out)
    return None


@torch.library.impl("dsv4::mxfp4_moe", "CPU")
def _(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_map, swiglu_limit, activation, ue8m0, out):
    _check_mxfp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_map, swiglu_limit, activation,
                     out)
    w = mxfp4_w4a8.w4a8_unlayout(w13, w13_scale, w2, w2_scale)
    y = reference.mxfp4_moe(x, topk_ids, topk_weights, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"],
                            swiglu_limit=swiglu_limit, activation="fp8", ue8m0=ue8m0, expert_map=expert_map)
    out.copy_(y.to(torch.bfloat16))


def mxfp4_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Mxfp4MoeWeights,
    *,
    swiglu_limit: Optional[float] = None,
    ue8m0: bool = True,
    expert_map: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    check_ids: bool = True,
) -> torch.Tensor:
    """Routed-expert MoE with MXFP4 weights in W4A8 (no routed_scaling_factor, no shared
    expert).

    Args:
        x: bf16 [M, K] tokens (contiguous; the CUDA kernels need K % 128 == 0).
        topk_ids: [M, k] integer expert ids (int32 preferred; others are converted):
            local ids in [0, E), or global ids in [0, E_global) with ``expert_map``.
        topk_weights: [M, k] float routing weights (converted to fp32). Both made
            contiguous (the one normalisation of both MoE wrappers,
            ``dsv4.moe._routing.normalize``).
        weights: :class:`Mxfp4MoeWeights`: ``dsv4.prepare_moe_weights(...,
            activation="fp8").tensors`` (or that :class:`dsv4.MoeWeights` itself).
        swiglu_limit: L of ``silu(min(g, L)) * clamp(u, -L, L)``, or None.
        ue8m0: GEMM1's per-128 activation scales rounded up to powers of two (vLLM's
            default on Hopper, DeepSeek's reference) or plain fp32.
        expert_map: int [E_global] global -> local expert id, -1 = not on this rank
            (those slots contribute nothing); converted to contiguous int32.
        out: optional bf16 [M, K] output buffer.
        check_ids: check the id ranges on the host (one device sync; skipped while
            capturing a CUDA graph or compiling). Out-of-range ids are dropped by the
            kernels in any case.

    Returns:
        bf16 [M, K]: ``sum_j topk_weights[m, j] * expert_{topk_ids[m, j]}(x[m])``.
    """
    op_name = "mxfp4_moe"
    if getattr(weights, "format", None) == "mxfp4" and getattr(weights, "activation", None) == "fp8":
        weights = weights.tensors  # a dsv4.MoeWeights prepared for W4A8
    if not isinstance(weights, Mxfp4MoeWeights):
        raise C.type_error(op_name, "weights must be the Mxfp4MoeWeights of dsv4.prepare_moe_weights(..., "
                                    f"activation='fp8'), got {type(weights).__name__}")
    r = _routing.normalize(op_name, x, topk_ids, topk_weights, expert_map, out, weights.w13.shape[0], check_ids)
    limit = None if swiglu_limit is None else float(swiglu_limit)
    op("mxfp4_moe")(x, r.topk_ids, r.topk_weights, *weights, r.expert_map, limit, "fp8", bool(ue8m0), r.out)
    return r.out
