"""Dense masked FMHA over ``[compressed | window]`` KV per sequence: ``dsv4.dense_fmha``
(the op ``dsv4::dense_fmha``, csrc/fmha/dense_fmha.cu).

Semantics are those of :func:`dsv4.reference.dense_fmha` (docs/design.md 3B): per
sequence the kv rows are ``[n_comp compressed entries | L_w window entries]``; query i of
a sequence with ``Tq_s`` queries sits at position ``p = start + L_w - Tq_s + i``
(bottom-right aligned to the window part), window entry j at ``start + j``. Causal: the
query sees window entries in ``[p - window + 1, p]`` and compressed entry w iff
``w < (p + 1) // ratio``. Per-head sink in the denominator; lse excludes the sink; a query
with nothing visible gets zeros and lse = -inf.

CUDA: two kernels behind one call (``dense_fmha_kernel`` names the one a call runs).

* Head dims 64, 128, 256 (any GQA/MQA grouping, K and V of the same head dim): the dense
  kernel ``dsv4::dense_fmha`` (csrc/fmha/): masks computed in the kernel from positions,
  KV read as contiguous tiles; split-KV plus a combine pass (sink applied once) when
  the query tiles alone would leave SMs idle (decode).
* Head dim 512 with one KV head that is both K and V and 64 or 128 query heads
  (DeepSeek V4's shape): the sparse MQA prefill kernel (``dsv4::sparse_mqa_prefill``,
  csrc/attention/), which has the wgmma pipeline for that shape and which the dense
  kernel has no tile for; the visible rows of each query are two contiguous ranges,
  written as an index list on the device (``visible_rows``, no host sync). The same call
  through ``visible_rows`` + ``dsv4.sparse_mqa_prefill`` by hand gives the same result.

Anything else raises a clear error on CUDA (the CPU kernel, the float32 reference
``dsv4.reference.dense_fmha``, runs every shape).

Rows a query does not see (docs/design.md section 1: their bytes must never reach the math): the
head-dim-512 path and the CPU path never let them into that query's result, whatever
they hold. The dense kernel reads whole 64-row tiles of the union of the visible ranges
of 64 queries: rows that none of those queries sees are never read, but a NaN or inf in
a row that one of them sees reaches the others as 0 * NaN inside the tile's P V product
(as in any tiled attention kernel; valid rows are expected to be finite).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import _checks as C
from . import reference
from ._ops import op
from .attention import sparse_mqa_prefill
from .formats.kv_cache import HEAD_DIM, WINDOW

__all__ = ["dense_fmha", "dense_fmha_kernel", "index_width", "visible_rows"]

DENSE_HEAD_DIMS = (64, 128, 256)


_OP = "dense_fmha"


def _check(q, k, v, cu_seqlens_q, cu_seqlens_kv, n_comp, seq_start_pos, attn_sink, softmax_scale, ratio, out) -> None:
    """The op's rules for the CPU and fake kernels: csrc/fmha/dense_fmha.cu's, less its
    kernel's limits (bf16, head dims 64/128/256, Dv = D, strides): the CPU kernel runs every
    shape and float dtype. Shapes only; :func:`_check_values` reads the sequence metadata."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        C.same_device(_OP, name, t, "q", q)
        C.floating(_OP, name, t)
        C.ndim(_OP, name, t, 3, "[rows, heads, head_dim]")
    tq, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    if k.shape[2] != d:
        raise C.error(_OP, f"k must have head_dim {d} like q, got k {list(k.shape)}")
    if v.shape[0] != k.shape[0] or v.shape[1] != k.shape[1]:
        raise C.error(_OP, f"v must have shape [{k.shape[0]}, {k.shape[1]}, Dv] like k, got {list(v.shape)}")
    if hkv == 0 or hq % hkv:
        raise C.error(_OP, f"q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    C.ndim(_OP, "cu_seqlens_q", cu_seqlens_q, 1, "[S + 1]")
    s = cu_seqlens_q.shape[0] - 1
    if s < 0:
        raise C.error(_OP, "cu_seqlens_q must have at least one element")
    for name, t, n in (("cu_seqlens_q", cu_seqlens_q, s + 1), ("cu_seqlens_kv", cu_seqlens_kv, s + 1),
                       ("n_comp", n_comp, s), ("seq_start_pos", seq_start_pos, s)):
        if t is not None:
            C.same_device(_OP, name, t, "q", q)
            C.dtype(_OP, name, t, torch.int32)
            C.shape(_OP, name, t, (n,))
    if attn_sink is not None:
        C.same_device(_OP, "attn_sink", attn_sink, "q", q)
        C.dtype(_OP, "attn_sink", attn_sink, torch.float32)
        C.shape(_OP, "attn_sink", attn_sink, (hq,))
    C.finite_positive(_OP, "softmax_scale", softmax_scale)
    if ratio < 1:
        raise C.error(_OP, f"ratio must be >= 1, got {ratio}")
    C.same_device(_OP, "out", out, "q", q)
    C.shape(_OP, "out", out, (tq, hq, dv))


def _check_values(q, k, cu_seqlens_q, cu_seqlens_kv, n_comp) -> None:
    """The sequence metadata's values (CPU kernel: reading them costs no device sync)."""
    cq, ckv, nc = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist(), n_comp.tolist()
    for name, cu, total in (("cu_seqlens_q", cq, q.shape[0]), ("cu_seqlens_kv", ckv, k.shape[0])):
        if cu[0] != 0 or cu[-1] != total:
            raise C.error(_OP, f"{name} must start at 0 and end at {total}, got {cu}")
        if any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise C.error(_OP, f"{name} must be non-decreasing, got {cu}")
    for i, n in enumerate(nc):
        if not 0 <= n <= ckv[i + 1] - ckv[i]:
            raise C.error(_OP, f"n_comp[{i}] = {n} must lie in [0, kv length {ckv[i + 1] - ckv[i]}]")


@torch.library.register_fake("dsv4::dense_fmha")
def _(q, k, v, cu_seqlens_q, cu_seqlens_kv, n_comp, seq_start_pos, attn_sink, softmax_scale, window, causal,
      ratio, max_seqlen_q, max_seqlen_kv, num_splits, out):
    _check(q, k, v, cu_seqlens_q, cu_seqlens_kv, n_comp, seq_start_pos, attn_sink, softmax_scale, ratio, out)
    return q.new_empty((q.shape[0], q.shape[1]), dtype=torch.float32)


@torch.library.impl("dsv4::dense_fmha", "CPU")
def _(q, k, v, cu_seqlens_q, cu_seqlens_kv, n_comp, seq_start_pos, attn_sink, softmax_scale, window, causal,
      ratio, max_seqlen_q, max_seqlen_kv, num_splits, out):
    _check(q, k, v, cu_seqlens_q, cu_seqlens_kv, n_comp, seq_start_pos, attn_sink, softmax_scale, ratio, out)
    _check_values(q, k, cu_seqlens_q, cu_seqlens_kv, n_comp)
    o, lse = reference.dense_fmha(q, k, v, cu_seqlens_q, cu_seqlens_kv, n_comp, window=window, causal=causal,
                                  ratio=ratio, seq_start_pos=seq_start_pos, sink=attn_sink, scale=softmax_scale)
    out.copy_(o)
    return lse


def visible_rows(
    num_rows: int,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    n_comp: torch.Tensor,
    *,
    width: int,
    window: int,
    causal: bool,
    ratio: int = 1,
    seq_start_pos: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index list of the kv rows each query row sees, for the sparse kernels.

    ``num_rows`` is Tq (q.shape[0]), passed on the host so nothing reads device memory.
    Returns ``(indices int32 [Tq, width], lengths int32 [Tq])``: row t lists its visible
    compressed rows, then its visible window rows (global kv row ids), -1 after
    ``lengths[t]``. ``width`` must be >= the longest visible set (``max_seqlen_kv`` is
    always enough). Device-side only: usable under CUDA graphs and torch.compile.
    """
    dev = cu_seqlens_q.device
    cq, ckv, nc = cu_seqlens_q.long(), cu_seqlens_kv.long(), n_comp.long()
    rows = torch.arange(num_rows, device=dev)
    seq = torch.searchsorted(cq[1:], rows, right=True)
    i = rows - cq[seq]
    tq_s = cq[seq + 1] - cq[seq]
    kv0 = ckv[seq]
    n_c = nc[seq]
    l_w = ckv[seq + 1] - kv0 - n_c
    start = seq_start_pos.long()[seq] if seq_start_pos is not None else torch.zeros_like(rows)
    if causal:
        p = start + l_w - tq_s + i
        n_vis = torch.div(p + 1, ratio, rounding_mode="floor").clamp(min=0)
        n_vis = torch.minimum(n_vis, n_c)
        lo = (p - window + 1 - start).clamp(min=0) if window > 0 else torch.zeros_like(p)
        hi = torch.minimum(p - start, l_w - 1)
    else:
        n_vis, lo, hi = n_c, torch.zeros_like(rows), l_w - 1
    n_win = (hi - lo + 1).clamp(min=0)
    lengths = (n_vis + n_win).to(torch.int32)
    # The [Tq, width] part is the costly one (Tq x ~1152 for a 4K prefill): int32 throughout
    # and four passes. Column c is kv0 + c, shifted past the invisible compressed rows and the
    # window rows before lo once c reaches n_vis, and -1 from lengths on. Row ids fit in
    # int32 (the kernels take int32 indices).
    col = torch.arange(width, device=dev, dtype=torch.int32)[None, :]
    shift = (n_c + lo - n_vis).to(torch.int32)[:, None]
    idx = (col >= n_vis.to(torch.int32)[:, None]).to(torch.int32) * shift
    idx += col + kv0.to(torch.int32)[:, None]
    return idx.masked_fill_(col >= lengths[:, None], -1), lengths


def index_width(max_seqlen_kv: int, *, window: int, causal: bool, ratio: int, has_start_pos: bool) -> int:
    """Host-side upper bound on any query's visible row count, the index list width.

    Causal, positions starting at 0: a query at position p < L_w sees at most
    min((p + 1) // ratio, n_comp) compressed entries, and n * (ratio + 1) <= n_comp + L_w
    <= max_seqlen_kv bounds that by max_seqlen_kv // (ratio + 1); the window part adds
    at most ``window``. For DeepSeek V4 (ratio 4, window 128) this is ~1/5 of
    max_seqlen_kv, which keeps the index list (and its memory traffic) small. Otherwise
    (not causal, or sequences starting at arbitrary positions) max_seqlen_kv.
    """
    if not causal or has_start_pos or ratio < 1:
        return max_seqlen_kv
    win = min(window, max_seqlen_kv) if window > 0 else max_seqlen_kv
    return min(max_seqlen_kv, max_seqlen_kv // (ratio + 1) + win)


def dense_fmha_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """The CUDA kernel :func:`dense_fmha` runs for these shapes: ``"dense_fmha"`` (head dims
    64/128/256, k and v of q's head dim), ``"sparse_mqa_prefill"`` (head dim 512, one KV
    head that is both K and V (``v is k``), 64 or 128 query heads) or None (CPU only)."""
    d = q.shape[-1] if q.dim() == 3 else None
    if d in DENSE_HEAD_DIMS and k.dim() == 3 and v.dim() == 3 and k.shape[-1] == d and v.shape[-1] == d:
        return "dense_fmha"
    if (v is k and k.dim() == 3 and k.shape[1] == 1 and d == HEAD_DIM and k.shape[-1] == HEAD_DIM
            and q.shape[1] in (64, 128)):
        return "sparse_mqa_prefill"
    return None


def dense_fmha(
    q: torch.Tensor,
    kv: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    n_comp: torch.Tensor,
    *,
    max_seqlen_kv: int,
    window: int = WINDOW,
    causal: bool = True,
    ratio: int = 1,
    seq_start_pos: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense masked attention over a ragged batch (see the module docstring for the masks).

    Args:
        q: ``[Tq, Hq, D]`` queries of all sequences concatenated (bf16 on CUDA).
        kv: ``[Nkv, Hkv, D]`` rows that are both key and value, or a ``(k, v)`` pair
            (``k [Nkv, Hkv, D]``, ``v [Nkv, Hkv, Dv]``); query head h uses kv head
            ``h // (Hq // Hkv)``.
        cu_seqlens_q, cu_seqlens_kv: int ``[S+1]`` cumulative query / kv row counts.
        n_comp: int ``[S]`` compressed entries at the front of each sequence's kv rows.
        max_seqlen_kv: host int >= every sequence's kv length (sizes the index list
            without reading device memory, so the call can be graph-captured).
        window: sliding window (<= 0: unlimited). causal: apply the position masks.
        ratio: compression ratio of the compressed entries. seq_start_pos: int ``[S]``
            absolute position of each sequence's first window entry (default 0).
        attn_sink: fp32 ``[Hq]`` or None. softmax_scale: default ``D ** -0.5``; finite and
            > 0, checked on the host.
        out: optional output buffer ``[Tq, Hq, Dv]`` of q's dtype.
        max_seqlen_q: host int >= every sequence's query count (sizes the dense kernel's
            grid; default Tq, always safe). A smaller value leaves rows unwritten.
        num_splits: dense kernel only: split each query tile's KV walk over this many
            CTAs plus a combine pass (0 = choose from the shapes: splits when the query
            tiles alone would leave SMs idle, as in decode).

    Returns:
        ``(out [Tq, Hq, Dv], lse fp32 [Tq, Hq])``.

    CUDA supports D in {64, 128, 256} with Dv = D (dense kernel, any Hq multiple of Hkv)
    and D = 512 with K = V shared by one KV head and Hq in {64, 128} (DeepSeek V4);
    anything else raises ValueError there (the CPU path runs every shape).
    """
    # checked on every device, so a call that works on CPU tensors works on CUDA ones
    C.host_int(_OP, "max_seqlen_kv", max_seqlen_kv, lo=0)
    if max_seqlen_q is None:
        max_seqlen_q = q.shape[0]
    C.host_int(_OP, "max_seqlen_q", max_seqlen_q, lo=0)
    C.host_int(_OP, "num_splits", num_splits, lo=0, hi=64, note=" (0 = choose)")
    C.host_int(_OP, "window", window)
    C.host_int(_OP, "ratio", ratio)
    k, v = kv if isinstance(kv, tuple) else (kv, kv)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    C.finite_positive(_OP, "softmax_scale", scale)
    # off CUDA the op's CPU kernel (the float32 reference) serves every shape
    kernel = dense_fmha_kernel(q, k, v) if q.device.type == "cuda" else "dense_fmha"
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv), ("n_comp", n_comp),
                    ("seq_start_pos", seq_start_pos)):
        if t is not None:
            C.integer(_OP, name, t)
    if kernel == "dense_fmha":
        if out is None:
            out = torch.empty((*q.shape[:2], v.shape[-1]), dtype=q.dtype, device=q.device)
        ints = [t.to(torch.int32) for t in (cu_seqlens_q, cu_seqlens_kv, n_comp)]
        start = seq_start_pos.to(torch.int32) if seq_start_pos is not None else None
        lse = op("dense_fmha")(q, k, v, *ints, start, attn_sink, scale, window, bool(causal), ratio, max_seqlen_q,
                               max_seqlen_kv, num_splits, out)
        return out, lse
    if kernel is None:
        raise C.error(_OP, "CUDA runs head dims 64/128/256 (k and v of the same head dim) and head dim 512 with one "
                           "KV head that is both K and V and 64 or 128 query heads (DeepSeek V4); got "
                           f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {'= k' if v is k else tuple(v.shape)}. "
                           "Other shapes run on CPU tensors only.")
    # kernel == "sparse_mqa_prefill"
    width = max(1, index_width(max_seqlen_kv, window=window, causal=causal, ratio=ratio,
                               has_start_pos=seq_start_pos is not None))
    indices, lengths = visible_rows(q.shape[0], cu_seqlens_q, cu_seqlens_kv, n_comp, width=width,
                                    window=window, causal=causal, ratio=ratio, seq_start_pos=seq_start_pos)
    return sparse_mqa_prefill(q, k.reshape(k.shape[0], HEAD_DIM), indices, lengths, attn_sink, scale, out=out)
