"""NVFP4 routed-expert MoE: ``dsv4.prepare_nvfp4_moe_weights`` and ``dsv4.nvfp4_moe``.

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
'Environment variables'). CPU: the float32 reference
(``dsv4.reference.nvfp4_moe``) on the un-prepared weights.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Optional, Union

import torch

from .. import _checks as C
from .. import formats, reference
from .._ops import op
from ..formats import mxfp4, mxfp4_w4a8
from . import modes

__all__ = [
    "Nvfp4MoeWeights", "prepare_nvfp4_moe_weights", "unprepare_nvfp4_moe_weights", "nvfp4_moe",
    "Mxfp4MoeWeights", "MoeWeights", "prepare_mxfp4_moe_weights", "prepare_moe_weights", "routed_moe",
]

_TILE = 64  # weight rows and K elements per prepared tile
_CTA_MODES = {"auto": 0, 0: 0, 1: 1, 2: 2}  # nvfp4_moe's cta_mode -> the op's int


class Nvfp4MoeWeights(NamedTuple):
    """Expert weights in the layout the dsv4 MoE kernels read (see
    :func:`prepare_nvfp4_moe_weights`). E experts, hidden K, intermediate N.

    w13: uint8 [E, 2N/64, K/64, 2048] (e2m1 code bits); w13_scale: uint8 [E, 2N/64, K/64, 256]
    (block scales re-encoded losslessly, see _encode_scales); w13_scale_2: float32 [E, 2]
    (gate, up); w2: uint8 [E, K/64, N/64, 2048]; w2_scale: uint8 [E, K/64, N/64, 256];
    w2_scale_2: float32 [E].
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_scale_2: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_scale_2: torch.Tensor


# Code tiles: a [64 rows, 64 k] tile viewed as (w, hi, g) x (j, kh, t, i) with
# row = 16w + 8hi + g and k = 16j + 8kh + 2t + i belongs to wgmma thread (w, g, t),
# k16 step j, fragment register p = 2kh + hi, element i. Thread (w, g, t) owns the 16
# bytes at 16 * (32w + 4g + t): four little-endian words, word j holding its 8 codes
# bit by bit at _BIT_POS[p][i][(m, e0, e1, s)] (csrc/moe/moe_device.cuh, dequant_kstep).
_CODE_PERM = (0, 1, 5, 2, 4, 8, 6, 7, 3, 9)  # [E,RT,w,hi,g,KT,j,kh,t,i] -> [E,RT,KT,w,g,t,j,kh,hi,i]
_SCALE_PERM = (0, 1, 5, 2, 4, 6, 3)  # [E,RT,w,hi,g,KT,j] -> [E,RT,KT,w,g,j,hi]
_BIT_POS = (
    ((6, 7, 8, 15), (22, 23, 24, 31)),    # p0: the bf16x2 pattern itself
    ((28, 29, 30, 5), (12, 13, 14, 21)),  # p1: pattern rotated right by 10
    ((25, 26, 27, 2), (9, 10, 11, 18)),   # p2: pattern rotated right by 13
    ((3, 4, 0, 1), (19, 20, 16, 17)),     # p3: the bits left over (a multiply gathers them)
)


def _inverse(perm):
    inv = [0] * len(perm)
    for pos, dim in enumerate(perm):
        inv[dim] = pos
    return tuple(inv)


def _interleave_rows(t: torch.Tensor) -> torch.Tensor:
    """[E, 2N, ...] gate rows then up rows -> per 64-row tile: 16w+8h+g = (gate|up)[32rt+8w+g]."""
    E, R = t.shape[:2]
    rest = t.shape[2:]
    return t.reshape(E, 2, R // 64, 4, 8, *rest).permute(0, 2, 3, 1, 4, *range(5, 5 + len(rest))).reshape(E, R, *rest)


def _deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    E, R = t.shape[:2]
    rest = t.shape[2:]
    return t.reshape(E, R // 64, 4, 2, 8, *rest).permute(0, 3, 1, 2, 4, *range(5, 5 + len(rest))).reshape(E, R, *rest)


def _bit_shifts(device) -> torch.Tensor:
    return torch.tensor(_BIT_POS, dtype=torch.int32, device=device).reshape(8, 4)  # [(p, i), bit]


def _tile_codes(packed: torch.Tensor, scale: torch.Tensor, interleave: bool) -> torch.Tensor:
    """[E, R, Kd/2] packed codes -> [E, R/64, Kd/64, 2048] (one expert at a time: the
    bit scatter needs 32 bytes of scratch per element)."""
    return torch.stack([_tile_codes_1(packed[e], scale[e], interleave) for e in range(packed.shape[0])])


def _tile_codes_1(packed: torch.Tensor, scale: torch.Tensor, interleave: bool) -> torch.Tensor:
    R, half = packed.shape
    kd = half * 2
    codes = formats.unpack_fp4(packed)  # [R, Kd]
    # A zero block scale makes the block's values 0 whatever its codes: store codes 0.
    zero = (scale.float() == 0).repeat_interleave(16, dim=-1)
    codes = torch.where(zero, torch.zeros_like(codes), codes)
    if interleave:
        codes = _interleave_rows(codes[None])[0]
    t = codes.reshape(1, R // 64, 4, 2, 8, kd // 64, 4, 2, 4, 2).permute(*_CODE_PERM)
    t = t.reshape(R // 64, kd // 64, 512, 8).to(torch.int32)  # [.., (w,g,t,j), (p,i)]
    bits = (t.unsqueeze(-1) >> torch.arange(4, device=t.device, dtype=torch.int32)) & 1  # [.., 8, 4]
    word = (bits << _bit_shifts(t.device)).sum(dim=(-2, -1), dtype=torch.int32)  # [.., 512]
    out = torch.stack([(word >> (8 * b)) & 0xFF for b in range(4)], dim=-1)
    return out.to(torch.uint8).reshape(R // 64, kd // 64, 2048).contiguous()


def _untile_codes(tiled: torch.Tensor, interleave: bool) -> torch.Tensor:
    return torch.stack([_untile_codes_1(tiled[e], interleave) for e in range(tiled.shape[0])])


def _untile_codes_1(tiled: torch.Tensor, interleave: bool) -> torch.Tensor:
    RT, KT, _ = tiled.shape
    b = tiled.reshape(RT, KT, 512, 4).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    bits = (word[..., None, None] >> _bit_shifts(tiled.device)) & 1  # [.., 8, 4]
    codes = (bits << torch.arange(4, device=tiled.device, dtype=torch.int32)).sum(-1)  # [.., 512, 8]
    t = codes.reshape(1, RT, KT, 4, 8, 4, 4, 2, 2, 2).permute(*_inverse(_CODE_PERM))
    codes = t.reshape(1, RT * 64, KT * 64).to(torch.uint8)
    if interleave:
        codes = _deinterleave_rows(codes)
    return formats.pack_fp4(codes[0].contiguous())


def _encode_scales(scale: torch.Tensor) -> torch.Tensor:
    """e4m3 scale -> prepared byte: 0 for 0, else (X + 10) << 3 | m for 2^X * (1 + m/8)."""
    v = scale.float()
    mant, ex = torch.frexp(v)  # v = mant * 2^ex, mant in [0.5, 1)
    m = ((mant * 2 - 1) * 8).round().to(torch.int32)
    b = ((ex - 1 + 10) << 3) | m
    return torch.where(v == 0, torch.zeros_like(b), b).to(torch.uint8)


def _decode_scales(b: torch.Tensor) -> torch.Tensor:
    bi = b.to(torch.int32)
    x = ((bi >> 3) - 10).float()
    v = torch.exp2(x) * (1 + (bi & 7).float() / 8)
    return torch.where(bi == 0, torch.zeros_like(v), v).to(torch.float8_e4m3fn)


def _tile_scales(scale: torch.Tensor, interleave: bool) -> torch.Tensor:
    E, R, kb = scale.shape
    s = _encode_scales(scale)
    if interleave:
        s = _interleave_rows(s)
    s = s.reshape(E, R // 64, 4, 2, 8, kb // 4, 4).permute(*_SCALE_PERM)
    return s.reshape(E, R // 64, kb // 4, 256).contiguous()


def _untile_scales(tiled: torch.Tensor, interleave: bool) -> torch.Tensor:
    E, RT, KT, _ = tiled.shape
    s = tiled.reshape(E, RT, KT, 4, 8, 4, 2).permute(*_inverse(_SCALE_PERM))
    s = s.reshape(E, RT * 64, KT * 4)
    if interleave:
        s = _deinterleave_rows(s)
    return _decode_scales(s.contiguous())


def _is_prepared(w13: torch.Tensor) -> bool:
    return isinstance(w13, torch.Tensor) and w13.dim() == 4


def _check_prepared(op: str, w: Nvfp4MoeWeights) -> tuple[int, int, int]:
    """Validates a prepared weight set; returns (E, N, K)."""
    hint = " (pass the output of dsv4.prepare_nvfp4_moe_weights)"
    for name in Nvfp4MoeWeights._fields:
        C.tensor(op, name, getattr(w, name))
    if w.w13.dtype != torch.uint8 or w.w13.dim() != 4 or w.w13.shape[3] != 2048:
        raise C.error(op, f"w13 must be the prepared layout uint8 [E, 2N/64, K/64, 2048]{hint}, got {w.w13.dtype} "
                          f"{tuple(w.w13.shape)}")
    E, rt, kt, _ = w.w13.shape
    N, K = rt * 32, kt * 64
    expect = {
        "w13_scale": ((E, rt, kt, 256), torch.uint8),
        "w13_scale_2": ((E, 2), torch.float32),
        "w2": ((E, K // 64, N // 64, 2048), torch.uint8),
        "w2_scale": ((E, K // 64, N // 64, 256), torch.uint8),
        "w2_scale_2": ((E,), torch.float32),
    }
    for name, (shape, dtype) in expect.items():
        t = getattr(w, name)
        C.dtype(op, name, t, dtype, note=hint)
        C.shape(op, name, t, shape, f" (the prepared layout){hint}")
    if N % 64:
        raise C.error(op, f"the intermediate size N = {N} must be a multiple of 64")
    return E, N, K


def prepare_nvfp4_moe_weights(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2) -> Nvfp4MoeWeights:
    """One-time conversion of vLLM's stacked ModelOpt NVFP4 expert weights into the
    layout the dsv4 MoE kernels read (a pure byte permutation; no value changes).

    Args (vLLM layout, docs/design.md section 2; E experts, hidden K, intermediate N;
    K and N multiples of 64):
        w13: uint8 [E, 2N, K/2] (gate rows 0..N-1, up rows N..2N-1; low nibble = even element).
        w13_scale: float8_e4m3fn [E, 2N, K/16].
        w13_scale_2: float32 [E] or [E, 2] (gate, up) global scales; with [E, 2] each
            half keeps its own (vLLM 0.33.0's ModelOpt path would use the gate's for
            both, see the module docstring).
        w2: uint8 [E, K, N/2].
        w2_scale: float8_e4m3fn [E, K, N/16].
        w2_scale_2: float32 [E].

    Returns:
        :class:`Nvfp4MoeWeights` on the same device: each projection cut into 64x64
        tiles (w13 rows interleaved per tile so gate and up of one column meet in one
        thread), tile bytes ordered as the wgmma A fragments of the consumer threads,
        code bits placed for a 1-3 instruction bf16 expansion, block scales
        re-encoded as one byte whose bf16 form is one PRMT + one IMAD away
        (csrc/moe/moe_params.cuh and moe_device.cuh document both); w13_scale_2 as
        [E, 2]. Lossless: the dequantized values are unchanged (codes of blocks whose
        scale is 0 are stored as 0, which is the same value). Block scales must be
        finite and >= 0.
        Idempotent: passing a prepared set returns it unchanged (same tensors).
        :func:`unprepare_nvfp4_moe_weights` inverts it.
        The prepared layout is internal to the dsv4 build that made it and changes with
        the kernels, without a version mark: prepare at load time (as the vLLM plugin
        does) and store checkpoints in the vLLM layout, never prepared sets.
    """
    op = "prepare_nvfp4_moe_weights"
    if _is_prepared(w13):
        w = Nvfp4MoeWeights(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
        _check_prepared(op, w)
        return w
    for name, t, dtype in (("w13", w13, torch.uint8), ("w13_scale", w13_scale, torch.float8_e4m3fn),
                           ("w2", w2, torch.uint8), ("w2_scale", w2_scale, torch.float8_e4m3fn)):
        C.tensor(op, name, t)
        if t.dtype != dtype or t.dim() != 3:
            raise C.error(op, f"{name} must be a 3-D {dtype} tensor (vLLM stacked layout), got {t.dtype} "
                              f"{tuple(t.shape)}")
    E, two_n, half_k = w13.shape
    N, K = two_n // 2, half_k * 2
    if two_n % 128 or K % 64:
        raise C.error(op, f"w13 [E, 2N, K/2] needs N and K multiples of 64, got shape {tuple(w13.shape)}")
    C.shape(op, "w13_scale", w13_scale, (E, 2 * N, K // 16), " to match w13")
    C.shape(op, "w2", w2, (E, K, N // 2), " to match w13")
    C.shape(op, "w2_scale", w2_scale, (E, K, N // 16), " to match w13")
    for name, t, shapes in (("w13_scale_2", w13_scale_2, ((E,), (E, 2))), ("w2_scale_2", w2_scale_2, ((E,),))):
        C.tensor(op, name, t)
        if t.dtype != torch.float32 or tuple(t.shape) not in shapes:
            want = " or ".join(str(list(x)) for x in shapes)
            raise C.error(op, f"{name} must be float32 {want}, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("w13_scale", w13_scale), ("w13_scale_2", w13_scale_2), ("w2", w2), ("w2_scale", w2_scale),
                    ("w2_scale_2", w2_scale_2)):
        C.same_device(op, name, t, "w13", w13)
    g13 = w13_scale_2 if w13_scale_2.dim() == 2 else w13_scale_2.unsqueeze(1).expand(E, 2)
    for name, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        v = t.float()
        if bool(((v < 0) | ~torch.isfinite(v)).any()):
            raise C.error(op, f"{name} must hold finite non-negative block scales")
    return Nvfp4MoeWeights(
        _tile_codes(w13, w13_scale, True), _tile_scales(w13_scale, True), g13.contiguous().clone(),
        _tile_codes(w2, w2_scale, False), _tile_scales(w2_scale, False), w2_scale_2.contiguous().clone())


def unprepare_nvfp4_moe_weights(weights: Nvfp4MoeWeights) -> dict:
    """Inverse of :func:`prepare_nvfp4_moe_weights`: the vLLM stacked layout
    (dict w13, w13_scale, w13_scale_2 [E, 2], w2, w2_scale, w2_scale_2)."""
    w = Nvfp4MoeWeights(*weights)
    _check_prepared("unprepare_nvfp4_moe_weights", w)
    return {
        "w13": _untile_codes(w.w13, True), "w13_scale": _untile_scales(w.w13_scale, True),
        "w13_scale_2": w.w13_scale_2, "w2": _untile_codes(w.w2, False),
        "w2_scale": _untile_scales(w.w2_scale, False), "w2_scale_2": w.w2_scale_2,
    }


# --------------------------------------------------------------------------------------
# op registrations
# --------------------------------------------------------------------------------------


def _check_tokens(op: str, x, topk_ids, topk_weights) -> tuple[int, int, int]:
    """Token and routing rules shared by the NVFP4 and MXFP4 MoE ops: (M, K, k)."""
    C.dtype(op, "x", x, torch.bfloat16)
    C.ndim(op, "x", x, 2, "[M, K]")
    M, K = x.shape
    C.same_device(op, "topk_ids", topk_ids, "x", x)
    C.dtype(op, "topk_ids", topk_ids, torch.int32)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M or topk_ids.shape[1] < 1:
        raise C.error(op, f"topk_ids must have shape [M={M}, k], got {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    C.same_device(op, "topk_weights", topk_weights, "x", x)
    C.dtype(op, "topk_weights", topk_weights, torch.float32)
    if tuple(topk_weights.shape) != (M, k):
        raise C.error(op, f"topk_weights must have shape [M={M}, k={k}] like topk_ids, got "
                          f"{tuple(topk_weights.shape)}")
    return M, K, k


def _check_map_and_out(op: str, x, expert_map, out, M: int, K: int) -> None:
    """expert_map and out: the rules the NVFP4 and MXFP4 MoE ops share."""
    if expert_map is not None:
        C.same_device(op, "expert_map", expert_map, "x", x)
        if expert_map.dtype != torch.int32 or expert_map.dim() != 1 or expert_map.numel() == 0:
            raise C.error(op, f"expert_map must be a non-empty 1-D torch.int32 tensor [E_global], got "
                              f"{expert_map.dtype} {tuple(expert_map.shape)}")
    C.same_device(op, "out", out, "x", x)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (M, K):
        raise C.error(op, f"out must be torch.bfloat16 [M={M}, K={K}], got {out.dtype} {tuple(out.shape)}")


def _check_nvfp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                     a13_scale, a2_scale, expert_map, swiglu_limit, activation, cta_mode, out) -> None:
    """The rules of csrc/moe/nvfp4_moe.cu, for the CPU and fake kernels."""
    op = "nvfp4_moe"
    M, K, _ = _check_tokens(op, x, topk_ids, topk_weights)
    w = Nvfp4MoeWeights(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
    E, _, Kw = _check_prepared(op, w)
    for name in Nvfp4MoeWeights._fields:
        C.same_device(op, name, getattr(w, name), "x", x)
    if Kw != K:
        raise C.error(op, f"w13 has K/64 = {Kw // 64} tiles but x has K = {K}")
    C.one_of(op, "activation", activation, ("bf16", "nvfp4"))
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
    _check_map_and_out(op, x, expert_map, out, M, K)


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


# --------------------------------------------------------------------------------------
# wrapper
# --------------------------------------------------------------------------------------


def _scale_tensor(s, device) -> Optional[torch.Tensor]:
    if s is None:
        return None
    if isinstance(s, torch.Tensor):
        return s.to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    return torch.tensor([float(s)], dtype=torch.float32, device=device)


def _may_sync(x: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _check_ids(op: str, topk_ids: torch.Tensor, expert_map: Optional[torch.Tensor], E: int) -> None:
    """Host check of expert ids (one device sync); the kernels drop bad ids safely."""
    if topk_ids.numel() == 0:
        return
    bound = expert_map.numel() if expert_map is not None else E
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= bound:
        what = "expert_map size" if expert_map is not None else "number of local experts"
        raise C.error(op, f"topk_ids must lie in [0, {bound}) ({what}), got values in [{lo}, {hi}]")
    if expert_map is not None and expert_map.numel():
        lo, hi = int(expert_map.min()), int(expert_map.max())
        if lo < -1 or hi >= E:
            raise C.error(op, f"expert_map values must lie in [-1, {E}), got values in [{lo}, {hi}]")


def nvfp4_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: Union[Nvfp4MoeWeights, dict, tuple],
    *,
    swiglu_limit: Optional[float] = None,
    activation: str = "bf16",
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
        topk_weights: [M, k] float routing weights (converted to fp32).
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
            (those slots contribute nothing).
        cta_mode: "auto" (0), 1 or 2: the prefill GEMM kernel. Above 24 expected
            tokens per local expert, 1 or 2 run the warp-specialized prefill kernel
            with single CTAs or with pairs of CTAs that share each token tile by
            multicast; "auto" runs it with single CTAs (pairs measured 0.97-0.99x of
            them) from 60 expected tokens per local expert and the one-warpgroup
            kernel below 60 (docs/perf-history/notebook-2026.md, nvfp4_moe). Decode sizes (up to 24)
            always run the small-batch kernels, whatever the mode.
        out: optional bf16 [M, K] output buffer.
        check_ids: check the id ranges on the host (one device sync; skipped while
            capturing a CUDA graph or compiling). Out-of-range ids are dropped by
            the kernels in any case.

    Returns:
        bf16 [M, K]: ``sum_j topk_weights[m, j] * expert_{topk_ids[m, j]}(x[m])``.
    """
    if isinstance(weights, dict):
        weights = tuple(weights[k] for k in Nvfp4MoeWeights._fields)
    if not _is_prepared(weights[0]):
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
    if topk_ids.dtype != torch.int32:
        topk_ids = topk_ids.to(torch.int32)
    if topk_weights.dtype != torch.float32:
        topk_weights = topk_weights.float()
    if expert_map is not None and expert_map.dtype != torch.int32:
        expert_map = expert_map.to(torch.int32)
    C.one_of(op_name, "activation", activation, ("bf16", "nvfp4"))
    nvfp4 = activation == "nvfp4"
    for name, s in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
        if nvfp4 and s is None:
            raise C.error(op_name, f'{name} is required when activation="nvfp4"')
        if nvfp4 and not isinstance(s, torch.Tensor):
            C.finite_positive(op_name, name, float(s))
    a13 = _scale_tensor(a13_scale, x.device) if nvfp4 else None
    a2 = _scale_tensor(a2_scale, x.device) if nvfp4 else None
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if check_ids and _may_sync(x):
        _check_ids(op_name, topk_ids, expert_map, w.w13.shape[0])
    limit = None if swiglu_limit is None else float(swiglu_limit)
    op("nvfp4_moe")(x, topk_ids.contiguous(), topk_weights.contiguous(), *w, a13, a2, expert_map, limit,
                    activation, _CTA_MODES[cta_mode], out)
    return out


# --------------------------------------------------------------------------------------
# Format-generic interface: NVFP4 and MXFP4 (DeepSeek V4's native checkpoints)
# --------------------------------------------------------------------------------------
#
# MXFP4 W4A16 ("bf16") runs on the bf16 kernels above: prepare folds each block's e8m0
# exponent into NVFP4 e4m3 block scales relative to a per-(expert, gate/up/down) fp32
# global scale (dsv4.formats.mxfp4.mxfp4_to_nvfp4; exact for every block within 17 binades of
# its matrix's largest) and calls dsv4::nvfp4_moe. MXFP4 W4A8 ("fp8", vLLM 0.33.0's
# Hopper numerics) is dsv4::mxfp4_moe: its CPU kernel is the float32 reference (on the
# un-prepared weights), its CUDA kernels (csrc/moe/mxfp4_moe.cu, mxfp4_gemm.cuh) the
# FP8 mma.sync decode GEMMs (split-K or classic grid) at every M for now (no wgmma
# prefill kernel yet).

_MOE_FORMATS = ("nvfp4", "mxfp4")


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
        C.one_of(op, "format", format, _MOE_FORMATS, note=" (or None: detect)")
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


def prepare_mxfp4_moe_weights(w13, w13_scale, w2, w2_scale, *, activation: str = modes.default_activation("mxfp4")) -> MoeWeights:
    """One-time conversion of vLLM's stacked MXFP4 expert weights (DeepSeek V4's native
    checkpoints) for the dsv4 MoE.

    Args (vLLM layout, dsv4.formats.mxfp4 module doc; K and N multiples of 32, K of 64):
        w13: uint8 [E, 2N, K/2] (gate rows, then up rows; low nibble = even element).
        w13_scale: e8m0 scales [E, 2N, K/32], torch.uint8 or torch.float8_e8m0fnu.
        w2: uint8 [E, K, N/2]; w2_scale: e8m0 [E, K, N/32].
        activation: "fp8" (W4A8, vLLM's Hopper numerics) or "bf16" (W4A16).

    N is padded to a multiple of 64 (the kernels' tile) with zero rows and columns, which
    add exactly nothing (V4.1-Flash at TP 8: 288 -> 320, as vLLM's Humming path pads it).
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
    E, N, K = mxfp4.check_mxfp4_moe_weights(w13, w13_scale, w2, w2_scale, op=op)
    if activation not in modes.ACTIVATIONS["mxfp4"]:
        raise C.error(op, f'activation must be "bf16" (W4A16) or "fp8" (W4A8) for MXFP4 weights, got {activation!r}')
    if K % _TILE:
        raise C.error(op, f"the hidden size K = {K} must be a multiple of {_TILE} (the MoE kernels' K tile)")
    if activation == "fp8" and K % mxfp4.FP8_GROUP:
        raise C.error(op, f"the hidden size K = {K} must be a multiple of {mxfp4.FP8_GROUP} for activation \"fp8\" "
                          "(the W4A8 kernels' K chunk, the activations' FP8 group)")
    p = mxfp4.pad_mxfp4_moe_weights(w13, w13_scale, w2, w2_scale, multiple=_TILE)
    Np = p["w2"].shape[2] * 2
    total = (2 * Np * K + K * Np) // mxfp4.MXFP4_BLOCK * E
    if activation == "bf16":
        c13, s13, g13, n13 = mxfp4.mxfp4_to_nvfp4(p["w13"], p["w13_scale"], halves=2, name="w13")
        c2, s2, g2, n2 = mxfp4.mxfp4_to_nvfp4(p["w2"], p["w2_scale"], halves=1, name="w2")
        report = _mxfp4_report(E, N, Np, K, activation, total, n13, n2)
        _warn_inexact(report, "expert matrix's largest block (17 binades)")
        return MoeWeights("mxfp4", "bf16", prepare_nvfp4_moe_weights(c13, s13, g13, c2, s2, g2), report)
    c13, s13, n13 = mxfp4.fit_fp8_operand(p["w13"], p["w13_scale"], name="w13")
    c2, s2, n2 = mxfp4.fit_fp8_operand(p["w2"], p["w2_scale"], name="w2")
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
        :func:`prepare_mxfp4_moe_weights` for what each does.
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
        E, N, K = _check_prepared(op, w)
        return MoeWeights("nvfp4", activation, w, {"format": "nvfp4", "activation": activation, "E": E, "N": N,
                                                   "N_padded": N, "K": K, "inexact_blocks": 0})
    if w13_scale_2 is not None or w2_scale_2 is not None:
        raise C.error(op, "MXFP4 weights have no global scales: w13_scale_2 and w2_scale_2 must be None")
    return prepare_mxfp4_moe_weights(w13, w13_scale, w2, w2_scale, activation=modes.default_activation("mxfp4") if activation is None
                                     else activation)


def _check_mxfp4_moe(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, expert_map, swiglu_limit,
                     activation, out) -> None:
    """The rules of csrc/moe/mxfp4_moe.cu, for the CPU and fake kernels."""
    op = "mxfp4_moe"
    M, K, _ = _check_tokens(op, x, topk_ids, topk_weights)
    _, _, Kw = mxfp4_w4a8.check_w4a8_layout(op, w13, w13_scale, w2, w2_scale, _MX_HINT)
    C.same_device(op, "w13", w13, "x", x)
    if Kw != K:
        raise C.error(op, f"w13 has K/128 = {Kw // 128} chunks but x has K = {K}")
    if activation != "fp8":
        raise C.error(op, f'dsv4::mxfp4_moe runs activation "fp8" (W4A8), got "{activation}" (MXFP4 W4A16 runs on '
                          'dsv4::nvfp4_moe: prepare with activation="bf16")')
    if swiglu_limit is not None and not swiglu_limit > 0:
        raise C.error(op, f"swiglu_limit must be positive, got {swiglu_limit}")
    _check_map_and_out(op, x, expert_map, out, M, K)


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
    if fmt not in _MOE_FORMATS or activation not in modes.ACTIVATIONS[fmt]:
        raise C.error(op_name, f"weights prepared as format {fmt!r}, activation {activation!r}: not a supported pair")
    if activation != "nvfp4" and (a13_scale is not None or a2_scale is not None):
        raise C.error(op_name, f'a13_scale / a2_scale are the NVFP4 activation scales of activation "nvfp4"; these '
                               f'weights run "{activation}"')
    if activation != "fp8":
        return nvfp4_moe(x, topk_ids, topk_weights, weights.tensors, swiglu_limit=swiglu_limit,
                         activation=activation, a13_scale=a13_scale, a2_scale=a2_scale, expert_map=expert_map,
                         cta_mode=cta_mode, out=out, check_ids=check_ids)
    w = weights.tensors
    if topk_ids.dtype != torch.int32:
        topk_ids = topk_ids.to(torch.int32)
    if topk_weights.dtype != torch.float32:
        topk_weights = topk_weights.float()
    if expert_map is not None and expert_map.dtype != torch.int32:
        expert_map = expert_map.to(torch.int32)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if check_ids and _may_sync(x):
        _check_ids("mxfp4_moe", topk_ids, expert_map, w.w13.shape[0])
    limit = None if swiglu_limit is None else float(swiglu_limit)
    op("mxfp4_moe")(x, topk_ids.contiguous(), topk_weights.contiguous(), *w, expert_map, limit, "fp8", bool(ue8m0),
                    out)
    return out
