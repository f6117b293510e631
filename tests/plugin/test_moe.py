"""dsv4 NVFP4 experts inside vLLM's modular MoE kernel vs vLLM's NVFP4 emulation.

vLLM's emulation experts (``Nvfp4QuantizationEmulationTritonExperts``) run a
Triton GEMM and vLLM C++ ops (moe_align_block_size, moe_sum), which need a GPU.
This test reproduces that class's ``apply`` step by step with the same vLLM
functions it calls for the numerics (``moe_kernel_quantize_input(...,
quantization_emulation=True)`` for the NVFP4 activation QDQ, the ModelOpt
weight dequantization ``dequantize_nvfp4_moe_weights`` that
``ModelOptNvFp4FusedMoE.dequantize_weight`` uses, ``swiglu_limit_func`` for the
clamped SwiGLU, the ``1 / max(input_scale)`` activation scale of
``convert_to_nvfp4_moe_kernel_format``), with the Triton GEMM replaced by a
float32 matmul and bf16 intermediates as in the Triton path.

The dsv4 side runs through the plugin's real objects: ``DSV4ModelOptNvFp4FusedMoE``
(vLLM's ModelOpt NVFP4 method, dsv4 kernel) converts the weights at load and
builds a ``FusedMoEKernel`` from vLLM's prepare/finalize and
``DSV4Experts``; ``apply`` is vLLM's ``ModelOptNvFp4FusedMoE.apply``.
"""

from __future__ import annotations

import pytest
import torch

E, N, K, TOPK, M = 8, 128, 256, 3, 21
LIMIT = 10.0


def _moe_config(num_experts, num_local_experts):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    return FusedMoEConfig(
        num_experts=num_experts,
        experts_per_token=TOPK,
        hidden_dim=K,
        intermediate_size=N,
        num_local_experts=num_local_experts,
        num_logical_experts=num_experts,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.DeepSeekV3,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16,
        swiglu_limit=LIMIT,
    )


def _nvfp4_config():
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    # As DeepseekV4FP8Config._get_nvfp4_config builds it for NVFP4 routed experts.
    return ModelOptNvFp4Config(
        is_checkpoint_nvfp4_serialized=True,
        kv_cache_quant_algo=None,
        exclude_modules=[],
        group_size=16,
    )


class _Layer(torch.nn.Module):
    """The RoutedExperts attributes ModelOptNvFp4FusedMoE reads."""

    def __init__(self, w, expert_map, global_num_experts):
        super().__init__()
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        for name, key in (
            ("w13_weight", "w13"),
            ("w13_weight_scale", "w13_scale"),
            ("w2_weight", "w2"),
            ("w2_weight_scale", "w2_scale"),
            ("w2_weight_scale_2", "w2_scale_2"),
            ("w13_input_scale", "w13_input_scale"),
            ("w2_input_scale", "w2_input_scale"),
        ):
            self.register_parameter(name, torch.nn.Parameter(w[key].clone(), requires_grad=False))
        # ModelOpt stores w1/w3 global scales as [E, 2]
        g = w["w13_scale_2"]
        self.register_parameter(
            "w13_weight_scale_2",
            torch.nn.Parameter(torch.stack([g, g], dim=1).contiguous(), requires_grad=False),
        )
        self.activation = MoEActivation.SILU
        self.global_num_experts = global_num_experts
        self.expert_map = expert_map
        self.apply_router_weight_on_input = False
        self.swiglu_limit = LIMIT

    def _expert_routing_tables(self):
        return None


def _vllm_emulation(x, topk_ids, topk_weights, w, activation, local_of_global=None,
                    cache_dtype=torch.bfloat16):
    """Nvfp4QuantizationEmulationTritonExperts.apply, Triton GEMM -> torch matmul.

    cache_dtype: dtype of the intermediate caches (bf16 in vLLM's Triton path;
    float32 gives the same computation without the bf16 rounding of GEMM1's output).
    """
    from vllm.model_executor.layers.fused_moe.utils import (
        moe_kernel_quantize_input,
        swiglu_limit_func,
    )
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        dequantize_nvfp4_moe_weights,
    )

    g = w["w13_scale_2"]
    w13, w2 = dequantize_nvfp4_moe_weights(
        w["w13"], w["w13_scale"], torch.stack([g, g], dim=1), w["w2"], w["w2_scale"],
        w["w2_scale_2"], torch.float32, invert_global_scales=False,
    )
    if activation == "nvfp4":
        a1_gscale = 1.0 / w["w13_input_scale"].max().float()
        a2_gscale = 1.0 / w["w2_input_scale"].max().float()
        x, _ = moe_kernel_quantize_input(
            A=x.to(cache_dtype), A_scale=a1_gscale, quant_dtype="nvfp4", per_act_token_quant=False,
            quantization_emulation=True,
        )
    out = torch.zeros(x.shape[0], K, dtype=torch.float32)
    for m in range(x.shape[0]):
        for j in range(TOPK):
            e = int(topk_ids[m, j])
            if local_of_global is not None:
                e = int(local_of_global[e])
                if e < 0:
                    continue
            h1 = (x[m : m + 1].float() @ w13[e].T).to(cache_dtype)  # GEMM1 -> cache
            h = torch.empty(1, N, dtype=cache_dtype)
            swiglu_limit_func(h, h1, LIMIT)
            if activation == "nvfp4":
                h, _ = moe_kernel_quantize_input(
                    A=h, A_scale=a2_gscale, quant_dtype="nvfp4", per_act_token_quant=False,
                    quantization_emulation=True,
                )
            y = (h.float() @ w2[e].T) * topk_weights[m, j]
            out[m] += y[0].to(cache_dtype).float()
    return out


def _routing(g, num_experts):
    logits = torch.randn(M, num_experts, generator=g)
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, dim=-1), TOPK, dim=-1)
    return topk_weights.float(), topk_ids.to(torch.int32)


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_dsv4_experts_match_vllm_nvfp4_emulation(plugin, activation):
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk

    from dsv4 import formats
    from dsv4_plugin.moe import DSV4Experts, DSV4ModelOptNvFp4FusedMoE

    g = torch.Generator().manual_seed(7)
    w = formats.random_nvfp4_moe_weights(E, N, K, generator=g)
    x = (torch.randn(M, K, generator=g) * 2.0).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(g, E)

    method = DSV4ModelOptNvFp4FusedMoE(_nvfp4_config(), _moe_config(E, E), activation=activation)
    layer = _Layer(w, expert_map=None, global_num_experts=E)
    method.process_weights_after_loading(layer)
    assert isinstance(method.moe_kernel, mk.FusedMoEKernel)
    assert isinstance(method.moe_kernel.fused_experts, DSV4Experts)
    # checkpoint-layout copies were released (dsv4 keeps its own layout)
    assert layer.w13_weight.untyped_storage().nbytes() <= 1
    assert tuple(layer.w13_weight.shape) == (E, 2 * N, K // 2)

    out = method.apply(layer, x, topk_weights, topk_ids, None, None)
    assert out.dtype == torch.bfloat16 and out.shape == (M, K)
    # Same vLLM emulation functions, float32 intermediates: dsv4 must agree to
    # bf16 output rounding (measured ~0.2% relative error).
    ref32 = _vllm_emulation(x, topk_ids, topk_weights, w, activation, cache_dtype=torch.float32)
    assert _rel_err(out, ref32) < 1e-2
    # vLLM's emulation experts as they run (bf16 intermediate caches). In nvfp4
    # mode, rounding GEMM1's output to bf16 before the NVFP4 activation
    # quantization moves values across code boundaries (measured ~4% relative
    # difference, vs ~21% between W4A4 and W4A16): dsv4 quantizes the float32
    # SwiGLU output, as a fused GEMM1 epilogue on Blackwell does.
    ref16 = _vllm_emulation(x, topk_ids, topk_weights, w, activation)
    assert _rel_err(out, ref16) < (1e-2 if activation == "bf16" else 6e-2)
    if activation == "nvfp4":  # and the A4 path really quantized the activations
        ref_a16 = _vllm_emulation(x, topk_ids, topk_weights, w, "bf16", cache_dtype=torch.float32)
        assert _rel_err(out, ref_a16) > 0.1


def test_dsv4_experts_expert_parallel_map(plugin):
    """EP: this rank holds global experts 4..7 as local 0..3; others contribute 0."""
    from dsv4 import formats
    from dsv4_plugin.moe import DSV4ModelOptNvFp4FusedMoE

    g = torch.Generator().manual_seed(11)
    w_all = formats.random_nvfp4_moe_weights(E, N, K, generator=g)
    local = slice(4, 8)
    w_local = {k: v[local] for k, v in w_all.items()}
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[4:8] = torch.arange(4, dtype=torch.int32)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    topk_weights, topk_ids = _routing(g, E)

    method = DSV4ModelOptNvFp4FusedMoE(_nvfp4_config(), _moe_config(E, 4), activation="bf16")
    layer = _Layer(w_local, expert_map=expert_map, global_num_experts=E)
    method.process_weights_after_loading(layer)
    out = method.apply(layer, x, topk_weights, topk_ids, None, None)
    ref = _vllm_emulation(x, topk_ids, topk_weights, w_local, "bf16", local_of_global=expert_map)
    assert _rel_err(out, ref) < 1e-2
    # tokens routed only to other ranks' experts get exactly zero
    only_remote = (topk_ids < 4).all(dim=1)
    if only_remote.any():
        assert out[only_remote].abs().max() == 0


def test_activation_mode_env(monkeypatch, plugin):
    """A choice of dsv4._env: unset or empty is the format's default; anything else must
    be exactly a mode the format runs, else one `dsv4:` error naming the variable, the
    format, its modes and the default (no stripping, no case folding)."""
    from dsv4_plugin import moe

    monkeypatch.delenv("DSV4_MOE_ACTIVATION", raising=False)
    assert (moe.activation_mode("nvfp4"), moe.activation_mode("mxfp4")) == ("bf16", "fp8")
    monkeypatch.setenv("DSV4_MOE_ACTIVATION", "")
    assert (moe.activation_mode("nvfp4"), moe.activation_mode("mxfp4")) == ("bf16", "fp8")
    monkeypatch.setenv("DSV4_MOE_ACTIVATION", "nvfp4")
    assert moe.activation_mode("nvfp4") == "nvfp4"
    monkeypatch.setenv("DSV4_MOE_ACTIVATION", "bf16")
    assert (moe.activation_mode("nvfp4"), moe.activation_mode("mxfp4")) == ("bf16", "bf16")
    for bad, fmt, modes in (("fp8", "nvfp4", "bf16 or nvfp4"), ("nvfp4", "mxfp4", "fp8 or bf16"),
                            ("w4a8", "mxfp4", "fp8 or bf16"), ("NVFP4", "nvfp4", "bf16 or nvfp4"),
                            (" ", "nvfp4", "bf16 or nvfp4"), (" bf16", "mxfp4", "fp8 or bf16")):
        monkeypatch.setenv("DSV4_MOE_ACTIVATION", bad)
        with pytest.raises(ValueError) as ei:
            moe.activation_mode(fmt)
        assert str(ei.value) == (f"dsv4: environment variable DSV4_MOE_ACTIVATION must be {modes} for "
                                 f"{fmt.upper()} routed experts (or unset: {modes.split(' ')[0]}), got \"{bad}\"")


def test_moe_switch_env(monkeypatch, plugin):
    """DSV4_MOE is a switch of dsv4._env (csrc/common/env.h's rule): unset or empty -> on,
    0 -> off, 1 -> on; anything else ("yes", " 0", "true") is an error naming it."""
    from dsv4_plugin import moe

    monkeypatch.delenv("DSV4_MOE", raising=False)
    assert moe.moe_enabled()
    for value, on in (("", True), ("1", True), ("0", False)):
        monkeypatch.setenv("DSV4_MOE", value)
        assert moe.moe_enabled() is on
    for bad in ("yes", "no", " 0", "true", "01", "2"):
        monkeypatch.setenv("DSV4_MOE", bad)
        with pytest.raises(ValueError) as ei:
            moe.moe_enabled()
        assert str(ei.value) == f'dsv4: environment variable DSV4_MOE must be 0 or 1 (or unset), got "{bad}"'
