"""The one table of model facts every dsv4 benchmark reads: DeepSeek V4-Flash, V4-Pro and
V4.1-Flash (docs/design.md section 1). The decode cases, the MoE cases, the layer
schedules of the decode-step estimate and the names in every report derive from it.

``HEAD_DIM`` (512 = 448 no-rope + 64 rope; K and V are the same vector) and ``WINDOW``
(128 sliding-window keys, every layer of every model) live once, in
``dsv4.formats.kv_cache``, beside the kernels that read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from ..formats.kv_cache import HEAD_DIM, WINDOW

__all__ = ["HEAD_DIM", "WINDOW", "SOFTMAX_SCALE", "KINDS", "RATIO", "BENCH_EP", "ModelShape", "MODELS", "MOE_MODELS",
           "SCHEDULED", "tiny_shape"]

SOFTMAX_SCALE = HEAD_DIM**-0.5
KINDS = ("swa", "csa", "hca")  # V4's attention layer types: window only, ratio 4 (indexer top-k), ratio 128
RATIO = {"csa": 4, "hca": 128}  # compress ratio of each compressed layer type
BENCH_EP = 8  # the expert-parallel size whose rank-0 experts the MoE benchmarks call "local"


@dataclass(frozen=True)
class ModelShape:
    """One model's facts as the kernels see them.

    ``layers`` is the attention layer schedule, ``{"swa": n, "csa": n, "hca": n}``, or
    None where it is not known here (V4.1-Flash). ``n_layers`` is the checkpoint's layer
    count (MTP layer not counted); every layer has a routed MoE.
    """

    key: str  # the name on the command line: flash, pro, v41flash
    name: str  # the name in reports
    hidden: int  # K of the MoE
    n_layers: int
    heads: int  # query heads (one KV head shared by all)
    index_topk: int  # compressed entries a CSA layer attends to
    n_experts: int  # routed experts (global)
    moe_inter: int  # N of the MoE (per gate / up half)
    layers: Optional[dict] = field(default=None, compare=False)
    experts_per_token: int = 6
    swiglu_limit: float = 10.0
    window: int = WINDOW
    moe_tp: int = 1  # > 1: one tensor-parallel rank of the MoE (every expert, moe_inter its N slice)

    def local_experts(self, ep: int = BENCH_EP) -> int:
        """Experts one rank of expert parallelism ``ep`` holds (a tensor-parallel rank: all)."""
        return self.n_experts // (1 if self.moe_tp > 1 else ep)

    def moe_name(self, ep: int = BENCH_EP) -> str:
        """'V4-Flash local-32' (one EP rank) or 'V4.1-Flash TP8 N=288' (one TP rank): the MoE
        row label."""
        if self.moe_tp > 1:
            return f"{self.name} TP{self.moe_tp} N={self.moe_inter}"
        return f"{self.name} local-{self.local_experts(ep)}"

    @property
    def prefill_topk(self) -> int:
        """Indices per token of a sparse prefill (vLLM's ``combined_topk``: window + top-k)."""
        return self.window + self.index_topk


# Layer schedules: the `compress_ratios` list of each checkpoint's HF config.json (0 =
# sliding window only, 4 = CSA, 128 = HCA; its last entry is the MTP layer, not counted).
# vLLM 0.33.0 reads the same list (vllm/transformers_utils/deepseek_v4_utils.py
# get_compress_ratios -> vllm/models/deepseek_v4/attention.py); the checkpoint configs are
# not in vLLM's source:
#   V4-Flash (43 layers): [0, 0] + [4, 128] * 20 + [4] (+ MTP 0) -> 2 SWA, 21 CSA, 20 HCA
#   V4-Pro   (61 layers): [128, 128] + [4, 128] * 29 + [4] (+ MTP 0) -> 0 SWA, 30 CSA, 31 HCA
# V4.1-Flash's layers use compress ratios 0, 1 and 2 with KV and index sources shared
# across layers (vllm/models/deepseek_v41/attention.py); its per-layer list is in its
# config.json only, not in any source at hand, so it has no schedule here.
MODELS = {
    "flash": ModelShape("flash", "V4-Flash", hidden=4096, n_layers=43, heads=64, index_topk=512, n_experts=256,
                        moe_inter=2048, layers={"swa": 2, "csa": 21, "hca": 20}),
    "pro": ModelShape("pro", "V4-Pro", hidden=7168, n_layers=61, heads=128, index_topk=1024, n_experts=384,
                      moe_inter=3072, layers={"swa": 0, "csa": 30, "hca": 31}),
    "v41flash": ModelShape("v41flash", "V4.1-Flash", hidden=5120, n_layers=40, heads=64, index_topk=512,
                           n_experts=384, moe_inter=2304, layers=None),
}
# The MoE benchmarks' shapes: each model's EP8 rank, and V4.1-Flash at tensor parallel 8
# (all 384 experts, 2304 / 8 = 288 columns per gate / up half; dsv4's MXFP4 W4A8 layout
# takes 288; for its W4A16 kernels (NVFP4, and MXFP4 W4A16) prepare pads N with zeros to
# 320, dsv4.formats.nvfp4_moe_layout.pad_nvfp4_moe_weights; the rows' FLOP and byte
# counts are those of the 288 real columns).
MOE_MODELS = {**MODELS, "v41flash-tp8": replace(MODELS["v41flash"], key="v41flash-tp8", moe_tp=8,
                                                moe_inter=MODELS["v41flash"].moe_inter // 8)}
# The models with a V4 layer schedule (SWA / CSA / HCA): the attention benchmarks' choices.
SCHEDULED = tuple(k for k, m in MODELS.items() if m.layers is not None)


def tiny_shape(shape: ModelShape) -> ModelShape:
    """Shrunk shape for the CPU reference run. Heads and head dim stay (the ops only take
    64 / 128 heads of 512); the MoE and the indexer top-k shrink; the expert count and
    the layer schedule stay, so the EP split and the step sum are the same arithmetic."""
    return replace(shape, name=shape.name + " (tiny CPU shape)", hidden=256, moe_inter=128,
                   index_topk=shape.index_topk // 16)
