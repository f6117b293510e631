"""dsv4::nvfp4_moe (CUDA: csrc/moe/nvfp4_moe.cu): the routed-expert MoE with NVFP4
weights. Its argument rules (the CPU and fake kernels check what the C++ entry checks),
fake kernel, CPU kernel (the float32 reference ``dsv4.reference.nvfp4_moe`` on the
un-prepared weights) and the wrapper :func:`nvfp4_moe`. The prepared weight layout is
``dsv4.formats.nvfp4_moe_layout`` (:func:`prepare_nvfp4_moe_weights`).

Math (docs/design.md sections 1-3): per token m and slot j with local expert e,
``y = W2_e @ swiglu(W1_e x, W3_e x)`` with ``swiglu(g, u) = silu(min(g, L)) *
clamp(u, -L, L)`` (L = swiglu_limit; plain ``silu(g) * u`` without it), and
``out[m] = sum_j topk_weights[m, j] * y``. Weights are NVFP4 (e2m1 codes, e4m3
scales per 16 along K, fp32 global scale per expert). Two activation modes:

* ``"bf16"`` (W4A16): activations stay bf16; weights are dequantized exactly to bf16.
* ``"nvfp4"`` (W4A4, the numerics of a Blackwell deployment): x is quantized to
  NVFP4 with ``a13_scale`` (per expert or one value) before GEMM1, and the SwiGLU
  output is quantized with ``a2_scale`` before GEMM2, with the rule of
  ``dsv4.reference.quantize_nvfp4`` (docs/design.md section 2); the CUDA kernels use
  ``rcp.approx`` reciprocals as Blackwell does, so a code can differ from the CPU
  reference's where its product lies within an ulp or so of a rounding tie.

Gate and up global scales: ``w13_scale_2`` may be [E, 2] (ModelOpt stores a
``weight_scale_2`` for w1 and one for w3); dsv4 dequantizes the gate rows with column
0 and the up rows with column 1, on every path. vLLM 0.33.0's ModelOpt NVFP4 MoE
(``ModelOptNvFp4FusedMoE.process_weights_after_loading``) warns and uses the gate's
scale for both halves, so for a checkpoint whose halves differ dsv4's output is the
correct one and differs from vLLM's.

CUDA (sm_90a): routing prep, a gather (NVFP4-quantizing in nvfp4 mode; in bf16 mode
at decode sizes GEMM1 reads x itself), grouped GEMM1 with the clamped-SwiGLU (+ NVFP4)
epilogue, grouped GEMM2, and a deterministic weighted combine; weights are the 64-row
MMA A operand, dequantized e2m1 -> bf16 in registers (warp-level mma.sync for decode tiles
of 8 or 16 tokens, wgmma for larger ones); tokens are the N operand. When the GEMM grid
would not fill the GPU once (few tokens), the GEMMs run split-K on a persistent grid
(deterministic fixup). Prefill sizes run a warp-specialized persistent kernel (a
bulk-copy producer, three dequantizing consumer warpgroups sharing each token tile,
optionally 2-CTA clusters multicasting it). No host sync, no value-dependent
allocation: CUDA-graph capturable. Development overrides of the kernel choice for A/B
runs and tests, read once per process: DSV4_MOE_SPLITK, DSV4_MOE_PDL, DSV4_MOE_DIRECT_X,
DSV4_MOE_WS = 0/1, and DSV4_PRINT_CONFIG=1 prints each call's choice (README.md,
'Environment variables').
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Union

import torch

from .. import _checks as C
from .. import reference
from .._ops import op
from ..formats.nvfp4_moe_layout import (
    Nvfp4MoeWeights,
    check_prepared,
    is_prepared,
    prepare_nvfp4_moe_weights,
    unprepare_nvfp4_moe_weights,
)
from . import _routing, modes

__all__ = ["nvfp4_moe"]

_CTA_MODES = {"auto": 0, 0: 0, 1: 1, 2: 2}  # nvfp4_moe's cta_mode -> the op's int


def _check_nvfp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                     a13_scale, a2_scale, expert_map, swiglu_limit, activation, cta_mode, out) -> None:
    """The rules of csrc/moe/nvfp4_moe.cu (section (a)), for the CPU and fake kernels."""
    op = "nvfp4_moe"
    M, K, _ = _routing.check_tokens(op, x, topk_ids, topk_weights)
    w = Nvfp4MoeWeights(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
    E, _, Kw = check_prepared(op, w)
    for name in Nvfp4MoeWeights._fields:
        C.same_device(op, name, getattr(w, name), "x", x)
    if Kw != K:
        raise C.error(op, f"w13 has K/64 = {Kw // 64} tiles but x has K = {K}")
    C.one_of(op, "activation", activation, modes.ACTIVATIONS["nvfp4"])
    if activation == "nvfp4":
        for name, s in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
            if s is None:
                raise C.error(op, f'{name} is required when activation="nvfp4"')
            C.same_device(op, name, s, "x", x)
            C.dtype(op, name, s, torch.float32)
            if not (s.numel() == 1 or tuple(s.shape) == (E,)):
                raise C.error(op, f"{name} must hold 1 element or have shape [{E}] (one per local expert), got "
                                  f"shape {tuple(s.shape)}")
    if swiglu_limit is not None and not (math.isfinite(swiglu_limit) and swiglu_limit > 0):
        raise C.error(op, f"swiglu_limit must be positive and finite, got {swiglu_limit}")
    if cta_mode not in (0, 1, 2):
        raise C.error(op, f"cta_mode must be 0 (auto), 1 or 2, got {cta_mode}")
    _routing.check_map_and_out(op, x, expert_map, out, M, K)


@torch.library.register_fake("dsv4::nvfp4_moe")
def _(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, a13_scale, a2_scale,
      expert_map, swiglu_limit, activation, cta_mode, out):
    _check_nvfp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, a13_scale,
                     a2_scale, expert_map, swiglu_limit, activation, cta_mode, out)
    return None


@torch.library.impl("dsv4::nvfp4_moe", "CPU")
def _(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, a13_scale, a2_scale,
      expert_map, swiglu_limit, activation, cta_mode, out):
    _check_nvfp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, a13_scale,
                     a2_scale, expert_map, swiglu_limit, activation, cta_mode, out)
    if activation == "nvfp4":
        # the values, on the CPU only (on CUDA reading them would be a device sync)
        C.finite_positive_values("nvfp4_moe", "a13_scale", a13_scale)
        C.finite_positive_values("nvfp4_moe", "a2_scale", a2_scale)
    w = unprepare_nvfp4_moe_weights(Nvfp4MoeWeights(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2))
    y = reference.nvfp4_moe(
        x, topk_ids, topk_weights, w["w13"], w["w13_scale"], w["w13_scale_2"], w["w2"], w["w2_scale"],
        w["w2_scale_2"], swiglu_limit=swiglu_limit, activation=activation,
        a13_scale=a13_scale if activation == "nvfp4" else None,
        a2_scale=a2_scale if activation == "nvfp4" else None, expert_map=expert_map)
    out.copy_(y.to(torch.bfloat16))


def _scale_tensor(s, device) -> Optional[torch.Tensor]:
    if s is None:
        return None
    if isinstance(s, torch.Tensor):
        return s.to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    return torch.tensor([float(s)], dtype=torch.float32, device=device)


def nvfp4_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Union[Nvfp4MoeWeights, dict, tuple],
    *,
    swiglu_limit: Optional[float] = None,
    activation: str = modes.default_activation("nvfp4"),
    a13_scale: Union[float, torch.Tensor, None] = None,
    a2_scale: Union[float, torch.Tensor, None] = None,
    expert_map: Optional[torch.Tensor] = None,
    cta_mode: Union[str, int] = "auto",
    out: Optional[torch.Tensor] = None,
    check_ids: bool = True,
) -> torch.Tensor:
    """Routed-expert MoE with NVFP4 weights (no routed_scaling_factor, no shared expert).

    Args:
        x: bf16 [M, K] tokens (contiguous).
        topk_ids: [M, k] integer expert ids (int32 preferred; others are converted):
            local ids in [0, E), or global ids in [0, E_global) with ``expert_map``.
        topk_weights: [M, k] float routing weights (converted to fp32). Both made
            contiguous (the one normalisation of both MoE wrappers,
            ``dsv4.moe._routing.normalize``).
        weights: :class:`Nvfp4MoeWeights` from :func:`prepare_nvfp4_moe_weights`
            (prepare once at load time). A vLLM-layout dict/tuple is accepted too and
            prepared on every call (slow).
        swiglu_limit: L of ``silu(min(g, L)) * clamp(u, -L, L)``, or None.
        activation: "bf16" (W4A16) or "nvfp4" (W4A4).
        a13_scale, a2_scale: NVFP4 activation global (dequant) scales of GEMM1's input
            and GEMM2's input (the checkpoint's ``input_scale``): a float, or an fp32
            tensor with 1 element or [E] (per local expert). Required for "nvfp4".
            Finite and > 0: a float is checked on the host, a tensor's values only on
            CPU (a check on CUDA would need a device sync); there 0, a negative value,
            inf or NaN give block scales that do not encode the activations
            (saturated, zero, negative or NaN; see ``dsv4.quantize_nvfp4``), so the
            output is meaningless, never an error.
        expert_map: int [E_global] global -> local expert id, -1 = not on this rank
            (those slots contribute nothing); converted to contiguous int32.
        cta_mode: "auto" (0), 1 or 2: the prefill GEMM kernel. At 64-token tiles (above
            20 expected tokens per local expert, 36 where N <= 512), 1 or 2 run the
            warp-specialized prefill kernel with single CTAs or with pairs of CTAs
            that share each token tile by multicast; "auto" runs it with single CTAs
            (pairs measured 0.97-0.99x of them) from 60 expected tokens per local
            expert and the one-warpgroup kernel below 60
            (docs/perf-history/2026-11-30-nvfp4-moe-prefill-ws.md). Smaller sizes
            always run the 8- and 16-token kernels, whatever the mode.
        out: optional bf16 [M, K] output buffer.
        check_ids: check the id ranges on the host (one device sync; skipped while
            capturing a CUDA graph or compiling). Out-of-range ids are dropped by
            the kernels in any case.

    Returns:
        bf16 [M, K]: ``sum_j topk_weights[m, j] * expert_{topk_ids[m, j]}(x[m])``.
    """
    if isinstance(weights, dict):
        weights = tuple(weights[k] for k in Nvfp4MoeWeights._fields)
    if not is_prepared(weights[0]):
        # converting the whole expert set on every call is a large hidden cost
        warnings.warn(
            "dsv4.nvfp4_moe got weights in vLLM's stacked layout and converts them on every "
            "call; call dsv4.prepare_nvfp4_moe_weights once at load time instead",
            stacklevel=2,
        )
    w = weights if isinstance(weights, Nvfp4MoeWeights) else prepare_nvfp4_moe_weights(*weights)
    op_name = "nvfp4_moe"
    if cta_mode not in _CTA_MODES:
        raise C.error(op_name, f'cta_mode must be "auto", 1 or 2, got {cta_mode!r}')
    C.one_of(op_name, "activation", activation, modes.ACTIVATIONS["nvfp4"])
    nvfp4 = activation == "nvfp4"
    for name, s in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
        if nvfp4 and s is None:
            raise C.error(op_name, f'{name} is required when activation="nvfp4"')
        if nvfp4 and not isinstance(s, torch.Tensor):
            C.finite_positive(op_name, name, float(s))
    r = _routing.normalize(op_name, x, topk_ids, topk_weights, expert_map, out, w.w13.shape[0], check_ids)
    a13 = _scale_tensor(a13_scale, x.device) if nvfp4 else None
    a2 = _scale_tensor(a2_scale, x.device) if nvfp4 else None
    limit = None if swiglu_limit is None else float(swiglu_limit)
    op("nvfp4_moe")(x, r.topk_ids, r.topk_weights, *w, a13, a2, r.expert_map, limit, activation,
                    _CTA_MODES[cta_mode], r.out)
    return r.out
