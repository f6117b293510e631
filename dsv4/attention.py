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


import torch

from . import _checks as C
from .formats.kv_cache import HEAD_DIM, dequantize_fp8_ds_mla_cache, kv_cache_layout
from .reference import sparse_mqa
from ._ops import op

__all__ = ["sparse_mqa_decode", "sparse_mqa_prefill"]

DEFAULT_SOFTMAX_SCALE = HEAD_DIM**-0.5


# --------------------------------------------------------------------------------------
# the rules of csrc/attention/sparse_mqa.cu, for the CPU and fake kernels
# --------------------------------------------------------------------------------------


def _check_qo(op: str, t: torch.Tensor, name: str, layout: str) -> None:
    """q or out: bf16, ``layout`` ([B, s_q, H, 512] or [T, H, 512]), head dim 512."""
    C.dtype(op, name, t, torch.bfloat16)
    C.ndim(op, name, t, layout.count(",") + 1, layout)
    if t.shape[-1] != HEAD_DIM:
        raise C.error(op, f"{name} head dim must be 512, got shape {tuple(t.shape)}")


def _check_source(op: str, q: torch.Tensor, cache: torch.Tensor, cache_name: str, idx: torch.Tensor, idx_name: str,
                  lengths, lengths_name: str, b: int, s_q: int) -> str:
    """One (cache, index list, lengths) source; returns the cache kind."""
    C.same_device(op, cache_name, cache, "q", q)
    kind, _ = kv_cache_layout(cache, op=op, name=cache_name)
    C.same_device(op, idx_name, idx, "q", q)
    C.dtype(op, idx_name, idx, torch.int32)
    if idx.dim() != 3 or idx.shape[0] != b or idx.shape[1] != s_q:
        raise C.error(op, f"{idx_name} must be [{b}, {s_q}, topk], got shape {tuple(idx.shape)}")
    if lengths is not None:
        C.same_device(op, lengths_name, lengths, "q", q)
        C.dtype(op, lengths_name, lengths, torch.int32)
        if lengths.dim() != 1 or lengths.shape[0] != b:
            raise C.error(op, f"{lengths_name} must be [{b}], got shape {tuple(lengths.shape)}")
    return kind


def _check_common(op: str, q4: torch.Tensor, out4: torch.Tensor, attn_sink, softmax_scale: float) -> None:
    h = q4.shape[2]
    if h not in (64, 128):
        raise C.error(op, f"q must have 64 or 128 heads (pad other head counts with sink = -inf), got {h}")
    if tuple(out4.shape) != tuple(q4.shape):
        raise C.error(op, f"out must have the shape of q {list(q4.shape)}, got {list(out4.shape)}")
    C.same_device(op, "out", out4, "q", q4)
    C.finite_positive(op, "softmax_scale", softmax_scale)
    if attn_sink is not None:
        C.same_device(op, "attn_sink", attn_sink, "q", q4)
        C.dtype(op, "attn_sink", attn_sink, torch.float32)
        if attn_sink.dim() != 1 or attn_sink.shape[0] != h:
            raise C.error(op, f"attn_sink must be [{h}] (one logit per head), got shape {tuple(attn_sink.shape)}")


def _check_decode(q, kv_cache, indices, topk_length, attn_sink, softmax_scale, extra_kv_cache, extra_indices,
                  extra_topk_length, out) -> None:
    op = "sparse_mqa_decode"
    _check_qo(op, q, "q", "[B, s_q, H, 512]")
    _check_qo(op, out, "out", "[B, s_q, H, 512]")
    b, s_q = q.shape[0], q.shape[1]
    kind = _check_source(op, q, kv_cache, "kv_cache", indices, "indices", topk_length, "topk_length", b, s_q)
    if (extra_kv_cache is None) != (extra_indices is None):
        raise C.error(op, "extra_kv_cache and extra_indices must be given together")
    if extra_kv_cache is None and extra_topk_length is not None:
        raise C.error(op, "extra_topk_length given without extra_kv_cache / extra_indices")
    if extra_kv_cache is not None:
        C.same_device(op, "extra_kv_cache", extra_kv_cache, "q", q)
        kind2, _ = kv_cache_layout(extra_kv_cache, op=op, name="extra_kv_cache")
        if kind2 != kind:
            raise C.error(op, f"extra_kv_cache must have the same layout (dtype) as kv_cache: got "
                              f"{extra_kv_cache.dtype} and {kv_cache.dtype}")
        _check_source(op, q, extra_kv_cache, "extra_kv_cache", extra_indices, "extra_indices", extra_topk_length,
                      "extra_topk_length", b, s_q)
    _check_common(op, q, out, attn_sink, softmax_scale)


def _check_prefill(q, kv, indices, topk_length, attn_sink, softmax_scale, out) -> None:
    op = "sparse_mqa_prefill"
    _check_qo(op, q, "q", "[T, H, 512]")
    _check_qo(op, out, "out", "[T, H, 512]")
    t = q.shape[0]
    C.dtype(op, "kv", kv, torch.bfloat16)
    if not (kv.dim() == 2 or (kv.dim() == 3 and kv.shape[1] == 1)):
        raise C.error(op, f"kv must be [N, 512] or [N, 1, 512], got shape {tuple(kv.shape)}")
    if kv.shape[-1] != HEAD_DIM:
        raise C.error(op, f"kv head dim must be 512, got shape {tuple(kv.shape)}")
    if not (indices.dim() == 2 or (indices.dim() == 3 and indices.shape[1] == 1)):
        raise C.error(op, f"indices must be [T, topk] or [T, 1, topk], got shape {tuple(indices.shape)}")
    # kv is a bf16 paged cache with block_size 1, as the C++ entry reads it
    kv3 = kv.unsqueeze(1) if kv.dim() == 2 else kv
    idx3 = indices if indices.dim() == 3 else indices.unsqueeze(1)
    _check_source(op, q, kv3, "kv", idx3, "indices", topk_length, "topk_length", t, 1)
    _check_common(op, q.unsqueeze(1), out.unsqueeze(1), attn_sink, softmax_scale)


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
    kind, _ = kv_cache_layout(cache)
    if kind == "fp8_ds_mla":
        return dequantize_fp8_ds_mla_cache(cache).float()
    c = cache[:, :, 0, :] if cache.dim() == 4 else cache
    return c.reshape(-1, HEAD_DIM).float()


def _run_reference(q4, rows, idx3, lengths_b, attn_sink, softmax_scale, rows2=None, idx3_2=None, lengths2_b=None):
    b, s_q, h, d = q4.shape
    t = b * s_q

    def per_token(x):
        return None if x is None else x.repeat_interleave(s_q)

    # (explicit topk: reshape(t, -1) is ambiguous for an empty batch)
    o, lse = sparse_mqa(
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
