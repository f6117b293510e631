"""The prepared layout of MXFP4 expert weights for the W4A8 kernels (``dsv4::mxfp4_moe``,
csrc/moe/mxfp4_gemm.cuh), made once at load from vLLM's stacked layout (plain torch, CPU or
GPU), and its inverse.

Input: vLLM's stacked tensors with N padded to a multiple of 32 (``dsv4.formats.mxfp4``
``pad_mxfp4_moe_weights``) and every block fitted to the exact FP8 operand rule
(``fit_fp8_operand``: within a row's 128 elements of K, every nonzero block lies at most
14 binades below the largest; all-zero blocks carry scale byte 0).

Numbers. Per row and per 128 of K (a "chunk", the activation's FP8 group) a base
``b = max(gmax - 127 - 6, -126)`` (gmax: the largest scale byte of the chunk's nonzero
blocks), carried in fp32 as ``2^b``; a block of scale byte e becomes the e4m3 values
``code * 2^d`` with ``d = e - 127 - b`` in [-8, 6] (exact: e2m1 times 2^-8 .. 2^6 is an
e4m3 value, subnormals included), so ``value = e4m3 * 2^b`` exactly. (The clamp keeps
``2^b`` a normal fp32; chunks whose largest byte is below 7 then have d in [-1, 5].)

Tiles: each projection (R output rows, reduction Kd) is cut into 64-row x 128-K tiles,
stored ``codes [E, R/64, KC, 4096]`` and ``scales [E, R/64, KC, 256]`` bytes, KC =
ceil(Kd / 128) (a last chunk of 64, GEMM2 at N = 320, is zero-padded to 128). Thread T =
32w + 4g + t of the kernels' warpgroup (warp w, lane 4g + t) multiplies tile rows
16w + g (half hh = 0) and 16w + g + 8 (hh = 1) with m16n8k32 MMAs; in the chunk it holds
MXFP4 block t of both rows: step s (of 4) takes the block's elements 8s .. 8s + 7, where the
PTX fragment says k = 4t .. 4t + 3 (elements 8s + 0..3) and 16 + 4t .. (8s + 4..7). So:

* code tile byte ``2048 hh + 16 T + 4 s + i``: byte i of the 32-bit word of step s of row
  (hh) of thread T; the word holds the 8 codes (element j = 0..7 of the step) as
  magnitude bits (e1 e0 m) at bits 4j .. 4j + 2 and sign bits at 8j + 7 (j < 4) and
  8(j - 4) + 3 (j >= 4): ``word & 0x77777777`` are PRMT selectors of the low four
  elements, ``>> 16`` of the high four; ``word & 0x80808080`` and ``(word << 4) &
  0x80808080`` their e4m3 sign bits (csrc/moe/mxfp4_gemm.cuh, ``e2m1x8_to_e4m3``).
* scale tile word ``8 (8w + g) + 4 hh`` (thread (w, g) reads 8 bytes: its two rows):
  bits 4t .. 4t + 3 = ``d + 8`` of block t (0 for an all-zero block), bits 23 .. 30 =
  ``b + 127``, so that ``word & 0x7F800000`` is the fp32 ``2^b``.
* w13 rows are interleaved per 64-row tile as in the NVFP4 layout: tile row 16w + r is
  gate row 32 rt + 8w + r for r < 8 and up row 32 rt + 8w + r - 8 otherwise, so a thread
  holds gate and up of the same intermediate column.

The activations follow the same order: in a chunk, MMA position ``p = 32 s + 16 hh + 4 t +
i`` holds element ``32 t + 8 s + 4 hh + i`` (:func:`chunk_position`), which is how the
kernels store GEMM1's quantized x and GEMM2's quantized h.
"""

from __future__ import annotations

import torch

from .. import _checks as C
from .mxfp4 import E8M0_BIAS, FP8_GROUP, FP8_OPERAND_SHIFT_MAX, FP8_OPERAND_SHIFT_MIN, MXFP4_BLOCK
from .nvfp4 import pack_fp4, unpack_fp4

TILE_ROWS = 64
# The layout's N granularity: a 64-row w13 tile holds the gate and up rows of 32 output
# columns (the interleave below), and w2's K is padded to whole 128-chunks anyway, so N
# needs only to be a multiple of 32 (V4.1-Flash at tensor parallel 8: N = 288, 9 tiles).
N_MULTIPLE = 32
CODE_TILE_BYTES = TILE_ROWS * FP8_GROUP // 2  # 4096
SCALE_TILE_BYTES = TILE_ROWS * 4  # 256: one 32-bit word per row
_BASE_MIN = -126  # 2^b stays a normal fp32
_NONE = -10_000

# bit of each code bit (m, e0, e1, s) of element j = 0..7 in a step's word
_BITS = tuple((4 * j, 4 * j + 1, 4 * j + 2, 8 * j + 7 if j < 4 else 8 * (j - 4) + 3) for j in range(8))


def chunk_position(element: torch.Tensor) -> torch.Tensor:
    """MMA position p (0..127) of chunk element e: e = 32 t + 8 s + 4 hh + i -> p = 32 s +
    16 hh + 4 t + i."""
    t, s, hh, i = element // 32, (element // 8) % 4, (element // 4) % 2, element % 4
    return 32 * s + 16 * hh + 4 * t + i


def interleave_rows(t: torch.Tensor) -> torch.Tensor:
    """[E, 2N, ...] gate rows then up rows -> per 64-row tile: row 16w + 8h + g = (gate | up)[32 rt + 8w + g]."""
    E, R = t.shape[:2]
    rest = t.shape[2:]
    return t.reshape(E, 2, R // 64, 4, 8, *rest).permute(0, 2, 3, 1, 4, *range(5, 5 + len(rest))).reshape(E, R, *rest)


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    E, R = t.shape[:2]
    rest = t.shape[2:]
    return t.reshape(E, R // 64, 4, 2, 8, *rest).permute(0, 3, 1, 2, 4, *range(5, 5 + len(rest))).reshape(E, R, *rest)


def encode_words(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., 8] (elements j = 0..7 of a step) -> int64 words [...] (the bit layout above)."""
    c = codes.to(torch.int64)
    word = torch.zeros(c.shape[:-1], dtype=torch.int64, device=c.device)
    for j, (m, e0, e1, sign) in enumerate(_BITS):
        cj = c[..., j]
        word |= ((cj & 7) << m) | ((cj >> 3) << sign)  # the magnitude bits sit together at m = 4j
    return word


def decode_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_words`: uint8 codes [..., 8]."""
    w = words.to(torch.int64)
    return torch.stack([((w >> m) & 7) | (((w >> sign) & 1) << 3) for (m, _, _, sign) in _BITS], -1).to(torch.uint8)


def _pad_chunks(codes: torch.Tensor, sb: torch.Tensor):
    """codes [E, R, Kd], bytes [E, R, Kd/32] -> padded to KC * 128 along K (zero blocks)."""
    kd = codes.shape[-1]
    kc = -(-kd // FP8_GROUP)
    pad = kc * FP8_GROUP - kd
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
        sb = torch.nn.functional.pad(sb, (0, pad // MXFP4_BLOCK))
    return codes, sb, kc


def scale_words(codes: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """The scale word of every (row, chunk): codes uint8 [E, R, KC * 128], fitted scale bytes
    [E, R, KC * 4] -> int64 [E, R, KC]."""
    E, R, kd = codes.shape
    kc = kd // FP8_GROUP
    live = ((codes.reshape(E, R, kc, 4, MXFP4_BLOCK) & 7) != 0).any(-1)  # [E, R, KC, 4]
    e = sb.to(torch.int64).reshape(E, R, kc, 4)
    gmax = torch.where(live, e, torch.full_like(e, _NONE)).amax(-1)  # [E, R, KC]
    b = torch.where(gmax > _NONE, gmax - E8M0_BIAS - FP8_OPERAND_SHIFT_MAX, torch.full_like(gmax, _BASE_MIN))
    b = b.clamp(min=_BASE_MIN)
    d = e - E8M0_BIAS - b[..., None]
    bad = live & ((d < FP8_OPERAND_SHIFT_MIN) | (d > FP8_OPERAND_SHIFT_MAX))
    if bool(bad.any()):  # fit_fp8_operand guarantees the window; a caller that skipped it gets this
        raise C.error("w4a8_layout", f"{int(bad.sum())} block(s) lie more than 14 binades below the largest block of "
                                     "their row's 128 elements (run dsv4.formats.fit_fp8_operand first)")
    nib = torch.where(live, d - FP8_OPERAND_SHIFT_MIN, torch.zeros_like(d))
    word = (nib << (4 * torch.arange(4, device=codes.device))).sum(-1)
    return word | ((b + 127) << 23)


def _tile(packed: torch.Tensor, sb: torch.Tensor, interleave: bool):
    """One projection, one expert at a time (the word encoding needs ~8 bytes of scratch
    per element): packed [E, R, Kd/2], scale bytes [E, R, Kd/32] -> the code and scale tiles."""
    codes_out, scales_out = [], []
    for e in range(packed.shape[0]):
        codes, sbe, kc = _pad_chunks(unpack_fp4(packed[e:e + 1]), sb[e:e + 1])
        if interleave:
            codes, sbe = interleave_rows(codes), interleave_rows(sbe)
        R = codes.shape[1]
        words = scale_words(codes, sbe)  # [1, R, KC]
        sc = words.reshape(1, R // 64, 4, 2, 8, kc).permute(0, 1, 5, 2, 4, 3)  # [1, RT, KC, w, g, hh]
        sc = torch.stack([(sc >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8)
        # codes [1, R, KC*128] -> [1, RT, w, hh, g, KC, t, s, j] -> words [1, RT, KC, hh, w, g, t, s]
        wd = encode_words(codes.reshape(1, R // 64, 4, 2, 8, kc, 4, 4, 8)).permute(0, 1, 5, 3, 2, 4, 6, 7)
        cb = torch.stack([(wd >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8)
        codes_out.append(cb.reshape(R // 64, kc, CODE_TILE_BYTES))
        scales_out.append(sc.reshape(R // 64, kc, SCALE_TILE_BYTES))
    return torch.stack(codes_out).contiguous(), torch.stack(scales_out).contiguous()


def _untile(tiles: torch.Tensor, scales: torch.Tensor, kd: int, interleave: bool):
    packed, bytes_ = [], []
    for e in range(tiles.shape[0]):
        RT, kc = tiles.shape[1], tiles.shape[2]
        b = tiles[e:e + 1].reshape(1, RT, kc, 2, 4, 8, 4, 4, 4).to(torch.int64)  # [.., hh, w, g, t, s, byte]
        words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
        codes = decode_words(words)  # [1, RT, KC, hh, w, g, t, s, j]
        codes = codes.permute(0, 1, 4, 3, 5, 2, 6, 7, 8).reshape(1, RT * 64, kc * FP8_GROUP)
        sw = scales[e:e + 1].reshape(1, RT, kc, 4, 8, 2, 4).to(torch.int64)
        sw = sw[..., 0] | (sw[..., 1] << 8) | (sw[..., 2] << 16) | (sw[..., 3] << 24)
        sw = sw.permute(0, 1, 3, 5, 4, 2).reshape(1, RT * 64, kc)  # [1, R, KC]
        nib = (sw[..., None] >> (4 * torch.arange(4, device=tiles.device))) & 15  # [1, R, KC, 4]
        base = ((sw >> 23) & 0xFF) - 127
        live = ((codes.reshape(1, RT * 64, kc, 4, MXFP4_BLOCK) & 7) != 0).any(-1)
        ex = nib + FP8_OPERAND_SHIFT_MIN + base[..., None] + E8M0_BIAS
        sb = torch.where(live, ex, torch.zeros_like(ex)).reshape(1, RT * 64, kc * 4).to(torch.uint8)
        if interleave:
            codes, sb = deinterleave_rows(codes), deinterleave_rows(sb)
        packed.append(pack_fp4(codes[0, :, :kd].contiguous()))
        bytes_.append(sb[0, :, : kd // MXFP4_BLOCK].contiguous())
    return torch.stack(packed), torch.stack(bytes_)


def w4a8_layout(w13, w13_scale, w2, w2_scale) -> tuple:
    """vLLM's stacked MXFP4 tensors (N a multiple of 32, K of 128, blocks fitted by
    ``fit_fp8_operand``) -> the W4A8 kernels' tiles (module doc):
    ``w13 [E, 2N/64, K/128, 4096]``, ``w13_scale [E, 2N/64, K/128, 256]``,
    ``w2 [E, K/64, ceil(N/128), 4096]``, ``w2_scale [E, K/64, ceil(N/128), 256]``, uint8.
    A pure re-encoding: :func:`w4a8_unlayout` gives the same values back (all-zero
    blocks with scale byte 0)."""
    op = "w4a8_layout"
    E, two_n, half_k = w13.shape
    N, K = two_n // 2, half_k * 2
    if N % N_MULTIPLE or K % FP8_GROUP:
        raise C.error(op, f"the W4A8 layout needs N a multiple of {N_MULTIPLE} and K of {FP8_GROUP}, got N = {N}, "
                          f"K = {K}")
    c13, s13 = _tile(w13, w13_scale, True)
    c2, s2 = _tile(w2, w2_scale, False)
    return c13, s13, c2, s2


def w4a8_unlayout(w13, w13_scale, w2, w2_scale) -> dict:
    """Inverse of :func:`w4a8_layout`: dict w13 [E, 2N, K/2], w13_scale [E, 2N, K/32],
    w2 [E, K, N/2], w2_scale [E, K, N/32] (uint8, vLLM's layout, N padded to 32)."""
    E, rt13, kc1, _ = w13.shape
    N, K = rt13 * 32, kc1 * FP8_GROUP
    c13, s13 = _untile(w13, w13_scale, K, True)
    c2, s2 = _untile(w2, w2_scale, N, False)
    return dict(w13=c13, w13_scale=s13, w2=c2, w2_scale=s2)


def w4a8_shapes(E: int, N: int, K: int) -> dict:
    """The prepared shapes for E experts, intermediate N (a multiple of 32), hidden K."""
    kc2 = -(-N // FP8_GROUP)
    return dict(w13=(E, 2 * N // 64, K // FP8_GROUP, CODE_TILE_BYTES),
                w13_scale=(E, 2 * N // 64, K // FP8_GROUP, SCALE_TILE_BYTES),
                w2=(E, K // 64, kc2, CODE_TILE_BYTES), w2_scale=(E, K // 64, kc2, SCALE_TILE_BYTES))


def check_w4a8_layout(op: str, w13, w13_scale, w2, w2_scale, hint: str = "") -> tuple[int, int, int]:
    """Validates the four prepared W4A8 tensors (shapes, dtypes, one device); returns (E, N, K).
    The same rules, in the same words, as csrc/moe/mxfp4_moe.cu's check_inputs."""
    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        C.dtype(op, name, t, torch.uint8, note=f" (the prepared W4A8 layout){hint}")
        C.ndim(op, name, t, 4, "[E, row tiles, K chunks, bytes]")
    if w13.shape[3] != CODE_TILE_BYTES or w13.shape[0] < 1:
        raise C.error(op, f"w13 must be the prepared layout [E, 2N/64, K/128, {CODE_TILE_BYTES}]{hint}, got shape "
                          f"{tuple(w13.shape)}")
    E, rt, kc, _ = w13.shape
    N, K = rt * 32, kc * FP8_GROUP  # N = 32 * w13.shape[1] is a multiple of N_MULTIPLE by construction
    want = w4a8_shapes(E, N, K)
    for name, t in (("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        C.shape(op, name, t, want[name], f" (the prepared layout for E = {E}, N = {N}, K = {K}){hint}")
        C.same_device(op, name, t, "w13", w13)
    return E, N, K
