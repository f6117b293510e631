"""dsv4's attention class for vLLM 0.33.0's DeepSeek V4.1 model.

:class:`DSV41FlashMLAAttention` subclasses vLLM's V4.1 ``DeepseekV4FlashMLAAttention``
(``vllm/models/deepseek_v41/nvidia/flashmla.py``) and keeps everything: projections,
the indexer and compressor on their source layers, the shared compressed-KV /
index sources (``kv_source_layer_ids`` / ``index_source_layer_ids``: consumers read
their source's cache through ``_compressed_kv_cache()`` and its metadata under
``compressed_cache_prefix``), the KV-cache specs, the metadata builders, o_proj and
the inherited ``forward_mqa``. Only the two kernel calls change:
``flash_mla_with_kvcache`` -> ``dsv4.attention.sparse_mqa_decode`` and
``flash_mla_sparse_fwd`` -> ``dsv4.attention.sparse_mqa_prefill``.

Why dsv4's kernels fit V4.1 unchanged on Hopper:

* the KV record: V4.1 layers write the 584-byte V4 ``fp8_ds_mla`` record (576-byte
  pages) on every GPU but SM100 (``attention._use_v41_mxfp8_kv_record``), the
  record ``sparse_mqa_decode`` reads;
* the compress ratios (0 = window only, 1, 2): the kernels take any paged cache
  plus lists of slot ids; the ratio only changes which lists vLLM builds
  (``compute_global_topk_indices_and_lens`` with the compressed block size
  ``block_size // compress_ratio``) and how many rows the prefill gathers.

Differences from vLLM's method bodies, both because dsv4's kernels take 64 or 128
heads: no per-type FlashMLA tile-scheduler metadata, and prefill runs all
``padded_heads`` (vLLM runs only ``n_local_heads`` on SM90 when that is 8, 16 or 32;
the padded heads have sink -inf and zero q, and ``_o_proj`` drops them).
"""

from __future__ import annotations

import torch

from vllm import envs
from vllm.models.deepseek_v41.common.ops import (
    combine_topk_swa_indices,
    compute_global_topk_indices_and_lens,
    dequantize_and_gather_k_cache,
)
from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention
from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLAMetadata
from vllm.utils.math_utils import round_up
from vllm.v1.worker.workspace import current_workspace_manager


def _dsv4_attention_ops():
    from dsv4 import attention as ops

    return ops


class DSV41FlashMLAAttention(DeepseekV4FlashMLAAttention):
    """vLLM's DeepSeek V4.1 FlashMLA attention with dsv4's sparse MQA kernels."""

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
            # Local indices written by this layer's index source; global slot ids
            # in the kv source's compressed cache (block_size // ratio per block).
            assert attn_metadata is not None
            assert swa_metadata.is_valid_token is not None
            assert self.topk_indices_buffer is not None
            global_indices, topk_lens = compute_global_topk_indices_and_lens(
                self.topk_indices_buffer[:num_decode_tokens],
                swa_metadata.token_to_req_indices,
                attn_metadata.block_table[:num_decodes],
                attn_metadata.block_size // self.compress_ratio,
                swa_metadata.is_valid_token[:num_decode_tokens],
            )
            topk_indices = global_indices.view(num_decode_tokens, 1, -1)

        # q arrives pre-padded to self.padded_heads: [T, H, 512] -> [T, 1, H, 512].
        # unsqueeze keeps the caches' padded block strides.
        swa_cache = self.swa_cache_layer.kv_cache.unsqueeze(-2)
        _dsv4_attention_ops().sparse_mqa_decode(
            q.unsqueeze(1),
            swa_cache,
            swa_metadata.decode_swa_indices,
            swa_metadata.decode_swa_lens,
            self.attn_sink,
            self.scale,
            extra_kv_cache=None if swa_only else kv_cache.unsqueeze(-2),
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
        # vLLM 0.33.0's V4.1 DeepseekV4FlashMLAAttention._forward_prefill: gather
        # each chunk's compressed + window KV into the bf16 workspace, combine the
        # index lists; then dsv4's kernel over all padded heads.
        swa_only = self.compress_ratio == 0

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

        assert self.topk_indices_buffer is not None
        topk_indices = self.topk_indices_buffer[num_decode_tokens:][:num_prefill_tokens]
        top_k = 0 if swa_only else topk_indices.shape[-1]
        chunk_plan = swa_metadata.get_prefill_chunk_plan(
            compress_ratio=self.compress_ratio,
            prefill_chunk_size=self.PREFILL_CHUNK_SIZE,
            has_compressed=not swa_only,
        )
        assert chunk_plan, "prefill chunk plan must be non-empty when num_prefills > 0"
        workspace_manager = current_workspace_manager()
        combined_topk = round_up(top_k + self.window_size, 128)
        ops = _dsv4_attention_ops()
        for chunk_start, chunk_end, chunk_N, chunk_M in chunk_plan:
            chunk_size = chunk_end - chunk_start
            kv, combined_indices_out, combined_lens_out = workspace_manager.get_simultaneous(
                ((chunk_size, chunk_M, q.shape[-1]), torch.bfloat16),
                ((self.max_num_batched_tokens, combined_topk), torch.int32),
                ((self.max_num_batched_tokens,), torch.int32),
            )
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
                out=(
                    combined_indices_out[: query_end - query_start],
                    combined_lens_out[: query_end - query_start],
                ),
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


__all__ = ["DSV41FlashMLAAttention"]
