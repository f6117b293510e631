"""DSV4 attention for vLLM 0.33.0's DeepSeek V4 model.

The seam (the ONLY place the plugin changes vLLM's code paths):

    vllm/models/deepseek_v4/nvidia/model.py :: _select_dsv4_attn_cls(vllm_config)

``DeepseekV4DecoderLayer.__init__`` looks this module-level function up at call
time and instantiates whatever class it returns. :func:`install_attention_seam`
rebinds that module attribute to :func:`select_attn_cls`, which returns
:class:`DSV4FlashMLAAttention` when ``attention_config.backend`` is the ``DSV4``
backend and otherwise calls vLLM's original function unchanged.

:class:`DSV4FlashMLAAttention` subclasses vLLM's ``DeepseekV4FlashMLAAttention``
and keeps everything (projections, indexer, compressor, KV-cache specs, the
FlashMLA metadata builders, o_proj) except the two kernel calls: ``forward_mqa``
(inherited: splits the batch into decode and prefill) runs our ``_forward_decode``
and ``_forward_prefill``, which are vLLM's with ``flash_mla_with_kvcache`` ->
``dsv4.attention.sparse_mqa_decode`` and ``flash_mla_sparse_fwd`` ->
``dsv4.attention.sparse_mqa_prefill`` on the same metadata, index buffers and caches.

Because the subclass re-states vLLM's two methods, the install step checks that
the vLLM source it was written against is the one installed (hash of each
function's source) and refuses to install otherwise, with a message that says so.
"""

from __future__ import annotations

import hashlib
import inspect
import textwrap
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

from ._backend import BACKEND_CLASS_PATH, BACKEND_NAME
SEAM_MODULE = "vllm.models.deepseek_v4.nvidia.model"
SEAM_FUNCTION = "_select_dsv4_attn_cls"

# sha256 of textwrap.dedent(inspect.getsource(obj)) in vllm 0.33.0. The plugin
# re-implements _forward_decode/_forward_prefill and relies on the seam's call
# protocol, so any change to these means the plugin must be reviewed.
EXPECTED_SOURCE_SHA256 = {
    "vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls": "de6e01e08bfa00193f8a2a66f2fbe3cfed8637d731cfb57f7835af3401002a28",
    "vllm.models.deepseek_v4.nvidia.model.DeepseekV4DecoderLayer.__init__": "30c9570e0a7aa8f39c69df2e789518ca93bbbc5345194dff6db453415833de95",
    "vllm.models.deepseek_v4.nvidia.flashmla.DeepseekV4FlashMLAAttention.forward_mqa": "327124c4100185b59c0e32d655882cc95d6c4afad370130a67216aa694210eff",
    "vllm.models.deepseek_v4.nvidia.flashmla.DeepseekV4FlashMLAAttention._forward_decode": "2537a6feb8b4863e52f3bb12f91a6d4e74bb6b0d28caa3a36d711c2bc0d37946",
    "vllm.models.deepseek_v4.nvidia.flashmla.DeepseekV4FlashMLAAttention._forward_prefill": "2e6f7c725e2ca7135241aa6757473c795dcb3a0f7980afa10a4ba9e0c2ae1cd1",
}


class SeamChangedError(RuntimeError):
    """vLLM's code at the plugin's seam differs from vllm 0.33.0."""


def source_sha256(obj) -> str:
    return hashlib.sha256(textwrap.dedent(inspect.getsource(obj)).encode()).hexdigest()


def _resolve(qualname: str):
    import importlib

    parts = qualname.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(qualname)


def check_seam() -> None:
    """Raise SeamChangedError unless vLLM's code at the seam is what we expect."""
    problems = []
    for qualname, expected in EXPECTED_SOURCE_SHA256.items():
        try:
            obj = _resolve(qualname)
            # The original (unwrapped) function, even after install.
            obj = getattr(obj, "__dsv4_original__", obj)
            got = source_sha256(obj)
        except Exception as e:  # missing attribute, no source file, ...
            problems.append(f"{qualname}: {type(e).__name__}: {e}")
            continue
        if got != expected:
            problems.append(f"{qualname}: source changed")
    layer_init = _resolve(SEAM_MODULE + ".DeepseekV4DecoderLayer.__init__")
    if SEAM_FUNCTION not in layer_init.__code__.co_names:
        problems.append(
            f"DeepseekV4DecoderLayer.__init__ no longer calls {SEAM_FUNCTION} by global name"
        )
    if problems:
        raise SeamChangedError(
            "dsv4 plugin: vLLM's DeepSeek V4 attention-class selection is not the code the "
            "plugin was written against (vllm==0.33.0), so the DSV4 backend cannot be "
            "installed safely:\n  - "
            + "\n  - ".join(problems)
            + "\nInstall vllm==0.33.0, or disable the plugin with VLLM_PLUGINS set to a list "
            "without 'dsv4'."
        )


def dsv4_backend_member():
    """The AttentionBackendEnum member named DSV4 (None if not registered)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.__members__.get(BACKEND_NAME)


def is_dsv4_selected(vllm_config: "VllmConfig") -> bool:
    member = dsv4_backend_member()
    return member is not None and vllm_config.attention_config.backend is member


def select_attn_cls(vllm_config: "VllmConfig"):
    """Replacement for vLLM's ``_select_dsv4_attn_cls``: DSV4 -> our class."""
    if is_dsv4_selected(vllm_config):
        return DSV4FlashMLAAttention
    return select_attn_cls.__dsv4_original__(vllm_config)


def install_attention_seam() -> None:
    """Rebind ``nvidia.model._select_dsv4_attn_cls`` (idempotent, checked)."""
    import importlib

    model = importlib.import_module(SEAM_MODULE)
    current = getattr(model, SEAM_FUNCTION, None)
    if current is select_attn_cls:
        return
    check_seam()
    select_attn_cls.__dsv4_original__ = current  # type: ignore[attr-defined]
    setattr(model, SEAM_FUNCTION, select_attn_cls)


def seam_installed() -> bool:
    import sys

    model = sys.modules.get(SEAM_MODULE)
    return model is not None and getattr(model, SEAM_FUNCTION, None) is select_attn_cls


# ---------------------------------------------------------------------------
# Backend class (what AttentionBackendEnum.DSV4.get_class() resolves to) and
# the attention layer.
# ---------------------------------------------------------------------------

from vllm.models.deepseek_v4.common.ops import (  # noqa: E402
    combine_topk_swa_indices,
    compute_global_topk_indices_and_lens,
    dequantize_and_gather_k_cache,
)
from vllm.models.deepseek_v4.nvidia.flashmla import (  # noqa: E402
    DeepseekV4FlashMLAAttention,
)
from vllm.models.deepseek_v4.sparse_mla import (  # noqa: E402
    DeepseekV4FlashMLABackend,
    DeepseekV4FlashMLAMetadata,
)
from vllm.utils.math_utils import round_up  # noqa: E402
from vllm.v1.worker.workspace import current_workspace_manager  # noqa: E402


class DSV4AttentionBackend(DeepseekV4FlashMLABackend):
    """Target of ``AttentionBackendEnum.DSV4``.

    DSV4 reads exactly the caches and metadata FlashMLA's DeepSeek V4 backend
    builds, so it is that backend (same name, builder and KV-cache layout, so
    vLLM's warm-ups and cache-spec code keyed on the name keep working). The
    attention layer itself is what changes, through the seam above.
    """


def _dsv4_attention_ops():
    from dsv4 import attention as ops

    return ops


class DSV4FlashMLAAttention(DeepseekV4FlashMLAAttention):
    """vLLM's DeepSeek V4 FlashMLA attention with dsv4's sparse MQA kernels."""

    def _forward_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor | None,
        swa_metadata,
        attn_metadata: DeepseekV4FlashMLAMetadata | None,
        swa_only: bool,
        output: torch.Tensor,
    ) -> None:
        num_decodes = swa_metadata.num_decodes
        num_decode_tokens = swa_metadata.num_decode_tokens

        topk_indices = None
        topk_lens = None
        if not swa_only:
            assert attn_metadata is not None
            assert swa_metadata.is_valid_token is not None
            block_size = attn_metadata.block_size // self.compress_ratio
            is_valid = swa_metadata.is_valid_token[:num_decode_tokens]
            if self.compress_ratio == 4:
                assert self.topk_indices_buffer is not None
                global_indices, topk_lens = compute_global_topk_indices_and_lens(
                    self.topk_indices_buffer[:num_decode_tokens],
                    swa_metadata.token_to_req_indices,
                    attn_metadata.block_table[:num_decodes],
                    block_size,
                    is_valid,
                )
                topk_indices = global_indices.view(num_decode_tokens, 1, -1)
            elif self.compress_ratio == 128:
                topk_indices = attn_metadata.c128a_global_decode_topk_indices
                topk_lens = attn_metadata.c128a_decode_topk_lens
                assert topk_indices is not None
                if topk_indices.dim() == 2:  # [T, W] -> [T, s_q=1, W]
                    topk_indices = topk_indices.unsqueeze(1)
            else:
                raise ValueError(
                    f"Unsupported compress_ratio={self.compress_ratio}; expected 1, 4, or 128."
                )

        # q arrives pre-padded to self.padded_heads: [T, H, 512] -> [T, 1, H, 512].
        q = q.unsqueeze(1)
        swa_cache = self.swa_cache_layer.kv_cache.unsqueeze(-2)
        if kv_cache is not None:
            kv_cache = kv_cache.unsqueeze(-2)

        _dsv4_attention_ops().sparse_mqa_decode(
            q,
            swa_cache,
            swa_metadata.decode_swa_indices,
            swa_metadata.decode_swa_lens,
            self.attn_sink,
            self.scale,
            extra_kv_cache=kv_cache if not swa_only else None,
            extra_indices=topk_indices,
            extra_topk_length=topk_lens,
            out=output.unsqueeze(1),
        )

    def _forward_prefill(
        self,
        q: torch.Tensor,
        positions: torch.Tensor,
        compressed_k_cache: torch.Tensor | None,
        swa_k_cache: torch.Tensor,
        output: torch.Tensor,
        attn_metadata: DeepseekV4FlashMLAMetadata | None,
        swa_metadata,
    ) -> None:
        # Identical to vLLM 0.33.0's DeepseekV4FlashMLAAttention._forward_prefill
        # (gather the compressed + window KV of each chunk into the bf16 workspace,
        # combine the index lists) except the final kernel call.
        swa_only = attn_metadata is None

        num_prefill_tokens = swa_metadata.num_prefill_tokens
        num_decodes = swa_metadata.num_decodes
        num_decode_tokens = swa_metadata.num_decode_tokens

        seq_lens = swa_metadata.prefill_seq_lens
        gather_lens = swa_metadata.prefill_gather_lens
        assert seq_lens is not None
        assert gather_lens is not None

        query_start_loc_cpu = swa_metadata.query_start_loc_cpu
        query_start_loc = swa_metadata.query_start_loc
        assert query_start_loc_cpu is not None
        assert query_start_loc is not None
        prefill_token_base = query_start_loc_cpu[num_decodes]

        if not swa_only:
            if self.compress_ratio == 4:
                assert self.topk_indices_buffer is not None
                topk_indices = self.topk_indices_buffer[num_decode_tokens:]
                topk_indices = topk_indices[:num_prefill_tokens]
            else:
                assert attn_metadata is not None
                topk_indices = attn_metadata.c128a_prefill_topk_indices
            top_k = topk_indices.shape[-1]
        else:
            assert self.topk_indices_buffer is not None
            topk_indices = self.topk_indices_buffer[num_decode_tokens:]
            top_k = 0
        chunk_plan = swa_metadata.get_prefill_chunk_plan(
            compress_ratio=self.compress_ratio,
            prefill_chunk_size=self.PREFILL_CHUNK_SIZE,
        )
        assert chunk_plan, "prefill chunk plan must be non-empty when num_prefills > 0"
        workspace_manager = current_workspace_manager()
        combined_topk = round_up(top_k + self.window_size + self.max_image_tokens, 128)
        ops = _dsv4_attention_ops()
        for chunk_start, chunk_end, chunk_N, chunk_M in chunk_plan:
            chunk_size = chunk_end - chunk_start
            workspace = workspace_manager.get_simultaneous(
                ((chunk_size, chunk_M, q.shape[-1]), torch.bfloat16),
                ((self.max_num_batched_tokens, combined_topk), torch.int32),
                ((self.max_num_batched_tokens,), torch.int32),
            )
            kv, combined_indices_out, combined_lens_out = workspace
            if not swa_only:
                assert attn_metadata is not None
                block_table = attn_metadata.block_table[num_decodes:]
                dequantize_and_gather_k_cache(
                    kv[:chunk_size],
                    compressed_k_cache,
                    seq_lens=seq_lens[chunk_start:chunk_end] // self.compress_ratio,
                    gather_lens=None,
                    block_table=block_table[chunk_start:chunk_end],
                    block_size=attn_metadata.block_size // self.compress_ratio,
                    offset=0,
                )

            swa_block_table = swa_metadata.block_table[num_decodes:]
            dequantize_and_gather_k_cache(
                kv[:chunk_size],
                swa_k_cache,
                seq_lens=seq_lens[chunk_start:chunk_end],
                gather_lens=gather_lens[chunk_start:chunk_end],
                block_table=swa_block_table[chunk_start:chunk_end],
                block_size=swa_metadata.block_size,
                offset=chunk_N,
            )

            query_start = query_start_loc_cpu[num_decodes + chunk_start] - prefill_token_base
            query_end = query_start_loc_cpu[num_decodes + chunk_end] - prefill_token_base
            combined_indices_out = combined_indices_out[: query_end - query_start]
            combined_lens_out = combined_lens_out[: query_end - query_start]

            combined_indices, combined_lens = combine_topk_swa_indices(
                topk_indices[query_start:query_end],
                query_start_loc[num_decodes + chunk_start : num_decodes + chunk_end + 1],
                seq_lens[chunk_start:chunk_end],
                gather_lens[chunk_start:chunk_end],
                self.window_size,
                self.compress_ratio,
                top_k,
                chunk_M,
                chunk_N,
                out=(combined_indices_out, combined_lens_out),
                left_visible=(
                    swa_metadata.prefill_left_visible[
                        num_decode_tokens + query_start : num_decode_tokens + query_end
                    ]
                    if swa_metadata.prefill_left_visible is not None
                    else None
                ),
                right_visible=(
                    swa_metadata.prefill_right_visible[
                        num_decode_tokens + query_start : num_decode_tokens + query_end
                    ]
                    if swa_metadata.prefill_right_visible is not None
                    else None
                ),
                max_image_tokens=self.max_image_tokens,
            )
            ops.sparse_mqa_prefill(
                q[query_start:query_end],
                kv.view(-1, q.shape[-1]),
                combined_indices,
                combined_lens,
                self.attn_sink,
                self.scale,
                out=output[query_start:query_end],
            )


__all__ = [
    "BACKEND_NAME",
    "DSV4AttentionBackend",
    "DSV4FlashMLAAttention",
    "SeamChangedError",
    "check_seam",
    "install_attention_seam",
    "select_attn_cls",
]

