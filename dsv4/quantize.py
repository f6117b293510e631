"""NVFP4 activation quantization: ``dsv4.quantize_nvfp4``.

Output layout (what the NVFP4 MoE kernels read): for x [M, K] bf16,
``codes`` uint8 [M, K/2], dense row-major, two e2m1 codes per byte with the even
element in the low nibble; ``scales`` float8_e4m3fn [M, K/16], dense row-major,
one scale per 16 consecutive elements of a row. Dequantized value =
e2m1(code) * scale * global_scale. Rounding rule: dsv4.reference.quantize_nvfp4, the
rule of Blackwell deployments (docs/design.md section 2). The CPU kernel *is* that function
(exact reciprocals, as vLLM's torch reference); the CUDA kernel runs Blackwell's
instruction sequence (rcp.approx.ftz.f32, cvt.rn.satfinite.e4m3x2.f32, exact
round-to-nearest-even onto the e2m1 grid of x * r): its scales equal the CPU
kernel's bit for bit, its codes too except where x * r lies within an ulp or so of a
rounding tie that rcp.approx moves (tests/test_quantize.py counts them; on the H200:
none on random data with g = 0.0173 or 1e-4, about 0.07% of the codes with the
tie-rich g = 0.01).
NaN inputs give unspecified codes and scales.
"""

from __future__ import annotations

import torch

from . import _checks as C
from . import reference
from ._ops import op

_OP = "quantize_nvfp4"


def _check(x: torch.Tensor, global_scale: torch.Tensor) -> None:
    # the rules of csrc/quantize/quantize_nvfp4.cu, for CPU and fake calls
    C.dtype(_OP, "x", x, torch.bfloat16)
    C.ndim(_OP, "x", x, 2, "[M, K]")
    C.same_device(_OP, "global_scale", global_scale, "x", x)
    C.dtype(_OP, "global_scale", global_scale, torch.float32)
    if global_scale.numel() != 1:
        raise C.error(_OP, f"global_scale must hold exactly 1 element, got shape {tuple(global_scale.shape)}")
    k = x.shape[1]
    if k <= 0 or k % 16:
        raise C.error(_OP, f"x.shape[1] (K) must be a positive multiple of 16, got {k}")


@torch.library.register_fake("dsv4::quantize_nvfp4")
def _(x, global_scale):
    _check(x, global_scale)
    m, k = x.shape
    return x.new_empty((m, k // 2), dtype=torch.uint8), x.new_empty((m, k // 16), dtype=torch.float8_e4m3fn)


@torch.library.impl("dsv4::quantize_nvfp4", "CPU")
def _(x, global_scale):
    _check(x, global_scale)
    return reference.quantize_nvfp4(x, global_scale)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations to NVFP4.

    Args:
        x: bf16 [M, K], K a multiple of 16; unit stride along K (rows may be strided,
            16-byte aligned on CUDA).
        global_scale: fp32 tensor with one element on x's device (or a Python float),
            the dequant multiplier g (a checkpoint's ``input_scale``). Must be finite and
            > 0: a Python float is checked here; a tensor's value is not (that would
            need a device sync), and 0, a negative value, inf or NaN give codes and
            scales that do not encode x (saturated, zero, negative or NaN block scales).

    Returns:
        (codes uint8 [M, K/2], scales float8_e4m3fn [M, K/16]); see the module docstring.
    """
    if not isinstance(global_scale, torch.Tensor):
        g = float(global_scale)
        C.finite_positive(_OP, "global_scale", g)
        global_scale = torch.tensor([g], dtype=torch.float32, device=x.device)
    return op("quantize_nvfp4")(x, global_scale)
