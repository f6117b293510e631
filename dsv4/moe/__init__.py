"""The routed-expert MoE of DeepSeek V4 for NVFP4 and MXFP4 (DeepSeek's native) expert
weights: one prepare step (:func:`prepare_moe_weights` -> :class:`MoeWeights`) and one
call (:func:`routed_moe`) that dispatches to the op of the weights' format and activation
mode (the one table of those: ``dsv4.moe.modes``):

* NVFP4, "bf16" (W4A16) or "nvfp4" (W4A4): :func:`dsv4.nvfp4_moe` (``dsv4.moe.nvfp4``,
  op dsv4::nvfp4_moe, csrc/moe/nvfp4_moe.cu), N padded with zeros to the kernels' 64-row
  tile (``dsv4.formats.nvfp4_moe_layout.pad_nvfp4_moe_weights``; 288 -> 320);
* MXFP4, "fp8" (W4A8, vLLM 0.33.0's Hopper numerics): :func:`dsv4.mxfp4_moe`
  (``dsv4.moe.mxfp4``, op dsv4::mxfp4_moe, csrc/moe/mxfp4_moe.cu);
* MXFP4, "bf16" (W4A16): prepare folds each block's e8m0 exponent into NVFP4 e4m3 block
  scales relative to a per-(expert, gate/up/down) fp32 global scale
  (``dsv4.formats.mxfp4.mxfp4_to_nvfp4``; exact for every block within 17 binades of its
  matrix's largest), then it runs on dsv4::nvfp4_moe.

Both op wrappers normalise the routing arguments the same way (``dsv4.moe._routing``:
int32 ids and map, float32 weights, contiguous, ``out`` allocated, ids checked on the
host when a sync is allowed). The prepared NVFP4 tile layout is
``dsv4.formats.nvfp4_moe_layout``.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional, Union

import torch

from .. import _checks as C
from ..formats import mxfp4 as mxfp4_format
from ..formats import mxfp4_w4a8
from ..formats.nvfp4_moe_layout import (
    TILE,
    Nvfp4MoeWeights,
    check_prepared,
    prepare_nvfp4_moe_weights,
    unprepare_nvfp4_moe_weights,
)
from . import modes
from .mxfp4 import Mxfp4MoeWeights, mxfp4_moe
from .nvfp4 import nvfp4_moe

__all__ = [
    "Nvfp4MoeWeights", "prepare_nvfp4_moe_weights", "unprepare_nvfp4_moe_weights", "nvfp4_moe",
    "Mxfp4MoeWeights", "mxfp4_moe", "MoeWeights", "prepare_mxfp4_moe_weights", "prepare_moe_weights", "routed_moe",
]


class MoeWeights(NamedTuple):
    """Routed-expert weights prepared by :func:`prepare_moe_weights`.

    format: "nvfp4" or "mxfp4" (the checkpoint's). activation: the activation mode these
    tensors serve ("bf16" or "nvfp4" for NVFP4 (the same tensors serve both), "bf16" or
    "fp8" for MXFP4). tensors: :class:`Nvfp4MoeWeights` (NVFP4, and MXFP4 for "bf16") or
    :class:`Mxfp4MoeWeights` (MXFP4 for "fp8"). report: what prepare did (dict: shapes,
    padding, blocks that could not be folded exactly and were re-rounded).
    """

    format: str
    activation: str
    tensors: tuple
    report: dict


def _detect_format(op: str, w13_scale, format) -> str:
    if format is not None:
        C.one_of(op, "format", format, tuple(modes.ACTIVATIONS), note=" (or None: detect)")
        return format
    if isinstance(w13_scale, torch.Tensor):
        if w13_scale.dtype == torch.float8_e4m3fn:
            return "nvfp4"
        if w13_scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
            return "mxfp4"
    got = w13_scale.dtype if isinstance(w13_scale, torch.Tensor) else type(w13_scale).__name__
    raise C.error(op, "cannot tell the weight format from w13_scale: float8_e4m3fn block scales are NVFP4, "
                      f"uint8 / float8_e8m0fnu ones MXFP4; got {got} (or pass format=)")


def _mxfp4_report(E, N, Np, K, activation, total, inexact13, inexact2) -> dict:
    return {"format": "mxfp4", "activation": activation, "E": E, "N": N, "N_padded": Np, "K": K,
            "blocks": total, "inexact_blocks": inexact13 + inexact2, "w13_inexact_blocks": inexact13,
            "w2_inexact_blocks": inexact2}


def _warn_inexact(report: dict, what: str) -> None:
    if report["inexact_blocks"]:
        warnings.warn(f"dsv4: {report['inexact_blocks']} of {report['blocks']} MXFP4 blocks lie too far below "
                      f"their {what} to be folded exactly and were re-rounded (prepare report: "
                      f"w13 {report['w13_inexact_blocks']}, w2 {report['w2_inexact_blocks']})", stacklevel=3)


def prepare_mxfp4_moe_weights(w13, w13_scale, w2, w2_scale, *,
                              activation: str = modes.default_activation("mxfp4")) -> MoeWeights:
    """One-time conversion of vLLM's stacked MXFP4 expert weights (DeepSeek V4's native
    checkpoints) for the dsv4 MoE.

    Args (vLLM layout, dsv4.formats.mxfp4 module doc; K and N multiples of 32, K of 64):
        w13: uint8 [E, 2N, K/2] (gate rows, then up rows; low nibble = even element).
        w13_scale: e8m0 scales [E, 2N, K/32], torch.uint8 or torch.float8_e8m0fnu.
        w2: uint8 [E, K, N/2]; w2_scale: e8m0 [E, K, N/32].
        activation: "fp8" (W4A8, vLLM's Hopper numerics) or "bf16" (W4A16).

    N is padded with zero rows and columns, which add exactly nothing, to a multiple of 64
    for "bf16" (the NVFP4 kernels' tile; V4.1-Flash at TP 8: 288 -> 320, as vLLM's Humming
    path pads it) and of 32 for "fp8" (dsv4.formats.mxfp4_w4a8.N_MULTIPLE: 288 stays 288,
    nine 64-row GEMM1 tiles instead of ten).
    "bf16": the NVFP4 layout of the same values (dsv4.formats.mxfp4.mxfp4_to_nvfp4), prepared for
    the bf16 kernels. "fp8": every block fitted to the FP8 operand rule
    (dsv4.formats.mxfp4.fit_fp8_operand), then tiled for the W4A8 kernels
    (dsv4.formats.mxfp4_w4a8.w4a8_layout). Blocks too far below their matrix's (bf16) or
    their 128 elements' (fp8) largest block to be folded exactly are re-rounded, counted
    in ``report`` and warned about once (none in real checkpoints' nonzero blocks so far).

    Returns:
        :class:`MoeWeights` (format "mxfp4"). Scale bytes 255 (NaN) raise.
    """
    op = "prepare_mxfp4_moe_weights"
    E, N, K = mxfp4_format.check_mxfp4_moe_weights(w13, w13_scale, w2, w2_scale, op=op)
    if activation not in modes.ACTIVATIONS["mxfp4"]:
        raise C.error(op, f'activation must be "bf16" (W4A16) or "fp8" (W4A8) for MXFP4 weights, got {activation!r}')
    if K % TILE:
        raise C.error(op, f"the hidden size K = {K} must be a multiple of {TILE} (the MoE kernels' K tile)")
    if activation == "fp8" and K % mxfp4_format.FP8_GROUP:
        raise C.error(op, f"the hidden size K = {K} must be a multiple of {mxfp4_format.FP8_GROUP} for activation "
                          "\"fp8\" (the W4A8 kernels' K chunk, the activations' FP8 group)")
    p = mxfp4_format.pad_mxfp4_moe_weights(w13, w13_scale, w2, w2_scale,
                                           multiple=TILE if activation == "bf16" else mxfp4_w4a8.N_MULTIPLE)
    Np = p["w2"].shape[2] * 2
    total = (2 * Np * K + K * Np) // mxfp4_format.MXFP4_BLOCK * E
    if activation == "bf16":
        c13, s13, g13, n13 = mxfp4_format.mxfp4_to_nvfp4(p["w13"], p["w13_scale"], halves=2, name="w13")
        c2, s2, g2, n2 = mxfp4_format.mxfp4_to_nvfp4(p["w2"], p["w2_scale"], halves=1, name="w2")
        report = _mxfp4_report(E, N, Np, K, activation, total, n13, n2)
        _warn_inexact(report, "expert matrix's largest block (17 binades)")
        return MoeWeights("mxfp4", "bf16", prepare_nvfp4_moe_weights(c13, s13, g13, c2, s2, g2), report)
    c13, s13, n13 = mxfp4_format.fit_fp8_operand(p["w13"], p["w13_scale"], name="w13")
    c2, s2, n2 = mxfp4_format.fit_fp8_operand(p["w2"], p["w2_scale"], name="w2")
    report = _mxfp4_report(E, N, Np, K, activation, total, n13, n2)
    _warn_inexact(report, "128 elements' largest block (14 binades)")
    return MoeWeights("mxfp4", "fp8", Mxfp4MoeWeights(*mxfp4_w4a8.w4a8_layout(c13, s13, c2, s2)), report)


def prepare_moe_weights(w13, w13_scale, w2, w2_scale, *, w13_scale_2=None, w2_scale_2=None,
                        format: Optional[str] = None, activation: Optional[str] = None) -> MoeWeights:
    """One prepare step for routed-expert weights of any supported format (vLLM's
    stacked layout), to be called once at load time; the result goes to :func:`routed_moe`.

    Args:
        w13, w13_scale, w2, w2_scale: the stacked tensors of either format (NVFP4:
            float8_e4m3fn block scales per 16; MXFP4: e8m0 ones per 32, uint8 or
            float8_e8m0fnu).
        w13_scale_2, w2_scale_2: NVFP4 global scales ([E] or [E, 2]; [E]); must be None
            for MXFP4.
        format: "nvfp4", "mxfp4", or None to tell from w13_scale's dtype.
        activation: the mode the weights will run in. NVFP4: "bf16" or "nvfp4" (one
            layout serves both; default "bf16"). MXFP4: "fp8" (default, W4A8) or "bf16".

    Returns:
        :class:`MoeWeights`. See :func:`prepare_nvfp4_moe_weights` and
        :func:`prepare_mxfp4_moe_weights` for what each does. Both pad N with zeros where
        their kernels need it (``report``: "N" as given, "N_padded" as prepared).
    """
    op = "prepare_moe_weights"
    fmt = _detect_format(op, w13_scale, format)
    if fmt == "nvfp4":
        if w13_scale_2 is None or w2_scale_2 is None:
            raise C.error(op, "NVFP4 weights need w13_scale_2 and w2_scale_2 (the global scales)")
        activation = modes.default_activation("nvfp4") if activation is None else activation
        if activation not in modes.ACTIVATIONS["nvfp4"]:
            raise C.error(op, f'activation must be "bf16" (W4A16) or "nvfp4" (W4A4) for NVFP4 weights, got '
                              f'{activation!r}')
        w = prepare_nvfp4_moe_weights(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
        E, Np, K = check_prepared(op, w)
        N = Np if w.w13 is w13 else w13.shape[1] // 2  # a prepared set came in: only its padded N is known
        return MoeWeights("nvfp4", activation, w, {"format": "nvfp4", "activation": activation, "E": E, "N": N,
                                                   "N_padded": Np, "K": K, "inexact_blocks": 0})
    if w13_scale_2 is not None or w2_scale_2 is not None:
        raise C.error(op, "MXFP4 weights have no global scales: w13_scale_2 and w2_scale_2 must be None")
    if activation is None:
        activation = modes.default_activation("mxfp4")
    return prepare_mxfp4_moe_weights(w13, w13_scale, w2, w2_scale, activation=activation)


def routed_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoeWeights,
    *,
    swiglu_limit: Optional[float] = None,
    ue8m0: bool = True,
    a13_scale: Union[float, torch.Tensor, None] = None,
    a2_scale: Union[float, torch.Tensor, None] = None,
    expert_map: Optional[torch.Tensor] = None,
    cta_mode: Union[str, int] = "auto",
    out: Optional[torch.Tensor] = None,
    check_ids: bool = True,
) -> torch.Tensor:
    """Routed-expert MoE for weights of any format, in the activation mode they were
    prepared for (``weights.activation``); no routed_scaling_factor, no shared expert.
    Dispatches to :func:`nvfp4_moe` (NVFP4, and MXFP4 "bf16") or :func:`mxfp4_moe`
    (MXFP4 "fp8"), which normalise the routing arguments alike.

    Args:
        x, topk_ids, topk_weights, swiglu_limit, expert_map, out, check_ids: as
            :func:`nvfp4_moe`.
        weights: :class:`MoeWeights` from :func:`prepare_moe_weights`.
        ue8m0: MXFP4 "fp8" mode: GEMM1's per-128 activation scales rounded up to powers
            of two (vLLM's default on Hopper, DeepSeek's reference) or plain fp32.
        a13_scale, a2_scale: NVFP4 "nvfp4" mode only (see :func:`nvfp4_moe`).
        cta_mode: the bf16 / nvfp4 kernels' prefill mode (see :func:`nvfp4_moe`).

    Returns:
        bf16 [M, K]: ``sum_j topk_weights[m, j] * expert_{topk_ids[m, j]}(x[m])``.
    """
    op_name = "routed_moe"
    if not isinstance(weights, MoeWeights):
        raise C.error(op_name, "weights must be the MoeWeights that dsv4.prepare_moe_weights returns, got "
                               f"{type(weights).__name__} (dsv4.nvfp4_moe takes Nvfp4MoeWeights)")
    fmt, activation = weights.format, weights.activation
    if fmt not in modes.ACTIVATIONS or activation not in modes.ACTIVATIONS[fmt]:
        raise C.error(op_name, f"weights prepared as format {fmt!r}, activation {activation!r}: not a supported pair")
    if activation != "nvfp4" and (a13_scale is not None or a2_scale is not None):
        raise C.error(op_name, f'a13_scale / a2_scale are the NVFP4 activation scales of activation "nvfp4"; these '
                               f'weights run "{activation}"')
    if activation != "fp8":
        return nvfp4_moe(x, topk_ids, topk_weights, weights.tensors, swiglu_limit=swiglu_limit,
                         activation=activation, a13_scale=a13_scale, a2_scale=a2_scale, expert_map=expert_map,
                         cta_mode=cta_mode, out=out, check_ids=check_ids)
    return mxfp4_moe(x, topk_ids, topk_weights, weights.tensors, swiglu_limit=swiglu_limit, ue8m0=ue8m0,
                     expert_map=expert_map, out=out, check_ids=check_ids)
