"""Sparse MQA attention for DeepSeek V4: ``dsv4.sparse_mqa_decode`` / ``dsv4.sparse_mqa_prefill``.

One KV head (K = V, 512 dims) serves all 64 or 128 query heads. Each query token
attends to the rows named by its index list(s); the softmax has a per-head sink logit
that only adds to the denominator. Conventions (docs/design.md section 1, dsv4.reference):

* entry ``e`` of a token's list is used iff ``e < topk_length[b]`` (all ``topk`` entries
  when ``topk_length`` is None) and ``0 <= index < number of slots``; ``-1`` padding and
  out-of-range ids are skipped; duplicate ids count twice; a skipped entry's bytes never
  reach the math (the CUDA kernels load a zero row in its place, the CPU kernel selects
  zeros), so NaN or inf in slots that no used entry names cannot reach the output;
* ``out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink[h] - m))`` with
  ``s_j = softmax_scale * <q, k_j>``; ``attn_sink = None`` or ``-inf`` = no sink,
  ``+inf`` = zero output (sink values are not checked: a NaN logit makes the head's
  output NaN where the token sees a key);
* ``lse`` = natural-log sum of exp(s_j) WITHOUT the sink; a token with no visible key
  gets a zero output and ``lse = -inf`` (never NaN).

CUDA: sm_90a kernels (csrc/attention). CPU: the float32 reference
(``dsv4.reference.sparse_mqa``) on the dequantized cache, rounded to bf16 on output.
"""

from __future__ import annotations

import math

import torch

from . import formats, reference
from ._ops import op

__all__ = ["sparse_mqa_decode", "sparse_mqa_prefill"]

HEAD_DIM = 512
DEFAULT_SOFTMAX_SCALE = HEAD_DIM**-0.5


# --------------------------------------------------------------------------------------
# validation shared by the CPU and fake kernels (same rules and wording as
# csrc/attention/sparse_mqa.cu)
# --------------------------------------------------------------------------------------


def _err(msg: str) -> ValueError:
    return ValueError("dsv4: " + msg)


def _check_qo(t: torch.Tensor, name: str, shape: str, ndim: int) -> None:
    if t.dtype != torch.bfloat16:
        raise _err(f"{name} must have dtype torch.bfloat16, got {t.dtype}")
    if t.dim() != ndim:
        raise _err(f"{name} must be {ndim}-D {shape}, got shape {tuple(t.shape)}")
    if t.shape[-1] != HEAD_DIM:
        raise _err(f"{name} head dim must be 512, got shape {tuple(t.shape)}")


def _check_heads(h: int) -> None:
    if h not in (64, 128):
        raise _err(f"q must have 64 or 128 heads (pad other head counts with sink = -inf), got {h}")


def _check_same_device(t: torch.Tensor, name: str, q: torch.Tensor) -> None:
    if t.device != q.device:
        raise _err(f"{name} is on {t.device} but q is on {q.device}; they must be on the same device")


def _check_cache(c: torch.Tensor, name: str, q: torch.Tensor) -> str:
    _check_same_device(c, name, q)
    if not (c.dim() == 3 or (c.dim() == 4 and c.shape[2] == 1)):
        raise _err(
            f"{name} must be [num_blocks, block_size, D] or [num_blocks, block_size, 1, D], "
            f"got shape {tuple(c.shape)}"
        )
    if c.dtype == torch.uint8:
        kind, last = "fp8_ds_mla", formats.FP8_DS_MLA_VIEW_LAST_DIM
        if c.shape[-1] != last:
            raise _err(f"{name} is a uint8 (fp8_ds_mla) cache and must have last dim {last}, got shape {tuple(c.shape)}")
    elif c.dtype == torch.bfloat16:
        kind, last = "bf16", HEAD_DIM
        if c.shape[-1] != last:
            raise _err(f"{name} is a bf16 cache and must have last dim 512, got shape {tuple(c.shape)}")
    else:
        raise _err(f"{name} must be uint8 (fp8_ds_mla layout) or bfloat16 (bf16 layout), got dtype {c.dtype}")
    nb, bs = c.shape[0], c.shape[1]
    if bs <= 0:
        raise _err(f"{name} must have block_size (dim 1) > 0, got shape {tuple(c.shape)}")
    if c.stride(-1) != 1:
        raise _err(f"{name} must have unit stride along its last dim, got strides {c.stride()}")
    if bs > 1 and c.stride(1) != last:
        raise _err(f"{name} must have stride(1) == {last} (rows of one block packed), got strides {c.stride()}")
    if nb > 1 and c.stride(0) < bs * last:
        raise _err(f"{name} block stride (stride(0)) {c.stride(0)} is smaller than block_size * {last}")
    return kind


def _check_indices(idx: torch.Tensor, name: str, q: torch.Tensor, b: int, s_q: int) -> None:
    _check_same_device(idx, name, q)
    if idx.dtype != torch.int32:
        raise _err(f"{name} must have dtype torch.int32, got {idx.dtype}")
    if idx.dim() != 3 or idx.shape[0] != b or idx.shape[1] != s_q:
        raise _err(f"{name} must be [{b}, {s_q}, topk], got shape {tuple(idx.shape)}")


def _check_lengths(t, name: str, q: torch.Tensor, b: int) -> None:
    if t is None:
        return
    _check_same_device(t, name, q)
    if t.dtype != torch.int32:
        raise _err(f"{name} must have dtype torch.int32, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != b:
        raise _err(f"{name} must be [{b}], got shape {tuple(t.shape)}")


def _check_common(q4: torch.Tensor, out4: torch.Tensor, attn_sink, softmax_scale: float) -> None:
    _check_heads(q4.shape[2])
    if tuple(out4.shape) != tuple(q4.shape):
        raise _err(f"out must have the shape of q {list(q4.shape)}, got {list(out4.shape)}")
    _check_same_device(out4, "out", q4)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise _err(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    if attn_sink is not None:
        _check_same_device(attn_sink, "attn_sink", q4)
        if attn_sink.dtype != torch.float32:
            raise _err(f"attn_sink must have dtype torch.float32, got {attn_sink.dtype}")
        if attn_sink.dim() != 1 or attn_sink.shape[0] != q4.shape[2]:
            raise _err(f"attn_sink must be [{q4.shape[2]}] (one logit per head), got shape {tuple(attn_sink.shape)}")


def _check_decode(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, extra_kv_cache, extra_indices,
                  extra_topk_length, out) -> None:
    _check_qo(q, "q", "[B, s_q, H, 512]", 4)
    _check_qo(out, "out", "[B, s_q, H, 512]", 4)
    b, s_q = q.shape[0], q.shape[1]
    kind = _check_cache(kv_cache, "kv_cache", q)
    _check_indices(indices, "indices", q, b, s_q)
    _check_lengths(topk_length, "topk_length", q, b)
    if (extra_kv_cache is None) != (extra_indices is None):
        raise _err("extra_kv_cache and extra_indices must be given together")
    if extra_kv_cache is None and extra_topk_length is not None:
        raise _err("extra_topk_length given without extra_kv_cache / extra_indices")
    if extra_kv_cache is not None:
        kind2 = _check_cache(extra_kv_cache, "extra_kv_cache", q)
        if kind2 != kind:
            raise _err(
                f"extra_kv_cache must have the same layout (dtype) as kv_cache: got {extra_kv_cache.dtype} "
                f"and {kv_cache.dtype}"
            )
        _check_indices(extra_indices, "extra_indices", q, b, s_q)
        _check_lengths(extra_topk_length, "extra_topk_length", q, b)
    _check_common(q, out, attn_sink, softmax_scale)


def _check_prefill(q, kv, indices, topk_length, attn_sink, softmax_scale, out) -> None:
    _check_qo(q, "q", "[T, H, 512]", 3)
    _check_qo(out, "out", "[T, H, 512]", 3)
    t = q.shape[0]
    _check_same_device(kv, "kv", q)
    if kv.dtype != torch.bfloat16:
        raise _err(f"kv must have dtype torch.bfloat16, got {kv.dtype}")
    if not (kv.dim() == 2 or (kv.dim() == 3 and kv.shape[1] == 1)):
        raise _err(f"kv must be [N, 512] or [N, 1, 512], got shape {tuple(kv.shape)}")
    if kv.shape[-1] != HEAD_DIM:
        raise _err(f"kv head dim must be 512, got shape {tuple(kv.shape)}")
    if kv.stride(-1) != 1:
        raise _err(f"kv must have unit stride along its last dim, got strides {kv.stride()}")
    if not (indices.dim() == 2 or (indices.dim() == 3 and indices.shape[1] == 1)):
        raise _err(f"indices must be [T, topk] or [T, 1, topk], got shape {tuple(indices.shape)}")
    idx3 = indices if indices.dim() == 3 else indices.unsqueeze(1)
    _check_indices(idx3, "indices", q, t, 1)
    _check_lengths(topk_length, "topk_length", q, t)
    _check_common(q.unsqueeze(1), out.unsqueeze(1), attn_sink, softmax_scale)


# --------------------------------------------------------------------------------------
# fake kernels (torch.compile / meta)
# --------------------------------------------------------------------------------------


@torch.library.register_fake("dsv4::sparse_mqa_decode")
def _(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, extra_kv_cache, extra_indices,
      extra_topk_length, out, batch_invariant=False):
    _check_decode(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, extra_kv_cache, extra_indices,
                  extra_topk_length, out)
    return q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.register_fake("dsv4::sparse_mqa_prefill")
def _(q, kv, indices, topk_length, attn_sink, softmax_scale, out):
    _check_prefill(q, kv, indices, topk_length, attn_sink, softmax_scale, out)
    return q.new_empty(q.shape[:2], dtype=torch.float32)


# --------------------------------------------------------------------------------------
# CPU kernels = float32 reference on the dequantized cache
# --------------------------------------------------------------------------------------


def _cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """All slots of a paged cache as float32 [num_blocks * block_size, 512]."""
    kind, _ = formats.kv_cache_layout(cache)
    if kind == "fp8_ds_mla":
        return formats.dequantize_fp8_ds_mla_cache(cache).float()
    c = cache[:, :, 0, :] if cache.dim() == 4 else cache
    return c.reshape(-1, HEAD_DIM).float()


def _run_reference(q4, rows, idx3, lengths_b, attn_sink, softmax_scale, rows2=None, idx3_2=None, lengths2_b=None):
    b, s_q, h, d = q4.shape
    t = b * s_q

    def per_token(x):
        return None if x is None else x.repeat_interleave(s_q)

    # (explicit topk: reshape(t, -1) is ambiguous for an empty batch)
    o, lse = reference.sparse_mqa(
        q4.reshape(t, h, d),
        rows,
        idx3.reshape(t, idx3.shape[-1]),
        per_token(lengths_b),
        attn_sink,
        softmax_scale,
        extra_kv=rows2,
        extra_indices=None if idx3_2 is None else idx3_2.reshape(t, idx3_2.shape[-1]),
        extra_lengths=per_token(lengths2_b),
    )
    return o.reshape(b, s_q, h, d), lse.reshape(b, s_q, h)


@torch.library.impl("dsv4::sparse_mqa_decode", "CPU")
def _(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, extra_kv_cache, extra_indices,
      extra_topk_length, out, batch_invariant=False):
    # the float32 reference treats every token on its own: batch invariant either way
    _check_decode(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, extra_kv_cache, extra_indices,
                  extra_topk_length, out)
    rows2 = None if extra_kv_cache is None else _cache_rows(extra_kv_cache)
    o, lse = _run_reference(q, _cache_rows(kv_cache), indices, topk_length, attn_sink, softmax_scale,
                            rows2, extra_indices, extra_topk_length)
    out.copy_(o.to(out.dtype))
    return lse


@torch.library.impl("dsv4::sparse_mqa_prefill", "CPU")
def _(q, kv, indices, topk_length, attn_sink, softmax_scale, out):
    _check_prefill(q, kv, indices, topk_length, attn_sink, softmax_scale, out)
    rows = kv.reshape(kv.shape[0], HEAD_DIM).float()
    idx3 = indices if indices.dim() == 3 else indices.unsqueeze(1)
    o, lse = _run_reference(q.unsqueeze(1), rows, idx3, topk_length, attn_sink, softmax_scale)
    out.copy_(o.squeeze(1).to(out.dtype))
    return lse.squeeze(1)


# --------------------------------------------------------------------------------------
# wrappers
# --------------------------------------------------------------------------------------


def sparse_mqa_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA decode over paged caches (replaces vLLM's ``flash_mla_with_kvcache``).

    Args:
        q: bf16 ``[B, s_q, H, 512]``, H in {64, 128}; unit stride along the last dim,
            other strides multiples of 8 elements.
        kv_cache: paged cache, either fp8_ds_mla (uint8 ``[num_blocks, block_size, 584]``
            or ``[num_blocks, block_size, 1, 584]``, real block stride in ``stride(0)``;
            see ``dsv4.formats``) or bf16 (``[num_blocks, block_size(, 1), 512]``).
            Slot id = block * block_size + offset.
        indices: int32 ``[B, s_q, topk]`` slot ids into ``kv_cache`` (unit stride along
            topk). -1 / out-of-range ids are skipped.
        topk_length: int32 ``[B]`` or None: only the first ``topk_length[b]`` entries of
            batch b's lists are used (shared by its s_q tokens).
        attn_sink: fp32 ``[H]`` sink logits or None.
        softmax_scale: defaults to 512 ** -0.5; finite and > 0.
        extra_kv_cache, extra_indices ``[B, s_q, topk2]``, extra_topk_length ``[B]``: a
            second cache and index list (same layout as ``kv_cache``) in the same softmax.
        out: optional bf16 ``[B, s_q, H, 512]`` output buffer (written in place).
        batch_invariant: when True, a token's ``out`` and ``lse`` are bitwise the same
            whatever the batch around it (size, other sequences, list widths, SM count):
            the key axis is split at fixed positions (every 512 keys) and the partials are
            merged in a fixed order, always through the split path. Lists may hold at most
            32,768 entries in all (kv + extra). Costs speed where the default would split differently
            (docs/perf.md). vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``) selects
            it in the plugin.

    Returns:
        ``(out bf16 [B, s_q, H, 512], lse fp32 [B, s_q, H])``; lse excludes the sink and
        is -inf for tokens without visible keys (their output is 0).
    """
    if softmax_scale is None:
        softmax_scale = DEFAULT_SOFTMAX_SCALE
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = op("sparse_mqa_decode")(
        q, kv_cache, indices, topk_length, attn_sink, float(softmax_scale), extra_kv_cache, extra_indices,
        extra_topk_length, out, bool(batch_invariant),
    )
    return out, lse


def sparse_mqa_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA prefill over a gathered bf16 KV buffer (replaces ``flash_mla_sparse_fwd``).

    Args:
        q: bf16 ``[T, H, 512]``, H in {64, 128}.
        kv: bf16 ``[N, 512]`` or ``[N, 1, 512]`` (unit stride along the last dim); row n
            is both key and value n.
        indices: int32 ``[T, topk]`` or ``[T, 1, topk]`` row ids into ``kv``; -1 /
            out-of-range ids are skipped.
        topk_length: int32 ``[T]`` or None: token t uses its first ``topk_length[t]``
            entries.
        attn_sink: fp32 ``[H]`` or None. softmax_scale: defaults to 512 ** -0.5; finite
            and > 0.
        out: optional bf16 ``[T, H, 512]`` output buffer.

    Returns:
        ``(out bf16 [T, H, 512], lse fp32 [T, H])`` (same conventions as decode).
    """
    if softmax_scale is None:
        softmax_scale = DEFAULT_SOFTMAX_SCALE
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    lse = op("sparse_mqa_prefill")(q, kv, indices, topk_length, attn_sink, float(softmax_scale), out)
    return out, lse
