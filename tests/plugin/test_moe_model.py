"""vLLM 0.33.0's real DeepSeek V4 MoE layers with dsv4 selected, end to end on CPU
(see _moe_model.py): vLLM's create_weights, a synthetic ModelOpt NVFP4 checkpoint
loaded through the model's own load_weights and name mapping, vLLM's router on the
hash-routed layer and the biased top-k layer, the routed scaling factor, swiglu_limit,
the shared expert and the runner's combine, against an independent float32
computation; and the same with expert parallelism over two gloo processes, with the
expert map vLLM's EP setup makes (NVFP4 and MXFP4 experts)."""

from __future__ import annotations

import os
import time

import torch

import _moe_model as mm
from _cpu_model import _ensure_distributed
from _moe_model import TOL, check_layers

M = 23  # tokens


def _loaded_names(layer: int, fmt: str) -> set:
    pre = f"model.layers.{layer}.ffn."
    routed = ["w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"]
    if fmt == "nvfp4":
        routed += ["w13_weight_scale_2", "w2_weight_scale_2", "w13_input_scale", "w2_input_scale"]
    gate = ["gate.weight", "gate.tid2eid" if layer == 0 else "gate.e_score_correction_bias"]
    shared = [f"shared_experts.{p}.{w}" for p in ("gate_up_proj", "down_proj") for w in ("weight", "weight_scale_inv")]
    return {pre + n for n in gate + shared + [f"experts.routed_experts.{r}" for r in routed]}


def test_nvfp4_moe_layers_end_to_end(plugin, tmp_path):
    from dsv4_plugin.moe import DSV4ModelOptNvFp4FusedMoE

    cfg, model = mm.build(mm.write_variant(str(tmp_path), "nvfp4"), _ensure_distributed)
    ckpt = mm.checkpoint("nvfp4", seed=1)
    loaded = mm.load(cfg, model, ckpt)
    assert {n for n in loaded if ".ffn." in n} == _loaded_names(0, "nvfp4") | _loaded_names(1, "nvfp4")
    x, input_ids = mm.tokens(2, M)
    check_layers(cfg, model, ckpt, "nvfp4", x, input_ids, DSV4ModelOptNvFp4FusedMoE)


def _mxfp4_w4a8_quantizers_fp32():
    """GEMM1 / GEMM2 input quantize-dequantize of vLLM's W4A8 MXFP4 MoE on Hopper with
    plain fp32 GEMM1 scales (dsv4.reference; test_mxfp4_plugin.py has vLLM's own)."""
    from dsv4 import reference as mxfp4

    return (lambda t: mxfp4.dequantize_fp8_groups(*mxfp4.quantize_fp8_gemm1(t, ue8m0=False)),
            lambda t: mxfp4.dequantize_fp8_groups(*mxfp4.quantize_fp8_gemm2(t)))


def test_expert_parallel_two_gloo_ranks(plugin, tmp_path):
    """--enable-expert-parallel with tensor parallel 2: each spawned rank builds the
    model, loads the whole checkpoint (vLLM's loader keeps its experts) and runs the
    same tokens; vLLM's all-reduce sums the ranks' shares into the full layer output."""
    import torch.multiprocessing as tmp

    import _moe_ep_child

    variants = {fmt: (mm.write_variant(str(tmp_path / fmt), fmt), mm.checkpoint(fmt, seed=5))
                for fmt in ("nvfp4", "mxfp4")}
    x, input_ids = mm.tokens(6, M)
    ctx = tmp.start_processes(_moe_ep_child.run, nprocs=2, join=False, start_method="spawn",
                              args=(2, str(tmp_path / "dist-init"), variants, x, input_ids, str(tmp_path)))
    deadline = time.monotonic() + 600
    try:
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline, "expert-parallel ranks did not finish within 600 s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    ranks = [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(2)]
    half = mm.E // 2
    for fmt, (_, ckpt) in variants.items():
        quantize = _mxfp4_w4a8_quantizers_fp32() if fmt == "mxfp4" else None
        for r, got in enumerate(rank[fmt] for rank in ranks):
            assert got["method"] == ("DSV4ModelOptNvFp4FusedMoE" if fmt == "nvfp4" else "DSV4Mxfp4FusedMoE")
            # vLLM's linear placement: rank r holds global experts [r * E/2, (r+1) * E/2)
            want = torch.full((mm.E,), -1, dtype=got["expert_map"].dtype)
            want[r * half:(r + 1) * half] = torch.arange(half)
            assert got["local_num_experts"] == half and torch.equal(got["expert_map"], want)
            if fmt == "mxfp4":  # vLLM's CPU platform: no DeepGEMM, so no E8M0 activation scales
                assert got["ue8m0"] is False
            for layer in mm.LAYERS:
                ref = mm.reference(ckpt, layer, x, input_ids, fmt, quantize=quantize)
                assert mm.rel_err(got["out"][layer], ref) < TOL, (fmt, r, layer)
        for layer in mm.LAYERS:
            assert torch.equal(ranks[0][fmt]["out"][layer], ranks[1][fmt]["out"][layer])
