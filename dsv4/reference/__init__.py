"""Float32 references of the dsv4 ops, one module per op family (as dsv4/ and csrc/):

- ``dsv4.reference.attention``: ``sparse_mqa`` (``dsv4.sparse_mqa_decode`` / ``_prefill``);
- ``dsv4.reference.fmha``: ``dense_fmha`` (``dsv4.dense_fmha``);
- ``dsv4.reference.quantize``: ``quantize_nvfp4`` (``dsv4.quantize_nvfp4``) and the codes
  ``rcp.approx`` reciprocals may give instead (``nvfp4_rcp_approx_codes``);
- ``dsv4.reference.moe``: ``nvfp4_moe`` (``dsv4.nvfp4_moe``), ``swiglu``;
- ``dsv4.reference.mxfp4``: ``mxfp4_moe`` (``dsv4::mxfp4_moe`` and MXFP4 ``dsv4.routed_moe``)
  and its FP8 activation quantizers.

They are the ground truth the CUDA kernels are tested against and the ops' CPU kernels.
They favour clarity over speed, work on CPU and CUDA tensors alike, and compute in float32
in the order their docstrings spell out (not to be "simplified"). They check nothing: the
ops' CPU kernels check their arguments first (``dsv4._checks``), and a direct call must
pass arguments those kernels would accept (any float dtype and shape where the docstring
says so). The byte layouts they read are in ``dsv4.formats``.
"""

from .attention import sparse_mqa
from .fmha import dense_fmha
from .moe import nvfp4_moe, swiglu
from .mxfp4 import dequantize_fp8_groups, mxfp4_moe, quantize_fp8_gemm1, quantize_fp8_gemm2
from .quantize import nvfp4_rcp_approx_codes, quantize_nvfp4

__all__ = [
    "sparse_mqa", "dense_fmha", "quantize_nvfp4", "nvfp4_rcp_approx_codes", "nvfp4_moe", "swiglu", "mxfp4_moe",
    "quantize_fp8_gemm1", "quantize_fp8_gemm2", "dequantize_fp8_groups",
]
