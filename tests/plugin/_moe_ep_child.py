"""One rank of the expert-parallel MoE test (test_moe_model.py), in a fresh interpreter
started by torch.multiprocessing's spawn: vLLM's tensor-parallel and expert-parallel
groups over gloo, then the routed-expert layers of the NVFP4 and MXFP4 variants."""

from __future__ import annotations

import os

_dist_ready = False


def _distributed(rank: int, world: int, init_file: str):
    def ensure(vllm_config) -> None:
        global _dist_ready
        if _dist_ready:
            return
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"file://{init_file}")
        initialize_model_parallel(tensor_model_parallel_size=world)
        _dist_ready = True

    return ensure


def run(rank: int, world: int, init_file: str, variants: dict, x, input_ids, out_dir: str) -> None:
    """variants: fmt -> (config dir, checkpoint). Saves, per format, the layer outputs,
    the routed experts' expert_map and local expert count to out_dir/rank{rank}.pt."""
    import torch

    # as conftest.py does, for this fresh interpreter (a CPU test machine)
    from _stand_ins import stand_in_for_cuda

    stand_in_for_cuda()
    import dsv4_plugin

    dsv4_plugin.register()
    import _moe_model as mm

    ensure = _distributed(rank, world, init_file)
    results = {}
    for fmt, (path, ckpt) in variants.items():
        cfg, model = mm.build(path, ensure, tensor_parallel_size=world, enable_expert_parallel=True)
        mm.load(cfg, model, ckpt)
        experts = model.model.layers[1].ffn.experts.routed_experts
        results[fmt] = {
            "method": type(experts.quant_method).__name__,
            "ue8m0": getattr(experts.quant_method.moe_kernel.fused_experts, "dsv4_ue8m0", None),
            "expert_map": experts.expert_map.clone(),
            "local_num_experts": experts.local_num_experts,
            "out": {layer: mm.forward(cfg, model, layer, x, input_ids) for layer in mm.LAYERS},
        }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
