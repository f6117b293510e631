"""Paged KV caches of DeepSeek V4 (one 512-dim latent per token, MQA): vLLM's
``fp8_ds_mla`` and bf16 layouts, as plain torch code (CPU or GPU).

"fp8_ds_mla" paged KV cache (one 512-dim latent per token, MQA)
---------------------------------------------------------------
Per block of ``B`` tokens, byte offsets relative to the start of the block:

* ``[t*576, t*576 + 448)``: token t's dims 0..447 (no-rope part, 7 groups of 64) as
  float8_e4m3fn.
* ``[t*576 + 448, t*576 + 576)``: token t's dims 448..511 (rope part) as 64 raw
  little-endian bfloat16 values.
* ``[B*576 + t*8, B*576 + t*8 + 8)``: token t's 7 UE8M0 exponent bytes (group i is
  scaled by ``2**(byte_i - 127)``) followed by one pad byte (0).
* The block stride is padded to a multiple of 576: ``fp8_ds_mla_block_bytes(B)``.

vLLM hands the cache over as a uint8 view ``[num_blocks, B, 584]`` with
``stride(0)`` = the real block stride (>= ``B*584``) and ``stride(1) == 584``.  The
view's rows do NOT line up with tokens (token t's data is at ``t*576``, not
``t*584``); only the block start ``cache[b, 0, 0]`` is meaningful.  A slot id is
``block_id * B + offset_in_block``.  FlashMLA is given the 4-D view
``[num_blocks, B, 1, 584]``.

"bf16" paged KV cache
---------------------
``bfloat16 [num_blocks, B, 512]`` (or the 4-D view ``[num_blocks, B, 1, 512]``), token
at ``[slot // B, slot % B]``.
"""

from __future__ import annotations

import torch

from .. import _checks as C
from ._float import E4M3_MAX, pow2


KV_DIM = 512
# The attention head dim: K and V are both this cached latent (MQA), so q's head dim is it too.
HEAD_DIM = KV_DIM
# Sliding-window length of every DeepSeek V4 / V4.1 layer (docs/design.md section 1).
WINDOW = 128
NOPE_DIM = 448
ROPE_DIM = 64
FP8_GROUP = 64
FP8_NUM_GROUPS = NOPE_DIM // FP8_GROUP  # 7
FP8_DS_MLA_TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
FP8_DS_MLA_TOKEN_SCALE_BYTES = 8  # 7 UE8M0 exponents + 1 pad
FP8_DS_MLA_VIEW_LAST_DIM = FP8_DS_MLA_TOKEN_DATA_BYTES + FP8_DS_MLA_TOKEN_SCALE_BYTES  # 584
_UE8M0_BIAS = 127
_FP8_AMAX_FLOOR = 1e-4


def fp8_ds_mla_block_bytes(block_size: int) -> int:
    """Bytes per block of the fp8_ds_mla cache: ``ceil(B * 584 / 576) * 576``."""
    C.host_int("fp8_ds_mla_block_bytes", "block_size", block_size, lo=1)
    unit = FP8_DS_MLA_TOKEN_DATA_BYTES
    return -(-block_size * FP8_DS_MLA_VIEW_LAST_DIM // unit) * unit


def new_fp8_ds_mla_cache(
    num_blocks: int,
    block_size: int,
    *,
    device="cpu",
    fill: str = "zeros",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Allocates an fp8_ds_mla cache shaped like the view vLLM hands over.

    Args:
        num_blocks: number of blocks (>= 0).
        block_size: tokens per block B (> 0).
        device: device of the cache.
        fill: ``"zeros"`` or ``"random"`` (uniform random bytes, to catch reads of
            unwritten bytes).
        generator: optional ``torch.Generator`` for ``fill="random"``.

    Returns:
        uint8 ``[num_blocks, B, 584]`` with strides
        ``(fp8_ds_mla_block_bytes(B), 584, 1)`` over a flat storage of
        ``num_blocks * fp8_ds_mla_block_bytes(B)`` bytes.
    """
    op = "new_fp8_ds_mla_cache"
    C.host_int(op, "num_blocks", num_blocks, lo=0)
    C.host_int(op, "block_size", block_size, lo=1)
    C.one_of(op, "fill", fill, ("zeros", "random"))
    block_bytes = fp8_ds_mla_block_bytes(block_size)
    total = num_blocks * block_bytes
    if fill == "zeros":
        flat = torch.zeros(total, dtype=torch.uint8, device=device)
    else:
        gen_device = generator.device if generator is not None else torch.device("cpu")
        flat = torch.randint(
            0, 256, (total,), dtype=torch.uint8, generator=generator, device=gen_device
        ).to(device)
    return flat.as_strided(
        (num_blocks, block_size, FP8_DS_MLA_VIEW_LAST_DIM),
        (block_bytes, FP8_DS_MLA_VIEW_LAST_DIM, 1),
    )


def kv_cache_layout(cache: torch.Tensor, *, op: str = "kv_cache_layout", name: str = "cache") -> tuple[str, int]:
    """Identifies and validates a paged KV cache tensor (the rules of the sparse MQA ops,
    csrc/attention/sparse_mqa.cu, which call this with their op and argument names).

    Accepted:

    * fp8_ds_mla: uint8 ``[num_blocks, B, 584]`` or ``[num_blocks, B, 1, 584]`` with
      ``stride(-1) == 1``, ``stride(1) == 584`` and ``stride(0) >= B * 584``.
    * bf16: bfloat16 ``[num_blocks, B, 512]`` or ``[num_blocks, B, 1, 512]`` with
      ``stride(-1) == 1``, ``stride(1) == 512`` and ``stride(0) >= B * 512``.

    Returns:
        ``("fp8_ds_mla" | "bf16", block_size)``.

    Raises:
        TypeError if ``cache`` is not a tensor, ValueError for anything else that does
        not match.
    """
    C.tensor(op, name, cache)
    shape = tuple(cache.shape)
    if not (cache.dim() == 3 or (cache.dim() == 4 and cache.shape[2] == 1)):
        raise C.error(op, f"{name} must be [num_blocks, block_size, D] or [num_blocks, block_size, 1, D], got shape "
                          f"{shape}")
    if cache.dtype == torch.uint8:
        kind, last = "fp8_ds_mla", FP8_DS_MLA_VIEW_LAST_DIM
        if cache.shape[-1] != last:
            raise C.error(op, f"{name} is a uint8 (fp8_ds_mla) cache and must have last dim {last}, got shape {shape}")
    elif cache.dtype == torch.bfloat16:
        kind, last = "bf16", KV_DIM
        if cache.shape[-1] != last:
            raise C.error(op, f"{name} is a bf16 cache and must have last dim {last}, got shape {shape}")
    else:
        raise C.error(op, f"{name} must be uint8 (fp8_ds_mla layout) or bfloat16 (bf16 layout), got dtype "
                          f"{cache.dtype}")
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    if block_size <= 0:
        raise C.error(op, f"{name} must have block_size (dim 1) > 0, got shape {shape}")
    if cache.stride(-1) != 1:
        raise C.error(op, f"{name} must have unit stride along its last dim, got strides {cache.stride()}")
    if block_size > 1 and cache.stride(1) != last:
        raise C.error(op, f"{name} must have stride(1) == {last} (rows of one block packed), got strides "
                          f"{cache.stride()}")
    if num_blocks > 1 and cache.stride(0) < block_size * last:
        raise C.error(op, f"{name} block stride (stride(0)) {cache.stride(0)} is smaller than block_size * {last}")
    return kind, block_size


def _as_3d(cache: torch.Tensor) -> torch.Tensor:
    return cache[:, :, 0, :] if cache.dim() == 4 else cache


def _fp8_ds_mla_regions(cache: torch.Tensor):
    """Views ``[num_blocks, B, 576]`` (token data) and ``[num_blocks, B, 8]`` (scales)."""
    num_blocks, block_size, _ = cache.shape
    stride0 = cache.stride(0)
    base = cache.storage_offset()
    data = cache.as_strided(
        (num_blocks, block_size, FP8_DS_MLA_TOKEN_DATA_BYTES),
        (stride0, FP8_DS_MLA_TOKEN_DATA_BYTES, 1),
        base,
    )
    scales = cache.as_strided(
        (num_blocks, block_size, FP8_DS_MLA_TOKEN_SCALE_BYTES),
        (stride0, FP8_DS_MLA_TOKEN_SCALE_BYTES, 1),
        base + block_size * FP8_DS_MLA_TOKEN_DATA_BYTES,
    )
    return data, scales


def _check_slots(op: str, slots, num_slots: int, device, *, allow_negative: bool) -> torch.Tensor:
    """int32/int64 slot ids [n] below ``num_slots`` (negative ones only if allowed), as int64
    on ``device``."""
    C.dtype(op, "slots", slots, torch.int32, torch.int64)
    C.ndim(op, "slots", slots, 1, "[n]")
    slots = slots.to(device=device, dtype=torch.int64)
    if slots.numel():
        if bool((slots >= num_slots).any()):
            raise C.error(op, f"slots must be < num_blocks * block_size = {num_slots}, got max {int(slots.max())}")
        if not allow_negative and bool((slots < 0).any()):
            raise C.error(op, f"slots must be >= 0, got min {int(slots.min())}")
    return slots


def _cache_of_kind(op: str, cache: torch.Tensor, want: str) -> tuple[torch.Tensor, int]:
    """``cache`` validated as a ``want`` cache: (its 3-D view, block_size)."""
    kind, block_size = kv_cache_layout(cache, op=op)
    if kind != want:
        what = "an fp8_ds_mla (uint8)" if want == "fp8_ds_mla" else "a bf16"
        raise C.error(op, f"cache must be {what} cache, got {kind}")
    return _as_3d(cache), block_size


def _check_rows(op: str, rows, n: int) -> None:
    C.floating(op, "rows", rows)
    C.shape(op, "rows", rows, (n, KV_DIM), " to match slots")


def _quantize_fp8_ds_mla_rows(rows: torch.Tensor):
    """Returns (data bytes uint8 [n, 576], scale bytes uint8 [n, 8])."""
    n = rows.shape[0]
    x_bf16 = rows.to(torch.bfloat16)
    x = x_bf16.float()
    nope = x[:, :NOPE_DIM].reshape(n, FP8_NUM_GROUPS, FP8_GROUP)
    fp8_max = torch.tensor(E4M3_MAX, dtype=torch.float32, device=rows.device)

    amax = nope.abs().amax(dim=-1, keepdim=True).clamp(min=_FP8_AMAX_FLOOR)
    # float32 log2 is exact at powers of two, and amax / 448 is either an exact power
    # of two or (bf16 amax, or the 1e-4 floor) far from one, so this ceil is the exact
    # ceil(log2) on every device.
    e = torch.ceil(torch.log2(amax / fp8_max)).to(torch.int32)
    q = torch.clamp(nope * pow2(-e), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    exp_bytes = torch.clamp(e.squeeze(-1) + _UE8M0_BIAS, 0, 255).to(torch.uint8)

    data = torch.cat(
        [q.reshape(n, NOPE_DIM).view(torch.uint8), x_bf16[:, NOPE_DIM:].contiguous().view(torch.uint8)],
        dim=1,
    )
    pad = torch.zeros(n, 1, dtype=torch.uint8, device=rows.device)
    return data, torch.cat([exp_bytes, pad], dim=1)


def write_fp8_ds_mla(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantizes rows into an fp8_ds_mla cache, in place, the way vLLM does.

    ``x = rows -> bf16 -> float32``; per 64-dim group of dims 0..447::

        amax = max(max|x|, 1e-4)
        e    = ceil(log2(amax / 448))          # float32 log2
        q    = clamp(x * 2**-e, -448, 448).to(float8_e4m3fn)
        byte = clamp(e + 127, 0, 255)

    Dims 448..511 are stored as raw bf16; the pad byte is 0.

    Args:
        cache: uint8 fp8_ds_mla cache ``[num_blocks, B, 584]`` (or ``[.., B, 1, 584]``).
        slots: int32/int64 ``[n]``; negative slots are skipped, slots
            ``>= num_blocks * B`` raise.  Slots should be unique.
        rows: float ``[n, 512]`` (any float dtype; rounded to bf16 first).
    """
    op = "write_fp8_ds_mla"
    cache, block_size = _cache_of_kind(op, cache, "fp8_ds_mla")
    slots = _check_slots(op, slots, cache.shape[0] * block_size, cache.device, allow_negative=True)
    _check_rows(op, rows, slots.shape[0])
    keep = slots >= 0
    slots, rows = slots[keep], rows.to(cache.device)[keep]
    data, scales = _quantize_fp8_ds_mla_rows(rows)
    data_view, scale_view = _fp8_ds_mla_regions(cache)
    block, offset = slots // block_size, slots % block_size
    data_view[block, offset] = data
    scale_view[block, offset] = scales


def _read_fp8_ds_mla_slots(cache: torch.Tensor, block_size: int, slots: torch.Tensor):
    data_view, scale_view = _fp8_ds_mla_regions(cache)
    block, offset = slots // block_size, slots % block_size
    data = data_view[block, offset]  # [n, 576]
    exp_bytes = scale_view[block, offset][:, :FP8_NUM_GROUPS]  # [n, 7]
    n = slots.shape[0]
    q = data[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float()
    scale = pow2(exp_bytes.to(torch.int32) - _UE8M0_BIAS)
    nope = (q.reshape(n, FP8_NUM_GROUPS, FP8_GROUP) * scale.unsqueeze(-1)).reshape(n, NOPE_DIM)
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16)
    return torch.cat([nope.to(torch.bfloat16), rope], dim=1)


def read_fp8_ds_mla(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Reads and dequantizes tokens from an fp8_ds_mla cache.

    Dims 0..447 are ``float(fp8) * 2**(byte - 127)`` (exact in bf16 for bytes written
    by :func:`write_fp8_ds_mla`); dims 448..511 are the raw bf16.

    Args:
        cache: uint8 fp8_ds_mla cache ``[num_blocks, B, 584]`` (or ``[.., B, 1, 584]``).
        slots: int32/int64 ``[n]``, each in ``[0, num_blocks * B)`` (else ValueError).

    Returns:
        bfloat16 ``[n, 512]``.
    """
    op = "read_fp8_ds_mla"
    cache, block_size = _cache_of_kind(op, cache, "fp8_ds_mla")
    slots = _check_slots(op, slots, cache.shape[0] * block_size, cache.device, allow_negative=False)
    return _read_fp8_ds_mla_slots(cache, block_size, slots)


def dequantize_fp8_ds_mla_cache(cache: torch.Tensor) -> torch.Tensor:
    """Dequantizes every slot of an fp8_ds_mla cache.

    Args:
        cache: uint8 fp8_ds_mla cache ``[num_blocks, B, 584]`` (or ``[.., B, 1, 584]``).

    Returns:
        bfloat16 ``[num_blocks * B, 512]``, row = slot id.
    """
    cache, block_size = _cache_of_kind("dequantize_fp8_ds_mla_cache", cache, "fp8_ds_mla")
    slots = torch.arange(cache.shape[0] * block_size, device=cache.device)
    return _read_fp8_ds_mla_slots(cache, block_size, slots)


def new_bf16_cache(
    num_blocks: int,
    block_size: int,
    *,
    device="cpu",
    fill: str = "zeros",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Allocates a contiguous bf16 paged cache.

    Args:
        num_blocks: number of blocks (>= 0).
        block_size: tokens per block B (> 0).
        device: device of the cache.
        fill: ``"zeros"`` or ``"random"`` (standard normal values).
        generator: optional ``torch.Generator`` for ``fill="random"``.

    Returns:
        bfloat16 ``[num_blocks, B, 512]``.
    """
    op = "new_bf16_cache"
    C.host_int(op, "num_blocks", num_blocks, lo=0)
    C.host_int(op, "block_size", block_size, lo=1)
    C.one_of(op, "fill", fill, ("zeros", "random"))
    shape = (num_blocks, block_size, KV_DIM)
    if fill == "zeros":
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.randn(shape, generator=generator, device=gen_device).to(
        device=device, dtype=torch.bfloat16
    )


def write_bf16_cache(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Writes rows (rounded to bf16) into a bf16 paged cache, in place.

    Args:
        cache: bfloat16 ``[num_blocks, B, 512]`` (or ``[num_blocks, B, 1, 512]``).
        slots: int32/int64 ``[n]``; negative slots are skipped, slots
            ``>= num_blocks * B`` raise.  Slots should be unique.
        rows: float ``[n, 512]``.
    """
    op = "write_bf16_cache"
    cache, block_size = _cache_of_kind(op, cache, "bf16")
    slots = _check_slots(op, slots, cache.shape[0] * block_size, cache.device, allow_negative=True)
    _check_rows(op, rows, slots.shape[0])
    keep = slots >= 0
    slots, rows = slots[keep], rows.to(cache.device)[keep]
    cache[slots // block_size, slots % block_size] = rows.to(torch.bfloat16)


def read_bf16_cache(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Reads tokens from a bf16 paged cache.

    Args:
        cache: bfloat16 ``[num_blocks, B, 512]`` (or ``[num_blocks, B, 1, 512]``).
        slots: int32/int64 ``[n]``, each in ``[0, num_blocks * B)`` (else ValueError).

    Returns:
        bfloat16 ``[n, 512]``.
    """
    op = "read_bf16_cache"
    cache, block_size = _cache_of_kind(op, cache, "bf16")
    slots = _check_slots(op, slots, cache.shape[0] * block_size, cache.device, allow_negative=False)
    return cache[slots // block_size, slots % block_size]
