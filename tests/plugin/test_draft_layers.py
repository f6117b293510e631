"""MTP / DSpark draft layers: which attention backend vLLM gives them, under both
model runners, and the real V4 MTP draft model built with dsv4 selected."""

from __future__ import annotations

import types

import pytest

from _cpu_model import V4_EXAMPLE, cuda_construction_stand_ins, engine_config


def _mtp_config(**spec):
    return engine_config(V4_EXAMPLE, "dsv4",
                         speculative_config={"method": "mtp", "num_speculative_tokens": 1, **spec})


def test_v2_runner_mtp_draft_keeps_dsv4_and_builds_dsv4_layers(plugin):
    """Model runner V2 (vllm/v1/worker/gpu/spec_decode/eagle/utils.py: load_eagle_model)
    builds the draft from speculative_config.apply_draft_overrides(target config),
    which keeps the target's backend: the MTP block is a DeepseekV4DecoderLayer, so
    the seam gives it dsv4's attention, and its NVFP4 experts dsv4's MoE."""
    import _cpu_model
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.nvidia.mtp import DeepSeekV4MTP

    from dsv4_plugin.attention_v4 import DSV4FlashMLAAttention
    from dsv4_plugin.moe import DSV4ModelOptNvFp4FusedMoE

    cfg = _mtp_config()
    draft_cfg = cfg.speculative_config.apply_draft_overrides(cfg)
    assert draft_cfg.attention_config.backend is cfg.attention_config.backend
    assert cfg.speculative_config.draft_model_config.quantization == "deepseek_v4_fp8"
    with cuda_construction_stand_ins(), set_current_vllm_config(draft_cfg):
        _cpu_model._ensure_distributed(draft_cfg)
        draft = DeepSeekV4MTP(vllm_config=draft_cfg)
    mods = dict(draft.named_modules())
    attn = [m for n, m in mods.items() if n.endswith("mtp_block.attn")]
    assert len(attn) == 1 and type(attn[0]) is DSV4FlashMLAAttention
    experts = [m for n, m in mods.items() if n.endswith("ffn.experts.routed_experts")]
    assert len(experts) == 1 and type(experts[0].quant_method) is DSV4ModelOptNvFp4FusedMoE


@pytest.mark.parametrize("spec_backend", [None, "dsv4"])
def test_v1_runner_mtp_draft_backend(plugin, spec_backend):
    """Model runner V1 (vllm/v1/spec_decode/llm_base_proposer.py:
    _create_draft_vllm_config) never inherits the target's backend: the draft gets
    speculative_config.attention_backend, i.e. vLLM's default (FlashMLA) unless
    --speculative-config sets "attention_backend": "dsv4" (the README says so)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    extra = {} if spec_backend is None else {"attention_backend": spec_backend}
    cfg = _mtp_config(**extra)
    proposer = types.SimpleNamespace(speculative_config=cfg.speculative_config, vllm_config=cfg)
    draft_cfg = SpecDecodeBaseProposer._create_draft_vllm_config(proposer)
    if spec_backend is None:
        assert draft_cfg.attention_config.backend is None
    else:
        assert draft_cfg.attention_config.backend is cfg.attention_config.backend


def test_dspark_draft_inherits_dsv4(plugin):
    """DSpark (model runner V2, vllm/v1/worker/gpu/spec_decode/dspark/utils.py) gives
    DeepSeek V4 / V4.1 drafts the target's backend unless the speculative config sets
    one; V4.1's DSpark model builds DeepseekV4DecoderLayer from the V4.1 model module,
    i.e. through the V4.1 seam."""
    import vllm.models.deepseek_v41.nvidia.dspark as dspark
    import vllm.models.deepseek_v41.nvidia.model as v41_model
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import _resolve_dspark_attention_backend

    dsv4 = AttentionBackendEnum["DSV4"]
    for model_type in ("deepseek_v4", "deepseek_v41"):
        draft = types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type=model_type))
        assert _resolve_dspark_attention_backend(draft, None, dsv4) is dsv4
    assert dspark.DeepseekV4DecoderLayer is v41_model.DeepseekV4DecoderLayer
