"""Host-side value checks that cost no device sync, and empty batches, for
dsv4.quantize_nvfp4 and dsv4.nvfp4_moe (attention and fmha have theirs in
test_attention.py / test_fmha.py): Python-float scales must be finite and > 0, every
message reads ``dsv4: <op>: <argument> ...`` (dsv4._checks; the C++ entries' messages do not
name the op yet), M = 0 returns an empty output."""

import math

import pytest
import torch

import dsv4
from dsv4 import formats
from dsv4.moe import nvfp4_moe, prepare_nvfp4_moe_weights

KEYS = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")
BAD = [0.0, -1.0, math.nan, math.inf]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # CPU/CUDA parity


@pytest.mark.parametrize("g", BAD)
def test_quantize_python_float_scale_checked(g):
    x = torch.randn(2, 32).bfloat16()
    with pytest.raises(ValueError, match=r"^dsv4: quantize_nvfp4: global_scale must be finite and > 0, got"):
        dsv4.quantize_nvfp4(x, g)


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_empty(device):
    codes, scales = dsv4.quantize_nvfp4(torch.randn(0, 64, device=device).bfloat16(), 0.5)
    assert codes.shape == (0, 32) and scales.shape == (0, 4)


def _moe(device):
    gen = torch.Generator().manual_seed(1)
    w = formats.random_nvfp4_moe_weights(4, 64, 128, generator=gen)
    p = prepare_nvfp4_moe_weights(*(w[k].to(device) for k in KEYS))
    x = torch.randn(3, 128, generator=gen).bfloat16().to(device)
    ids = torch.tensor([[0, 1], [2, 3], [1, 1]], dtype=torch.int32, device=device)
    return x, ids, torch.full((3, 2), 0.5, device=device), p


@pytest.mark.parametrize("name", ["a13_scale", "a2_scale"])
@pytest.mark.parametrize("value", BAD)
def test_moe_python_float_activation_scales_checked(name, value):
    x, ids, tw, p = _moe("cpu")
    kw = dict(a13_scale=1.0, a2_scale=1.0)
    kw[name] = value
    with pytest.raises(ValueError, match=rf"^dsv4: nvfp4_moe: {name} must be finite and > 0, got"):
        nvfp4_moe(x, ids, tw, p, activation="nvfp4", **kw)


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_moe_tensor_activation_scale_checked_on_cpu(value):
    x, ids, tw, p = _moe("cpu")
    with pytest.raises(ValueError, match=r"^dsv4: nvfp4_moe: a13_scale must be finite and > 0, got"):
        nvfp4_moe(x, ids, tw, p, activation="nvfp4", a13_scale=torch.tensor([value]), a2_scale=1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("limit", [math.inf, math.nan, 0.0])
def test_moe_swiglu_limit_checked(device, limit):
    x, ids, tw, p = _moe(device)
    # the C++ entry's message does not name the op yet
    op = "" if device == "cuda" else "nvfp4_moe: "
    with pytest.raises((ValueError, RuntimeError), match=rf"^dsv4: {op}swiglu_limit must be positive and finite"):
        torch.ops.dsv4.nvfp4_moe(x, ids, tw, *p, None, None, None, limit, "bf16", 0, torch.empty_like(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_moe_empty(device, activation):
    x, ids, tw, p = _moe(device)
    out = nvfp4_moe(x[:0], ids[:0], tw[:0], p, activation=activation, a13_scale=0.5, a2_scale=0.5)
    assert out.shape == (0, 128) and out.dtype == torch.bfloat16
