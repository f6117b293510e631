"""The MoE modes: expert format -> activation modes (the default first) and the
numerics label of each mode. The one table the ops, the vLLM plugin and the benchmarks
derive theirs from.

* ``nvfp4`` (NVIDIA's ModelOpt exports): ``bf16`` (W4A16, exact weights in bf16 MMAs)
  by default; ``nvfp4`` (W4A4, Blackwell's activation numerics emulated).
* ``mxfp4`` (DeepSeek's native checkpoints): ``fp8`` (W4A8, the numerics vLLM 0.33.0
  runs on Hopper: docs/design.md section 2) by default; ``bf16`` (W4A16).
"""

from __future__ import annotations

ACTIVATIONS: dict[str, tuple[str, ...]] = {"nvfp4": ("bf16", "nvfp4"), "mxfp4": ("fp8", "bf16")}
NUMERICS: dict[str, str] = {"bf16": "W4A16", "nvfp4": "W4A4", "fp8": "W4A8"}


def default_activation(fmt: str) -> str:
    """The activation mode used for ``fmt`` experts when none is asked for."""
    return ACTIVATIONS[fmt][0]


def label(fmt: str, activation: str) -> str:
    """"NVFP4 W4A16", "MXFP4 W4A8", ...: how reports and logs name a mode."""
    return f"{fmt.upper()} {NUMERICS[activation]}"
