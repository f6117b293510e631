"""Compressed-cache decode (V4 C4A; V4.1 ratio 1 and 2, kv sources and the layers
sharing their cache) through vLLM's real ``forward_mqa``, on the attention layers of
the real models built from the tiny configs (test_model_build.py), against float64
attention.

``forward_mqa`` is vLLM's (inherited); the metadata are vLLM's dataclasses, passed
through vLLM's forward context under the prefixes vLLM's layers look them up by
(the SWA cache's, and the kv source's ``compressed_cache_prefix`` on V4.1). The one
vLLM helper on this path that is a Triton kernel,
``compute_global_topk_indices_and_lens``, is replaced by
``_stand_ins.global_topk_indices_and_lens`` (written from its docstring, checked
against it in test_stand_ins_match_vllm.py). The compressed top-k
lists are local positions in a request's compressed sequence, as the indexer writes
them into the shared ``topk_indices_buffer``.
"""

from __future__ import annotations

import math

import pytest
import torch

from _stand_ins import global_topk_indices_and_lens

D = 512


def _expected(q, keys_per_token, sink, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t, k in enumerate(keys_per_token):
        if k.shape[0] == 0:
            continue
        k = k.double()
        s = (q[t].double() @ k.T) * scale
        m = torch.maximum(s.max(dim=1).values, sink.double())
        p = torch.exp(s - m[:, None])
        out[t] = (p @ k) / (p.sum(dim=1) + torch.exp(sink.double() - m))[:, None]
    return out


def _run_decode(layer, kv_owner, g, monkeypatch, module):
    """Three decode requests through layer.forward_mqa; returns (output, expected)."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    from dsv4 import formats

    if module.endswith("v41"):
        from vllm.models.deepseek_v41.sparse_mla import DeepseekV4FlashMLAMetadata
    else:
        from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata

    import importlib

    monkeypatch.setattr(importlib.import_module(module), "compute_global_topk_indices_and_lens",
                        global_topk_indices_and_lens)
    ratio = layer.compress_ratio
    T = 3
    seq_lens = [40, 130, 77]  # positions p = seq_len - 1; the last is a padding token
    is_valid = torch.tensor([True, True, False])
    W = layer.window_size
    swa_block = layer.swa_cache_layer.block_size
    swa_blocks_per_req = math.ceil(W / swa_block) + 1

    # SWA cache: request r owns blocks r*n .. r*n+n-1 (ring by position % (n*bs)).
    n_swa = T * swa_blocks_per_req
    swa_cache = formats.new_fp8_ds_mla_cache(n_swa, swa_block, fill="random", generator=g)
    formats.write_fp8_ds_mla(swa_cache, torch.arange(n_swa * swa_block),
                             torch.randn(n_swa * swa_block, D, generator=g).to(torch.bfloat16))
    swa_rows = formats.read_fp8_ds_mla(swa_cache, torch.arange(n_swa * swa_block))
    swa_idx = torch.full((T, 1, W), -1, dtype=torch.int32)
    swa_len = torch.zeros(T, dtype=torch.int32)
    keys = []
    for r, L in enumerate(seq_lens):
        p = L - 1
        slots = [r * swa_blocks_per_req * swa_block + x % (swa_blocks_per_req * swa_block)
                 for x in range(max(0, p - W + 1), p + 1)]
        swa_idx[r, 0, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        swa_len[r] = len(slots)
        keys.append([swa_rows[s] for s in slots])

    # Compressed cache of the kv source: block_size // ratio entries per block,
    # blocks handed out in a shuffled order per request.
    block_size = 64 if module.endswith("v41") else 256  # vLLM's kernel block sizes
    comp_block = block_size // ratio
    max_comp = max(L // ratio for L in seq_lens)
    blocks_per_req = math.ceil(max_comp / comp_block)
    n_comp = T * blocks_per_req + 1
    comp_cache = formats.new_fp8_ds_mla_cache(n_comp, comp_block, fill="random", generator=g)
    formats.write_fp8_ds_mla(comp_cache, torch.arange(n_comp * comp_block),
                             torch.randn(n_comp * comp_block, D, generator=g).to(torch.bfloat16))
    comp_rows = formats.read_fp8_ds_mla(comp_cache, torch.arange(n_comp * comp_block))
    block_table = torch.randperm(n_comp, generator=g)[: T * blocks_per_req].view(T, -1).to(torch.int32)
    topk = layer.topk_indices_buffer.shape[-1]
    local = torch.full((T, topk), -1, dtype=torch.int32)
    for r, L in enumerate(seq_lens):
        n = L // ratio
        pick = torch.randperm(n, generator=g)[: min(n, 37)]
        local[r, : pick.numel()] = pick.to(torch.int32)
        if is_valid[r]:
            for x in pick.tolist():
                slot = int(block_table[r, x // comp_block]) * comp_block + x % comp_block
                keys[r].append(comp_rows[slot])
        else:
            keys[r] = []  # padding token: vLLM's decode lengths are 0
            swa_len[r] = 0
    layer.topk_indices_buffer[:T] = local  # what the index source's indexer wrote
    kv_owner.kv_cache = comp_cache
    layer.swa_cache_layer.kv_cache = swa_cache

    flashmla_md = DeepseekV4FlashMLAMetadata(
        num_reqs=T, max_query_len=1, max_seq_len=max(seq_lens), num_actual_tokens=T,
        query_start_loc=torch.arange(T + 1, dtype=torch.int32),
        slot_mapping=torch.zeros(T, dtype=torch.int64), block_table=block_table,
        req_id_per_token=torch.arange(T, dtype=torch.int32), block_size=block_size,
        topk_tokens=topk,
    )
    swa_md = DeepseekSparseSWAMetadata(
        block_table=torch.zeros(T, 1, dtype=torch.int32), slot_mapping=torch.zeros(T, dtype=torch.int64),
        block_size=swa_block, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.arange(T + 1, dtype=torch.int32),
        query_start_loc_cpu=torch.arange(T + 1, dtype=torch.int32),
        is_valid_token=is_valid, token_to_req_indices=torch.arange(T, dtype=torch.int32),
        decode_swa_indices=swa_idx, decode_swa_lens=swa_len, decode_swa_width=W,
        num_decodes=T, num_prefills=0, num_decode_tokens=T, num_prefill_tokens=0,
    )
    md_prefix = getattr(layer, "compressed_cache_prefix", None) or layer.prefix
    attn_metadata = {layer.swa_cache_layer.prefix: swa_md, md_prefix: flashmla_md}

    H = layer.padded_heads
    with torch.no_grad():
        layer.attn_sink.copy_(torch.randn(H, generator=g))
        layer.attn_sink[-1] = -math.inf
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    output = torch.full_like(q, float("nan"))
    with set_forward_context(attn_metadata, VllmConfig()):
        layer.forward_mqa(q, None, torch.tensor([L - 1 for L in seq_lens]), output)
    kt = [torch.stack(k) if k else torch.zeros(0, D) for k in keys]
    return output, _expected(q, kt, layer.attn_sink, layer.scale), kt


def _layers(model, base_name):
    return {n: m for n, m in model.named_modules() if type(m).__name__ == base_name}


@pytest.mark.parametrize("which", ["v4_c4a", "v41_r1_source", "v41_r1_shared", "v41_r2_source",
                                   "v41_r2_shared"])
def test_compressed_decode_matches_float64(attn_models, monkeypatch, which):
    key = which.split("_")[0]
    cfg, model = attn_models[key]
    g = torch.Generator().manual_seed(hash(which) % 2**31)
    if key == "v4":
        layers = _layers(model, "DSV4FlashMLAAttention")
        layer = next(m for m in layers.values() if m.compress_ratio == 4)
        owner, module = layer, "dsv4_plugin.attention_v4"
    else:
        ratio = int(which.split("_")[1][1])
        layers = _layers(model, "DSV41FlashMLAAttention")
        want_source = which.endswith("source")
        layer = next(m for m in layers.values()
                     if m.compress_ratio == ratio and m.is_kv_source == want_source)
        owner = cfg.compilation_config.static_forward_context[layer.compressed_cache_prefix]
        assert (owner is layer) == want_source
        module = "dsv4_plugin.attention_v41"
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(cfg):
        out, expected, keys = _run_decode(layer, owner, g, monkeypatch, module)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    assert torch.all(out[2] == 0)  # padding token: nothing attended, zero output
    # both caches were read: the window alone gives a different answer
    assert keys[1].shape[0] > layer.window_size
