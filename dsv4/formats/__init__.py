"""Byte layouts of DeepSeek V4 serving, as plain torch code (CPU or GPU tensors):

- ``dsv4.formats.nvfp4``: the e2m1 element format (shared with MXFP4), NVFP4 blocks and
  global scales, ModelOpt's checkpoint tensors and vLLM's stacked MoE layout;
- ``dsv4.formats.mxfp4``: MXFP4 (DeepSeek's native experts): e8m0 block scales, vLLM's
  stacked layout, and the conversions the MoE prepare step makes of it;
- ``dsv4.formats.kv_cache``: vLLM's paged ``fp8_ds_mla`` and bf16 KV caches;
- ``dsv4.formats.nvfp4_moe_layout``: the prepared NVFP4 MoE weights, the tile layout
  dsv4::nvfp4_moe's kernels read (``prepare_nvfp4_moe_weights``, which pads N with
  ``pad_nvfp4_moe_weights``, and its inverse);
- ``dsv4.formats.mxfp4_w4a8``: the tiles the MXFP4 W4A8 kernels read (made by the MoE
  prepare step, activation "fp8"), and their inverse.

Each module's docstring has its layouts byte for byte (docs/design.md section 2 the same
in prose). The names below are the modules' public ones, for ``dsv4.formats.X``. The float32
references of the ops, including the activation quantizers, are in ``dsv4.reference``.
"""

from .kv_cache import (
    FP8_DS_MLA_TOKEN_DATA_BYTES,
    FP8_DS_MLA_TOKEN_SCALE_BYTES,
    FP8_DS_MLA_VIEW_LAST_DIM,
    FP8_NUM_GROUPS,
    KV_DIM,
    NOPE_DIM,
    ROPE_DIM,
    dequantize_fp8_ds_mla_cache,
    fp8_ds_mla_block_bytes,
    kv_cache_layout,
    new_bf16_cache,
    new_fp8_ds_mla_cache,
    read_bf16_cache,
    read_fp8_ds_mla,
    write_bf16_cache,
    write_fp8_ds_mla,
)
from .mxfp4 import (
    MXFP4_BLOCK,
    check_mxfp4_moe_weights,
    dequantize_mxfp4,
    dequantize_mxfp4_experts,
    e8m0_bytes,
    e8m0_to_float,
    fit_fp8_operand,
    mxfp4_to_nvfp4,
    pad_mxfp4_moe_weights,
    quantize_mxfp4,
    random_mxfp4_moe_weights,
)
from .nvfp4 import (
    E2M1_MAX,
    E2M1_VALUES,
    NVFP4_BLOCK,
    dequantize_experts,
    dequantize_nvfp4,
    e2m1_to_float,
    pack_fp4,
    quantize_nvfp4_weight,
    random_nvfp4_moe_weights,
    round_to_e2m1,
    stack_modelopt_experts,
    unpack_fp4,
)
from .nvfp4_moe_layout import (
    Nvfp4MoeWeights,
    pad_nvfp4_moe_weights,
    prepare_nvfp4_moe_weights,
    unprepare_nvfp4_moe_weights,
)

__all__ = [
    # nvfp4
    "E2M1_VALUES", "E2M1_MAX", "NVFP4_BLOCK", "round_to_e2m1", "pack_fp4", "unpack_fp4", "e2m1_to_float",
    "dequantize_nvfp4", "quantize_nvfp4_weight", "stack_modelopt_experts", "dequantize_experts",
    "random_nvfp4_moe_weights",
    # mxfp4
    "MXFP4_BLOCK", "e8m0_bytes", "e8m0_to_float", "quantize_mxfp4", "dequantize_mxfp4", "dequantize_mxfp4_experts",
    "check_mxfp4_moe_weights", "pad_mxfp4_moe_weights", "random_mxfp4_moe_weights", "mxfp4_to_nvfp4",
    "fit_fp8_operand",
    # nvfp4_moe_layout
    "Nvfp4MoeWeights", "prepare_nvfp4_moe_weights", "unprepare_nvfp4_moe_weights", "pad_nvfp4_moe_weights",
    # kv_cache
    "KV_DIM", "NOPE_DIM", "ROPE_DIM", "FP8_NUM_GROUPS", "FP8_DS_MLA_TOKEN_DATA_BYTES", "FP8_DS_MLA_TOKEN_SCALE_BYTES",
    "FP8_DS_MLA_VIEW_LAST_DIM", "fp8_ds_mla_block_bytes", "new_fp8_ds_mla_cache", "kv_cache_layout", "write_fp8_ds_mla",
    "read_fp8_ds_mla", "dequantize_fp8_ds_mla_cache", "new_bf16_cache", "write_bf16_cache", "read_bf16_cache",
]
