"""Attention inputs of every benchmark, shaped as vLLM 0.33.0 builds them for DeepSeek V4
(``vllm/v1/attention/backends/mla/sparse_swa.py``, ``vllm/models/deepseek_v4/sparse_mla.py``,
``vllm/models/deepseek_v4/nvidia/flashmla.py``), and the calls made on them.

Decode attention, one layer, ``s_q = 1`` (what vLLM passes), built by :func:`decode_case`
for the decode-step, compare and profile routines alike:

* caches: ``fp8_ds_mla`` paged pools (584 bytes per token view, block stride padded to a
  multiple of 576 bytes) in vLLM's block sizes: the SWA cache in blocks of 64 tokens; the
  compressed cache of a ratio-4 (CSA / C4A) layer in blocks of 64 entries, of a ratio-128
  (HCA / C128A) layer in blocks of 2 entries (vLLM's 256-token KV block divided by the
  ratio);
* index rows: SWA ``[T, 1, 128]`` (the window, -1 where the context is shorter); C4A the
  indexer's top-k (``[T, 1, topk]``, a random subset of the visible compressed entries, -1
  padded); C128A every visible compressed entry in a row of width
  ``max(next_pow2(context // 128), 128)`` (vLLM's ``active_topk_width``), -1 padded;
  int32 lengths per token.

Sequences draw their slots from one shared pool per cache (a random run of consecutive
slots each, as its pages would be), so batch 256 at 128K needs no private caches.

Prefill attention (:func:`prefill_case`): q ``[T, H, 512]`` over vLLM's gathered bf16
workspace rows ``[rows, 512]`` with ``window + topk`` indices per token (vLLM's
``combined_topk``), int32 lengths.

The predecessor of the compare routine's ``--predecessor gemm`` mode
(:class:`QProjection`): the kernel that writes q right before attention in a V4 layer,
so that a launch overlap of attention with it (programmatic dependent launch) shows in the
timed graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import formats
from .models import HEAD_DIM, KINDS, RATIO, SOFTMAX_SCALE, WINDOW, ModelShape

__all__ = ["BLOCK", "C128A_ALIGN", "c128a_width", "attention_keys", "random_fp8_pool", "DecodePools",
           "decode_case", "prefill_case", "dsv4_decode", "torch_decode", "torch_decode_bytes", "PREDECESSORS",
           "Q_LORA_RANK", "QProjection"]

# vLLM's block sizes of the three caches (entries per block): window 64, C4A 256 / 4, C128A 256 / 128.
BLOCK = {"swa": 64, "csa": 64, "hca": 2}
C128A_ALIGN = 128  # vllm/models/deepseek_v4/sparse_mla.py: _C128A_TOPK_ALIGNMENT


def c128a_width(context: int, max_compressed: Optional[int] = None) -> int:
    """Row width of vLLM's C128A index rows: the next power of two of the visible entries,
    at least 128, at most the model's maximum (when given)."""
    n = max(context // RATIO["hca"], 1)
    w = max(1 << (n - 1).bit_length(), C128A_ALIGN)
    return min(w, max_compressed) if max_compressed else w


def attention_keys(kind: str, model: ModelShape, context: int) -> tuple[int, int]:
    """(window keys, compressed keys) one decode token at position ``context - 1`` attends
    to in a layer of ``kind``. A compressed entry w (ratio r) is visible iff
    w < context // r; CSA keeps the indexer's top-k of them, HCA all."""
    if kind not in KINDS:
        raise ValueError(f"dsv4: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    win = min(model.window, context)
    if kind == "swa":
        return win, 0
    span = context // RATIO[kind]
    return win, min(span, model.index_topk) if kind == "csa" else span


def random_fp8_pool(num_slots: int, block: int, device, gen: torch.Generator,
                    rows_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An fp8_ds_mla cache of ``ceil(num_slots / block)`` blocks holding random rows
    (unit normal, quantized). ``rows_out`` (bf16 [blocks * block, 512]), when given,
    receives the same rows dequantized."""
    nb = -(-num_slots // block)
    cache = formats.new_fp8_ds_mla_cache(nb, block, device=device)
    n = nb * block
    chunk = 1 << 16  # bounds the float32 temporaries of the quantizer
    for s in range(0, n, chunk):
        slots = torch.arange(s, min(s + chunk, n), device=device)
        formats.write_fp8_ds_mla(cache, slots, torch.randn(len(slots), HEAD_DIM, device=device, generator=gen))
        if rows_out is not None:
            rows_out[s:s + len(slots)] = formats.read_fp8_ds_mla(cache, slots)
    return cache


@dataclass
class DecodePools:
    """One shared fp8_ds_mla pool per cache type, in vLLM's block sizes (:data:`BLOCK`):
    window (``swa``), C4A (``c4a``, the CSA layers) and C128A (``c128a``, the HCA layers).
    ``rows_bf16``, when built, holds the same rows dequantized, [swa | c4a | c128a] slots
    one after the other (the torch baseline of the decode-step routine gathers from it)."""

    swa: torch.Tensor
    c4a: torch.Tensor
    c128a: torch.Tensor
    rows_bf16: Optional[torch.Tensor] = None

    @staticmethod
    def build(n_swa: int, n_c4a: int, n_c128a: int, device, seed: int = 0, bf16_rows: bool = False) -> "DecodePools":
        gen = torch.Generator(device=device).manual_seed(seed)
        sizes = [(-(-n // BLOCK[k])) * BLOCK[k] for n, k in zip((n_swa, n_c4a, n_c128a), KINDS)]
        rows = torch.empty(sum(sizes), HEAD_DIM, dtype=torch.bfloat16, device=device) if bf16_rows else None
        caches, start = [], 0
        for n, kind in zip(sizes, KINDS):
            caches.append(random_fp8_pool(n, BLOCK[kind], device, gen, None if rows is None else rows[start:start + n]))
            start += n
        return DecodePools(*caches, rows_bf16=rows)

    @staticmethod
    def for_cases(max_batch: int, max_context: int, device, *, above_l2: bool = True,
                  bf16_rows: bool = False) -> "DecodePools":
        """Pools for decode cases up to ``max_batch`` sequences of ``max_context`` tokens.
        ``above_l2``: each pool well above L2 (50 MB), so that every sequence draws a cold
        run of slots (a GPU run); else just large enough (the CPU reference run)."""
        floor = (1 << 18, 1 << 20, 1 << 16) if above_l2 else (1024, 4096, 512)
        return DecodePools.build(max(floor[0], 4 * WINDOW * max_batch), max(floor[1], 2 * max_context // RATIO["csa"]),
                                 max(floor[2], 4 * max_context // RATIO["hca"]), device, bf16_rows=bf16_rows)

    def cache(self, kind: str) -> torch.Tensor:
        return {"swa": self.swa, "csa": self.c4a, "hca": self.c128a}[kind]

    def slots(self, kind: str) -> int:
        c = self.cache(kind)
        return c.shape[0] * c.shape[1]

    def row_offset(self, kind: str) -> int:
        """First row of ``kind``'s slots in :attr:`rows_bf16`."""
        return sum(self.slots(k) for k in KINDS[:KINDS.index(kind)])


def decode_case(kind: str, model: ModelShape, batch: int, context: int, pools: DecodePools,
                gen: torch.Generator) -> dict:
    """Inputs of one decode call of a layer of ``kind`` ("swa", "csa", "hca") for
    ``batch`` sequences of ``context`` tokens each (the new token at position
    ``context - 1``).

    Returns dict: ``q`` bf16 [B, 1, H, 512], ``sink`` fp32 [H], ``swa_cache``,
    ``swa_idx`` int32 [B, 1, 128], ``swa_len`` int32 [B], and for csa/hca
    ``extra_cache``, ``extra_idx`` int32 [B, 1, W], ``extra_len`` int32 [B] (None for
    swa); ``kind``; ``window_keys``, ``compressed_keys`` and ``keys`` (their sum): the
    visible keys per token (:func:`attention_keys`, for FLOP and byte counts).
    """
    device = pools.swa.device
    if kind not in KINDS:
        raise ValueError(f"dsv4: kind must be 'swa', 'csa' or 'hca', got {kind!r}")
    if batch < 0 or context < 1:
        raise ValueError(f"dsv4: need batch >= 0 and context >= 1, got batch={batch}, context={context}")
    k_win, k_comp = attention_keys(kind, model, context)

    def run(pool_slots: int, span: int, width: int, pick: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        if span > pool_slots:
            raise ValueError(f"dsv4: the pool has {pool_slots} slots, a sequence needs {span}")
        start = torch.randint(0, pool_slots - span + 1, (batch, 1), generator=gen, device=device)
        if pick is None or pick >= span:
            offs = torch.arange(span, device=device).expand(batch, span)
        else:  # a random subset, in random order, like the indexer's top-k output
            offs = torch.rand(batch, span, generator=gen, device=device).topk(pick, dim=1).indices
        n = offs.shape[1]
        idx = torch.full((batch, width), -1, dtype=torch.int32, device=device)
        idx[:, :n] = (start + offs).to(torch.int32)
        return idx.view(batch, 1, width), torch.full((batch,), n, dtype=torch.int32, device=device)

    swa_idx, swa_len = run(pools.slots("swa"), k_win, model.window)
    case = dict(kind=kind, q=torch.randn(batch, 1, model.heads, HEAD_DIM, generator=gen, device=device)
                .to(torch.bfloat16), sink=torch.randn(model.heads, generator=gen, device=device),
                swa_cache=pools.swa, swa_idx=swa_idx, swa_len=swa_len, extra_cache=None, extra_idx=None,
                extra_len=None, window_keys=k_win, compressed_keys=k_comp, keys=k_win + k_comp)
    if kind != "swa":
        span = context // RATIO[kind]
        width = model.index_topk if kind == "csa" else c128a_width(context)
        pick = model.index_topk if kind == "csa" else None
        case["extra_idx"], case["extra_len"] = run(pools.slots(kind), span, width, pick)
        case["extra_cache"] = pools.cache(kind)
    return case


def dsv4_decode(case: dict, out: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """dsv4's kernel on a :func:`decode_case`, called the way vLLM calls it: window cache
    and rows as the main list, compressed cache and rows as the extra list."""
    from ..attention import sparse_mqa_decode

    return sparse_mqa_decode(case["q"], case["swa_cache"], case["swa_idx"], case["swa_len"], case["sink"],
                             SOFTMAX_SCALE, extra_kv_cache=case["extra_cache"], extra_indices=case["extra_idx"],
                             extra_topk_length=case["extra_len"], out=out, batch_invariant=batch_invariant)


def torch_decode(case: dict, pools: DecodePools) -> torch.Tensor:
    """Baseline: plain torch bf16 sparse MQA over gathered rows of ``pools.rows_bf16``
    (gather, bf16 matmuls, fp32 softmax with the sink as an extra logit). No host sync,
    so it runs under CUDA graphs like the kernel. Returns bf16 [B, 1, H, 512]."""
    q = case["q"]
    b, _, h, d = q.shape
    idx = case["swa_idx"].view(b, -1)[:, :case["window_keys"]]
    if case["extra_idx"] is not None:  # only the visible entries; the -1 padding is left out
        comp = case["extra_idx"].view(b, -1)[:, :case["compressed_keys"]] + pools.row_offset(case["kind"])
        idx = torch.cat([idx, comp], dim=1)
    kv = pools.rows_bf16[idx.long()]  # [b, keys, d]
    s = torch.matmul(q.view(b, h, d), kv.transpose(1, 2)).float() * SOFTMAX_SCALE  # [b, h, keys]
    s = torch.cat([s, case["sink"].view(1, h, 1).expand(b, h, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1].to(torch.bfloat16)  # the sink only adds to the denominator
    return torch.matmul(p, kv).view(b, 1, h, d)


def torch_decode_bytes(batch: int, heads: int, keys: int) -> int:
    """Peak temporaries of :func:`torch_decode` (gathered rows + score tensors)."""
    return batch * keys * HEAD_DIM * 2 + batch * heads * (keys + 1) * (2 + 4 + 4 + 4 + 2)


def prefill_case(model: ModelShape, tokens: int, kv_rows: int, gen: torch.Generator, device,
                 kv: Optional[torch.Tensor] = None) -> dict:
    """Inputs of one sparse prefill call: ``q`` bf16 [T, H, 512], ``kv`` bf16 [rows, 512]
    (vLLM's gathered workspace; pass one to share it between cases), ``idx`` int32
    [T, window + topk] of valid rows (distinct when rows <= 8192), ``lens`` int32 [T]
    (all full), ``sink`` fp32 [H], ``topk``."""
    topk = model.prefill_topk
    if kv is None:
        kv = torch.randn(kv_rows, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    idx = torch.rand(tokens, kv.shape[0], generator=gen, device=device).topk(topk, dim=1).indices.to(torch.int32) \
        if kv.shape[0] <= 8192 else torch.randint(0, kv.shape[0], (tokens, topk), generator=gen, device=device,
                                                  dtype=torch.int32)
    return dict(q=torch.randn(tokens, model.heads, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16),
                kv=kv, idx=idx, lens=torch.full((tokens,), topk, dtype=torch.int32, device=device),
                sink=torch.randn(model.heads, generator=gen, device=device), topk=topk)


# --------------------------------------------------------------------------------------
# The predecessor kernel of the compare routine's --predecessor mode
# --------------------------------------------------------------------------------------

PREDECESSORS = ("none", "gemm")  # --predecessor: nothing before attention in the graph, or the q projection
# q_lora_rank of the checkpoints' config.json (deepseek-ai/DeepSeek-V4-Flash: 1024, DeepSeek-V4-Pro: 1536): the
# rank of V4's low-rank q path, x -> wq_a -> q_norm -> wq_b -> q [heads, 512]; keyed like MODELS.
Q_LORA_RANK = {"flash": 1024, "pro": 1536}


@dataclass
class QProjection:
    """V4's q up-projection ``wq_b`` as the predecessor of an attention call: the bf16
    GEMM ``[tokens, q_lora_rank] x [q_lora_rank, heads * 512]`` whose output *is* q, written
    in place into the attention call's q buffer (so the attention kernel reads what its
    predecessor wrote, as in a model step; the RoPE on q's last 64 dims that vLLM runs in
    between is left out). bf16 where the checkpoints store ``wq_b`` in block FP8: the shape
    and the data dependency are what matter here (the launch overlap at the kernel boundary),
    not the GEMM's own time, which the compare routine measures alone and subtracts.

    ``weight`` bf16 [q_lora_rank, heads * 512], shared by every call of one model (64 MB
    for V4-Flash, 192 MB for V4-Pro: larger than L2, so the GEMM streams it as the real
    projection does).
    """

    weight: torch.Tensor

    @staticmethod
    def build(model: ModelShape, device, gen: torch.Generator) -> "QProjection":
        k = Q_LORA_RANK[model.key]
        w = torch.randn(k, model.heads * HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
        return QProjection(w)

    @staticmethod
    def shape_text(model: ModelShape) -> str:
        """'[T, 1024] x [1024, 32768]': the GEMM of one call over T query tokens."""
        k = Q_LORA_RANK[model.key]
        return f"[T, {k}] x [{k}, {model.heads * HEAD_DIM}]"

    def writer(self, q: torch.Tensor, gen: torch.Generator) -> Callable[[], torch.Tensor]:
        """A zero-argument call writing ``q`` (bf16 [..., heads, 512], contiguous) as
        ``x @ weight`` for a fresh x [tokens, q_lora_rank] scaled so that q ~ N(0, 1) like
        the cases' own q. Writes the same values on every call."""
        k, n = self.weight.shape
        if not q.is_contiguous() or q.dtype != torch.bfloat16 or q.numel() % n:
            raise ValueError(f"dsv4: q must be a contiguous bf16 tensor of [tokens, {n}] elements, got "
                             f"{q.dtype} {tuple(q.shape)}")
        tokens = q.numel() // n
        x = (torch.randn(tokens, k, generator=gen, device=q.device) * k**-0.5).to(torch.bfloat16)
        qv = q.view(tokens, n)
        w = self.weight

        def call() -> torch.Tensor:
            return torch.matmul(x, w, out=qv)

        call()
        return call
