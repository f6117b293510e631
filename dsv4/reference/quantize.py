"""Float32 reference of NVFP4 activation quantization (the ``dsv4.quantize_nvfp4`` op's
CPU kernel, and the W4A4 MoE's quantizer): the rule of Blackwell deployments
(docs/design.md section 2), and the codes that ``rcp.approx`` reciprocals may give instead.

Divisions are always between two tensors on the same device (on CUDA, ``tensor /
python_scalar`` is computed as ``tensor * (1 / scalar)``, not the correctly rounded quotient).
"""

from __future__ import annotations

import torch

from ..formats._float import E4M3_MAX
from ..formats.nvfp4 import E2M1_MAX, NVFP4_BLOCK, pack_fp4, round_to_e2m1


def _quantize_nvfp4_blocks(x: torch.Tensor, g: torch.Tensor):
    """Activation quantizer, the rule of Blackwell deployments (see :func:`quantize_nvfp4`).

    ``x``: float ``[..., K]``; ``g``: 0-dim float32 tensor (the dequant global scale).
    Every reciprocal is an IEEE division of two float32 tensors (``one / t``), never
    ``t / python_scalar``, so the result is the same on CPU and CUDA tensors.
    """
    K = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    six = torch.tensor(E2M1_MAX, dtype=torch.float32, device=x.device)

    G = one / g  # the encode scale, as vLLM computes it at load (1.0 / input_scale)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    s32 = G * (amax * (one / six))
    s = torch.clamp(s32, max=E4M3_MAX).to(torch.float8_e4m3fn)  # RN-even, satfinite
    sf = s.float()
    # A zero scale (zero block, or a scale that underflowed) has r = 0: codes 0.
    r = torch.where(sf == 0, torch.zeros_like(sf), one / (sf * (one / G)))
    codes = round_to_e2m1(xb * r).reshape(x.shape)
    return pack_fp4(codes), s.reshape(*x.shape[:-1], K // NVFP4_BLOCK)


def quantize_nvfp4(x: torch.Tensor, global_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes activations to NVFP4 with 16-element blocks along the last dim, with
    the rule of Blackwell deployments (docs/design.md section 2).

    ``g`` is the dequant multiplier (a checkpoint's ``input_scale``) and ``G = 1 / g``
    the encode scale.  Per block, in float32 and in exactly this order::

        G     = 1 / g                      # IEEE division, once per call
        amax  = max|x|
        s     = e4m3_rn_satfinite(G * (amax * (1 / 6)))
        r     = 0 if s == 0 else 1 / (float(s) * (1 / G))
        codes = round_to_e2m1(x * r)        # RN-even on the e2m1 grid, saturating at 6

    Why this rule: it is what vLLM's Blackwell kernel (``cvt_warp_fp16_to_fp4``),
    FlashInfer and TensorRT-LLM compute for the same checkpoint (their ``rcp`` is
    ``rcp.approx.ftz.f32``, their last step ``cvt.rn.satfinite.e2m1x2.f32`` of the
    product), so W4A4 here gives a Blackwell deployment's codes.  Every reciprocal here
    is the exact IEEE one, as in vLLM's torch reference ``ref_nvfp4_quant``
    (``vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py``); the
    dsv4 CUDA kernels use ``rcp.approx.ftz.f32`` as Blackwell does, which can move a
    code only where ``x * r`` lies within a few ulps of a rounding tie.  The earlier
    rule ``round_to_e2m1(x / (float(s) * g))`` differs from this one exactly at such
    ties: e.g. x = 1.171875 in a block with amax = 5.625 and g = 2^-8 has s = 240 and
    x / (s * g) = 1.25, a tie that goes to 1.0, while x * r = 1.2500001 rounds to 1.5.
    Dequantization uses ``g`` itself: ``E2M1_VALUES[code] * float(s) * g``.

    A product ``x * r`` of -0.0 (a -0.0 input, or any input of a zero-scale block)
    gives code 0 (see :func:`round_to_e2m1`); a Blackwell conversion may give code 8
    (-0.0) there, the same value.  NaN inputs give unspecified codes and scales.

    Args:
        x: float tensor (any float dtype, any leading shape, may be non-contiguous)
            ``[..., K]`` with ``K % 16 == 0``.
        global_scale: ``g``, the dequant multiplier: python float > 0 or a 1-element
            float32 tensor (its value is not checked, to avoid a device sync; a
            non-positive or NaN ``g`` gives meaningless scales).

    Returns:
        ``(packed, scales)``: uint8 ``[..., K/2]`` (see :func:`pack_fp4`) and
        float8_e4m3fn ``[..., K/16]``.
    """
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
    return _quantize_nvfp4_blocks(x, g)


def _f32_step(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` moved by ``k`` float32 ulps (positive finite normal ``t``)."""
    return (t.view(torch.int32) + k).view(torch.float32)


def nvfp4_rcp_approx_codes(x: torch.Tensor, global_scale) -> torch.Tensor:
    """The e2m1 codes a quantizer with ``rcp.approx`` reciprocals may give.

    :func:`quantize_nvfp4` uses exact reciprocals; the CUDA kernels (like Blackwell
    deployments) use ``rcp.approx.ftz.f32`` for ``rcp(G)`` and for ``r``, which is
    within 1 ulp of the exact reciprocal, so each of those two values is the
    correctly rounded one or a float32 neighbour.  This evaluates all 9 combinations
    (the block scales are the same in all of them: ``rcp(6)`` is exactly RN(1/6) on the
    GPUs measured) and returns every element's 9 candidate codes; a code that is
    none of them is not explained by ``rcp.approx`` rounding.  Candidates differ from
    the exact code only where ``x * r`` lies within a few ulps of a rounding tie.

    Args:
        x: float ``[..., K]``, ``K % 16 == 0``.
        global_scale: as for :func:`quantize_nvfp4`.

    Returns:
        uint8 ``[..., K, 9]``; ``[..., 4]`` (no ulp moved) is the code of
        :func:`quantize_nvfp4`.
    """
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
    _, scales = _quantize_nvfp4_blocks(x, g)
    K = x.shape[-1]
    xb = x.float().reshape(*x.shape[:-1], K // NVFP4_BLOCK, NVFP4_BLOCK)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    sf = scales.float().unsqueeze(-1)
    rcp_g = one / (one / g)
    out = []
    for kg in (-1, 0, 1):
        d = sf * _f32_step(rcp_g, kg)
        for kr in (-1, 0, 1):
            r = torch.where(sf == 0, torch.zeros_like(d), _f32_step(one / torch.where(sf == 0, one, d), kr))
            out.append(round_to_e2m1(xb * r).reshape(x.shape))
    return torch.stack(out, dim=-1)
