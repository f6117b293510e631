"""DSV4FlashMLAAttention.forward_mqa on CPU tensors with vLLM's own metadata.

The layer is vLLM's attention class with the plugin's kernels; its __init__
(projections, DeepGEMM o_proj recipe, indexer, compressor) needs a full model
config and GPU libraries, so the test builds the instance without __init__ and
sets exactly the attributes forward_mqa reads (the same ones vLLM's __init__
sets). The metadata are vLLM 0.33.0's real dataclasses
(DeepseekSparseSWAMetadata, DeepseekV4FlashMLAMetadata) passed through vLLM's
forward context, and the caches are fp8_ds_mla byte caches with vLLM's padded
block stride. The expected output is computed independently: rows read back
from the caches, then an explicit float64 softmax-with-sink per token over the
slot ids in the index lists.

Decode is covered here for SWA-only (compress_ratio 1) and C128A (compress_ratio
128) layers; C4A and V4.1's compressed decode in test_forward_mqa_compressed.py
(on the real models' layers, with a torch stand-in for vLLM's Triton
compute_global_topk_indices_and_lens); prefill and mixed batches, with metadata from
vLLM's own builders, in test_forward_mqa_prefill.py.
"""

from __future__ import annotations

import math

import pytest
import torch

H = 64  # heads as the layer sees them (vLLM pads q to 64 or 128)
D = 512
WINDOW = 8
SWA_BLOCK = 16
SCALE = D**-0.5


def _expected(q, rows_by_slot, index_lists, sink):
    """float64 reference: q [T, H, D]; index_lists[t] = list of (cache, slot)."""
    T = q.shape[0]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        keys = [rows_by_slot[c][s] for c, s in index_lists[t]]
        if not keys:
            continue
        k = torch.stack(keys).double()  # [n, D]
        s = (q[t].double() @ k.T) * SCALE  # [H, n]
        m = torch.maximum(s.max(dim=1).values, sink.double())
        p = torch.exp(s - m[:, None])
        denom = p.sum(dim=1) + torch.exp(sink.double() - m)
        out[t] = (p @ k) / denom[:, None]
    return out


def _make_layer(cls, compress_ratio, swa_cache, comp_cache, sink):
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    layer.prefix = "model.layers.0.attn"
    layer.compress_ratio = compress_ratio
    layer.scale = SCALE
    layer.attn_sink = sink
    layer.window_size = WINDOW
    layer.topk_indices_buffer = None
    layer.kv_cache = comp_cache if comp_cache is not None else torch.empty(0)

    class _SwaCacheLayer:  # vLLM's DeepseekV4SWACache exposes .prefix and .kv_cache
        prefix = "model.layers.0.attn.swa_cache"
        kv_cache = swa_cache

    layer.swa_cache_layer = _SwaCacheLayer()
    return layer


@pytest.mark.parametrize("compress_ratio", [1, 128])
@pytest.mark.parametrize("invariant", [False, True])
def test_forward_mqa_decode_matches_independent_math(plugin, compress_ratio, invariant, monkeypatch):
    import dsv4.attention

    # VLLM_BATCH_INVARIANT=1 must reach the kernel as batch_invariant=True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1" if invariant else "0")
    seen = []
    real = dsv4.attention.sparse_mqa_decode

    def spy(*args, **kwargs):
        seen.append(kwargs.get("batch_invariant"))
        return real(*args, **kwargs)

    monkeypatch.setattr(dsv4.attention, "sparse_mqa_decode", spy)
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWAMetadata

    from dsv4 import formats
    from dsv4_plugin.attention_v4 import DSV4FlashMLAAttention

    g = torch.Generator().manual_seed(1234 + compress_ratio)
    T = 3  # decode tokens (one per request)
    seq_lens = [5, 13, 11]  # positions p = seq_len - 1

    # SWA cache: 4 blocks of 16; request r owns block r (slot = r*16 + pos % 16).
    swa_cache = formats.new_fp8_ds_mla_cache(4, SWA_BLOCK, fill="random", generator=g)
    swa_slots = torch.arange(4 * SWA_BLOCK)
    swa_rows = torch.randn(4 * SWA_BLOCK, D, generator=g).to(torch.bfloat16)
    formats.write_fp8_ds_mla(swa_cache, swa_slots, swa_rows)
    rows = {"swa": formats.read_fp8_ds_mla(swa_cache, swa_slots)}

    W = WINDOW
    swa_idx = torch.full((T, 1, W), -1, dtype=torch.int32)
    swa_len = torch.zeros(T, dtype=torch.int32)
    lists = []
    for r, L in enumerate(seq_lens):
        p = L - 1
        pos = list(range(max(0, p - W + 1), p + 1))
        slots = [r * SWA_BLOCK + (x % SWA_BLOCK) for x in pos]
        swa_idx[r, 0, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        swa_len[r] = len(slots)
        lists.append([("swa", s) for s in slots])
    # Padding beyond topk_length must be ignored even if it holds valid slot ids.
    swa_idx[0, 0, int(swa_len[0]):] = 7

    comp_cache = None
    flashmla_md = None
    if compress_ratio == 128:
        comp_block = 2
        comp_cache = formats.new_fp8_ds_mla_cache(3, comp_block, fill="random", generator=g)
        comp_slots = torch.arange(3 * comp_block)
        formats.write_fp8_ds_mla(
            comp_cache, comp_slots, torch.randn(3 * comp_block, D, generator=g).to(torch.bfloat16)
        )
        rows["comp"] = formats.read_fp8_ds_mla(comp_cache, comp_slots)
        # Pre-computed C128A decode metadata: global slot ids + lengths, [T, width].
        c_idx = torch.tensor([[-1, -1, -1, -1], [0, 3, 5, -1], [4, 1, 2, 2]], dtype=torch.int32)
        c_len = torch.tensor([0, 3, 4], dtype=torch.int32)
        for t in range(T):
            lists[t] += [("comp", int(s)) for s in c_idx[t, : int(c_len[t])]]
        flashmla_md = DeepseekV4FlashMLAMetadata(
            num_reqs=T,
            max_query_len=1,
            max_seq_len=max(seq_lens),
            num_actual_tokens=T,
            query_start_loc=torch.arange(T + 1, dtype=torch.int32),
            slot_mapping=torch.zeros(T, dtype=torch.int64),
            block_table=torch.zeros(T, 4, dtype=torch.int32),
            req_id_per_token=torch.arange(T, dtype=torch.int32),
            block_size=comp_block * compress_ratio,
            topk_tokens=512,
            c128a_global_decode_topk_indices=c_idx,
            c128a_decode_topk_lens=c_len,
        )

    swa_md = DeepseekSparseSWAMetadata(
        block_table=torch.arange(T, dtype=torch.int32).unsqueeze(1),
        slot_mapping=torch.zeros(T, dtype=torch.int64),
        block_size=SWA_BLOCK,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.arange(T + 1, dtype=torch.int32),
        query_start_loc_cpu=torch.arange(T + 1, dtype=torch.int32),
        is_valid_token=torch.ones(T, dtype=torch.bool),
        token_to_req_indices=torch.arange(T, dtype=torch.int32),
        decode_swa_indices=swa_idx,
        decode_swa_lens=swa_len,
        decode_swa_width=W,
        num_decodes=T,
        num_prefills=0,
        num_decode_tokens=T,
        num_prefill_tokens=0,
    )

    sink = torch.randn(H, generator=g, dtype=torch.float32)
    sink[5] = -math.inf  # padded-head style: no sink
    layer = _make_layer(DSV4FlashMLAAttention, compress_ratio, swa_cache, comp_cache, sink)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    output = torch.full_like(q, float("nan"))
    attn_metadata = {layer.swa_cache_layer.prefix: swa_md}
    if flashmla_md is not None:
        attn_metadata[layer.prefix] = flashmla_md

    with set_forward_context(attn_metadata, VllmConfig()):
        layer.forward_mqa(q, None, torch.tensor([L - 1 for L in seq_lens]), output)

    assert seen == [invariant]
    expected = _expected(q, rows, lists, sink)
    torch.testing.assert_close(output.double(), expected, atol=2e-2, rtol=2e-2)
    if compress_ratio == 128:
        # token 0 has no compressed entries; tokens 1, 2 do: both caches were read
        assert not torch.allclose(
            expected[1], _expected(q, rows, [lists[t][: int(swa_len[t])] for t in range(T)], sink)[1]
        )


def test_forward_mqa_uses_vllm_call_protocol(plugin):
    """forward_mqa itself is vLLM's (inherited): only the two kernel methods change."""
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    from dsv4_plugin.attention_v4 import DSV4FlashMLAAttention

    assert issubclass(DSV4FlashMLAAttention, DeepseekV4FlashMLAAttention)
    assert DSV4FlashMLAAttention.forward_mqa is DeepseekV4FlashMLAAttention.forward_mqa
    own = {k for k in vars(DSV4FlashMLAAttention) if not k.startswith("__") and k != "_abc_impl"}
    assert own == {"_forward_decode", "_forward_prefill"}
    assert DSV4FlashMLAAttention.backend_cls is DeepseekV4FlashMLAAttention.backend_cls
