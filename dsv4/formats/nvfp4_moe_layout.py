"""The prepared NVFP4 MoE layout: the byte permutation that
:func:`prepare_nvfp4_moe_weights` applies once at load to vLLM's stacked ModelOpt NVFP4
expert weights (``dsv4.formats.nvfp4``), so that dsv4::nvfp4_moe's kernels read each
thread's MMA A fragments with one 16-byte load and dequantize them in 1-3 integer
instructions per element pair; :func:`unprepare_nvfp4_moe_weights` inverts it.

Layout (csrc/moe/params.cuh has the same in the kernels' terms; the bit placement of
``_BIT_POS`` is what ``dequant_kstep`` in csrc/moe/dequant.cuh expands):

* each projection (w13: 2N rows over K; w2: K rows over N) cut into 64 x 64 tiles,
  ``[E, R/64, Kd/64, 2048]`` code bytes and ``[E, R/64, Kd/64, 256]`` scale bytes;
* w13 rows interleaved per tile so that gate and up of one intermediate column meet in
  one thread: tile row 16w + r is gate row 32rt + 8w + r for r < 8, up row
  32rt + 8w + r - 8 otherwise;
* code bytes in A-fragment order: thread (w, g, t) of the warpgroup owns the 16 bytes at
  16 * (32w + 4g + t), one little-endian word per k16 step, its 8 codes bit by bit at
  ``_BIT_POS``; codes of blocks whose scale is 0 are stored as 0 (the same values);
* block scales re-encoded as one byte each: 0 for 0, else ``(X + 10) << 3 | m`` for
  ``2^X * (1 + m/8)`` (lossless for every e4m3 value >= 0), thread (w, g) reading 8 bytes
  at 8 * (8w + g), byte 2j the scale of row 16w + g, byte 2j + 1 of row 16w + g + 8;
* w13_scale_2 as float32 [E, 2] (gate, up);
* N padded first to a multiple of 64 (:func:`pad_nvfp4_moe_weights`: zero gate rows after
  row N-1, zero up rows after row 2N-1, zero w2 columns; V4.1-Flash at tensor parallel 8:
  288 -> 320), which adds exactly nothing to the op's output; K must be a multiple of 64.

The layout belongs to the dsv4 build that made it (no version mark): prepare at load
time and store checkpoints in the vLLM layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _checks as C
from .nvfp4 import NVFP4_BLOCK, pack_fp4, pad_columns, pad_gate_up_rows, unpack_fp4

__all__ = ["Nvfp4MoeWeights", "prepare_nvfp4_moe_weights", "unprepare_nvfp4_moe_weights", "pad_nvfp4_moe_weights",
           "is_prepared", "check_prepared", "TILE"]

TILE = 64  # weight rows and K elements per prepared tile (csrc/moe/params.cuh kTileRows, kTileK)


class Nvfp4MoeWeights(NamedTuple):
    """Expert weights in the layout the dsv4 MoE kernels read (see
    :func:`prepare_nvfp4_moe_weights`). E experts, hidden K, intermediate N (the padded
    one, a multiple of 64: :func:`pad_nvfp4_moe_weights`).

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
# bit by bit at _BIT_POS[p][i][(m, e0, e1, s)] (csrc/moe/dequant.cuh, dequant_kstep).
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
    codes = unpack_fp4(packed)  # [R, Kd]
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
    return pack_fp4(codes[0].contiguous())


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


def is_prepared(w13: torch.Tensor) -> bool:
    return isinstance(w13, torch.Tensor) and w13.dim() == 4


def check_prepared(op: str, w: Nvfp4MoeWeights) -> tuple[int, int, int]:
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
    if N % TILE:
        raise C.error(op, f"the intermediate size N = {N} must be a multiple of {TILE} (pass the output of "
                          "dsv4.prepare_nvfp4_moe_weights, which pads it)")
    return E, N, K


def _check_stacked(op: str, w13, w13_scale, w2, w2_scale) -> tuple[int, int, int]:
    """Validates vLLM's stacked NVFP4 expert codes and block scales (dsv4.formats.nvfp4:
    w13 uint8 [E, 2N, K/2], w13_scale float8_e4m3fn [E, 2N, K/16], w2 uint8 [E, K, N/2],
    w2_scale float8_e4m3fn [E, K, N/16]; N and K positive multiples of 16, the NVFP4
    block); returns (E, N, K). ``op``: the caller, named in the errors."""
    for name, t, dtype in (("w13", w13, torch.uint8), ("w13_scale", w13_scale, torch.float8_e4m3fn),
                           ("w2", w2, torch.uint8), ("w2_scale", w2_scale, torch.float8_e4m3fn)):
        C.tensor(op, name, t)
        if t.dtype != dtype or t.dim() != 3:
            raise C.error(op, f"{name} must be a 3-D {dtype} tensor (vLLM stacked layout), got {t.dtype} "
                              f"{tuple(t.shape)}")
    E, two_n, half_k = w13.shape
    N, K = two_n // 2, half_k * 2
    if two_n % 2 or N == 0 or N % NVFP4_BLOCK or K == 0 or K % NVFP4_BLOCK:
        raise C.error(op, f"w13 [E, 2N, K/2] needs the intermediate size N and the hidden size K to be positive "
                          f"multiples of {NVFP4_BLOCK} (the NVFP4 block), got shape {tuple(w13.shape)} "
                          f"(2N = {two_n}, K = {K})")
    note = f" to match w13 {list(w13.shape)} (E = {E}, N = {N}, K = {K})"
    C.shape(op, "w13_scale", w13_scale, (E, 2 * N, K // NVFP4_BLOCK), note)
    C.shape(op, "w2", w2, (E, K, N // 2), note)
    C.shape(op, "w2_scale", w2_scale, (E, K, N // NVFP4_BLOCK), note)
    for name, t in (("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        C.same_device(op, name, t, "w13", w13)
    return E, N, K


def pad_nvfp4_moe_weights(w13, w13_scale, w2, w2_scale, multiple: int = TILE) -> dict:
    """Pads vLLM's stacked NVFP4 expert weights from intermediate size N to the next
    multiple of ``multiple`` (default :data:`TILE`, the kernels' 64-row tile; V4.1-Flash
    at tensor parallel 8: N = 2304 / 8 = 288 -> 320), as
    ``dsv4.formats.mxfp4.pad_mxfp4_moe_weights`` does for MXFP4: gate rows N..Np-1 and
    up rows N..Np-1 of w13 (each half padded at its end), columns N..Np-1 of w2.

    Padded elements get code 0 (+0.0) and block scale 0 (e4m3 byte 0x00, +0.0): their
    value ``0 * scale * g`` is 0 for any finite global scale g, so the global scales
    (``w13_scale_2``, ``w2_scale_2``) need no change and are not taken. Scale 0 rather
    than some nonzero scale: a zero code is 0 under any finite scale anyway, and 0 is what
    vLLM's zero-filled padded parameters hold, what prepare already reads as "this block
    is zero" (its codes stored as 0, scale byte 0, decoded by the kernels as 0:
    csrc/moe/dequant.cuh) and what no scale statistic can mistake for a real block.

    Exact: a padded intermediate column j computes gate = up = 0, so ``swiglu(0, 0) =
    silu(min(0, L)) * clamp(0, -L, L) = 0``; in W4A4 its NVFP4 blocks (N and Np multiples
    of 16) are whole zero blocks (scale 0, codes 0) and the real blocks are unchanged;
    GEMM2 multiplies it by the zero column j of w2. The output [M, K] is the unpadded
    math's: a product that is exactly 0 changes no fp32 partial sum. What can differ is
    only where a kernel (or torch's matmul) cuts GEMM2's now longer sum into chunks, the
    fp32 summation order (the float32 reference on padded vs unpadded weights: ~1e-7).

    Args (vLLM layout, dsv4.formats.nvfp4; E experts, hidden K, intermediate N, both
    positive multiples of 16):
        w13: uint8 [E, 2N, K/2]; w13_scale: float8_e4m3fn [E, 2N, K/16];
        w2: uint8 [E, K, N/2]; w2_scale: float8_e4m3fn [E, K, N/16].
        multiple: a positive multiple of 16 (so the padded columns of w2 are whole
            NVFP4 blocks).

    Returns:
        dict w13 uint8 [E, 2Np, K/2], w13_scale float8_e4m3fn [E, 2Np, K/16], w2 uint8
        [E, K, Np/2], w2_scale float8_e4m3fn [E, K, Np/16] (new tensors on the inputs'
        device; the inputs themselves when N is already a multiple).
    """
    op = "pad_nvfp4_moe_weights"
    E, N, K = _check_stacked(op, w13, w13_scale, w2, w2_scale)
    C.host_int(op, "multiple", multiple, lo=1)
    if multiple % NVFP4_BLOCK:
        raise C.error(op, f"multiple must be a multiple of {NVFP4_BLOCK} (the NVFP4 block: w2's padded columns "
                          f"are whole blocks), got {multiple}")
    return _pad_checked(w13, w13_scale, w2, w2_scale, N, -(-N // multiple) * multiple)


def _pad_checked(w13, w13_scale, w2, w2_scale, N: int, Np: int) -> dict:
    """pad_nvfp4_moe_weights on tensors its caller has checked (_check_stacked): N -> Np."""
    if Np == N:
        return dict(w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale)
    # scales padded as their bytes: byte 0 is e4m3 +0.0
    return dict(
        w13=pad_gate_up_rows(w13, N, Np),
        w13_scale=pad_gate_up_rows(w13_scale.view(torch.uint8), N, Np).view(torch.float8_e4m3fn),
        w2=pad_columns(w2, Np // 2),
        w2_scale=pad_columns(w2_scale.view(torch.uint8), Np // NVFP4_BLOCK).view(torch.float8_e4m3fn))


def prepare_nvfp4_moe_weights(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2) -> Nvfp4MoeWeights:
    """One-time conversion of vLLM's stacked ModelOpt NVFP4 expert weights into the
    layout the dsv4 MoE kernels read (a byte permutation after zero padding; no value
    changes).

    Args (vLLM layout, docs/design.md section 2; E experts, hidden K, intermediate N;
    K a multiple of 64, N a positive multiple of 16):
        w13: uint8 [E, 2N, K/2] (gate rows 0..N-1, up rows N..2N-1; low nibble = even element).
        w13_scale: float8_e4m3fn [E, 2N, K/16].
        w13_scale_2: float32 [E] or [E, 2] (gate, up) global scales; with [E, 2] each
            half keeps its own (vLLM 0.33.0's ModelOpt path would use the gate's for
            both, see dsv4.moe.nvfp4).
        w2: uint8 [E, K, N/2].
        w2_scale: float8_e4m3fn [E, K, N/16].
        w2_scale_2: float32 [E].

    Returns:
        :class:`Nvfp4MoeWeights` on the same device, for the padded intermediate size
        Np = N rounded up to a multiple of 64 (:func:`pad_nvfp4_moe_weights`: zero gate
        and up rows, zero w2 columns, which add exactly nothing: the op's output is the
        unpadded math's; V4.1-Flash at tensor parallel 8: 288 -> 320): each projection
        cut into 64x64 tiles (w13 rows interleaved per tile so gate and up of one
        column meet in one thread), tile bytes ordered as the wgmma A fragments of the
        consumer threads, code bits placed for a 1-3 instruction bf16 expansion, block
        scales re-encoded as one byte whose bf16 form is one PRMT + one IMAD away
        (this module's docstring; csrc/moe/params.cuh and dequant.cuh); w13_scale_2 as
        [E, 2]. Lossless: the dequantized values are unchanged (codes of blocks whose
        scale is 0 are stored as 0, which is the same value). Block scales must be
        finite and >= 0.
        Idempotent: passing a prepared set returns it unchanged (same tensors).
        :func:`unprepare_nvfp4_moe_weights` inverts it (giving the padded tensors).
        The prepared layout is internal to the dsv4 build that made it and changes with
        the kernels, without a version mark: prepare at load time (as the vLLM plugin
        does) and store checkpoints in the vLLM layout, never prepared sets.
    """
    op = "prepare_nvfp4_moe_weights"
    if is_prepared(w13):
        w = Nvfp4MoeWeights(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
        check_prepared(op, w)
        return w
    E, N, K = _check_stacked(op, w13, w13_scale, w2, w2_scale)
    if K % TILE:
        raise C.error(op, f"the hidden size K = {K} must be a multiple of {TILE} (the MoE kernels' K tile), got "
                          f"w13 shape {tuple(w13.shape)}")
    for name, t, shapes in (("w13_scale_2", w13_scale_2, ((E,), (E, 2))), ("w2_scale_2", w2_scale_2, ((E,),))):
        C.tensor(op, name, t)
        if t.dtype != torch.float32 or tuple(t.shape) not in shapes:
            want = " or ".join(str(list(x)) for x in shapes)
            raise C.error(op, f"{name} must be float32 {want}, got {t.dtype} {tuple(t.shape)}")
        C.same_device(op, name, t, "w13", w13)
    g13 = w13_scale_2 if w13_scale_2.dim() == 2 else w13_scale_2.unsqueeze(1).expand(E, 2)
    for name, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        v = t.float()
        if bool(((v < 0) | ~torch.isfinite(v)).any()):
            raise C.error(op, f"{name} must hold finite non-negative block scales")
    p = _pad_checked(w13, w13_scale, w2, w2_scale, N, -(-N // TILE) * TILE)  # pad_nvfp4_moe_weights, checked above
    return Nvfp4MoeWeights(
        _tile_codes(p["w13"], p["w13_scale"], True), _tile_scales(p["w13_scale"], True), g13.contiguous().clone(),
        _tile_codes(p["w2"], p["w2_scale"], False), _tile_scales(p["w2_scale"], False), w2_scale_2.contiguous().clone())


def unprepare_nvfp4_moe_weights(weights: Nvfp4MoeWeights) -> dict:
    """Inverse of :func:`prepare_nvfp4_moe_weights`: the vLLM stacked layout
    (dict w13, w13_scale, w13_scale_2 [E, 2], w2, w2_scale, w2_scale_2) of the prepared
    set's N, i.e. with the zero rows and columns of :func:`pad_nvfp4_moe_weights` when
    prepare padded N (``w13[:, :N]`` / ``w13[:, Np:Np + N]`` and ``w2[..., :N/2]`` are the
    original tensors)."""
    w = Nvfp4MoeWeights(*weights)
    check_prepared("unprepare_nvfp4_moe_weights", w)
    return {
        "w13": _untile_codes(w.w13, True), "w13_scale": _untile_scales(w.w13_scale, True),
        "w13_scale_2": w.w13_scale_2, "w2": _untile_codes(w.w2, False),
        "w2_scale": _untile_scales(w.w2_scale, False), "w2_scale_2": w.w2_scale_2,
    }
