"""dsv4: DeepSeek V4 attention and NVFP4 MoE kernels for NVIDIA Hopper.

Ops (CUDA kernels on sm_90a, float32 reference kernels on CPU, fake kernels for
torch.compile), one module per family, named as its folder in csrc/ (each op as its
``torch.ops.dsv4`` name and its .cu file):

- ``dsv4.quantize``: ``quantize_nvfp4``
- ``dsv4.attention``: ``sparse_mqa_decode``, ``sparse_mqa_prefill``
- ``dsv4.fmha``: ``dense_fmha`` (dense masked attention over [compressed | window] KV)
- ``dsv4.moe``: ``nvfp4_moe`` (``dsv4.moe.nvfp4``) with ``prepare_nvfp4_moe_weights``,
  ``mxfp4_moe`` (``dsv4.moe.mxfp4``, MXFP4 W4A8); for NVFP4 and MXFP4 (DeepSeek V4's
  native) weights alike: ``prepare_moe_weights``, ``routed_moe``

``dsv4.formats`` holds the byte layouts (``nvfp4``, ``mxfp4``, ``kv_cache``, and
``nvfp4_moe_layout``, the MoE kernels' prepared NVFP4 tiles),
``dsv4.reference`` the float32 references (one module per family).
"""

from ._ops import HAS_CUDA_EXTENSION
from .attention import sparse_mqa_decode, sparse_mqa_prefill
from .fmha import dense_fmha
from .moe import (
    MoeWeights,
    Mxfp4MoeWeights,
    Nvfp4MoeWeights,
    mxfp4_moe,
    nvfp4_moe,
    prepare_moe_weights,
    prepare_mxfp4_moe_weights,
    prepare_nvfp4_moe_weights,
    routed_moe,
    unprepare_nvfp4_moe_weights,
)
from .quantize import quantize_nvfp4

__all__ = [
    "HAS_CUDA_EXTENSION",
    "dense_fmha",
    "MoeWeights",
    "Mxfp4MoeWeights",
    "Nvfp4MoeWeights",
    "mxfp4_moe",
    "nvfp4_moe",
    "prepare_moe_weights",
    "prepare_mxfp4_moe_weights",
    "prepare_nvfp4_moe_weights",
    "quantize_nvfp4",
    "routed_moe",
    "sparse_mqa_decode",
    "sparse_mqa_prefill",
    "unprepare_nvfp4_moe_weights",
]
__version__ = "0.1.0"
