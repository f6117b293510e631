"""What dsv4_plugin/attention_v4.py and attention_v41.py read from vLLM's metadata
builders, KV-cache specs and layers, asserted field by field on vLLM 0.33.0's real
builder output for a mixed batch (_attn_batch.MIXED), so a vLLM change that the
plugin would misread fails here with the field's name.

Shapes, dtypes and strides are those of vLLM's own buffers and views (the builders'
Python code, run for real); the values filled in by vLLM's Triton helpers come from
the stand-ins in _stand_ins.py, which test_stand_ins_match_vllm.py holds to vLLM's
kernels, so their meaning is checked here as well.
"""

from __future__ import annotations

import pytest
import torch

from _attn_batch import MIXED, AttnBatch, pick_layer

I32 = torch.int32


def tensor(where, value, dtype, shape=None, unit_stride=True):
    """``value`` is a tensor of ``dtype`` (and ``shape``), unit stride in its last dim."""
    assert isinstance(value, torch.Tensor), f"{where}: expected a tensor, got {value!r}"
    assert value.dtype == dtype, f"{where}: dtype {value.dtype}, the plugin expects {dtype}"
    if shape is not None:
        assert tuple(value.shape) == tuple(shape), \
            f"{where}: shape {tuple(value.shape)}, the plugin expects {tuple(shape)}"
    if unit_stride and value.numel():
        assert value.stride(-1) == 1, f"{where}: last-dim stride {value.stride(-1)}, expected 1"


def same(where, value, expected, meaning):
    assert torch.equal(value.cpu().long(), expected.long()), f"{where}: not {meaning}"


def plain_int(where, value, expected):
    assert type(value) is int and value == expected, f"{where}: {value!r}, expected int {expected}"


def _batch(attn_models, which, seed=5):
    cfg, layer = pick_layer(attn_models, which)
    batch = AttnBatch(cfg, layer, MIXED[which.split("_")[0]], torch.Generator().manual_seed(seed))
    return cfg, layer, batch, batch.build_metadata()


def _window_slots(batch, t):
    p, r = int(batch.positions[t]), int(batch.req_of_token[t])
    win = torch.arange(max(0, p - batch.window + 1), p + 1)
    bs = batch.swa_spec.block_size
    return batch.swa_block_table[r, win // bs].long() * bs + win % bs


@pytest.mark.parametrize("which", ["v4_swa", "v41_swa"])
def test_sparse_swa_metadata(attn_models, attn_helpers, which):
    """DeepseekSparseSWAMetadata, one per model step, read by every layer."""
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    cfg, layer, batch, md = _batch(attn_models, which)
    m = md[layer.swa_cache_layer.prefix]
    S = "DeepseekSparseSWAMetadata"
    assert isinstance(m, DeepseekSparseSWAMetadata), f"{S}: got {type(m).__name__}"
    R, T, W = len(batch.requests), batch.num_tokens, batch.window
    nd, npf = batch.num_decodes, R - batch.num_decodes
    # the decode / prefill split forward_mqa slices q and output by
    plain_int(f"{S}.num_decodes", m.num_decodes, nd)
    plain_int(f"{S}.num_prefills", m.num_prefills, npf)
    plain_int(f"{S}.num_decode_tokens", m.num_decode_tokens, nd)
    plain_int(f"{S}.num_prefill_tokens", m.num_prefill_tokens, T - nd)
    # slot ids and gathers use the SWA cache's own block size
    plain_int(f"{S}.block_size", m.block_size, layer.swa_cache_layer.block_size)
    tensor(f"{S}.block_table", m.block_table, I32)
    same(f"{S}.block_table", m.block_table[:, : batch.swa_block_table.shape[1]],
         batch.swa_block_table, "the SWA group's block table, one row per request in batch order")

    # decode: window slot ids + lengths, handed to sparse_mqa_decode as they are
    tensor(f"{S}.decode_swa_indices", m.decode_swa_indices, I32, (nd, 1, W))
    tensor(f"{S}.decode_swa_lens", m.decode_swa_lens, I32, (nd,))
    plain_int(f"{S}.decode_swa_width", m.decode_swa_width, W)
    for t in range(nd):
        slots = _window_slots(batch, t)
        row = torch.full((W,), -1, dtype=torch.long)
        row[: slots.numel()] = slots
        same(f"{S}.decode_swa_indices[{t}]", m.decode_swa_indices[t, 0], row,
             "the SWA slot ids of the decode token's window, then -1")
        assert int(m.decode_swa_lens[t]) == slots.numel(), \
            f"{S}.decode_swa_lens[{t}]: {int(m.decode_swa_lens[t])}, expected {slots.numel()}"
    tensor(f"{S}.is_valid_token", m.is_valid_token, torch.bool)
    assert bool(m.is_valid_token[:T].all()), f"{S}.is_valid_token: real tokens must be valid"
    tensor(f"{S}.token_to_req_indices", m.token_to_req_indices, I32)
    same(f"{S}.token_to_req_indices", m.token_to_req_indices[:T], batch.req_of_token,
         "each token's request index")

    # prefill: per-request lengths (device) and token offsets (host)
    tensor(f"{S}.query_start_loc", m.query_start_loc, I32, (R + 1,))
    tensor(f"{S}.query_start_loc_cpu", m.query_start_loc_cpu, I32, (R + 1,))
    assert m.query_start_loc_cpu.device.type == "cpu", f"{S}.query_start_loc_cpu: not on the host"
    same(f"{S}.query_start_loc_cpu", m.query_start_loc_cpu, batch.query_start_loc,
         "the batch's query start offsets")
    tensor(f"{S}.prefill_seq_lens", m.prefill_seq_lens, I32, (npf,))
    same(f"{S}.prefill_seq_lens", m.prefill_seq_lens, batch.seq_lens[nd:],
         "the prefill requests' sequence lengths")
    gather = torch.tensor([r.query + min(r.prefix, W - 1) for r in batch.requests[nd:]])
    tensor(f"{S}.prefill_gather_lens", m.prefill_gather_lens, I32, (npf,))
    same(f"{S}.prefill_gather_lens", m.prefill_gather_lens, gather,
         "query length + the window's positions before the query")
    assert m.prefill_left_visible is None and m.prefill_right_visible is None, \
        f"{S}.prefill_left_visible / prefill_right_visible: set for a text-only batch"


def _chunk_plan(layer, m):
    """The plugin's call (attention_v4 / attention_v41 _forward_prefill)."""
    kwargs = dict(compress_ratio=layer.compress_ratio, prefill_chunk_size=layer.PREFILL_CHUNK_SIZE)
    if type(layer).__name__ == "DSV41FlashMLAAttention":
        kwargs["has_compressed"] = layer.compress_ratio != 0
    return m.get_prefill_chunk_plan(**kwargs)


@pytest.mark.parametrize("which", ["v4_swa", "v4_c4a", "v4_c128a", "v41_swa", "v41_r1_source",
                                   "v41_r2_shared"])
def test_prefill_chunk_plan(attn_models, attn_helpers, which):
    """get_prefill_chunk_plan: (start, end, N, M) chunks; the plugin gathers request b's
    compressed entries to workspace row b at [0, N) and its window at [N, N + gather)."""
    cfg, layer, batch, md = _batch(attn_models, which)
    m = md[layer.swa_cache_layer.prefix]
    plan = _chunk_plan(layer, m)
    P = "DeepseekSparseSWAMetadata.get_prefill_chunk_plan"
    assert isinstance(plan, list) and plan, f"{P}: expected a non-empty list, got {plan!r}"
    nd = batch.num_decodes
    reqs = batch.requests[nd:]
    ratio = max(layer.compress_ratio, 1)
    comp = [((r.prefix + r.query) // ratio if batch.comp_cache is not None else 0) for r in reqs]
    gather = [r.query + min(r.prefix, batch.window - 1) for r in reqs]
    end = 0
    for chunk in plan:
        assert isinstance(chunk, tuple) and len(chunk) == 4 and all(type(x) is int for x in chunk), \
            f"{P}: chunk {chunk!r} is not (start, end, N, M) ints"
        start, stop, N, M = chunk
        assert start == end and stop > start, f"{P}: chunks {plan} do not tile the prefills"
        end = stop
        for b in range(start, stop):
            assert comp[b] <= N and N + gather[b] <= M, \
                f"{P}: chunk {chunk} has no room for request {b} ({comp[b]} compressed, {gather[b]} gathered)"
    assert end == len(reqs), f"{P}: chunks {plan} do not cover the {len(reqs)} prefills"
    assert len(plan) == 2  # the batch is sized for two chunks (_attn_batch.MIXED)


@pytest.mark.parametrize("which", ["v4_c4a", "v4_c128a", "v41_r1_source", "v41_r1_shared",
                                   "v41_r2_source", "v41_r2_shared"])
def test_flashmla_metadata(attn_models, attn_helpers, which):
    """DeepseekV4FlashMLAMetadata of the compressed cache (the kv source's on V4.1)."""
    cfg, layer, batch, md = _batch(attn_models, which)
    F = "DeepseekV4FlashMLAMetadata"
    key = "v41" if which.startswith("v41") else "v4"
    if key == "v41":
        from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLAMetadata
    else:
        from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata
    prefix = layer.compressed_cache_prefix if key == "v41" else layer.prefix
    assert prefix in md, f"{F}: not under {prefix!r}, the prefix forward_mqa looks it up by"
    m = md[prefix]
    assert isinstance(m, DeepseekV4FlashMLAMetadata), f"{F}: got {type(m).__name__}"
    R, ratio = len(batch.requests), layer.compress_ratio
    nd = batch.num_decodes
    # block_size // compress_ratio = compressed entries per cache block
    plain_int(f"{F}.block_size", m.block_size, batch.flash_spec.block_size)
    assert m.block_size % ratio == 0 and m.block_size // ratio == batch.flash_spec.num_states, \
        f"{F}.block_size: {m.block_size} // {ratio} is not the cache's entries per block " \
        f"({batch.flash_spec.num_states})"
    tensor(f"{F}.block_table", m.block_table, I32)
    assert m.block_table.shape[0] == R, f"{F}.block_table: {m.block_table.shape[0]} rows for {R} requests"
    same(f"{F}.block_table", m.block_table[:, : batch.comp_block_table.shape[1]],
         batch.comp_block_table, "the compressed group's block table, one row per request")

    if ratio != 128:
        for f in ("c128a_global_decode_topk_indices", "c128a_decode_topk_lens",
                  "c128a_prefill_topk_indices"):
            assert getattr(m, f, None) is None, f"{F}.{f}: set for a ratio-{ratio} layer"
        return
    # C128A: vLLM's builder resolves every entry; the plugin hands these over as they are
    n = (batch.positions + 1) // ratio
    g = m.c128a_global_decode_topk_indices
    tensor(f"{F}.c128a_global_decode_topk_indices", g, I32)
    assert g.dim() == 3 and g.shape[:2] == (nd, 1) and g.shape[2] % 128 == 0 and \
        g.shape[2] >= int(n.max()), \
        f"{F}.c128a_global_decode_topk_indices: shape {tuple(g.shape)}, expected ({nd}, 1, k*128 >= {int(n.max())})"
    tensor(f"{F}.c128a_decode_topk_lens", m.c128a_decode_topk_lens, I32, (nd,))
    per = batch.comp_cache.shape[1]
    for t in range(nd):
        r, k = int(batch.req_of_token[t]), int(n[t])
        ent = torch.arange(k)
        row = torch.full((g.shape[2],), -1, dtype=torch.long)
        row[:k] = batch.comp_block_table[r, ent // per].long() * per + ent % per
        same(f"{F}.c128a_global_decode_topk_indices[{t}]", g[t, 0], row,
             "the cache slots of the decode token's compressed entries, then -1")
        assert int(m.c128a_decode_topk_lens[t]) == k, f"{F}.c128a_decode_topk_lens[{t}]"
    p = m.c128a_prefill_topk_indices
    tensor(f"{F}.c128a_prefill_topk_indices", p, I32)
    assert p.dim() == 2 and p.shape[0] == batch.num_tokens - nd and p.shape[1] >= int(n.max()), \
        f"{F}.c128a_prefill_topk_indices: shape {tuple(p.shape)}"
    for t in range(nd, batch.num_tokens):
        k = int(n[t])
        row = torch.cat([torch.arange(k), torch.full((p.shape[1] - k,), -1)])
        same(f"{F}.c128a_prefill_topk_indices[{t - nd}]", p[t - nd], row,
             "local entry ids 0..n-1, then -1")


@pytest.mark.parametrize("key", ["v4", "v41"])
def test_layer_buffers_and_kv_cache_specs(attn_models, key):
    """The shared top-k buffer, and the cache layout dsv4's kernels read."""
    from dsv4 import formats

    from _cpu_model import kv_cache_specs

    cfg, model = attn_models[key]
    specs = kv_cache_specs(cfg)
    name = "DSV41FlashMLAAttention" if key == "v41" else "DSV4FlashMLAAttention"
    layers = [m for m in model.modules() if type(m).__name__ == name]
    index_topk = cfg.model_config.hf_text_config.index_topk
    B = cfg.scheduler_config.max_num_batched_tokens
    for layer in layers:
        L = layer.prefix
        buf = layer.topk_indices_buffer
        tensor(f"{L}.topk_indices_buffer", buf, I32, (B, index_topk))
        assert buf.is_contiguous(), f"{L}.topk_indices_buffer: not contiguous"
        swa = specs[layer.swa_cache_layer.prefix]
        S = f"{layer.swa_cache_layer.prefix} spec"
        plain_int(f"{S}.block_size", swa.block_size, layer.swa_cache_layer.block_size)
        plain_int(f"{S}.sliding_window", swa.sliding_window, layer.window_size)
        plain_int(f"{S}.state_content_bytes", swa.state_content_bytes,
                  formats.FP8_DS_MLA_VIEW_LAST_DIM)
        plain_int(f"{S}.page_size_padded", swa.page_size_padded,
                  formats.fp8_ds_mla_block_bytes(swa.block_size))
        assert swa.dtype == torch.uint8 and swa.cache_dtype_str == "fp8_ds_mla", \
            f"{S}: {swa.dtype} / {swa.cache_dtype_str}, the plugin reads fp8_ds_mla bytes"
        own = specs.get(L)
        has_own = layer.compress_ratio > 1 if key == "v4" else layer.is_kv_source
        assert (own is not None) == has_own, f"{L} spec: {own!r}"
        if own is None:
            continue
        C = f"{L} spec"
        plain_int(f"{C}.tokens_per_state", own.tokens_per_state, layer.compress_ratio)
        plain_int(f"{C}.state_content_bytes", own.state_content_bytes,
                  formats.FP8_DS_MLA_VIEW_LAST_DIM)
        per_block = own.block_size // layer.compress_ratio
        plain_int(f"{C}.page_size_padded", own.page_size_padded,
                  formats.fp8_ds_mla_block_bytes(per_block))
        assert own.block_size % layer.compress_ratio == 0, \
            f"{C}.block_size: {own.block_size} is not a multiple of the ratio"
