"""Prefill through vLLM's real ``forward_mqa`` with dsv4 selected: a mixed batch (3
decodes, 7 prefills) and a prefill-only one, on each attention-layer type of the
real V4 and V4.1 models built from the tiny configs (window only, V4 C4A and C128A,
V4.1 ratio 1 and 2, kv sources and layers sharing a source's cache), against
float64 attention.

The metadata come from vLLM's own builders (_attn_batch.AttnBatch), and the batch is
big enough that each layer's prefill chunk plan has two chunks, so the plugin's
chunk loop (workspace gather, combined index lists, one ``sparse_mqa_prefill`` per
chunk) and the decode / prefill split of ``forward_mqa`` both run. vLLM's Triton
helpers are the stand-ins of _stand_ins.py (checked against vLLM's own under
Triton's interpreter in test_stand_ins_match_vllm.py); the bf16 workspace is
poisoned (NaN) before every forward pass.
"""

from __future__ import annotations

import math

import pytest
import torch

from _attn_batch import LAYERS, MIXED, AttnBatch, pick_layer

WORKSPACE_BYTES = 64 << 20


def poison_workspace():
    from vllm.v1.worker.workspace import current_workspace_manager

    ws = current_workspace_manager().get_simultaneous(((WORKSPACE_BYTES,), torch.uint8))[0]
    ws.fill_(0xFF)  # bf16 NaN, int32 -1


def run_forward(cfg, layer, batch, g, monkeypatch):
    """Returns (output, expected, number of sparse_mqa_prefill calls)."""
    import dsv4.attention
    from vllm.forward_context import set_forward_context

    calls = []
    real = dsv4.attention.sparse_mqa_prefill

    def count(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(dsv4.attention, "sparse_mqa_prefill", count)
    md = batch.build_metadata()
    batch.bind()
    H = layer.padded_heads
    with torch.no_grad():
        layer.attn_sink.copy_(torch.randn(H, generator=g))
        layer.attn_sink[3] = -math.inf
    q = torch.randn(batch.num_tokens, H, 512, generator=g).to(torch.bfloat16)
    output = torch.full_like(q, float("nan"))
    poison_workspace()
    with set_forward_context(md, cfg):
        layer.forward_mqa(q, None, batch.positions, output)
    return output, batch.expected(q, layer.attn_sink, layer.scale), calls


# Every V4 layer kind and V4.1's window-only, ratio-1 and ratio-2 layers with the
# mixed batch (a V4.1 kv source and a layer sharing its source's cache: their
# decode paths are covered in test_forward_mqa_compressed.py); one layer per model
# without decodes.
CASES = [(w, "mixed") for w in ("v4_swa", "v4_c4a", "v4_c128a", "v41_swa", "v41_r1_source",
                                "v41_r2_shared")] + [("v4_c4a", "prefill_only"),
                                                     ("v41_r2_source", "prefill_only")]


@pytest.mark.parametrize("which,requests", CASES)
def test_prefill_and_mixed_batches_match_float64(attn_models, attn_helpers, monkeypatch, which,
                                                 requests):
    cfg, layer = pick_layer(attn_models, which)
    g = torch.Generator().manual_seed(sum(map(ord, which + requests)))
    reqs = MIXED[LAYERS[which][0]]
    if requests == "prefill_only":
        reqs = [r for r in reqs if r.query > 1]
    batch = AttnBatch(cfg, layer, reqs, g)
    assert batch.num_decodes == (3 if requests == "mixed" else 0)
    out, expected, calls = run_forward(cfg, layer, batch, g, monkeypatch)

    assert len(calls) == 2, f"expected a two-chunk prefill plan, got chunks of {calls} tokens"
    assert sum(calls) == batch.num_tokens - batch.num_decode_tokens
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    # the last token read compressed entries: all of its C128A ones, an index_topk
    # subset of its C4A / ratio 1-2 ones
    if batch.comp_cache is not None:
        t = batch.num_tokens - 1
        assert len(batch.compressed_entries(t)) > 0
        if batch.topk is not None:
            assert len(batch.compressed_entries(t)) == layer.topk_indices_buffer.shape[-1]
