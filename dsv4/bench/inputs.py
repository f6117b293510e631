"""Inputs of both sides of every comparison, shaped as vLLM 0.33.0 builds them for
DeepSeek V4 (``vllm/v1/attention/backends/mla/sparse_swa.py``,
``vllm/models/deepseek_v4/sparse_mla.py``, ``vllm/models/deepseek_v4/nvidia/flashmla.py``).

Decode attention, one layer, ``s_q = 1`` (what vLLM passes):

* caches: ``fp8_ds_mla`` paged pools (584 bytes per token view, block stride padded to a
  multiple of 576 bytes): the SWA cache in blocks of 64 tokens; the compressed cache of a
  ratio-4 (CSA / C4A) layer in blocks of 64 entries, of a ratio-128 (HCA / C128A) layer in
  blocks of 2 entries (vLLM's 256-token KV block divided by the ratio);
* index rows: SWA ``[T, 1, 128]`` (the window, -1 where the context is shorter); C4A the
  indexer's top-k (``[T, 1, topk]``, a random subset of the visible compressed entries, -1
  padded); C128A every visible compressed entry in a row of width
  ``max(next_pow2(context // 128), 128)`` (vLLM's ``active_topk_width``), -1 padded;
  int32 lengths per token.

Sequences draw their slots from one shared pool per cache (a random run of consecutive
slots each, as its pages would be), so batch 256 at 128K needs no private caches.

Prefill attention: q ``[T, H, 512]`` over vLLM's gathered bf16 workspace rows
``[rows, 512]`` with ``window + topk`` indices per token (1152 for V4-Pro, 640 for
V4-Flash; vLLM's ``combined_topk``), int32 lengths.

MoE: ModelOpt NVFP4 experts or DeepSeek V4's native MXFP4 experts, each in vLLM's stacked
layout (``dsv4.formats``, ``dsv4.formats.mxfp4``), random top-6 routing over the global experts and
the expert map of EP rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import argparse

import torch

from .. import formats
from ..formats import mxfp4
from ..moe import modes

__all__ = ["AttnModel", "ATTN_MODELS", "MoeModel", "MOE_MODELS", "SWA_BLOCK", "C4A_BLOCK", "C128A_BLOCK",
           "WINDOW", "c128a_width", "DecodePools", "decode_case", "prefill_case", "random_nvfp4_experts",
           "random_mxfp4_experts", "MOE_FORMATS", "MOE_LABELS", "MOE_FORMAT_NAMES", "moe_format_list", "moe_cases",
           "moe_experts", "moe_routing"]

HEAD_DIM = 512
WINDOW = 128
SWA_BLOCK = 64
C4A_BLOCK = 64  # vLLM's 256-token block / ratio 4
C128A_BLOCK = 2  # vLLM's 256-token block / ratio 128
C128A_ALIGN = 128  # vllm/models/deepseek_v4/sparse_mla.py: _C128A_TOPK_ALIGNMENT
RATIO = {"csa": 4, "hca": 128}


@dataclass(frozen=True)
class AttnModel:
    name: str
    heads: int  # query heads per GPU as the kernel sees them (64 or 128)
    index_topk: int  # C4A entries per token


ATTN_MODELS = {
    "flash": AttnModel("V4-Flash", 64, 512),
    "pro": AttnModel("V4-Pro", 128, 1024),
}


@dataclass(frozen=True)
class MoeModel:
    name: str
    K: int  # hidden
    N: int  # intermediate per gate/up half
    E_global: int
    E_local: int  # experts of one EP rank
    topk: int = 6
    swiglu_limit: float = 10.0


MOE_MODELS = {
    "flash": MoeModel("V4-Flash local-32", 4096, 2048, 256, 32),
    "pro": MoeModel("V4-Pro local-48", 7168, 3072, 384, 48),
    "v41flash": MoeModel("V4.1-Flash local-48", 5120, 2304, 384, 48),
}


def c128a_width(context: int, max_compressed: Optional[int] = None) -> int:
    """Row width of vLLM's C128A index rows: the next power of two of the visible entries,
    at least 128, at most the model's maximum (when given)."""
    n = max(context // 128, 1)
    w = max(1 << (n - 1).bit_length(), C128A_ALIGN)
    return min(w, max_compressed) if max_compressed else w


def _random_fp8_pool(num_slots: int, block: int, device, gen: torch.Generator) -> torch.Tensor:
    nb = -(-num_slots // block)
    cache = formats.new_fp8_ds_mla_cache(nb, block, device=device)
    n = nb * block
    chunk = 1 << 16  # bounds the float32 temporaries of the quantizer
    for s in range(0, n, chunk):
        slots = torch.arange(s, min(s + chunk, n), device=device)
        formats.write_fp8_ds_mla(cache, slots, torch.randn(len(slots), HEAD_DIM, device=device, generator=gen))
    return cache


@dataclass
class DecodePools:
    """One shared fp8_ds_mla pool per cache type: window (block 64), C4A (block 64) and
    C128A (block 2)."""

    swa: torch.Tensor
    c4a: torch.Tensor
    c128a: torch.Tensor

    @staticmethod
    def build(n_swa: int, n_c4a: int, n_c128a: int, device, seed: int = 0) -> "DecodePools":
        gen = torch.Generator(device=device).manual_seed(seed)
        return DecodePools(_random_fp8_pool(n_swa, SWA_BLOCK, device, gen),
                           _random_fp8_pool(n_c4a, C4A_BLOCK, device, gen),
                           _random_fp8_pool(n_c128a, C128A_BLOCK, device, gen))

    @staticmethod
    def for_cases(max_batch: int, max_context: int, device) -> "DecodePools":
        """Pools for decode cases up to ``max_batch`` sequences of ``max_context`` tokens,
        each well above L2 (50 MB), so that every sequence draws a cold run of slots."""
        return DecodePools.build(max(1 << 18, 4 * WINDOW * max_batch), max(1 << 20, 2 * max_context // 4),
                                 max(1 << 16, 4 * max_context // 128), device)

    def slots(self, kind: str) -> int:
        c = {"swa": self.swa, "csa": self.c4a, "hca": self.c128a}[kind]
        return c.shape[0] * c.shape[1]


def decode_case(kind: str, model: AttnModel, batch: int, context: int, pools: DecodePools,
                gen: torch.Generator) -> dict:
    """Inputs of one decode call of a layer of ``kind`` ("swa", "csa", "hca") for
    ``batch`` sequences of ``context`` tokens each (the new token at position
    ``context - 1``).

    Returns dict: ``q`` bf16 [B, 1, H, 512], ``sink`` fp32 [H], ``swa_cache``,
    ``swa_idx`` int32 [B, 1, 128], ``swa_len`` int32 [B], and for csa/hca
    ``extra_cache``, ``extra_idx`` int32 [B, 1, W], ``extra_len`` int32 [B] (None for
    swa); ``keys`` = visible keys per token (for FLOP and byte counts).
    """
    device = pools.swa.device
    if kind not in ("swa", "csa", "hca"):
        raise ValueError(f"dsv4: kind must be 'swa', 'csa' or 'hca', got {kind!r}")
    if batch < 0 or context < 1:
        raise ValueError(f"dsv4: need batch >= 0 and context >= 1, got batch={batch}, context={context}")

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

    swa_idx, swa_len = run(pools.slots("swa"), min(WINDOW, context), WINDOW)
    case = dict(q=torch.randn(batch, 1, model.heads, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16),
                sink=torch.randn(model.heads, generator=gen, device=device), swa_cache=pools.swa,
                swa_idx=swa_idx, swa_len=swa_len, extra_cache=None, extra_idx=None, extra_len=None,
                keys=min(WINDOW, context))
    if kind == "csa":
        span = context // RATIO["csa"]
        case["extra_idx"], case["extra_len"] = run(pools.slots("csa"), span, model.index_topk, model.index_topk)
        case["extra_cache"] = pools.c4a
        case["keys"] += min(span, model.index_topk)
    elif kind == "hca":
        span = context // RATIO["hca"]
        case["extra_idx"], case["extra_len"] = run(pools.slots("hca"), span, c128a_width(context))
        case["extra_cache"] = pools.c128a
        case["keys"] += span
    return case


def prefill_case(model: AttnModel, tokens: int, kv_rows: int, gen: torch.Generator, device,
                 kv: Optional[torch.Tensor] = None) -> dict:
    """Inputs of one sparse prefill call: ``q`` bf16 [T, H, 512], ``kv`` bf16 [rows, 512]
    (vLLM's gathered workspace; pass one to share it between cases), ``idx`` int32
    [T, window + topk] of distinct valid rows, ``lens`` int32 [T] (all full)."""
    topk = WINDOW + model.index_topk
    if kv is None:
        kv = torch.randn(kv_rows, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    idx = torch.rand(tokens, kv.shape[0], generator=gen, device=device).topk(topk, dim=1).indices.to(torch.int32) \
        if kv.shape[0] <= 8192 else torch.randint(0, kv.shape[0], (tokens, topk), generator=gen, device=device,
                                                  dtype=torch.int32)
    return dict(q=torch.randn(tokens, model.heads, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16),
                kv=kv, idx=idx, lens=torch.full((tokens,), topk, dtype=torch.int32, device=device),
                sink=torch.randn(model.heads, generator=gen, device=device), topk=topk)


def random_nvfp4_experts(E: int, N: int, K: int, device, gen: torch.Generator) -> dict:
    """Random ModelOpt NVFP4 experts in vLLM's stacked layout, drawn directly as codes and
    e4m3 block scales (timing does not depend on the values, and quantizing float weights
    for 384 experts of Pro would take longer than a sweep). Values stay O(0.02) like real
    weights; equal gate/up global scales."""

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen, device=device)

    def scales(*shape):  # e4m3 block scales in [16, 64)
        return (16 + 48 * torch.rand(shape, generator=gen, device=device)).to(torch.float8_e4m3fn)

    g = torch.full((E,), 2e-4, dtype=torch.float32, device=device)
    return dict(w13=codes(E, 2 * N, K // 2), w13_scale=scales(E, 2 * N, K // 16), w13_scale_2=g,
                w2=codes(E, K, N // 2), w2_scale=scales(E, K, N // 16), w2_scale_2=g.clone())


def random_mxfp4_experts(E: int, N: int, K: int, device, gen: torch.Generator) -> dict:
    """Random MXFP4 experts in vLLM 0.33.0's DeepSeek V4 layout (``Mxfp4MoEMethod``'s
    stacked parameters, ``dsv4.formats.mxfp4``: ``w13`` uint8 [E, 2N, K/2] gate rows then up rows,
    ``w13_scale`` uint8 e8m0 [E, 2N, K/32], ``w2`` uint8 [E, K, N/2], ``w2_scale`` uint8
    [E, K, N/32]), drawn directly as codes and e8m0 bytes in [118, 122] (values O(0.02);
    quantizing float weights would take longer than a sweep). Every block then lies
    within 4 binades of its matrix's largest: every W4A8 path folds them exactly."""
    return mxfp4.random_mxfp4_moe_weights(E, N, K, generator=gen, device=device, quantize=False)


# Expert weight formats of the MoE cases: the builder and the weight bytes per element
# (codes + block scales: NVFP4 1/2 + 1/16 B, MXFP4 1/2 + 1/32 B).
MOE_FORMATS = {"nvfp4": (random_nvfp4_experts, 9 / 16), "mxfp4": (random_mxfp4_experts, 17 / 32)}


# The MoE cases, (weight format, dsv4 activation mode), and their labels: NVFP4 W4A16 and
# W4A4 (dsv4.nvfp4_moe), MXFP4 W4A8 (vLLM 0.33.0's Hopper numerics) and W4A16
# (dsv4.routed_moe).
MOE_LABELS = {(fmt, act): modes.label(fmt, act) for fmt, acts in modes.ACTIVATIONS.items() for act in acts}
# The benchmarks' --moe-format names: "nvfp4" runs the NVFP4 activation modes asked for
# (--activation), an MXFP4 name one mode.
MOE_FORMAT_NAMES = {"nvfp4": None, "mxfp4-w4a8": ("mxfp4", "fp8"), "mxfp4-w4a16": ("mxfp4", "bf16")}


def moe_format_list(text: str) -> list[str]:
    """argparse type of --moe-format: 'nvfp4,mxfp4-w4a8' -> ['nvfp4', 'mxfp4-w4a8'] (order
    kept, repeats dropped); every item one of :data:`MOE_FORMAT_NAMES`."""
    items = [v.strip() for v in text.split(",")]
    bad = [v for v in items if v not in MOE_FORMAT_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(MOE_FORMAT_NAMES)}, got "
                                         f"{text!r}")
    return list(dict.fromkeys(items))


def moe_cases(names, nvfp4_acts=("bf16",)) -> list[tuple[str, str]]:
    """--moe-format names -> the (weight format, activation mode) cases, in order: "nvfp4"
    gives one case per NVFP4 mode in ``nvfp4_acts`` ("bf16" W4A16, "nvfp4" W4A4)."""
    out = []
    for name in names:
        out += [("nvfp4", a) for a in nvfp4_acts] if name == "nvfp4" else [MOE_FORMAT_NAMES[name]]
    return list(dict.fromkeys(out))


def moe_experts(m: MoeModel, device, seed: int = 1, fmt: str = "nvfp4") -> dict:
    """The random experts of ``fmt`` ("nvfp4" or "mxfp4", :data:`MOE_FORMATS`) for the
    local experts of one EP rank of ``m``."""
    if fmt not in MOE_FORMATS:
        raise ValueError(f"dsv4: fmt must be one of {', '.join(MOE_FORMATS)}, got {fmt!r}")
    build = MOE_FORMATS[fmt][0]
    return build(m.E_local, m.N, m.K, device, torch.Generator(device=device).manual_seed(seed))


def moe_routing(m: MoeModel, M: int, device, seed: int) -> dict:
    """``x`` bf16 [M, K], random distinct top-k ``ids`` int32 [M, k] over the global
    experts with normalised ``tw`` fp32 [M, k], and ``emap`` int32 [E_global] of EP rank
    0 (experts [0, E_local) local, the rest -1). ``n_local`` = local (token, expert)
    pairs, ``touched`` = distinct local experts used."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, m.K, generator=gen, device=device).to(torch.bfloat16)
    tw, ids = torch.rand(M, m.E_global, generator=gen, device=device).topk(m.topk, dim=1)
    emap = torch.full((m.E_global,), -1, dtype=torch.int32, device=device)
    emap[: m.E_local] = torch.arange(m.E_local, dtype=torch.int32, device=device)
    local = ids[ids < m.E_local]
    return dict(x=x, ids=ids.to(torch.int32), tw=(tw / tw.sum(1, keepdim=True)).float(), emap=emap,
                n_local=int(local.numel()), touched=int(torch.unique(local).numel()))
