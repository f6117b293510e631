"""dsv4: DeepSeek V4 attention and NVFP4 MoE kernels for NVIDIA Hopper.

Ops (CUDA kernels on sm_90a, float32 reference kernels on CPU, fake kernels for
torch.compile): see the modules named below. ``dsv4.formats`` holds the byte
layouts, ``dsv4.reference`` the float32 references.
"""

from ._ops import HAS_CUDA_EXTENSION
from .quantize import quantize_nvfp4

__all__ = ["HAS_CUDA_EXTENSION", "quantize_nvfp4"]
__version__ = "0.1.0"
