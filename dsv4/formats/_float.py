"""Exact float32 helpers and the e4m3 range, shared by the formats and the references."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**k`` for an integer tensor ``k`` (0 / inf outside float32 range).

    Built from exponent bits rather than ``torch.exp2`` so that it is exact on every
    device; splitting ``k`` in two halves keeps each factor a normal float32, so
    subnormal results (k down to -149) are exact too.
    """
    k = k.to(torch.int32).clamp(-252, 254)
    half = torch.div(k, 2, rounding_mode="floor")

    def normal_pow2(j):
        return ((j + 127) << 23).view(torch.float32)

    return normal_pow2(half) * normal_pow2(k - half)


def ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """int32 ``ceil(log2(v))`` for finite v > 0, exact (frexp: v = m * 2^x, m in [0.5, 1))."""
    m, x = torch.frexp(v)
    return torch.where(m == 0.5, x - 1, x).to(torch.int32)
