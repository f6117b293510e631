"""MXFP4 routed-expert weights (DeepSeek V4 / V4.1 native checkpoints): the e8m0 block
format, vLLM's stacked MoE layout and the conversions to the MoE kernels' operands, as
plain torch code (CPU or GPU).

MXFP4 weights
-------------
* e2m1 codes as NVFP4 (``dsv4.formats.nvfp4``): 4 bits, bit 3 = sign, two per uint8 byte along
  K, the LOW nibble holding the even element (the OCP MX convention; vLLM's loaders copy
  the checkpoint bytes unchanged, and torch's ``float4_e2m1fn_x2`` reads them the same way).
* One e8m0 scale byte ``e`` per 32 consecutive elements along K: the block's values are
  ``E2M1_VALUES[code] * 2^(e - 127)``. No global scale. ``e = 0`` is 2^-127 (an fp32
  subnormal, exact); from ``e = 253`` on, codes 4 and 6 overflow fp32 (real weights sit
  near e = 120). ``e = 255`` is NaN in e8m0 (OCP MX, torch ``float8_e8m0fnu``):
  :func:`dequantize_mxfp4` gives NaN for such a block, and the MoE prepare step rejects it
  (a checkpoint never holds it; a NaN weight would only poison every token routed there).
  vLLM's fp32 upcast (``fp8_utils._upcast_e8m0_to_fp32``) and Humming read byte 0 as 0.0
  instead of 2^-127: the two differ by at most 6 * 2^-127 per element.
* Scales are stored as uint8 bytes (vLLM's parameter dtype; the checkpoints hold
  ``float8_e8m0fnu``, which vLLM views as uint8 before loading). Both dtypes are accepted.
* vLLM 0.33.0 stacked MoE layout (``Mxfp4MoEMethod.create_weights``): ``w13`` uint8
  ``[E, 2N, K/2]`` (rows ``0..N-1`` gate = w1, rows ``N..2N-1`` up = w3), ``w13_scale``
  uint8 ``[E, 2N, K/32]``, ``w2`` uint8 ``[E, K, N/2]``, ``w2_scale`` uint8 ``[E, K, N/32]``.
  N is the per-rank intermediate size. vLLM rounds N up for the backend
  (``mxfp4_round_up_hidden_size_and_intermediate_size``: 64 for Humming, its SM90 path) and
  zero-fills the parameters before loading, so padded rows/columns hold code 0, scale 0:
  value 0. V4.1-Flash at TP 8: N = 2304 / 8 = 288, padded to 320.

Every element value is exact in bf16 (e2m1 has 2 significant bits) and exact in FP8 e4m3
relative to a base carried in fp32 when the block exponent fits e4m3's range: see
:func:`mxfp4_to_nvfp4` (the W4A16 kernels' operand) and :func:`fit_fp8_operand` (the
W4A8 rule), the conversions the MoE prepare step runs.

Divisions are always between two tensors on the same device (on CUDA, ``tensor /
python_scalar`` is computed as ``tensor * (1 / scalar)``, not the correctly rounded quotient).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _checks as C
from ._float import ceil_log2, pow2
from .nvfp4 import E2M1_MAX, e2m1_to_float, pack_fp4, pad_columns, pad_gate_up_rows, round_to_e2m1, unpack_fp4


MXFP4_BLOCK = 32
FP8_GROUP = 128
E8M0_BIAS = 127
E8M0_NAN = 255


# e4m3 holds the powers of two 2^-9 (its smallest subnormal) .. 2^8 exactly.
_E4M3_POW2_MIN, _E4M3_POW2_MAX = -9, 8


# An e2m1 value (0.5 .. 6, one significant bit after the leading one) times 2^d is an
# e4m3 value for every code iff -8 <= d <= 6: 0.5 * 2^-8 = 2^-9 is the smallest
# subnormal, 6 * 2^6 = 384 <= 448 < 6 * 2^7.
FP8_OPERAND_SHIFT_MIN, FP8_OPERAND_SHIFT_MAX = -8, 6


def e8m0_bytes(scale: torch.Tensor, name: str = "scale", op: str = "e8m0_bytes") -> torch.Tensor:
    """The uint8 view of an e8m0 scale tensor (uint8 or float8_e8m0fnu)."""
    C.tensor(op, name, scale)
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    raise C.error(op, f"{name} must hold MXFP4 e8m0 scales as torch.uint8 (vLLM's parameter dtype) or "
                      f"torch.float8_e8m0fnu (the checkpoint's), got {scale.dtype}")


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes -> float32 ``2^(e - 127)``, exact (byte 0: 2^-127; byte 255: NaN)."""
    e = e8m0_bytes(scale, op="e8m0_to_float").to(torch.int32)
    v = pow2(e - E8M0_BIAS)
    return torch.where(e == E8M0_NAN, torch.full_like(v, float("nan")), v)


def _check_last_dim(op: str, t: torch.Tensor, name: str, multiple: int) -> None:
    if t.dim() == 0 or t.shape[-1] % multiple:
        raise C.error(op, f"{name} must have a last dim that is a multiple of {multiple}, got shape {tuple(t.shape)}")


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes to MXFP4 along the last dim, for making test weights.

    Per block of 32: ``e = ceil(log2(amax / 6))`` (the smallest power of two that maps the
    block into e2m1's range, so nothing saturates; an all-zero block gets e = -127),
    byte ``clamp(e + 127, 0, 254)``, codes ``round_to_e2m1(x / 2^e)`` (ties to even).
    (Not a checkpoint specification: DeepSeek's checkpoints come quantized.)

    Args:
        x: float ``[..., K]``, K a multiple of 32.

    Returns:
        ``(packed uint8 [..., K/2], scales uint8 [..., K/32])``.
    """
    C.floating("quantize_mxfp4", "x", x)
    _check_last_dim("quantize_mxfp4", x, "x", MXFP4_BLOCK)
    K = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], K // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    six = torch.tensor(E2M1_MAX, dtype=torch.float32, device=x.device)
    ratio = amax / six
    e = torch.where(amax > 0, ceil_log2(torch.where(amax > 0, ratio, torch.ones_like(ratio))),
                    torch.full_like(amax, -E8M0_BIAS, dtype=torch.int32))
    e = e.clamp(-E8M0_BIAS, 254 - E8M0_BIAS)
    codes = round_to_e2m1(xb * pow2(-e)).reshape(x.shape)
    return pack_fp4(codes), (e + E8M0_BIAS).to(torch.uint8).squeeze(-1)


def _check_packed_scales(op: str, packed: torch.Tensor, scales: torch.Tensor, pname: str, sname: str) -> torch.Tensor:
    """MXFP4 codes uint8 [..., K/2] with their e8m0 block scales [..., K/32]; the scales' bytes."""
    C.dtype(op, pname, packed, torch.uint8, note=" (packed e2m1 codes)")
    sb = e8m0_bytes(scales, sname, op)
    _check_last_dim(op, packed, pname, MXFP4_BLOCK // 2)
    C.shape(op, sname, sb, (*packed.shape[:-1], packed.shape[-1] * 2 // MXFP4_BLOCK),
            f" (one e8m0 byte per 32 elements of {pname} {list(packed.shape)})")
    return sb


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``E2M1_VALUES[code] * 2^(e - 127)`` in float32 (exact), cast to ``dtype``.

    Args:
        packed: uint8 ``[..., K/2]`` (low nibble = even element).
        scales: uint8 or float8_e8m0fnu ``[..., K/32]``.

    Returns:
        ``dtype`` ``[..., K]``; NaN in blocks whose scale byte is 255.
    """
    sb = _check_packed_scales("dequantize_mxfp4", packed, scales, "packed", "scales")
    codes = unpack_fp4(packed)
    K = codes.shape[-1]
    vals = e2m1_to_float(codes).reshape(*codes.shape[:-1], K // MXFP4_BLOCK, MXFP4_BLOCK)
    return (vals * e8m0_to_float(sb).unsqueeze(-1)).reshape(codes.shape).to(dtype)


def dequantize_mxfp4_experts(w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Stacked MXFP4 expert weights (``[E, rows, Kd/2]``, ``[E, rows, Kd/32]``) -> float32
    ``[E, rows, Kd]``."""
    C.tensor("dequantize_mxfp4_experts", "w", w)
    C.ndim("dequantize_mxfp4_experts", "w", w, 3, "[E, rows, K/2]")
    return dequantize_mxfp4(w, w_scale)


def check_mxfp4_moe_weights(w13, w13_scale, w2, w2_scale, *, op: str = "check_mxfp4_moe_weights"
                            ) -> tuple[int, int, int]:
    """Validates vLLM's stacked MXFP4 MoE tensors; returns (E, N, K). ``op``: the caller,
    named in the errors.

    w13 uint8 [E, 2N, K/2], w13_scale e8m0 [E, 2N, K/32], w2 uint8 [E, K, N/2],
    w2_scale e8m0 [E, K, N/32]; K and N multiples of 32 (the MXFP4 block).
    """
    for name, t in (("w13", w13), ("w2", w2)):
        C.tensor(op, name, t)
        if t.dtype != torch.uint8 or t.dim() != 3:
            raise C.error(op, f"{name} must be a 3-D torch.uint8 tensor of packed e2m1 codes (vLLM stacked MXFP4 "
                              f"layout), got {t.dtype} {tuple(t.shape)}")
    s13, s2 = e8m0_bytes(w13_scale, "w13_scale", op), e8m0_bytes(w2_scale, "w2_scale", op)
    E, two_n, half_k = w13.shape
    N, K = two_n // 2, half_k * 2
    if two_n % 2 or K % MXFP4_BLOCK or N % MXFP4_BLOCK or N == 0 or K == 0:
        raise C.error(op, f"w13 [E, 2N, K/2] needs the hidden size K and the intermediate size N to be positive "
                          f"multiples of {MXFP4_BLOCK} (the MXFP4 block), got shape {tuple(w13.shape)} "
                          f"(K = {K}, 2N = {two_n})")
    note = f" to match w13 {list(w13.shape)} (E = {E}, N = {N}, K = {K})"
    C.shape(op, "w13_scale", s13, (E, 2 * N, K // 32), note)
    C.shape(op, "w2", w2, (E, K, N // 2), note)
    C.shape(op, "w2_scale", s2, (E, K, N // 32), note)
    for name, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale), ("w2", w2)):
        C.same_device(op, name, t, "w13", w13)
    return E, N, K


def pad_mxfp4_moe_weights(w13, w13_scale, w2, w2_scale, multiple: int = 64) -> dict:
    """Pads the intermediate size N up to a multiple of ``multiple`` the way vLLM's
    padded parameters hold it: zero gate rows after row N-1 and zero up rows after row
    2N-1 of w13, zero columns of w2 (codes 0, scale bytes 0: value 0). The padded
    intermediate columns then compute ``swiglu(0, 0) = 0`` and contribute nothing.

    Returns a dict w13, w13_scale, w2, w2_scale (uint8; the inputs themselves when N is
    already a multiple).
    """
    E, N, K = check_mxfp4_moe_weights(w13, w13_scale, w2, w2_scale, op="pad_mxfp4_moe_weights")
    s13, s2 = e8m0_bytes(w13_scale), e8m0_bytes(w2_scale)
    Np = -(-N // multiple) * multiple
    if Np == N:
        return dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)
    return dict(w13=pad_gate_up_rows(w13, N, Np), w13_scale=pad_gate_up_rows(s13, N, Np), w2=pad_columns(w2, Np // 2),
                w2_scale=pad_columns(s2, Np // MXFP4_BLOCK))


def random_mxfp4_moe_weights(E: int, N: int, K: int, *, generator: Optional[torch.Generator] = None,
                             device="cpu", std: float = 0.02, spread: float = 2.0, quantize: bool = True) -> dict:
    """Random MXFP4 MoE weights in vLLM's stacked layout (for tests and benchmarks).

    quantize=True: ``N(0, std^2)`` samples, each row scaled by ``2^u`` with u uniform in
    [-spread, spread] (block exponents then spread over several binades, as in real
    checkpoints), quantized with :func:`quantize_mxfp4`. quantize=False: codes drawn as
    uniform random bytes and scale bytes uniform in [118, 122] (values O(0.02); fast, for
    timing only).

    Returns:
        dict ``w13`` uint8 [E, 2N, K/2], ``w13_scale`` uint8 [E, 2N, K/32], ``w2`` uint8
        [E, K, N/2], ``w2_scale`` uint8 [E, K, N/32].
    """
    op = "random_mxfp4_moe_weights"
    for name, value in (("E", E), ("N", N), ("K", K)):
        C.host_int(op, name, value, lo=1)
        if name != "E" and value % MXFP4_BLOCK:
            raise C.error(op, f"{name} must be a multiple of {MXFP4_BLOCK}, got {value}")
    gen_device = generator.device if generator is not None else torch.device("cpu")
    if not quantize:
        def codes(*shape):
            return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator, device=gen_device).to(device)

        def scales(*shape):
            return torch.randint(118, 123, shape, dtype=torch.uint8, generator=generator, device=gen_device).to(device)

        return dict(w13=codes(E, 2 * N, K // 2), w13_scale=scales(E, 2 * N, K // 32),
                    w2=codes(E, K, N // 2), w2_scale=scales(E, K, N // 32))

    def weight(rows, cols):
        w = torch.randn(E, rows, cols, generator=generator, device=gen_device) * std
        u = (torch.rand(E, rows, 1, generator=generator, device=gen_device) * 2 - 1) * spread
        return quantize_mxfp4((w * torch.exp2(u)).to(device))

    w13, s13 = weight(2 * N, K)
    w2, s2 = weight(K, N)
    return dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)


def _nonzero_blocks(codes: torch.Tensor) -> torch.Tensor:
    """[..., nb, 32] codes -> [..., nb] bool: some element is not +-0."""
    return ((codes & 7) != 0).any(dim=-1)


def _reject_nan(op: str, sb: torch.Tensor, name: str) -> None:
    bad = int((sb == E8M0_NAN).sum())
    if bad:
        raise C.error(op, f"{name} holds {bad} block scale(s) with the e8m0 NaN byte 255; MXFP4 weights must have "
                          "finite block scales")


def mxfp4_to_nvfp4(w: torch.Tensor, w_scale: torch.Tensor, halves: int = 1, name: str = "w"):
    """MXFP4 stacked weights -> NVFP4 stacked weights of the same values, for the bf16
    (W4A16) kernels, which read NVFP4's e4m3 block scales and fp32 global scales.

    Each expert matrix (or each of its ``halves`` row ranges: 2 for w13's gate and up)
    gets the global scale ``g = 2^b`` with ``b = (largest exponent of its blocks that are
    not all zero) - 8``, and each block of 32 becomes two NVFP4 blocks of 16 with the
    e4m3 scale ``2^(e - 127 - b)``: exact for every block within 17 binades of the
    largest (e4m3 holds 2^-9 .. 2^8 exactly). All-zero blocks get scale 0. A block further
    below is re-expressed on the scale 2^-9 (relative to g) by round_to_e2m1 (ties to
    even; exact when its codes allow); blocks whose values change are counted; each such
    value moves by at most 2^-11 * g, i.e. 2^-19 times the matrix's largest block scale.

    Args:
        w: uint8 [E, R, Kd/2]; w_scale: e8m0 [E, R, Kd/32]; halves: row ranges with
            their own global scale (1 or 2; R must be a multiple).

    Returns:
        ``(codes uint8 [E, R, Kd/2], scales float8_e4m3fn [E, R, Kd/16], global float32
        [E] (halves=1) or [E, 2], inexact_blocks int)``. A scale byte 255 (NaN) raises.
    """
    op = "mxfp4_to_nvfp4"
    sb = _check_packed_scales(op, w, w_scale, name, f"{name}_scale")
    _reject_nan(op, sb, f"{name}_scale")
    E, R, half_k = w.shape
    nb = half_k * 2 // MXFP4_BLOCK
    codes = unpack_fp4(w).reshape(E, halves, R // halves, nb, MXFP4_BLOCK)
    e = sb.to(torch.int32).reshape(E, halves, R // halves, nb) - E8M0_BIAS
    live = _nonzero_blocks(codes)
    floor = torch.full_like(e, -10_000)
    emax = torch.where(live, e, floor).amax(dim=(2, 3))  # [E, halves]
    base = torch.where(emax > -10_000, emax - _E4M3_POW2_MAX, torch.zeros_like(emax))
    d = e - base[:, :, None, None]
    fits = d >= _E4M3_POW2_MIN
    low = live & ~fits
    inexact = 0
    if bool(low.any()):
        # re-round onto the window's lowest scale: value = code * 2^d = (code * 2^(d + 9)) * 2^-9
        vals = e2m1_to_float(codes) * pow2(d - _E4M3_POW2_MIN).unsqueeze(-1)
        new = round_to_e2m1(vals)
        inexact = int((low & (e2m1_to_float(new) != vals).any(dim=-1)).sum())
        codes = torch.where(low.unsqueeze(-1), new, codes)
        d = torch.where(low, torch.full_like(d, _E4M3_POW2_MIN), d)
    scale = pow2(d.clamp(_E4M3_POW2_MIN, _E4M3_POW2_MAX))
    live = _nonzero_blocks(codes)  # re-rounding can zero a block
    scale = torch.where(live, scale, torch.zeros_like(scale))
    scale16 = scale.repeat_interleave(2, dim=-1).reshape(E, R, nb * 2).to(torch.float8_e4m3fn)
    g = pow2(base)
    g = g[:, 0] if halves == 1 else g
    return pack_fp4(codes.reshape(E, R, nb * MXFP4_BLOCK)), scale16, g.contiguous(), inexact


def fit_fp8_operand(w: torch.Tensor, w_scale: torch.Tensor, group: int = FP8_GROUP, name: str = "w"):
    """MXFP4 weights made to fit the W4A8 kernel's exact FP8 operand rule.

    Rule (one base per row and per ``group`` elements of K, carried in fp32 and applied to
    the accumulator together with the activation's per-128 scale): ``b = (largest exponent
    of the group's blocks that are not all zero) - 6``; a block of exponent e becomes the
    e4m3 values ``code * 2^(e - b)``, exact iff ``e - b >= -8``, i.e. iff the block lies
    within 14 binades of the largest block of its 128 elements of its row. (Humming's one
    base per expert matrix re-rounds every block more than 11 binades below the matrix's
    largest.) A block further below is re-expressed on the exponent ``b - 8``
    (round_to_e2m1, ties to even: exact when its codes allow, e.g. 6 * 2^-1 = 3); blocks
    whose values change are counted; each such value moves by at most 2^-16 times the
    group's largest block scale.

    Args:
        w: uint8 [E, R, Kd/2]; w_scale: e8m0 [E, R, Kd/32].

    Returns:
        ``(codes uint8 [E, R, Kd/2], scales uint8 [E, R, Kd/32], inexact_blocks int)``, with
        the scale bytes of all-zero blocks set to 0 (the kernel's base is the largest byte
        of the group); the inputs themselves when nothing changes. A scale byte 255 (NaN)
        raises.
    """
    op = "fit_fp8_operand"
    sb = _check_packed_scales(op, w, w_scale, name, f"{name}_scale")
    _reject_nan(op, sb, f"{name}_scale")
    E, R, half_k = w.shape
    nb = half_k * 2 // MXFP4_BLOCK
    per = group // MXFP4_BLOCK
    codes = unpack_fp4(w).reshape(E, R, nb, MXFP4_BLOCK)
    live = _nonzero_blocks(codes)
    e = sb.to(torch.int32)
    none = torch.full_like(e, -10_000)
    ng = -(-nb // per)
    padded = torch.nn.functional.pad(torch.where(live, e, none), (0, ng * per - nb), value=-10_000)
    gmax = padded.reshape(E, R, ng, per).amax(dim=-1).repeat_interleave(per, dim=-1)[..., :nb]
    lowest = gmax - FP8_OPERAND_SHIFT_MAX + FP8_OPERAND_SHIFT_MIN  # b - 8
    low = live & (e < lowest)
    dead = ~live & (e != 0)
    if not bool(low.any()) and not bool(dead.any()):
        return w, sb, 0
    # all-zero blocks get byte 0: the kernel takes the group's largest byte as is
    sb = torch.where(live, e, torch.zeros_like(e))
    if not bool(low.any()):
        return w, sb.to(torch.uint8), 0
    vals = e2m1_to_float(codes) * pow2(e - lowest).unsqueeze(-1)
    new = round_to_e2m1(vals)
    inexact = int((low & (e2m1_to_float(new) != vals).any(dim=-1)).sum())
    codes = torch.where(low.unsqueeze(-1), new, codes)
    sb = torch.where(low, lowest, sb).to(torch.uint8)
    return pack_fp4(codes.reshape(E, R, nb * MXFP4_BLOCK)), sb, inexact
