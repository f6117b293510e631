"""The plugin's MXFP4 path: DeepSeek V4 checkpoints with MXFP4 routed experts
(``expert_dtype: fp4``, no ``moe_quant_algo``; DeepSeek's native V4-Flash / V4-Pro /
V4.1-Flash) get dsv4's experts through the quantization-plugin hook under
``--attention-backend dsv4``, inside vLLM's real model (see _moe_model.py): vLLM's
Mxfp4MoEMethod.create_weights, the checkpoint's ``.scale`` e8m0 tensors through the
model's name mapping and vLLM's MXFP4 scale loader, vLLM's router, against vLLM's own
W4A8 numerics (its torch functions: the fp4 / e8m0 decoders, QuantFP8's native
per-128 activation quantizer, Humming's reference input quantizer) and, for W4A16, an
independent float32 computation. The per-rank intermediate size is 96, which dsv4's
prepare pads to the NVFP4 kernels' 64-wide tile for W4A16 and keeps for W4A8 (its
granularity is 32: V4.1-Flash's 288 at tensor parallel 8 stays 288 there)."""

from __future__ import annotations

import pytest
import torch

import _moe_model as mm
from _cpu_model import _ensure_distributed, engine_config
from _moe_model import TOL, check_layers

M = 23
N = 96


def _vllm_w4a8_quantizers(ue8m0: bool):
    """GEMM1 / GEMM2 input quantize-dequantize as vLLM 0.33.0 runs them for these
    checkpoints on Hopper: vLLM's per-128 block FP8 (QuantFP8, scales UE8M0 or fp32),
    then Humming's input quantization of the float32 SwiGLU output."""
    try:
        from humming import dtypes
        from humming.config import InputQuantizationMode
        from humming.testing.process_input import quant_input_ref
    except Exception as e:  # humming-kernels ships with vllm's CUDA wheels; may not import on CPU
        pytest.skip(f"humming's torch reference is not importable here: {type(e).__name__}: {e}")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(VllmConfig()):
        quant = QuantFP8(static=False, group_shape=GroupShape(1, 128), use_ue8m0=ue8m0)

    def gemm1(x):  # the MoE input is bf16, so this cast is exact
        q, s = quant.forward_native(x.to(torch.bfloat16))
        return (q.float().view(x.shape[0], -1, 128) * s.float()[..., None]).view(x.shape)

    def gemm2(h):
        q, s, _ = quant_input_ref(h, InputQuantizationMode.DynamicGroup, dtypes.float8e4m3,
                                  quant_group_size=128, group_scale_dtype=dtypes.float32)
        groups = q.float().view(h.shape[0], -1, min(128, h.shape[1]))
        return (groups * s.float().view(h.shape[0], -1, 1)).view(h.shape)

    return gemm1, gemm2


def _build_and_load(tmp_path, seed):
    cfg, model = mm.build(mm.write_variant(str(tmp_path), "mxfp4", n=N), _ensure_distributed)
    ckpt = mm.checkpoint("mxfp4", seed=seed, n=N)
    loaded = mm.load(cfg, model, ckpt)
    assert len([n for n in loaded if ".routed_experts." in n]) == 4 * len(mm.LAYERS)
    return cfg, model, ckpt


def _experts(model, layer=1):
    return model.model.layers[layer].ffn.experts.routed_experts.quant_method.moe_kernel.fused_experts


def test_reference_decodes_like_vllm():
    """The float32 computation reads the checkpoint as vLLM's decoders do."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import _upcast_e8m0_to_fp32
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes

    ckpt = mm.checkpoint("mxfp4", seed=4, n=N)
    p = "layers.1.ffn.experts.3.w2."
    vllm = break_fp4_bytes(ckpt[p + "weight"], torch.float32) * \
        _upcast_e8m0_to_fp32(ckpt[p + "scale"]).repeat_interleave(32, -1)
    assert torch.equal(mm.expert_weights(ckpt, 1, 3, "mxfp4")["w2"], vllm)


def test_mxfp4_w4a8_end_to_end_matches_vllm_numerics(plugin, tmp_path, monkeypatch):
    """Default mode (W4A8) with vLLM's Hopper setting (DeepGEMM E8M0 on: power-of-two
    GEMM1 scales), then the same layers with plain fp32 GEMM1 scales."""
    from dsv4_plugin import moe

    monkeypatch.delenv("DSV4_MOE_ACTIVATION", raising=False)
    monkeypatch.setattr(moe, "is_deep_gemm_e8m0_used", lambda: True)
    cfg, model, ckpt = _build_and_load(tmp_path, seed=7)
    experts = _experts(model)
    assert experts.dsv4_ue8m0 is True
    assert (experts.weights.format, experts.weights.activation) == ("mxfp4", "fp8")
    assert experts.weights.report["N_padded"] == 96 and experts.weights.report["inexact_blocks"] == 0
    x, input_ids = mm.tokens(8, M)
    ue8m0, fp32 = _vllm_w4a8_quantizers(True), _vllm_w4a8_quantizers(False)
    check_layers(cfg, model, ckpt, "mxfp4", x, input_ids, moe.DSV4Mxfp4FusedMoE, quantize=ue8m0)
    for layer in mm.LAYERS:  # the comparison tells the three modes apart
        a, b, c = (mm.reference(ckpt, layer, x, input_ids, "mxfp4", quantize=q) for q in (ue8m0, fp32, None))
        assert min(mm.rel_err(a, b), mm.rel_err(a, c), mm.rel_err(b, c)) > 5 * TOL
    for layer in mm.LAYERS:
        _experts(model, layer).dsv4_ue8m0 = False
    check_layers(cfg, model, ckpt, "mxfp4", x, input_ids, moe.DSV4Mxfp4FusedMoE, quantize=fp32)


def test_mxfp4_w4a16_end_to_end(plugin, tmp_path, monkeypatch):
    from dsv4_plugin import moe

    monkeypatch.setenv("DSV4_MOE_ACTIVATION", "bf16")
    cfg, model, ckpt = _build_and_load(tmp_path, seed=9)
    assert (_experts(model).weights.format, _experts(model).weights.activation) == ("mxfp4", "bf16")
    x, input_ids = mm.tokens(10, M)
    check_layers(cfg, model, ckpt, "mxfp4", x, input_ids, moe.DSV4Mxfp4FusedMoE)


@pytest.mark.parametrize("fmt,bad", [("mxfp4", "nvfp4"), ("nvfp4", "fp8"), ("mxfp4", "int8")])
def test_bad_activation_mode_fails_at_load_with_one_line(plugin, tmp_path, monkeypatch, fmt, bad):
    monkeypatch.setenv("DSV4_MOE_ACTIVATION", bad)
    with pytest.raises(ValueError) as ei:
        mm.build(mm.write_variant(str(tmp_path), fmt), _ensure_distributed)
    msg = str(ei.value)
    assert msg.startswith("dsv4: environment variable DSV4_MOE_ACTIVATION must be ")
    assert f" for {fmt.upper()} routed experts (or unset: " in msg and msg.endswith(f'got "{bad}"')
    assert "\n" not in msg


def test_refused_feature_while_the_mxfp4_model_is_built(plugin, tmp_path, monkeypatch):
    """One MXFP4-only refusal on the real model, and DSV4_MOE=0 keeping vLLM's method."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod

    from dsv4_plugin.moe import DSV4MoEUnsupportedError

    path = mm.write_variant(str(tmp_path), "mxfp4")
    monkeypatch.setenv("VLLM_HUMMING_INPUT_QUANT_CONFIG", '{"dtype": "float8e4m3"}')
    with pytest.raises(DSV4MoEUnsupportedError) as ei:
        mm.build(path, _ensure_distributed)
    assert str(ei.value).startswith("dsv4 MXFP4 MoE does not support VLLM_HUMMING_INPUT_QUANT_CONFIG (")
    monkeypatch.setenv("DSV4_MOE", "0")
    cfg, model = mm.build(path, _ensure_distributed)
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(type(m.quant_method) is Mxfp4MoEMethod for m in experts)


@pytest.mark.parametrize("user_quant", [None, "deepseek_v4_fp8", "fp8", "mxfp4"])
def test_explicit_quantization_is_honoured(plugin, tmp_path, user_quant):
    """--quantization on an MXFP4 checkpoint is resolved by vLLM alone (its
    DeepseekV4FP8Config.override_quantization_method, inherited); where that gives
    deepseek_v4_fp8 the dsv4 method is chosen under dsv4 only."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.models.deepseek_v41.quant_config import DeepseekV4FP8Config

    from dsv4_plugin.moe import DSV4DeepseekV4Config, DSV4Mxfp4FusedMoE

    path = mm.write_variant(str(tmp_path), "mxfp4")
    layer = RoutedExperts.__new__(RoutedExperts)
    for backend, want in (("dsv4", DSV4Mxfp4FusedMoE), (None, None)):
        cfg = engine_config(path, backend, quantization=user_quant)
        hf = cfg.model_config.hf_config
        expected = DeepseekV4FP8Config.override_quantization_method(
            hf.quantization_config, user_quant, hf_config=hf) or user_quant
        assert cfg.model_config.quantization == expected == "deepseek_v4_fp8"
        assert type(cfg.quant_config) is DSV4DeepseekV4Config
        with set_current_vllm_config(cfg):
            assert cfg.quant_config._dsv4_method_for(layer, "model.layers.1.ffn.experts") is want
