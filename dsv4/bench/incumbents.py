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
* :class:`HummingW4A16`: Humming's W4A16 MoE on ModelOpt NVFP4 experts after Humming's
  own load-time conversion (the steps of vLLM's ``convert_to_humming_moe_kernel_format``
  for ``{"quant_method": "modelopt", "quant_algo": "nvfp4"}``: schema conversion, then
  ``prepare_and_transform_humming_tensors`` padding N to 256 and K to 128), run as
  vLLM's ``HummingIndexedExperts.apply`` runs it: routing aligned per block size of
  Humming's own tuning table, GEMM1 (gate|up) with ``top_k``, the clamped-SwiGLU
  activation in Humming's input processing, GEMM2, then the weighted sum.
"""

from __future__ import annotations

import json
import math
from typing import Optional

import torch

__all__ = ["FlashMLADecode", "flashmla_prefill", "HummingW4A16", "align_routes"]

HEAD_DIM = 512


# --------------------------------------------------------------------------------------
# FlashMLA (vllm/_flashmla_C.abi3.so)
# --------------------------------------------------------------------------------------


class FlashMLADecode:
    """One decode step's FlashMLA call for one layer type, plan kept across calls.

    Parameters
    ----------
    case : dict
        :func:`dsv4.bench.inputs.decode_case` output (q bf16 [B, s_q, H, 512], fp8_ds_mla
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


# --------------------------------------------------------------------------------------
# Humming (humming-kernels==0.1.19)
# --------------------------------------------------------------------------------------


def align_routes(ids: torch.Tensor, emap: torch.Tensor, n_local: int, block: int) -> tuple:
    """Routing prep of the indexed MoE GEMM (the semantics of vLLM's
    ``moe_align_block_size(..., expert_map, ignore_invalid_experts=True)``), in torch:
    the flat route ids (token * k + slot) of each local expert, padded to a multiple of
    ``block`` with the sentinel ``ids.numel()``, experts in order; the local expert of
    every block; the padded total. Non-local routes are dropped. Host-side (not
    capturable): build it once per input set."""
    local = emap.long()[ids.long()].view(-1).cpu()
    sentinel = ids.numel()
    sorted_ids, expert_ids = [], []
    for e in range(n_local):
        r = torch.nonzero(local == e).view(-1)
        if r.numel() == 0:
            continue
        nb = -(-r.numel() // block)
        sorted_ids.append(torch.cat([r, torch.full((nb * block - r.numel(),), sentinel, dtype=torch.long)]))
        expert_ids += [e] * nb
    if not sorted_ids:  # no local route: one empty block keeps the tensors non-empty
        sorted_ids, expert_ids = [torch.full((block,), sentinel, dtype=torch.long)], [0]
        total = 0
    else:
        total = sum(s.numel() for s in sorted_ids)
    dev = ids.device
    return (torch.cat(sorted_ids).to(torch.int32).to(dev), torch.tensor(expert_ids, dtype=torch.int32, device=dev),
            torch.tensor([total], dtype=torch.int32, device=dev))


def _block_for(tuning: list, valid_m: int, default: int = 64) -> int:
    for lo, hi, cfg in tuning:
        if lo < valid_m <= hi:
            return cfg["block_shape"][0]
    return default


class HummingW4A16:
    """Humming's W4A16 MoE on ModelOpt NVFP4 experts, as vLLM 0.33.0 runs it on SM90.

    Parameters
    ----------
    w : dict
        vLLM stacked ModelOpt layout of the local experts: ``w13`` uint8 [E, 2N, K/2],
        ``w13_scale`` e4m3 [E, 2N, K/16], ``w13_scale_2`` fp32 [E] (one scale per expert:
        vLLM's ModelOpt path uses the gate's), ``w2`` uint8 [E, K, N/2], ``w2_scale`` e4m3
        [E, K, N/16], ``w2_scale_2`` fp32 [E]. Converted once here (not kept).
    E_global : int
        Global expert count (the routing ids index it).
    swiglu_limit : float
    """

    def __init__(self, w: dict, E_global: int, swiglu_limit: float):
        from humming.config import GemmType
        from humming.schema import BaseWeightSchema, HummingInputSchema
        from humming.transform import prepare_and_transform_humming_tensors
        from humming.tune import get_heuristics_config

        E, two_n, half_k = w["w13"].shape
        self.E, self.N, self.K, self.E_global = E, two_n // 2, half_k * 2, E_global
        device = w["w13"].device
        g13 = w["w13_scale_2"]
        if g13.dim() == 2:  # vLLM's ModelOpt MoE keeps the gate half's global scale for both halves
            g13 = g13[:, 0].contiguous()
        schema = BaseWeightSchema.from_config({"quant_method": "modelopt", "quant_algo": "nvfp4"})
        subs = {"w13": (2 * self.N, self.K, [self.N, self.N], w["w13"], w["w13_scale"], g13),
                "w2": (self.K, self.N, [self.K], w["w2"], w["w2_scale"], w["w2_scale_2"])}
        self.cfg, self.t, self.tuning = {}, {}, {}
        self.compute_config = json.dumps({"use_batch_invariant": False, "use_f16_accum": False,
                                          "gemm_type": GemmType.INDEXED.value})
        for name, (n, k, stacks, weight, scale, scale_2) in subs.items():
            tensors = {"weight": weight, "weight_scale": scale, "weight_scale_2": scale_2}
            wschema, wt = schema.convert_humming(tensors=tensors, shape_n_stacks=stacks, shape_k_stacks=[k],
                                                 param_dtype=torch.bfloat16, num_experts=E)
            ischema, it = HummingInputSchema().convert_humming(tensors=tensors, shape_n_stacks=stacks,
                                                               shape_k_stacks=[k], param_dtype=torch.bfloat16,
                                                               num_experts=E)
            wt.update(it)
            cfg, tt = prepare_and_transform_humming_tensors(
                tensors=wt, shape_n=n, shape_k=k, weight_schema=wschema, input_schema=ischema, num_experts=E,
                pad_n_to_multiple=256, pad_k_to_multiple=128, has_bias=False, torch_dtype=torch.bfloat16,
                device=device)
            self.cfg[name], self.t[name] = cfg, tt
            self.tuning[name] = get_heuristics_config(layer_config=cfg, use_f16_accum=False,
                                                      use_batch_invariant=False, gemm_type=GemmType.INDEXED)
        self.tuning_str = {k: json.dumps(v) for k, v in self.tuning.items()}
        props = torch.cuda.get_device_properties(device)
        self.locks = torch.zeros(props.multi_processor_count * 8, dtype=torch.int32, device=device)
        # vLLM's clamped SiLU-and-mul for swiglu_limit L (alpha 1, beta 0): gate = min(a, L),
        # up = clamp(b, -L, L), silu(gate) * up; gate and up are the two halves of GEMM1's row.
        lim = f"({float(swiglu_limit)}f)"
        self.activation = dict(
            activation_type="binary_split",
            activation_impl=(f"[](float a, float b) {{ const float g = fminf(a, {lim}); "
                             f"const float u = fmaxf(fminf(b, {lim}), -{lim}); "
                             f"return g / (1.f + expf(-g)) * u; }}(a, b)"))

    def plan(self, ids: torch.Tensor, emap: torch.Tensor) -> dict:
        """Routing prep for one input set (vLLM redoes it every forward; here it is
        built once per input set, outside the timed region)."""
        M, k = ids.shape
        valid_m = math.ceil(M * k * self.E / self.E_global)  # vLLM's estimate_local_valid_shape_m
        plans = {}
        for name in ("w13", "w2"):
            block = _block_for(self.tuning[name], valid_m)
            plans[name] = align_routes(ids, emap, self.E, block)
        dev = ids.device
        return dict(M=M, k=k, valid_m=valid_m, align=plans,
                    gate_up=torch.empty(M * k, 2 * self.N, dtype=torch.bfloat16, device=dev),
                    act=torch.empty(M * k, self.N, dtype=torch.bfloat16, device=dev),
                    down=torch.empty(M * k, self.K, dtype=torch.bfloat16, device=dev),
                    local=(emap.long()[ids.long()] >= 0))

    def experts(self, x: torch.Tensor, plan: dict) -> torch.Tensor:
        """GEMM1 + activation + GEMM2 (the Humming kernels); returns the per-route outputs
        [M*k, K] (rows of non-local routes are not written)."""
        from humming.forward import humming_forward, may_process_input

        for name, inputs, outputs, top_k in (("w13", x, plan["gate_up"], plan["k"]), ("w2", None, plan["down"], 1)):
            if name == "w2":
                inputs, _, _ = may_process_input(self.cfg["w2"], inputs=plan["gate_up"], outputs=plan["act"],
                                                 layout="normal", **self.activation)
            s, e, n = plan["align"][name]
            t = self.t[name]
            humming_forward(self.cfg[name], inputs=inputs, weight=t["weight"], weight_scale=t.get("weight_scale"),
                            weight_scale_2=t.get("weight_scale_2"), outputs=outputs, locks=self.locks,
                            sorted_ids=s, expert_ids=e, num_tokens_padded=n, top_k=top_k,
                            valid_shape_m=plan["valid_m"], compute_config=self.compute_config,
                            tuning_config=self.tuning_str[name])
        return plan["down"]

    def __call__(self, x: torch.Tensor, tw: torch.Tensor, plan: dict) -> torch.Tensor:
        """The whole MoE: experts, then the weighted sum over each token's local routes
        (torch; vLLM runs its own fused kernel for it). Returns bf16 [M, K]."""
        down = self.experts(x, plan).view(plan["M"], plan["k"], self.K)
        w = torch.where(plan["local"], tw, 0.0).unsqueeze(-1)
        y = torch.where(plan["local"].unsqueeze(-1), down.float(), 0.0)
        return (y * w).sum(1).to(torch.bfloat16)
