"""dsv4.formats.mxfp4 and dsv4.reference.mxfp4 against vLLM 0.33.0's (and Humming's) own
torch implementations, where they have them: the per-128 FP8 activation quantizer of GEMM1 (QuantFP8's native path,
the same math as the per_token_group_quant_fp8 CUDA kernel vLLM runs on an H200 apart
from the floor of tiny groups), Humming's reference of its input quantization (GEMM2's
input), vLLM's e8m0 upcast and fp4 nibble decoder, and the intermediate-size padding
of vLLM's Humming MXFP4 path."""

import pytest
import torch

from dsv4 import reference
from dsv4.formats import mxfp4


def _acts(M, K, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * scale
    x[0, :128] *= 1e-2  # a group of small values (amax still far above QuantFP8's floor)
    x[1, 7] = 448.0 * 2  # a group whose amax / 448 is a power of two
    return x


@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("K", [4096, 5120, 300])
def test_gemm1_quantizer_matches_vllm_quantfp8_native(ue8m0, K):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    x = _acts(8, K, seed=K).to(torch.bfloat16)
    with set_current_vllm_config(VllmConfig()):
        quant = QuantFP8(static=False, group_shape=GroupShape(1, 128), use_ue8m0=ue8m0)
    # QuantFP8's native path floors the scale at 1 / (448 * 512) instead of flooring amax
    # at 1e-10; every group here has amax >> 1 / 512, where the two agree.
    vq, vs = quant.forward_native(x)
    q, s = reference.quantize_fp8_gemm1(x, ue8m0=ue8m0)
    assert torch.equal(s, vs.float())
    assert torch.equal(q.view(torch.uint8), vq.view(torch.uint8))


@pytest.mark.parametrize("K", [2048, 288, 3072])
def test_gemm2_quantizer_matches_humming_reference(K):
    try:
        from humming import dtypes
        from humming.config import InputQuantizationMode
        from humming.testing.process_input import quant_input_ref
    except Exception as e:  # humming-kernels ships with vllm's CUDA wheels; may not import on CPU
        pytest.skip(f"humming's torch reference is not importable here: {type(e).__name__}: {e}")
    a = _acts(6, K, seed=K, scale=1.7)
    a[2, :128] = 0  # an all-zero group: scale floored at 1e-30, codes 0
    hq, hs, _ = quant_input_ref(a, InputQuantizationMode.DynamicGroup, dtypes.float8e4m3, quant_group_size=128,
                                group_scale_dtype=dtypes.float32)
    q, s = reference.quantize_fp8_gemm2(a)
    assert torch.equal(s, hs.float().reshape(s.shape))
    assert torch.equal(q.view(torch.uint8), hq.view(torch.uint8).reshape(q.shape))


def test_e8m0_upcast_matches_vllm():
    from vllm.model_executor.layers.quantization.utils.fp8_utils import _upcast_e8m0_to_fp32

    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours, theirs = mxfp4.e8m0_to_float(b), _upcast_e8m0_to_fp32(b)
    assert torch.equal(ours[1:255], theirs[1:255])
    # byte 0: vLLM (and Humming) read 0.0, e8m0 (and dsv4) 2^-127; byte 255: inf vs NaN
    assert theirs[0].item() == 0.0 and ours[0].item() == 2.0**-127
    assert ours[255].isnan()


def test_fp4_nibble_order_matches_vllm():
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import break_fp4_bytes

    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (5, 64), generator=gen, dtype=torch.uint8)
    ones = torch.full((5, 4), 127, dtype=torch.uint8)  # 2^0
    assert torch.equal(mxfp4.dequantize_mxfp4(packed, ones), break_fp4_bytes(packed, torch.float32))


def test_humming_intermediate_padding():
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import (
        Mxfp4MoeBackend,
        mxfp4_round_up_hidden_size_and_intermediate_size,
    )

    for hidden, inter, want in ((5120, 288, 320), (4096, 2048, 2048), (7168, 3072 // 8, 384), (5120, 2304 // 4, 576)):
        assert mxfp4_round_up_hidden_size_and_intermediate_size(Mxfp4MoeBackend.HUMMING, hidden, inter) == \
            (hidden, want)
        w = mxfp4.random_mxfp4_moe_weights(1, inter, 64, quantize=False)
        assert mxfp4.pad_mxfp4_moe_weights(**w, multiple=64)["w2"].shape[2] * 2 == want
