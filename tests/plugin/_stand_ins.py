"""Named stand-ins for what the CPU tests cannot run.

1. The two plugin checks that need CUDA (see conftest.py), and the real ones.
2. vLLM's Triton / FlashMLA helpers on the DeepSeek V4 / V4.1 attention path. vLLM
   runs none of them without a GPU driver (``vllm.triton_utils.HAS_TRITON`` is False
   there, so its kernels are undecorated functions). Each stand-in is plain torch,
   written for what the helper is documented to compute (its docstring, the field
   comments of the metadata it fills in, the kernel's comments), and has the call
   signature of the object it replaces. test_stand_ins_match_vllm.py runs each one
   against vLLM's own helper under Triton's CPU interpreter, so a stand-in that
   drifts from vLLM fails there.

   Builders (``vllm/v1/attention/backends/mla/sparse_swa.py``, the models'
   ``sparse_mla.py``): :func:`token_to_req_indices`, :func:`swa_indices_and_lens`,
   :func:`prefill_gather_lens`, :func:`mla_sched_meta`, :func:`compressed_slot_mapping`,
   :func:`c128a_topk_metadata`.
   Forward (the plugin's ``_forward_decode`` / ``_forward_prefill``):
   :func:`global_topk_indices_and_lens`, :func:`dequantize_and_gather_k_cache`,
   :func:`combine_topk_swa_indices` (V4) and :func:`combine_topk_swa_indices_v41`.
"""

from __future__ import annotations

import torch

import dsv4_plugin
import dsv4_plugin.attention

REAL_PLATFORM_PROBLEM = dsv4_plugin._platform_problem
REAL_DEVICE_PROBLEM = dsv4_plugin.attention.device_problem


def stand_in_for_cuda() -> None:
    """Make the plugin treat this CPU process as a CUDA platform with dsv4's kernels."""
    dsv4_plugin._platform_problem = lambda: None
    dsv4_plugin.attention.device_problem = lambda: None


# ---------------------------------------------------------------------------
# vLLM's metadata-builder helpers
# ---------------------------------------------------------------------------


def token_to_req_indices(query_start_loc, out, num_mapped_tokens, num_tokens):
    """vllm.v1.attention.ops.metadata.compute_token_to_req_indices: "Map each of the
    first num_tokens tokens to its request index ... Tokens at or past
    num_mapped_tokens are mapped to 0." (empty requests own no token)."""
    num_reqs = query_start_loc.shape[0] - 1
    tokens = torch.arange(num_tokens, dtype=query_start_loc.dtype)
    req = torch.searchsorted(query_start_loc[1:], tokens, right=True).clamp(max=num_reqs - 1)
    out[:num_tokens] = torch.where(tokens < num_mapped_tokens, req, 0).to(out.dtype)
    return out[:num_tokens]


def _token_positions(query_start_loc, seq_lens, token_to_req, tokens):
    """(request, position) of each token: a request's query is its last query_len positions."""
    req = token_to_req.long()[tokens]
    q_start = query_start_loc.long()[req]
    q_len = query_start_loc.long()[req + 1] - q_start
    return req, seq_lens.long()[req] - q_len + (tokens - q_start)


def _slots(block_table, req, pos, block_size):
    """Slot ids of positions ``pos`` of requests ``req`` (same shapes) in a paged cache."""
    return block_table.long()[req, pos // block_size] * block_size + pos % block_size


def swa_indices_and_lens(swa_indices, swa_lens, window_size, index_width, left_visible,
                         right_visible, query_start_loc, seq_lens, token_to_req_indices,
                         is_valid_token, block_table, block_size, replay_start, *,
                         num_tokens, token_offset, has_image=False):
    """sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL (text only). Row i is token
    ``token_offset + i``: the SWA-cache slot ids of its causal window (the last
    ``window_size`` positions up to its own, none below its request's
    ``replay_start``), -1 after them; its length; padding tokens: length 0, row -1."""
    assert not has_image, "the stand-in covers text-only batches"
    if num_tokens == 0:
        return
    tokens = torch.arange(token_offset, token_offset + num_tokens)
    req, pos = _token_positions(query_start_loc, seq_lens, token_to_req_indices, tokens)
    start = torch.maximum((pos - (window_size - 1)).clamp(min=0), replay_start.long()[req])
    lens = pos + 1 - start
    col = torch.arange(index_width)
    p = start[:, None] + col
    keep = (col < lens[:, None]) & is_valid_token[tokens][:, None]
    rows = torch.where(keep, _slots(block_table, req[:, None].expand_as(p),
                                    torch.where(keep, p, 0), block_size), -1)
    flat = swa_indices.view(swa_indices.shape[0], -1)
    flat[:num_tokens, :index_width] = rows.to(swa_indices.dtype)
    swa_lens[:num_tokens] = torch.where(is_valid_token[tokens], lens, 0).to(swa_lens.dtype)


def prefill_gather_lens(prefill_gather_lens, seq_lens, query_start_loc, replay_start,
                        num_prefills, num_decodes, window_size):
    """sparse_swa._COMPUTE_PREFILL_METADATA_KERNEL, "prefill gather_lens": per prefill
    request, its query plus the part of its window before the query
    (``query_len + min(prefix above replay_start, window_size - 1)``)."""
    r = torch.arange(num_decodes, num_decodes + num_prefills)
    q_len = query_start_loc.long()[r + 1] - query_start_loc.long()[r]
    prefix = seq_lens.long()[r] - q_len
    visible = (prefix - replay_start.long()[r]).clamp(min=0)
    prefill_gather_lens[:num_prefills] = (q_len + visible.clamp(max=window_size - 1)).to(
        prefill_gather_lens.dtype)


class TritonUtils:
    """The part of ``triton`` vLLM's C128A builder calls on the host (vLLM's
    placeholder module has none of it without a GPU driver)."""

    @staticmethod
    def next_power_of_2(n: int) -> int:
        return 1 << max(int(n) - 1, 0).bit_length()


class InertSchedMeta:
    """FlashMLA's FlashMLASchedMeta stand-in: dsv4's kernels need no tile plan."""


def mla_sched_meta():
    """vllm.v1.attention.ops.flashmla.get_mla_metadata: a fresh, empty plan holder."""
    return InertSchedMeta(), None


def compressed_slot_mapping(compressed_slot_mapping, slot_mapping, query_start_loc, seq_lens,
                            block_table, block_size, compress_ratio, dcp_world_size,
                            cp_interleave):
    """compressor_utils._COMPRESSED_SLOT_MAPPING_KERNEL (no DCP): "Every
    ``compress_ratio`` tokens share one compressed state, written by the last of them:
    that token maps to the state's slot, the others to PAD. A token whose own
    ``slot_mapping`` entry is PAD maps to PAD too." ``block_size`` = states per block."""
    assert dcp_world_size == 1, "the stand-in covers DCP 1"
    num_reqs = block_table.shape[0]
    for r in range(num_reqs):
        q0, q1 = int(query_start_loc[r]), int(query_start_loc[r + 1])
        pos = torch.arange(int(seq_lens[r]) - (q1 - q0), int(seq_lens[r]))
        writes = ((pos + 1) % compress_ratio == 0) & (slot_mapping[q0:q1] >= 0)
        state = pos // compress_ratio
        slots = _slots(block_table, torch.full_like(state, r), torch.where(writes, state, 0),
                       block_size)
        compressed_slot_mapping[q0:q1] = torch.where(writes, slots, -1)


def c128a_topk_metadata(global_decode_buffer, decode_lens_buffer, prefill_buffer, positions,
                        compress_ratio, max_compressed_tokens, num_decode_tokens,
                        token_to_req_indices, block_table, block_size, slot_mapping):
    """sparse_mla._BUILD_C128A_TOPK_METADATA_KERNEL, per build_c128a_topk_metadata's
    docstring: "Decode tokens: position -> block_table lookup -> global slot ids +
    topk_lens. Prefill tokens: position -> local indices [0, ..., n-1, -1, ...]", with
    n = (position + 1) // compress_ratio (capped at the width); a decode token whose
    slot_mapping is PAD has length 0."""
    W = max_compressed_tokens
    n = ((positions.long() + 1) // compress_ratio).clamp(max=W)
    col = torch.arange(W)
    has = col < n[:, None]
    nd = num_decode_tokens
    if nd:
        req = token_to_req_indices.long()[:nd, None].expand(nd, W)
        slots = _slots(block_table, req, torch.where(has[:nd], col, 0), block_size)
        global_decode_buffer[:nd, :W] = torch.where(has[:nd], slots, -1).to(torch.int32)
        decode_lens_buffer[:nd] = torch.where(slot_mapping[:nd] >= 0, n[:nd], 0).to(torch.int32)
    np_ = positions.shape[0] - nd
    if np_:
        prefill_buffer[:np_, :W] = torch.where(has[nd:], col, -1).to(torch.int32)


# ---------------------------------------------------------------------------
# vLLM's helpers on the forward path
# ---------------------------------------------------------------------------


def global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table, block_size,
                                 is_valid_token):
    """common.ops.compute_global_topk_indices_and_lens: "map local topk indices to
    global KV cache slots and count valid entries ... masking padding tokens to
    length 0"."""
    local = topk_indices.long()
    valid = local >= 0
    req = token_to_req_indices.long()[: local.shape[0], None].expand_as(local)
    slots = torch.where(valid, _slots(block_table, req, local.clamp(min=0), block_size), -1)
    lens = torch.where(is_valid_token, valid.sum(dim=1), 0)
    return slots.to(topk_indices.dtype), lens.to(torch.int32)


def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table, block_size,
                                  offset, use_fnuz=False, max_gather_len=None):
    """common.ops.dequantize_and_gather_k_cache, "dequantize and gather a paged DSv4 K
    cache": request b's last ``gather_lens[b]`` positions (all ``seq_lens[b]`` when
    None), dequantized to bf16, into ``out[b, offset:]``."""
    from dsv4 import formats

    assert not use_fnuz
    assert k_cache.shape[1] == block_size, (k_cache.shape, block_size)
    for b in range(seq_lens.shape[0]):
        n = int(seq_lens[b]) if gather_lens is None else int(gather_lens[b])
        if n == 0:
            continue
        pos = torch.arange(int(seq_lens[b]) - n, int(seq_lens[b]))
        slots = _slots(block_table, torch.full_like(pos, b), pos, block_size)
        out[b, offset : offset + n] = formats.read_fp8_ds_mla(k_cache, slots)


def _combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio,
             topk, M, N, out, v41):
    width = -(-(topk + window_size) // 128) * 128
    T = topk_indices.shape[0]
    if out is None:
        out = (torch.empty(T, width, dtype=torch.int32), torch.empty(T, dtype=torch.int32))
    idx, lens = out
    idx.fill_(-1)
    base = int(query_start_loc[0])
    for b in range(seq_lens.shape[0]):
        q0, q1 = int(query_start_loc[b]) - base, int(query_start_loc[b + 1]) - base
        seq, gather = int(seq_lens[b]), int(gather_lens[b])
        for t in range(q0, q1):
            pos = seq - (q1 - q0) + (t - q0)
            k = min((pos + 1) // compress_ratio, topk) if topk else 0
            start = max(pos - (window_size - 1), 0)
            if v41:
                start = max(start, seq - gather)
            n_win = pos - start + 1
            picks = topk_indices[t, :k]
            if v41:  # a failed (-1) or out-of-pool pick stays -1
                idx[t, :k] = torch.where((picks >= 0) & (picks < N), picks + M * b, -1)
            else:
                idx[t, :k] = picks + M * b
            # the window sits at N + (position - first gathered position) in row b
            idx[t, k : k + n_win] = M * b + N + torch.arange(start, pos + 1) - (seq - gather)
            lens[t] = k + n_win
    return idx, lens


def combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                             compress_ratio, topk, M, N, out=None, left_visible=None,
                             right_visible=None, max_image_tokens=0):
    """V4 common.ops.combine_topk_swa_indices: row ids into the chunk's gathered KV
    (request b's compressed entries at ``b*M``, its gathered window positions from
    ``b*M + N``) of each query token's ``min((pos+1) // compress_ratio, topk)`` top-k
    entries followed by its causal window; -1 after them."""
    assert left_visible is None and right_visible is None and max_image_tokens == 0
    return _combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                    compress_ratio, topk, M, N, out, v41=False)


def combine_topk_swa_indices_v41(topk_indices, query_start_loc, seq_lens, gather_lens,
                                 window_size, compress_ratio, topk, M, N, out=None):
    """V4.1 common.ops.combine_topk_swa_indices: as V4's, except that a top-k pick
    outside the request's compressed pool (-1: the indexer found nothing) stays -1
    and the window starts no earlier than the gathered buffer (SWA bounded replay)."""
    return _combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                    max(compress_ratio, 1), topk, M, N, out, v41=True)


def install_attention_helpers(mp) -> None:
    """Install every stand-in above where vLLM's builders and the plugin look it up.

    ``mp``: a pytest MonkeyPatch (its owner undoes it).
    """
    import vllm.models.deepseek_v4.sparse_mla as v4_mla
    import vllm.v1.attention.backends.mla.compressor_utils as compressor_utils
    import vllm.v1.attention.backends.mla.sparse_swa as sparse_swa
    import vllm.v1.attention.ops.metadata as ops_metadata

    import dsv4_plugin.attention_v4 as plugin_v4
    import dsv4_plugin.attention_v41 as plugin_v41

    mp.setattr(ops_metadata, "compute_token_to_req_indices", token_to_req_indices)
    mp.setattr(sparse_swa, "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL", swa_indices_and_lens)
    mp.setattr(sparse_swa, "_COMPUTE_PREFILL_METADATA_KERNEL", prefill_gather_lens)
    mp.setattr(sparse_swa, "get_mla_metadata", mla_sched_meta)
    mp.setattr(compressor_utils, "_COMPRESSED_SLOT_MAPPING_KERNEL", compressed_slot_mapping)
    mp.setattr(v4_mla, "_BUILD_C128A_TOPK_METADATA_KERNEL", c128a_topk_metadata)
    mp.setattr(v4_mla, "triton", TritonUtils)
    for mod, combine in ((plugin_v4, combine_topk_swa_indices),
                         (plugin_v41, combine_topk_swa_indices_v41)):
        mp.setattr(mod, "compute_global_topk_indices_and_lens", global_topk_indices_and_lens)
        mp.setattr(mod, "dequantize_and_gather_k_cache", dequantize_and_gather_k_cache)
        mp.setattr(mod, "combine_topk_swa_indices", combine)
