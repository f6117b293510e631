"""CLI parsing through vLLM's real `vllm serve` parser, engine-config creation for
the example checkpoint config, and the attention-class selection at the seam."""

from __future__ import annotations

import json
import os
import types

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "dsv4-tiny-nvfp4")


def _serve_parser():
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # What `vllm serve` builds (vllm/entrypoints/cli/serve.py: make_arg_parser);
    # building it loads the general plugins, i.e. calls dsv4_plugin.register().
    return make_arg_parser(FlexibleArgumentParser())


@pytest.fixture(scope="module")
def serve_parser(plugin):
    return _serve_parser()


@pytest.mark.parametrize(
    "argv",
    [
        ["--attention-backend", "dsv4"],
        ["--attention-backend", "DSV4"],
        ["--attention-config", '{"backend": "dsv4"}'],
        ["--attention-config.backend", "dsv4"],
    ],
)
def test_cli_parses_dsv4(serve_parser, argv):
    from vllm.config import AttentionConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    args = serve_parser.parse_args(["--model", EXAMPLE, *argv])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    # Same resolution as EngineArgs.create_engine_config.
    if engine_args.attention_backend is not None:
        backend = AttentionConfig.validate_backend_before(engine_args.attention_backend)
    else:
        backend = engine_args.attention_config.backend
    assert backend is AttentionBackendEnum.DSV4


def test_cli_unknown_backend_is_still_an_error(serve_parser):
    from vllm.config import AttentionConfig

    args = serve_parser.parse_args(["--model", EXAMPLE, "--attention-backend", "dsv5"])
    with pytest.raises(ValueError, match="Unknown attention backend: 'DSV5'.*DSV4"):
        AttentionConfig.validate_backend_before(args.attention_backend)


def _engine_config(parser, *extra):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = parser.parse_args(
        ["--model", EXAMPLE, "--load-format", "dummy", "--skip-tokenizer-init",
         "--max-model-len", "4096", *extra]
    )
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def test_example_config_builds_a_vllm_engine_config(serve_parser):
    """`vllm serve examples/dsv4-tiny-nvfp4 --load-format dummy --attention-backend dsv4`
    up to (not including) starting the engine: vLLM's config classes accept it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from dsv4_plugin.moe import QUANT_NAME, DSV4DeepseekV4Config

    cfg = _engine_config(serve_parser, "--attention-backend", "dsv4")
    assert cfg.attention_config.backend is AttentionBackendEnum.DSV4
    assert cfg.model_config.architectures == ["DeepseekV4ForCausalLM"]
    hf = cfg.model_config.hf_config
    assert hf.model_type == "deepseek_v4"
    assert hf.quantization_config["moe_quant_algo"] == "NVFP4"
    with open(os.path.join(EXAMPLE, "config.json")) as f:
        raw = json.load(f)
    assert hf.num_hidden_layers == raw["num_hidden_layers"]
    assert hf.layer_types == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ]
    # vLLM's own quantization name; its class is the plugin's subclass of vLLM's.
    assert cfg.model_config.quantization == QUANT_NAME == "deepseek_v4_fp8"
    assert isinstance(cfg.quant_config, DSV4DeepseekV4Config)


def _cfg(backend):
    from vllm.config import AttentionConfig

    return types.SimpleNamespace(attention_config=AttentionConfig(backend=backend))


def test_selection_returns_our_class_for_dsv4_only(plugin):
    """DeepSeek V4's seam."""
    import vllm.models.deepseek_v4.nvidia.model as model
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferMLAAttention,
    )
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    from dsv4_plugin.attention import select_attn_cls
    from dsv4_plugin.attention_v4 import DSV4FlashMLAAttention

    # The seam: the decoder layer looks this module global up at call time.
    assert model._select_dsv4_attn_cls is select_attn_cls
    assert "_select_dsv4_attn_cls" in model.DeepseekV4DecoderLayer.__init__.__code__.co_names

    select = model._select_dsv4_attn_cls
    assert select(_cfg("dsv4")) is DSV4FlashMLAAttention
    assert select(_cfg("DSV4")) is DSV4FlashMLAAttention
    # Everything else is vLLM's own choice, unchanged.
    assert select(_cfg(None)) is DeepseekV4FlashMLAAttention
    assert select(_cfg("FLASHMLA_SPARSE_DSV4")) is DeepseekV4FlashMLAAttention
    assert select(_cfg("FLASHMLA_SPARSE")) is DeepseekV4FlashMLAAttention
    assert select(_cfg("FLASHINFER_MLA_SPARSE_DSV4")) is DeepseekV4FlashInferMLAAttention
    with pytest.raises(ValueError, match="not a DeepSeek V4 attention backend"):
        select(_cfg("FLASHINFER_MLA_SPARSE"))
    assert DSV4FlashMLAAttention is not DeepseekV4FlashMLAAttention
    assert issubclass(DSV4FlashMLAAttention, DeepseekV4FlashMLAAttention)


def test_v41_selection_returns_our_class_for_dsv4_only(plugin):
    """DeepSeek V4.1's seam: DSV4 -> dsv4's V4.1 class; every other backend, and
    prefill context parallelism, stays vLLM's decision."""
    import vllm.models.deepseek_v41.nvidia.model as model
    from vllm.models.deepseek_v41.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferMLAAttention,
    )
    from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention

    from dsv4_plugin.attention import select_attn_cls_v41
    from dsv4_plugin.attention_v41 import DSV41FlashMLAAttention

    assert model._select_dsv4_attn_cls is select_attn_cls_v41
    assert "_select_dsv4_attn_cls" in model.DeepseekV4DecoderLayer.__init__.__code__.co_names

    def cfg(backend, pcp=1):
        c = _cfg(backend)
        c.parallel_config = types.SimpleNamespace(prefill_context_parallel_size=pcp)
        return c

    assert model._select_dsv4_attn_cls(cfg("dsv4")) is DSV41FlashMLAAttention
    assert model._select_dsv4_attn_cls(cfg("FLASHMLA_SPARSE_DSV41")) is DeepseekV4FlashMLAAttention
    assert model._select_dsv4_attn_cls(cfg("FLASHINFER_MLA_SPARSE_DSV41")) is \
        DeepseekV4FlashInferMLAAttention
    with pytest.raises(NotImplementedError, match="PCP requires FlashMLA"):
        model._select_dsv4_attn_cls(cfg("dsv4", pcp=2))
    assert issubclass(DSV41FlashMLAAttention, DeepseekV4FlashMLAAttention)
    own = {k for k in vars(DSV41FlashMLAAttention) if not k.startswith("__") and k != "_abc_impl"}
    assert own == {"_forward_decode", "_forward_prefill"}


def test_moe_quant_method_only_under_dsv4(plugin, serve_parser):
    """With the example's config: routed experts get the dsv4 method only when the
    DSV4 attention backend is selected; otherwise vLLM's ModelOpt NVFP4 method."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4FusedMoE

    from dsv4_plugin.moe import DSV4DeepseekV4Config, DSV4ModelOptNvFp4FusedMoE

    cfg = _engine_config(serve_parser, "--attention-backend", "dsv4")
    qc = cfg.quant_config
    assert isinstance(qc, DSV4DeepseekV4Config)

    fake_layer = RoutedExperts.__new__(RoutedExperts)
    fake_layer.moe_config = None  # vLLM's methods only store it at construction
    with set_current_vllm_config(cfg):
        assert qc.moe_quant_algo == "NVFP4"
        assert qc._dsv4_method_for(fake_layer, "model.layers.1.ffn.experts") is DSV4ModelOptNvFp4FusedMoE
    cfg.attention_config.backend = None
    with set_current_vllm_config(cfg):
        assert qc._dsv4_method_for(fake_layer, "model.layers.1.ffn.experts") is None
    assert issubclass(DSV4ModelOptNvFp4FusedMoE, ModelOptNvFp4FusedMoE)
