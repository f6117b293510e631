"""dsv4's NVFP4 activation quantizer vs vLLM 0.33.0's own torch reference.

``ref_nvfp4_quant`` (``vllm/model_executor/layers/quantization/utils/
nvfp4_emulation_utils.py``) is the CPU mirror of vLLM's Blackwell kernel
``cvt_warp_fp16_to_fp4`` with exact reciprocals; it takes the encode scale
G = 1 / input_scale (vLLM computes ``1.0 / a13_scale`` at load) and returns the
e2m1 values (signed floats) and the block scales as float32. dsv4 takes the dequant
scale g = input_scale. Both must agree on every block scale and every code value,
ties included (signed zeros compare equal: vLLM returns values, not codes).
"""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant

from dsv4 import formats, reference

_TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _random(m, k, gen):
    x = torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen) * 2)
    x.view(-1)[torch.randint(0, m * k, (m * k // 50,), generator=gen)] *= 300.0  # outliers
    x[0, :16] = 0.0  # a zero block
    x[1, :16] *= 1e-12  # a block whose scale underflows
    x[2, 3] = float("inf")
    x[2, 20] = float("-inf")
    return x.to(torch.bfloat16)


def _ties(g, gen, n=2048):
    """Blocks whose elements x make x * r land on or next to every rounding tie:
    a power-of-two g and x = t * d for the block's own divisor d (as bf16)."""
    amax = (torch.rand(n, 1, generator=gen) * 5 + 1).to(torch.bfloat16).float()
    s = (amax / 6 / g).clamp(max=448).to(torch.float8_e4m3fn).float()
    pick = _TIES[torch.randint(0, 7, (n, 15), generator=gen)]
    near = (pick * s * g).to(torch.bfloat16).view(torch.int16)
    near = (near + torch.randint(-1, 2, (n, 15), generator=gen).to(torch.int16)).view(torch.bfloat16).float()
    sign = torch.where(torch.rand(n, 15, generator=gen) < 0.5, -1.0, 1.0)
    return torch.cat([amax, torch.minimum(near, amax) * sign], 1).to(torch.bfloat16).reshape(n // 4, 64)


def _compare(x, g):
    g = torch.tensor([g], dtype=torch.float32)
    G = 1.0 / g  # what vLLM passes to its quantizers
    v_values, v_scales = ref_nvfp4_quant(x, G, 16)
    packed, scales = reference.quantize_nvfp4(x, g)
    table = torch.tensor(formats.E2M1_VALUES)
    d_values = table[formats.unpack_fp4(packed).long()]
    assert torch.equal(scales.float(), v_scales), "block scales differ from vLLM's ref_nvfp4_quant"
    diff = d_values != v_values
    assert not diff.any(), f"{int(diff.sum())} of {diff.numel()} codes differ from vLLM's ref_nvfp4_quant"


@pytest.mark.parametrize("g", [0.0173, 1e-4, 3e-3 / 448, 1.0, 2.0 ** -8])
def test_random_activations_match_vllm(g):
    _compare(_random(64, 512, torch.Generator().manual_seed(1)), g)


@pytest.mark.parametrize("g", [1.0, 2.0 ** -8, 2.0 ** -4])
def test_rounding_ties_match_vllm(g):
    x = _ties(g, torch.Generator().manual_seed(2))
    _compare(x, g)


def test_the_tie_of_design_section_2():
    # x = 1.171875, amax = 5.625, g = 2^-8: Blackwell's rule (and vLLM's reference)
    # gives 1.5, the earlier division rule 1.0 (tests/test_formats.py works it out).
    x = torch.tensor([[5.625, 1.171875] + [0.0] * 14])
    v_values, v_scales = ref_nvfp4_quant(x, torch.tensor([256.0]), 16)
    assert v_values[0, 1].item() == 1.5 and v_scales.item() == 240.0
    _compare(x, 2.0 ** -8)
