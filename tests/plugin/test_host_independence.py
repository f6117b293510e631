"""The plugin suite's verdicts do not depend on the CPU that runs it.

vLLM's CPU platform asks ``torch.cpu._is_amx_tile_supported()`` and, for an MLA model
on a CPU without AMX tiles, turns chunked prefill and prefix caching off and raises
``max_num_batched_tokens`` to ``max_model_len`` (``vllm/platforms/cpu.py``
``check_and_update_config``); its MXFP4 MoE oracle offers CPU experts only with AMX
tiles. The suite models a Hopper worker instead (_cpu_model.py: ``cuda_engine_limits``,
the MXFP4 backend stand-in). Here the probe is patched both ways, so whichever CPU runs
the suite, both branches of vLLM are exercised: the engine limits, the prefill chunk
plans built from them by vLLM's metadata builders, and the build of vLLM's own MXFP4
MoE method.
"""

from __future__ import annotations

import pytest
import torch

import _moe_model as mm
from _attn_batch import ENGINE_KWARGS, MIXED, AttnBatch, pick_layer
from _cpu_model import V41_EXAMPLE, V4_EXAMPLE, _ensure_distributed, build_model

EXAMPLES = {"v4": V4_EXAMPLE, "v41": V41_EXAMPLE}


@pytest.fixture(params=[False, True], ids=["no_amx", "amx"])
def amx(request, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: request.param)
    return request.param


def test_the_probe_decides_vllms_cpu_limits(amx):
    """Without the stand-in, vLLM's CPU platform keeps the limits only with AMX tiles:
    the patched probe reaches the branch the suite's stand-in neutralises."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs = ENGINE_KWARGS["v4"]
    cfg = EngineArgs(model=V4_EXAMPLE, load_format="dummy", skip_tokenizer_init=True,
                     attention_backend="dsv4", **kwargs).create_engine_config()
    sched = cfg.scheduler_config
    if amx:
        assert sched.enable_chunked_prefill
        assert sched.max_num_batched_tokens == kwargs["max_num_batched_tokens"]
    else:
        assert not sched.enable_chunked_prefill
        assert sched.max_num_batched_tokens >= kwargs["max_model_len"]


@pytest.mark.parametrize("key", ["v4", "v41"])
def test_engine_limits_and_chunk_plans_match_on_any_cpu(plugin, amx, monkeypatch, key):
    """_cpu_model.engine_config keeps the limits asked for (it checks them too), and vLLM's
    builders then plan the mixed batch's prefills in two chunks, as on a Hopper worker."""
    from _stand_ins import install_attention_helpers
    from test_metadata_contract import _chunk_plan

    models = {key: build_model(EXAMPLES[key], "dsv4", **ENGINE_KWARGS[key])}
    sched = models[key][0].scheduler_config
    assert sched.enable_chunked_prefill
    assert sched.max_num_batched_tokens == ENGINE_KWARGS[key]["max_num_batched_tokens"]
    install_attention_helpers(monkeypatch)  # after the build, as the attn_models fixture
    for which in ("v4_swa", "v4_c4a", "v4_c128a") if key == "v4" else ("v41_swa", "v41_r2_source"):
        cfg, layer = pick_layer(models, which)
        batch = AttnBatch(cfg, layer, MIXED[key], torch.Generator().manual_seed(3))
        md = batch.build_metadata()
        plan = _chunk_plan(layer, md[layer.swa_cache_layer.prefix])
        assert len(plan) == 2, f"{which}: chunk plan {plan}"


def test_vllms_own_mxfp4_method_builds_on_any_cpu(plugin, amx, tmp_path, monkeypatch):
    """DSV4_MOE=0 leaves the MXFP4 experts to vLLM's Mxfp4MoEMethod, whose backend is
    the one vLLM picks on Hopper (Humming), with or without AMX tiles on this host."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod

    monkeypatch.setenv("DSV4_MOE", "0")
    cfg, model = mm.build(mm.write_variant(str(tmp_path), "mxfp4"), _ensure_distributed)
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(type(m.quant_method) is Mxfp4MoEMethod for m in experts)
    assert all(m.quant_method.mxfp4_backend is Mxfp4MoeBackend.HUMMING for m in experts)
