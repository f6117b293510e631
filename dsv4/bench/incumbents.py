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
* :class:`HummingW4A8`: Humming's W4A8 MoE on DeepSeek V4's MXFP4 experts, the path vLLM
  0.33.0 takes for those checkpoints on Hopper (``fused_moe/oracle/mxfp4.py``
  ``_humming_input_schema``: block-FP8 activations, e4m3 with float32 scales per 128
  along K): the same conversion steps for ``{"quant_method": "mxfp4"}`` with that input
  schema, then per call vLLM's ``per_token_group_quant_fp8`` on GEMM1's input (vLLM's
  prepare step quantizes block-FP8 activations before the dispatch), GEMM1 on the FP8
  input, the clamped SwiGLU and GEMM2's dynamic FP8 quantization in Humming's input
  processing, GEMM2.

Both Humming wrappers run vLLM's indexed experts (``HummingIndexedExperts``, vLLM's
choice without expert parallelism; with EP vLLM picks the grouped GEMM) with GEMM2's
input in the normal layout (vLLM scatters it once an expert map is set and M * top_k
exceeds twice the SM count), and leave the routing prep and the weighted sum out of the
timed ``experts`` call.
"""

from __future__ import annotations

import json
import math
from typing import Optional

import torch

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


# The MoE cases with an incumbent, (weight format, dsv4 activation mode) -> what vLLM
# 0.33.0 runs for them on Hopper, with the same numerics: NVFP4 W4A16 as Humming W4A16,
# DeepSeek V4's MXFP4 checkpoints as Humming W4A8.
# What vLLM 0.33.0 runs on Hopper for each dsv4 MoE case's weights. dsv4's MXFP4 W4A16
# (bf16 activations) is measured against Humming W4A8 too: vLLM serves MXFP4 checkpoints
# only with W4A8, so that is the time a user switching to dsv4's W4A16 path replaces (the
# numerics differ: bf16 activations are the more precise of the two).
MOE_INCUMBENTS = {("nvfp4", "bf16"): "Humming W4A16", ("mxfp4", "fp8"): "Humming W4A8",
                  ("mxfp4", "bf16"): "Humming W4A8"}


def moe_incumbent_missing(anchors, case: tuple) -> Optional[str]:
    """Why the incumbent of MoE ``case`` cannot run with ``anchors``
    (:class:`dsv4.bench.anchors.Anchors`); None when it can. Humming W4A8 also needs
    vLLM's GEMM1 input quantizer (the ``vllm_c`` library)."""
    if case not in MOE_INCUMBENTS:
        return (f"no incumbent: vLLM 0.33.0's default Hopper MoE path for {case[0]} weights has other numerics than "
                f"{case[1]} activations")
    need = ["humming"] + (["vllm_c"] if case[0] == "mxfp4" else [])
    why = [f"{n}: {anchors.missing[n]}" for n in need if n in anchors.missing]
    return "; ".join(why) or None


def _clamped_swiglu(limit: float) -> dict:
    """vLLM's clamped SiLU-and-mul for swiglu_limit L (alpha 1, beta 0) as Humming's
    input-processing activation: gate = min(a, L), up = clamp(b, -L, L), silu(gate) * up,
    in fp32; a and b are the two halves (gate | up) of GEMM1's output row."""
    lim = f"({float(limit)}f)"
    return dict(activation_type="binary_split",
                activation_impl=(f"[](float a, float b) {{ const float g = fminf(a, {lim}); "
                                 f"const float u = fmaxf(fminf(b, {lim}), -{lim}); "
                                 f"return g / (1.f + expf(-g)) * u; }}(a, b)"))


class _HummingMoe:
    """What Humming's MoE runs share, whatever the weight format: the load-time conversion
    of both sublayers (schema conversion; the input schema must fit the weights as is,
    vLLM's ``allow_input_schema_fallback=False``; then
    ``prepare_and_transform_humming_tensors`` padding N to 256 and K to 128, as vLLM's
    ``_prepare_and_transform_sublayer``), the tuning tables, the routing plan and the
    weighted sum. ``subs`` maps "w13" / "w2" to (shape_n, shape_k, shape_n_stacks, the
    sublayer's checkpoint tensors)."""

    def __init__(self, subs: dict, weight_schema, input_schema, E: int, N: int, K: int, E_global: int,
                 swiglu_limit: float, device):
        from humming.config import GemmType
        from humming.transform import prepare_and_transform_humming_tensors
        from humming.tune import get_heuristics_config

        self.E, self.N, self.K, self.E_global = E, N, K, E_global
        self.cfg, self.t, self.tuning = {}, {}, {}
        self.compute_config = json.dumps({"use_batch_invariant": False, "use_f16_accum": False,
                                          "gemm_type": GemmType.INDEXED.value})
        for name, (n, k, stacks, tensors) in subs.items():
            kw = dict(tensors=tensors, shape_n_stacks=stacks, shape_k_stacks=[k], param_dtype=torch.bfloat16,
                      num_experts=E)
            wschema, wt = weight_schema.convert_humming(**kw)
            ischema, it = input_schema.convert_humming(**kw)
            if not ischema.is_compatible_with(wschema, torch.bfloat16):
                raise ValueError(f"dsv4: Humming has no kernel for input schema {ischema} with weight schema "
                                 f"{wschema} on this device")
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
        self.activation = _clamped_swiglu(swiglu_limit)

    def plan(self, ids: torch.Tensor, emap: torch.Tensor) -> dict:
        """Routing prep and buffers for one input set (vLLM redoes the routing prep every
        forward; here it is built once per input set, outside the timed region)."""
        M, k = ids.shape
        valid_m = math.ceil(M * k * self.E / self.E_global)  # vLLM's estimate_local_valid_shape_m
        align = {name: align_routes(ids, emap, self.E, _block_for(self.tuning[name], valid_m))
                 for name in ("w13", "w2")}
        dev = ids.device
        return dict(M=M, k=k, valid_m=valid_m, align=align,
                    gate_up=torch.empty(M * k, 2 * self.N, dtype=torch.bfloat16, device=dev),
                    act=torch.empty(M * k, self.N, dtype=self._act_dtype, device=dev),
                    down=torch.empty(M * k, self.K, dtype=torch.bfloat16, device=dev),
                    local=(emap.long()[ids.long()] >= 0))

    _act_dtype = torch.bfloat16  # GEMM2's input as Humming's input processing writes it

    def _gemm(self, name: str, inputs: torch.Tensor, input_scale: Optional[torch.Tensor], outputs: torch.Tensor,
              plan: dict, top_k: int) -> None:
        from humming.forward import humming_forward

        s, e, n = plan["align"][name]
        t = self.t[name]
        humming_forward(self.cfg[name], inputs=inputs, weight=t["weight"], weight_scale=t.get("weight_scale"),
                        weight_scale_2=t.get("weight_scale_2"), input_scale=input_scale, outputs=outputs,
                        locks=self.locks, sorted_ids=s, expert_ids=e, num_tokens_padded=n, top_k=top_k,
                        valid_shape_m=plan["valid_m"], compute_config=self.compute_config,
                        tuning_config=self.tuning_str[name])

    def _gemm2(self, plan: dict) -> torch.Tensor:
        """The clamped SwiGLU of GEMM1's output in Humming's input processing (and, when
        GEMM2's input schema quantizes, its dynamic quantization there), then GEMM2."""
        from humming.forward import may_process_input

        inputs, group_scales, _ = may_process_input(self.cfg["w2"], inputs=plan["gate_up"], outputs=plan["act"],
                                                    layout="normal", **self.activation)
        self._gemm("w2", inputs, group_scales, plan["down"], plan, 1)
        return plan["down"]

    def __call__(self, x: torch.Tensor, tw: torch.Tensor, plan: dict) -> torch.Tensor:
        """The whole MoE: experts, then the weighted sum over each token's local routes
        (torch; vLLM runs its own fused kernel for it). Returns bf16 [M, K]."""
        down = self.experts(x, plan).view(plan["M"], plan["k"], self.K)
        w = torch.where(plan["local"], tw, 0.0).unsqueeze(-1)
        y = torch.where(plan["local"].unsqueeze(-1), down.float(), 0.0)
        return (y * w).sum(1).to(torch.bfloat16)


class HummingW4A16(_HummingMoe):
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
        from humming.schema import BaseWeightSchema, HummingInputSchema

        E, two_n, half_k = w["w13"].shape
        N, K = two_n // 2, half_k * 2
        g13 = w["w13_scale_2"]
        if g13.dim() == 2:  # vLLM's ModelOpt MoE keeps the gate half's global scale for both halves
            g13 = g13[:, 0].contiguous()
        subs = {"w13": (2 * N, K, [N, N], {"weight": w["w13"], "weight_scale": w["w13_scale"],
                                           "weight_scale_2": g13}),
                "w2": (K, N, [K], {"weight": w["w2"], "weight_scale": w["w2_scale"],
                                   "weight_scale_2": w["w2_scale_2"]})}
        super().__init__(subs, BaseWeightSchema.from_config({"quant_method": "modelopt", "quant_algo": "nvfp4"}),
                         HummingInputSchema(), E, N, K, E_global, swiglu_limit, w["w13"].device)

    def experts(self, x: torch.Tensor, plan: dict) -> torch.Tensor:
        """GEMM1 (gate|up) with ``top_k``, the activation, GEMM2 (the Humming kernels);
        returns the per-route outputs [M*k, K] (rows of non-local routes are not written)."""
        self._gemm("w13", x, None, plan["gate_up"], plan, plan["k"])
        return self._gemm2(plan)


class HummingW4A8(_HummingMoe):
    """Humming's W4A8 MoE on DeepSeek V4's MXFP4 experts, as vLLM 0.33.0 runs the MXFP4
    checkpoints on SM90 (``oracle/mxfp4.py``: the checkpoint's MXFP8 activation key becomes
    block FP8 on Hopper, ``_humming_input_schema``).

    Load time (here, outside any timed region): the checkpoint tensors padded to N a
    multiple of 64 with zero rows / columns (vLLM's MXFP4 parameters for Humming), the
    ``{"quant_method": "mxfp4"}`` weight schema and the block-FP8 input schema (e4m3,
    dynamic float32 scales per 128 along K), then Humming's own transform, which folds
    the e8m0 scales into FP8 operands with one base per expert matrix.

    Per call (:meth:`experts`, all of it timed, as each vLLM forward runs it): GEMM1's
    input quantized by vLLM's ``per_token_group_quant_fp8`` kernel (group 128, eps
    1e-10, UE8M0 scales with ``ue8m0``: vLLM's prepare step before the dispatch, as for
    every block-FP8 Humming MoE), GEMM1 on the FP8 input and its scales, the clamped
    SwiGLU and GEMM2's dynamic FP8 quantization in Humming's input processing, GEMM2.

    Parameters
    ----------
    w : dict
        vLLM's stacked MXFP4 layout of the local experts (``dsv4.formats.mxfp4``): ``w13`` uint8
        [E, 2N, K/2], ``w13_scale`` e8m0 [E, 2N, K/32], ``w2`` uint8 [E, K, N/2],
        ``w2_scale`` e8m0 [E, K, N/32] (uint8 or float8_e8m0fnu). Converted once here.
    E_global : int
        Global expert count (the routing ids index it).
    swiglu_limit : float
    ue8m0 : bool
        GEMM1's activation scales rounded up to powers of two (vLLM's
        ``VLLM_USE_DEEP_GEMM_E8M0`` default on Hopper) or plain fp32.

    Needs ``torch.ops._C.per_token_group_fp8_quant`` (vLLM's ``_C_stable_libtorch``
    library, :mod:`dsv4.bench.anchors` ``vllm_c``).
    """

    _act_dtype = torch.float8_e4m3fn

    def __init__(self, w: dict, E_global: int, swiglu_limit: float, ue8m0: bool = True):
        if not hasattr(torch.ops._C, "per_token_group_fp8_quant"):
            raise RuntimeError("dsv4: Humming W4A8 needs vLLM's per_token_group_fp8_quant (load vLLM's "
                               "_C_stable_libtorch library: dsv4.bench.anchors vllm_c)")
        from humming import dtypes
        from humming.config import InputQuantizationMode
        from humming.schema import BaseWeightSchema, HummingInputSchema

        from ..formats import mxfp4

        p = mxfp4.pad_mxfp4_moe_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], multiple=64)
        E, two_n, half_k = p["w13"].shape
        N, K = two_n // 2, half_k * 2
        subs = {"w13": (2 * N, K, [N, N], {"weight": p["w13"], "weight_scale": p["w13_scale"]}),
                "w2": (K, N, [K], {"weight": p["w2"], "weight_scale": p["w2_scale"]})}
        block_fp8 = HummingInputSchema(a_dtype=dtypes.float8e4m3, input_scale_group_size=128,
                                       input_scale_dtype=dtypes.float32,
                                       input_quant_mode=InputQuantizationMode.DynamicGroup)
        super().__init__(subs, BaseWeightSchema.from_config({"quant_method": "mxfp4"}), block_fp8, E, N, K,
                         E_global, swiglu_limit, w["w13"].device)
        self.ue8m0 = bool(ue8m0)

    def plan(self, ids: torch.Tensor, emap: torch.Tensor) -> dict:
        p = super().plan(ids, emap)
        M, dev = ids.shape[0], ids.device
        p.update(xq=torch.empty(M, self.K, dtype=torch.float8_e4m3fn, device=dev),
                 xs=torch.empty(M, self.K // 128, dtype=torch.float32, device=dev))
        return p

    def experts(self, x: torch.Tensor, plan: dict) -> torch.Tensor:
        """GEMM1's input quantization (vLLM's kernel), GEMM1 (gate|up) with ``top_k``, the
        activation and GEMM2's input quantization, GEMM2; returns the per-route outputs
        [M*k, K] (rows of non-local routes are not written)."""
        # per_token_group_fp8_quant(x, x_q, x_s, group, eps, fp8_min, fp8_max, ue8m0,
        # column-major scales, TMA-aligned scales): vLLM's call for block FP8 on e4m3fn.
        torch.ops._C.per_token_group_fp8_quant(x, plan["xq"], plan["xs"], 128, 1e-10, -448.0, 448.0, self.ue8m0,
                                               False, False)
        self._gemm("w13", plan["xq"], plan["xs"], plan["gate_up"], plan, plan["k"])
        return self._gemm2(plan)
