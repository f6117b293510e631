"""Loads the CUDA extension and makes sure every dsv4 op exists.

With the extension (``dsv4._C``), the schemas come from csrc/registration.cpp and
the CUDA kernels are bound there. Without it (pure-Python install: no CUDA torch or
no nvcc at build time), the same schemas are defined here so that the CPU kernels,
fake kernels and torch.compile keep working, and a CUDA call raises an error that
says how to build. tests/test_ops_registry.py checks the two schema lists agree.
"""

from __future__ import annotations

import torch

# Mirror of csrc/registration.cpp, used only when the extension is missing.
SCHEMAS = {
    "quantize_nvfp4": "(Tensor x, Tensor global_scale) -> (Tensor, Tensor)",
    # csrc/moe/nvfp4_moe.cu (Python: dsv4.moe.nvfp4)
    "nvfp4_moe": (
        "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w13_scale, "
        "Tensor w13_scale_2, Tensor w2, Tensor w2_scale, Tensor w2_scale_2, Tensor? a13_scale, "
        "Tensor? a2_scale, Tensor? expert_map, float? swiglu_limit, str activation, int cta_mode, "
        "Tensor(a!) out) -> ()"
    ),
    # csrc/moe/mxfp4_moe.cu (Python: dsv4.moe.mxfp4)
    "mxfp4_moe": (
        "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w13_scale, Tensor w2, "
        "Tensor w2_scale, Tensor? expert_map, float? swiglu_limit, str activation, bool ue8m0, "
        "Tensor(a!) out) -> ()"
    ),
    "sparse_mqa_decode": (
        "(Tensor q, Tensor kv_cache, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
        "float softmax_scale, Tensor? extra_kv_cache, Tensor? extra_indices, "
        "Tensor? extra_topk_length, Tensor(a!) out, bool batch_invariant=False) -> Tensor"
    ),
    "sparse_mqa_prefill": (
        "(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
        "float softmax_scale, Tensor(a!) out) -> Tensor"
    ),
    # csrc/fmha
    "dense_fmha": (
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_kv, Tensor n_comp, "
        "Tensor? seq_start_pos, Tensor? attn_sink, float softmax_scale, int window, bool causal, int ratio, "
        "int max_seqlen_q, int max_seqlen_kv, int num_splits, Tensor(a!) out) -> Tensor"
    ),
}

BUILD_HINT = (
    "dsv4 was installed without its CUDA extension (dsv4._C), so its CUDA kernels are "
    "unavailable. Rebuild against a CUDA-enabled torch with nvcc on PATH: "
    "`pip install ninja && DSV4_CUDA=1 pip install --no-build-isolation .` "
    "(see README.md, 'Install')."
)

try:
    from . import _C  # noqa: F401  (registers the schemas and CUDA kernels)

    HAS_CUDA_EXTENSION = True
    EXTENSION_ERROR: str | None = None
except ImportError as e:
    HAS_CUDA_EXTENSION = False
    EXTENSION_ERROR = str(e)
    _lib = torch.library.Library("dsv4", "DEF")
    for _name, _schema in SCHEMAS.items():
        _lib.define(_name + _schema)

        def _no_extension(*args, _name=_name, **kwargs):
            raise RuntimeError(f"dsv4::{_name}: {BUILD_HINT} (import error: {EXTENSION_ERROR})")

        _lib.impl(_name, _no_extension, "CUDA")


def op(name: str):
    """The registered ``torch.ops.dsv4.<name>`` overload packet."""
    return getattr(torch.ops.dsv4, name)
