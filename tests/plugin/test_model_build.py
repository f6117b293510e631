"""vLLM's real DeepSeek V4 and V4.1 models, built from the tiny example configs on
CPU (see _cpu_model.py for the construction stand-ins), once with
``--attention-backend dsv4`` and once with vLLM's own FlashMLA backend for that
model, compared layer by layer."""

from __future__ import annotations

import json
import os

import pytest

from _cpu_model import V41_EXAMPLE, V4_EXAMPLE, build_model, kv_cache_specs

# example, vLLM's own FlashMLA backend for it, dsv4's attention class
MODELS = {
    "v4": (V4_EXAMPLE, "FLASHMLA_SPARSE_DSV4", "dsv4_plugin.attention_v4:DSV4FlashMLAAttention"),
    "v41": (V41_EXAMPLE, "FLASHMLA_SPARSE_DSV41", "dsv4_plugin.attention_v41:DSV41FlashMLAAttention"),
}


def _cls(path):
    import importlib

    mod, name = path.split(":")
    return getattr(importlib.import_module(mod), name)


def _vllm_flashmla_cls(key):
    if key == "v41":
        from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention
    else:
        from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention
    return DeepseekV4FlashMLAAttention


def _text_config(example):
    with open(os.path.join(example, "config.json")) as f:
        raw = json.load(f)
    return raw.get("text_config", raw)


@pytest.fixture(scope="module", params=sorted(MODELS))
def built(request, plugin):
    example, vllm_backend, ours = MODELS[request.param]
    cfg, model = build_model(example, "dsv4")
    ref_cfg, ref_model = build_model(example, vllm_backend)
    return request.param, example, (cfg, model), (ref_cfg, ref_model), _cls(ours)


def _attn_layers(model, base):
    return {n: m for n, m in model.named_modules() if isinstance(m, base)}


def test_every_layer_runs_dsv4_attention_with_its_compress_ratio(built):
    key, example, (cfg, model), (ref_cfg, ref_model), ours = built
    base = _vllm_flashmla_cls(key)
    text = _text_config(example)
    n = text["num_hidden_layers"]
    layers = _attn_layers(model, base)
    ref_layers = _attn_layers(ref_model, base)
    assert len(layers) == len(ref_layers) == n
    assert {type(m) for m in layers.values()} == {ours}
    assert {type(m) for m in ref_layers.values()} == {base}  # vLLM's, unchanged
    ratios = [layers[name].compress_ratio for name in sorted(layers, key=_layer_index)]
    expected = text["compress_ratios"][:n]
    if key == "v4":  # V4 calls the window-only layers ratio 1
        expected = [r if r > 1 else 1 for r in expected]
    assert ratios == expected
    assert ratios == [ref_layers[name].compress_ratio for name in sorted(ref_layers, key=_layer_index)]
    if key == "v41":
        # shared KV / index sources, as vLLM resolves them for its own class
        for name, m in layers.items():
            r = ref_layers[name]
            assert (m.is_kv_source, m.is_index_source, m.compressed_cache_prefix) == \
                (r.is_kv_source, r.is_index_source, r.compressed_cache_prefix)
            assert (m.indexer is None) == (r.indexer is None)
            assert (m.compressor is None) == (r.compressor is None)
        src = {m.layer_id for m in layers.values() if m.is_kv_source}
        assert src == set(text["kv_source_layer_ids"])
        # Hopper: the 584-byte V4 record dsv4's decode reads
        assert {m.swa_bytes_per_token for m in layers.values()} == {584}
        assert not any(m.kv_mxfp8 for m in layers.values())


def _layer_index(name):
    return int(name.split("layers.")[1].split(".")[0])


def test_kv_cache_specs_equal_vllms_own_backend(built):
    key, example, (cfg, model), (ref_cfg, ref_model), ours = built
    specs = kv_cache_specs(cfg)
    ref_specs = kv_cache_specs(ref_cfg)
    assert specs.keys() == ref_specs.keys()
    assert specs == ref_specs
    real = {k: v for k, v in specs.items() if v is not None}
    assert any(k.endswith(".swa_cache") for k in real)  # the window caches are there
    assert any(k.endswith(".indexer.k_cache") for k in real)
    assert len(real) >= 2


def test_routed_experts_use_dsv4_moe_only_under_dsv4(built):
    """Same quantization methods layer by layer, except the NVFP4 routed experts."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4FusedMoE

    from dsv4_plugin.moe import DSV4ModelOptNvFp4FusedMoE

    key, example, (cfg, model), (ref_cfg, ref_model), ours = built
    assert cfg.model_config.quantization == ref_cfg.model_config.quantization == "deepseek_v4_fp8"
    ref_modules = dict(ref_model.named_modules())
    experts = 0
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is None:
            continue
        ref_qm = ref_modules[name].quant_method
        if isinstance(m, RoutedExperts):
            experts += 1
            assert type(qm) is DSV4ModelOptNvFp4FusedMoE, name
            assert type(ref_qm) is ModelOptNvFp4FusedMoE, name
        else:
            assert type(qm) is type(ref_qm), name
    assert experts == _text_config(example)["num_hidden_layers"]
