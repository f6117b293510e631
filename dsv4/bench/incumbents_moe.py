"""The MoE incumbents, called exactly as vLLM 0.33.0 calls them for DeepSeek V4 on Hopper.

Written from the incumbents' interface documentation and vLLM's call sites (nothing of
them is copied here; :mod:`dsv4.bench.anchors` loads them):

* :class:`HummingW4A16`: Humming's W4A16 MoE on ModelOpt NVFP4 experts, converted at load
  as vLLM's ``convert_to_humming_moe_kernel_format`` does for ``{"quant_method":
  "modelopt", "quant_algo": "nvfp4"}`` (schema conversion, then
  ``prepare_and_transform_humming_tensors`` padding N to 256 and K to 128).
* :class:`HummingW4A8`: Humming's W4A8 MoE on DeepSeek V4's MXFP4 experts, vLLM 0.33.0's
  path for those checkpoints on Hopper (``fused_moe/oracle/mxfp4.py``
  ``_humming_input_schema``: block-FP8 activations, e4m3 with float32 scales per 128 along
  K), the same conversion for ``{"quant_method": "mxfp4"}``; per call vLLM's
  ``per_token_group_quant_fp8`` quantizes GEMM1's input (vLLM's prepare step, before the
  dispatch) and Humming's input processing applies the clamped SwiGLU and GEMM2's dynamic
  FP8 quantization.

Both time two calls:

* ``apply`` (the incumbent's time of record): the whole routed-expert call as vLLM runs it
  per forward, from the router's ids and weights to the output, as dsv4's ``routed_moe`` /
  ``nvfp4_moe`` calls are timed. Without expert parallelism ``HummingIndexedExperts.apply``
  (``moe_align_block_size``, the indexed GEMMs, the Triton ``moe_fused_mul_sum``); with it
  vLLM's choice there, ``HummingGroupedExperts.apply`` (``moe_permute`` of the FP8 input,
  or ``moe_prepare_scatter`` and Humming's scatter for a bf16 one, the grouped GEMMs over
  expert-contiguous rows, ``moe_unpermute``). The routing and permute kernels come from
  ``_moe_C_stable_libtorch`` (``moe_c``), the weighted sum from vLLM's Python package
  (``vllm_py``, :func:`dsv4.bench.anchors.vllm_module`).
* ``experts`` (beside it; the number of record before 2026-12-04): the indexed GEMMs and
  the input processing alone, routing prep built once outside the timed region, no
  weighted sum, whatever the parallelism.
"""

from __future__ import annotations

import json
import math
from typing import Optional

import torch

__all__ = ["HummingW4A16", "HummingW4A8", "MOE_INCUMBENTS", "moe_incumbent_missing", "align_routes"]


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


def moe_incumbent_missing(anchors, case: tuple, ep: bool = True) -> Optional[str]:
    """Why the incumbent of MoE ``case`` cannot run with ``anchors``
    (:class:`dsv4.bench.anchors.Anchors`) for experts split by expert parallelism (``ep``)
    or not; None when it can. Humming needs vLLM's routing and permute kernels (``moe_c``);
    W4A8 also vLLM's GEMM1 input quantizer (``vllm_c``); without expert parallelism vLLM's
    weighted sum (``vllm_py``)."""
    if case not in MOE_INCUMBENTS:
        return (f"no incumbent: vLLM 0.33.0's default Hopper MoE path for {case[0]} weights has other numerics than "
                f"{case[1]} activations")
    need = ["humming", "moe_c"] + (["vllm_c"] if case[0] == "mxfp4" else []) + ([] if ep else ["vllm_py"])
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
        # What vLLM's apply runs (fused_humming_moe.get_humming_moe_gemm_type): with expert
        # parallelism the grouped GEMM over expert-contiguous rows, without it the indexed one
        # (the one :meth:`experts` runs in either case)
        self.ep = E < E_global
        gemm = GemmType.GROUPED_CONTIGUOUS if self.ep else GemmType.INDEXED
        self.apply_compute_config = json.dumps({"use_batch_invariant": False, "use_f16_accum": False,
                                                "gemm_type": gemm.value})
        self.apply_tuning = {name: self.tuning[name] if gemm == GemmType.INDEXED else
                             get_heuristics_config(layer_config=self.cfg[name], use_f16_accum=False,
                                                   use_batch_invariant=False, gemm_type=gemm)
                             for name in subs}
        self.apply_tuning_str = {k: json.dumps(v) for k, v in self.apply_tuning.items()}
        props = torch.cuda.get_device_properties(device)
        self.locks = torch.zeros(props.multi_processor_count * 8, dtype=torch.int32, device=device)
        self.activation = _clamped_swiglu(swiglu_limit)
        self._mul_sum = None  # vLLM's moe_fused_mul_sum, loaded at the first indexed apply_plan

    def _buffers(self, ids: torch.Tensor) -> dict:
        """What both calls' plans hold for one input set: the shapes, vLLM's
        ``estimate_local_valid_shape_m``, GEMM1's input (and its scales) as vLLM's prepare
        step writes it, and GEMM1's output, GEMM2's input and output per route."""
        M, k = ids.shape
        dev, rows = ids.device, ids.numel()
        return dict(M=M, k=k, valid_m=math.ceil(rows * self.E / self.E_global),
                    gate_up=torch.empty(rows, 2 * self.N, dtype=torch.bfloat16, device=dev),
                    act=torch.empty(rows, self.N, dtype=self._act_dtype, device=dev),
                    down=torch.empty(rows, self.K, dtype=torch.bfloat16, device=dev), **self._input_buffers(M, dev))

    def plan(self, ids: torch.Tensor, emap: torch.Tensor) -> dict:
        """Routing prep and buffers for one input set (vLLM redoes the routing prep every
        forward; here it is built once per input set, outside the timed region)."""
        p = self._buffers(ids)
        p.update(align={name: align_routes(ids, emap, self.E, _block_for(self.tuning[name], p["valid_m"]))
                        for name in ("w13", "w2")},
                 local=(emap.long()[ids.long()] >= 0))
        return p

    _act_dtype = torch.bfloat16  # GEMM2's input as Humming's input processing writes it

    def _gemm(self, name: str, inputs: torch.Tensor, input_scale: Optional[torch.Tensor], outputs: torch.Tensor,
              p: dict, vllm_apply: bool = False, **kw) -> None:
        """One Humming GEMM: indexed with :meth:`plan`'s alignment (``experts``), or with
        vLLM's GEMM type, tuning and the routing arguments in ``kw`` (``apply``)."""
        from humming.forward import humming_forward

        if not vllm_apply:
            s, e, n = p["align"][name]
            kw.update(sorted_ids=s, expert_ids=e, num_tokens_padded=n)
        t = self.t[name]
        humming_forward(self.cfg[name], inputs=inputs, weight=t["weight"], weight_scale=t.get("weight_scale"),
                        weight_scale_2=t.get("weight_scale_2"), input_scale=input_scale, outputs=outputs,
                        locks=self.locks, valid_shape_m=p["valid_m"],
                        compute_config=self.apply_compute_config if vllm_apply else self.compute_config,
                        tuning_config=(self.apply_tuning_str if vllm_apply else self.tuning_str)[name], **kw)

    def _activation(self, p: dict, num_valid_tokens: Optional[torch.Tensor] = None) -> tuple:
        """GEMM2's input from GEMM1's output, as vLLM's ``process_input("w2", ...)``: Humming's
        input processing with the clamped SwiGLU (and, when GEMM2's input schema quantizes,
        its dynamic quantization), rows bounded by ``num_valid_tokens`` in grouped mode."""
        from humming.forward import may_process_input

        mode = self.cfg["w2"].input_quant_mode
        h, gs, ts = may_process_input(self.cfg["w2"], inputs=p["gate_up"], outputs=p["act"], token_scales=None,
                                      layout="normal", num_valid_tokens=num_valid_tokens, **self.activation)
        return h, (gs if mode.has_group_scale else ts)

    def _gemm2(self, plan: dict) -> torch.Tensor:
        """The activation, then GEMM2 (indexed, :meth:`plan`'s alignment)."""
        h, h_scale = self._activation(plan)
        self._gemm("w2", h, h_scale, plan["down"], plan, top_k=1)
        return plan["down"]

    def __call__(self, x: torch.Tensor, tw: torch.Tensor, plan: dict) -> torch.Tensor:
        """The whole MoE: experts, then the weighted sum over each token's local routes
        (torch; vLLM runs its own fused kernel for it). Returns bf16 [M, K]."""
        down = self.experts(x, plan).view(plan["M"], plan["k"], self.K)
        w = torch.where(plan["local"], tw, 0.0).unsqueeze(-1)
        y = torch.where(plan["local"].unsqueeze(-1), down.float(), 0.0)
        return (y * w).sum(1).to(torch.bfloat16)

    # ---- vLLM's whole call: HummingIndexedExperts.apply / HummingGroupedExperts.apply ----

    def apply_plan(self, ids: torch.Tensor, emap: torch.Tensor, anchors) -> dict:
        """The buffers of :meth:`apply` for one input set, sized as vLLM sizes them (its
        workspace and permute scratch are persistent across forwards, so they are made here,
        outside the timed region). ``emap`` is passed on only with expert parallelism (vLLM
        has no expert map without it). ``anchors`` locates vLLM's weighted sum (indexed path)."""
        M, k = ids.shape
        dev, rows = ids.device, ids.numel()
        p = self._buffers(ids)
        p.update(ids=ids, emap=emap if self.ep else None, out=torch.empty(M, self.K, dtype=torch.bfloat16, device=dev))
        if self.ep:
            # MoEPermuteScratch (moe_permute_unpermute.py), reserved for M * k rows; GEMM1's
            # input in expert order ("quanted_gate_up_input", M * k rows in grouped mode)
            i32 = dict(dtype=torch.int32, device=dev)
            ws = torch.ops._moe_C.moe_permute_sort_workspace_size(rows, self.E_global)
            p.update(token_expert_indices=torch.arange(rows, **i32).view(M, k),
                     offsets=torch.empty(self.E + 1, dtype=torch.int64, device=dev),
                     permuted_idx=torch.empty(rows, **i32), inv=torch.empty(rows, **i32).view(M, k),
                     sort_ws=torch.empty(ws, dtype=torch.int8, device=dev),
                     permuted_experts=torch.empty(rows, **i32).view(M, k),
                     sorted_rows=torch.empty(rows, **i32).view(M, k),
                     ids_for_sort=torch.empty(rows, **i32).view(M, k),
                     a1_perm=torch.empty(rows, self.K, dtype=self._in_dtype, device=dev))
        else:
            # moe_align_block_size's buffers per Humming block size (GEMM2 realigns when its
            # tuning picks another)
            p["align"] = {}
            for name in ("w13", "w2"):
                b = _block_for(self.apply_tuning[name], p["valid_m"])
                if b not in p["align"]:
                    n = rows + self.E_global * (b - 1)
                    if rows < self.E_global:
                        n = min(rows * b, n)
                    p["align"][b] = (torch.empty(n, dtype=torch.int32, device=dev),
                                     torch.empty(-(-n // b), dtype=torch.int32, device=dev),
                                     torch.empty(1, dtype=torch.int32, device=dev))
                p[f"block_{name}"] = b
            if self._mul_sum is None:
                from .anchors import vllm_module
                self._mul_sum = vllm_module(anchors, "model_executor/layers/fused_moe/moe_fused_mul_sum.py",
                                            "_dsv4_anchor_vllm_moe_fused_mul_sum").moe_fused_mul_sum
        return p

    def apply(self, x: torch.Tensor, tw: torch.Tensor, p: dict) -> torch.Tensor:
        """The routed experts as vLLM 0.33.0 runs them per forward (``fused_humming_moe.py``;
        the module docstring lists the kernels), x bf16 [M, K], the plan's ``ids`` [M, k]
        int32 and ``tw`` [M, k] fp32 to the bf16 output [M, K]. The EP dispatch and combine
        collectives are not in it (dsv4 sits behind the same ones)."""
        from humming.forward import may_process_input

        ids, M, k = p["ids"], p["M"], p["k"]
        if ids.numel() == 0:
            return p["out"]
        a1, a1_scale = self._prepare_input(x, p)
        if not self.ep:
            s1, e1, n1 = p["align"][p["block_w13"]]
            torch.ops._moe_C.moe_align_block_size(ids, self.E_global, p["block_w13"], s1, e1, n1, None, None)
            s2, e2, n2 = p["align"][p["block_w2"]]
            if p["block_w2"] != p["block_w13"]:
                torch.ops._moe_C.moe_align_block_size(ids, self.E_global, p["block_w2"], s2, e2, n2, None, None)
            self._gemm("w13", a1, a1_scale, p["gate_up"], p, True, sorted_ids=s1, expert_ids=e1,
                       num_tokens_padded=n1, top_k=k)
            h, h_scale = self._activation(p)
            self._gemm("w2", h, h_scale, p["down"], p, True, sorted_ids=s2, expert_ids=e2, num_tokens_padded=n2,
                       top_k=1)
            self._mul_sum(p["down"].view(M, k, self.K), tw, outputs=p["out"], topk_ids=ids, expert_map=None)
            return p["out"]
        rows = ids.numel()
        if a1_scale is not None:  # block-FP8 input, quantized before the dispatch: permute it
            p["permuted_idx"].fill_(rows)
            torch.ops._moe_C.moe_permute_with_scratch(
                a1, ids, p["token_expert_indices"], p["emap"], self.E_global, self.E, k, p["a1_perm"], p["offsets"],
                p["inv"], p["permuted_idx"], p["sort_ws"], p["permuted_experts"], p["sorted_rows"], p["ids_for_sort"])
            a1_scale = a1_scale[p["permuted_idx"].clamp(max=rows - 1) // k]
        else:  # unquantized input: Humming's input processing scatters it into expert order
            torch.ops._moe_C.moe_prepare_scatter(
                ids, p["token_expert_indices"], p["emap"], self.E_global, self.E, p["offsets"], p["inv"], p["sort_ws"],
                p["permuted_experts"], p["sorted_rows"], p["ids_for_sort"])
            mode = self.cfg["w13"].input_quant_mode
            _, gs, ts = may_process_input(self.cfg["w13"], inputs=a1, outputs=p["a1_perm"], token_scales=None,
                                          layout="scatter", scatter_idx=p["inv"], num_valid_tokens=p["offsets"][-1:])
            a1_scale = gs if mode.has_group_scale else ts
        self._gemm("w13", p["a1_perm"], a1_scale, p["gate_up"], p, True, expert_layout=p["offsets"])
        h, h_scale = self._activation(p, p["offsets"][-1:])
        self._gemm("w2", h, h_scale, p["down"], p, True, expert_layout=p["offsets"])
        torch.ops._moe_C.moe_unpermute(p["down"].view(M, k, self.K), tw, p["inv"].flatten(), p["offsets"], k, p["out"])
        return p["out"]

    _in_dtype = torch.bfloat16  # GEMM1's input as the GEMM reads it

    def _input_buffers(self, M: int, dev) -> dict:
        return {}

    def _prepare_input(self, x: torch.Tensor, p: dict) -> tuple:
        """GEMM1's input and its scales after vLLM's prepare step (none for bf16 inputs)."""
        return x, None


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
        self._gemm("w13", x, None, plan["gate_up"], plan, top_k=plan["k"])
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

    Per call (:meth:`apply` or :meth:`experts`, the module docstring says which kernels):
    GEMM1's input quantized first by vLLM's ``per_token_group_quant_fp8`` kernel (group
    128, eps 1e-10, UE8M0 scales with ``ue8m0``: vLLM's prepare step before the dispatch,
    as for every block-FP8 Humming MoE); the clamped SwiGLU and GEMM2's dynamic FP8
    quantization in Humming's input processing.

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

    def experts(self, x: torch.Tensor, plan: dict) -> torch.Tensor:
        """GEMM1's input quantization (vLLM's kernel), GEMM1 (gate|up) with ``top_k``, the
        activation and GEMM2's input quantization, GEMM2; returns the per-route outputs
        [M*k, K] (rows of non-local routes are not written)."""
        xq, xs = self._prepare_input(x, plan)
        self._gemm("w13", xq, xs, plan["gate_up"], plan, top_k=plan["k"])
        return self._gemm2(plan)

    _in_dtype = torch.float8_e4m3fn

    def _input_buffers(self, M: int, dev) -> dict:
        return dict(xq=torch.empty(M, self.K, dtype=torch.float8_e4m3fn, device=dev),
                    xs=torch.empty(M, self.K // 128, dtype=torch.float32, device=dev))

    def _prepare_input(self, x: torch.Tensor, p: dict) -> tuple:
        # per_token_group_fp8_quant(x, x_q, x_s, group, eps, fp8_min, fp8_max, ue8m0,
        # column-major scales, TMA-aligned scales): vLLM's call for block FP8 on e4m3fn.
        torch.ops._C.per_token_group_fp8_quant(x, p["xq"], p["xs"], 128, 1e-10, -448.0, 448.0, self.ue8m0,
                                               False, False)
        return p["xq"], p["xs"]
