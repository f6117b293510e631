"""The incumbents, called exactly as vLLM 0.33.0 calls them for DeepSeek V4 on Hopper.

Written from the incumbents' interface documentation and vLLM's call sites (nothing of
them is copied here; :mod:`dsv4.bench.anchors` loads them):

* :class:`FlashMLADecode`: ``flash_mla_with_kvcache`` as
  ``vllm/models/deepseek_v4/nvidia/flashmla.py`` ``_forward_decode`` calls it: window cache
  and index rows as the main list, the compressed cache and rows as the ``extra`` list,
  per-token lengths, the sink, fp8 cache. vLLM builds the tile-scheduler plan once per
  step (the first layer of each type runs FlashMLA's planner, the others reuse it), so
  the plan is built by the first call, outside the timed region, and every timed call
  (and a CUDA graph capturing it) reuses it: the number is the attention kernel + its
  split-KV combine, as every layer but the first of a step pays it.
* :func:`flashmla_prefill`: ``flash_mla_sparse_fwd`` on vLLM's gathered bf16 workspace.
* The MoE incumbents (Humming W4A16 and W4A8 as vLLM's fused-MoE layer runs them) live
  in :mod:`dsv4.bench.incumbents_moe` and are importable from here.
"""

from __future__ import annotations

from typing import Optional

import torch

from .incumbents_moe import MOE_INCUMBENTS, HummingW4A8, HummingW4A16, align_routes, moe_incumbent_missing
from .models import HEAD_DIM

__all__ = ["FlashMLADecode", "flashmla_prefill", "HummingW4A16", "HummingW4A8", "MOE_INCUMBENTS",
           "moe_incumbent_missing", "align_routes"]


# --------------------------------------------------------------------------------------
# FlashMLA (vllm/_flashmla_C.abi3.so)
# --------------------------------------------------------------------------------------


class FlashMLADecode:
    """One decode step's FlashMLA call for one layer type, plan kept across calls.

    Parameters
    ----------
    case : dict
        :func:`dsv4.bench.cases.decode_case` output (q bf16 [B, s_q, H, 512], fp8_ds_mla
        caches [nb, B, 584], int32 index rows [B, s_q, W] and lengths [B], sink fp32 [H]).
    softmax_scale : float
    out : torch.Tensor
        bf16 [B, s_q, H, 512], written in place.
    """

    def __init__(self, case: dict, softmax_scale: float, out: torch.Tensor):
        self.case, self.scale, self.out = case, softmax_scale, out
        self.tile_md = self.num_splits = None
        self.lse = None

    def __call__(self) -> torch.Tensor:
        c = self.case
        extra = c["extra_cache"]
        out, lse, md, ns = torch.ops._flashmla_C.sparse_decode_fwd(
            c["q"], c["swa_cache"].unsqueeze(-2), c["swa_idx"], c["swa_len"], c["sink"],
            self.tile_md, self.num_splits,
            extra.unsqueeze(-2) if extra is not None else None, c["extra_idx"], c["extra_len"],
            HEAD_DIM, self.scale, self.out, False)
        if self.tile_md is None:  # the first call planned: keep the plan, as vLLM does within a step
            self.tile_md, self.num_splits = md, ns
        self.lse = lse
        return out


def flashmla_prefill(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, lens: Optional[torch.Tensor],
                     sink: Optional[torch.Tensor], softmax_scale: float, out: torch.Tensor):
    """``flash_mla_sparse_fwd``: q bf16 [T, H, 512], kv bf16 [rows, 512], idx int32
    [T, topk] (-1 or >= rows skipped), lens int32 [T] or None. Returns (out, max_logits, lse)."""
    return torch.ops._flashmla_C.sparse_prefill_fwd(q, kv.view(-1, 1, HEAD_DIM), idx.unsqueeze(1), softmax_scale,
                                                     HEAD_DIM, sink, lens, out)
