"""dsv4's attention class for vLLM 0.33.0's DeepSeek V4 model (and the DSV4 backend).

:class:`DSV4FlashMLAAttention` subclasses vLLM's ``DeepseekV4FlashMLAAttention``
and keeps everything (projections, indexer, compressor, KV-cache specs, the
FlashMLA metadata builders, o_proj) except the two kernel calls: ``forward_mqa``
(inherited: splits the batch into decode and prefill) runs our ``_forward_decode``
and ``_forward_prefill``, which are vLLM's with ``flash_mla_with_kvcache`` ->
``dsv4.attention.sparse_mqa_decode`` and ``flash_mla_sparse_fwd`` ->
``dsv4.attention.sparse_mqa_prefill`` on the same metadata, index buffers and caches.

Imported only when the DSV4 backend is selected for a V4 model or its backend class
is resolved (:mod:`dsv4_plugin.attention` guards the vLLM source this mirrors).
"""

from __future__ import annotations

import torch

from vllm import envs
from vllm.models.deepseek_v4.common.ops import (
    combine_topk_swa_indices,
    compute_global_topk_indices_and_lens,
    dequantize_and_gather_k_cache,
)
from vllm.models.deepseek_v4.nvidia.flashmla import (
    DeepseekV4FlashMLAAttention,
)
from vllm.models.deepseek_v4.sparse_mla import (
    DeepseekV4FlashMLABackend,
    DeepseekV4FlashMLAMetadata,
)
from vllm.utils.math_utils import round_up
from vllm.v1.worker.workspace import current_workspace_manager


class DSV4AttentionBackend(DeepseekV4FlashMLABackend):
    """Target of ``AttentionBackendEnum.DSV4``.

    DSV4 reads exactly the caches and metadata FlashMLA's DeepSeek V4 backend
    builds, so it is that backend (same name, builder and KV-cache layout, so
    vLLM's warm-ups and cache-spec code keyed on the name keep working). The
    attention layer itself is what changes, through the seams in
    :mod:`dsv4_plugin.attention` (V4.1 layers keep their own FlashMLA backend class).
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
            # vLLM's batch-invariant mode: bitwise the same result whatever the batch
            batch_invariant=envs.VLLM_BATCH_INVARIANT,
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


__all__ = ["DSV4AttentionBackend", "DSV4FlashMLAAttention"]
