"""One scheduled batch of DeepSeek V4 / V4.1 attention requests on CPU, for one
attention layer of a real model (_cpu_model.build_model): paged fp8_ds_mla caches,
block tables and slot mappings laid out as vLLM's KV-cache manager lays them out,
the layer's metadata from vLLM's own metadata builders (built as vLLM's GPU model
runner builds them, with _stand_ins.install_attention_helpers in place), and the
float64 attention each query token should get.

Layout rules followed (vLLM 0.33.0):

* decodes first (query length 1), then prefills (vLLM's reorder);
* a request's query is its last ``query`` positions, ``seq_len = prefix + query``;
* the sliding-window cache's block table holds the null block (0) for blocks wholly
  before the window of the request's first query token (the sliding-window manager
  frees them); block 0 of every cache is never written (random bytes), so reading it
  spoils the result;
* the compressed cache (kv source) is paged by the attention backend's kernel block
  size in tokens, ``block_size // compress_ratio`` entries per block; entry ``i`` is
  tokens ``[i*ratio, (i+1)*ratio)``, so a request has ``seq_len // ratio`` entries and
  a token at position ``p`` may use entries ``< (p + 1) // ratio``;
* the indexer (C4A, V4.1 ratio 1/2) writes each token's local entry ids into the
  shared ``topk_indices_buffer``: ``min((p + 1) // ratio, index_topk)`` distinct ids
  first, -1 after them; C128A uses all of its entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

D = 512


@dataclass(frozen=True)
class Request:
    prefix: int  # tokens already cached
    query: int  # tokens scheduled now (1: a decode)


# Per model: 3 decodes and 7 prefills, and vLLM's engine limits for them. Every
# layer type's prefill chunk plan (PREFILL_CHUNK_SIZE 4, workspace bounded by
# max_model_len / ratio + window + max_num_batched_tokens per request) splits the
# prefills into two chunks, and the longest requests have more compressed entries
# than index_topk (512) at V4's ratio 4 and V4.1's ratios 1 and 2.
MIXED = {
    "v4": (Request(700, 1), Request(2999, 1), Request(130, 1),
           Request(3000, 8), Request(2950, 6), Request(0, 9), Request(2990, 8),
           Request(60, 7), Request(3010, 5), Request(2800, 8)),
    "v41": (Request(700, 1), Request(1499, 1), Request(130, 1),
            Request(1450, 8), Request(1400, 6), Request(0, 9), Request(1440, 8),
            Request(60, 7), Request(1460, 5), Request(1300, 8)),
}
ENGINE_KWARGS = {
    "v4": dict(max_model_len=4096, max_num_batched_tokens=64, max_num_seqs=16),
    "v41": dict(max_model_len=1536, max_num_batched_tokens=64, max_num_seqs=16),
}


# One attention layer of each kind: (model, compress ratio, is the kv source).
LAYERS = {
    "v4_swa": ("v4", 1, None),
    "v4_c4a": ("v4", 4, None),
    "v4_c128a": ("v4", 128, None),
    "v41_swa": ("v41", 0, None),
    "v41_r1_source": ("v41", 1, True),
    "v41_r1_shared": ("v41", 1, False),
    "v41_r2_source": ("v41", 2, True),
    "v41_r2_shared": ("v41", 2, False),
}


def pick_layer(models, which):
    """(vllm_config, layer): the first attention layer of the kind ``which`` in
    ``models`` (the conftest ``attn_models`` fixture)."""
    key, ratio, source = LAYERS[which]
    cfg, model = models[key]
    name = "DSV41FlashMLAAttention" if key == "v41" else "DSV4FlashMLAAttention"
    for m in model.modules():
        if type(m).__name__ == name and m.compress_ratio == ratio and \
                (source is None or m.is_kv_source == source):
            return cfg, m
    raise LookupError(which)


def is_v41(layer) -> bool:
    return type(layer).__name__ == "DSV41FlashMLAAttention"


def has_compressed(layer) -> bool:
    return layer.compress_ratio > (0 if is_v41(layer) else 1)


def metadata_prefix(layer) -> str | None:
    """The prefix vLLM's forward_mqa looks the layer's compressed-cache metadata up by."""
    if not has_compressed(layer):
        return None
    return layer.compressed_cache_prefix if is_v41(layer) else layer.prefix


def _builder(cfg, prefix, backend):
    """vLLM's model runner: backend's builder on the group's spec at the kernel block size.

    V4.1's FlashMLA backend pages by 64 tokens on SM90; vLLM's CPU platform sets a
    16-token cache block for it, which a Hopper worker never has, so the spec is
    taken at the kernel block size as the CUDA platform would choose it.
    """
    from _cpu_model import kv_cache_specs

    spec = kv_cache_specs(cfg)[prefix]
    kernel = backend.get_supported_kernel_block_sizes()[0]
    if isinstance(kernel, int) and kernel != spec.block_size:
        spec = spec.copy_with_new_block_size(kernel)
    return backend.get_builder_cls()(spec, [prefix], cfg, torch.device("cpu")), spec


def _random_cache(num_blocks, block_size, g):
    """fp8_ds_mla cache with random rows in every block but the null block 0."""
    from dsv4 import formats

    cache = formats.new_fp8_ds_mla_cache(num_blocks, block_size, fill="random", generator=g)
    slots = torch.arange(block_size, num_blocks * block_size)
    formats.write_fp8_ds_mla(cache, slots,
                             torch.randn(slots.numel(), D, generator=g).to(torch.bfloat16))
    return cache


class AttnBatch:
    """``requests`` scheduled on ``layer`` (an attention layer of the model built with ``cfg``)."""

    def __init__(self, cfg, layer, requests, g):
        from vllm.config import set_current_vllm_config

        from _cpu_model import cuda_construction_stand_ins

        self.cfg, self.layer, self.requests = cfg, layer, list(requests)
        self.ratio = layer.compress_ratio
        self.window = layer.window_size
        R = len(self.requests)
        q = torch.tensor([r.query for r in self.requests])
        self.seq_lens = torch.tensor([r.prefix + r.query for r in self.requests], dtype=torch.int32)
        self.query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32),
                                          q.cumsum(0).to(torch.int32)])
        self.num_tokens = int(self.query_start_loc[-1])
        self.req_of_token = torch.repeat_interleave(torch.arange(R), q)
        self.positions = torch.cat([torch.arange(r.prefix, r.prefix + r.query)
                                    for r in self.requests])
        self.num_decodes = sum(r.query == 1 for r in self.requests)
        self.num_decode_tokens = self.num_decodes

        with cuda_construction_stand_ins(), set_current_vllm_config(cfg):
            swa = layer.swa_cache_layer
            self.swa_builder, self.swa_spec = _builder(cfg, swa.prefix, swa.get_attn_backend())
            self.md_prefix = metadata_prefix(layer)
            self.flash_builder = self.flash_spec = None
            if self.md_prefix is not None:
                owner = cfg.compilation_config.static_forward_context[self.md_prefix]
                self.flash_builder, self.flash_spec = _builder(cfg, self.md_prefix,
                                                               owner.get_attn_backend())

        # Sliding-window cache: blocks below the first query token's window are null.
        bs = self.swa_spec.block_size
        width = math.ceil(int(self.seq_lens.max()) / bs)
        self.swa_block_table = torch.zeros(R, width, dtype=torch.int32)
        needed = []
        for r, req in enumerate(self.requests):
            first = max(0, req.prefix - (self.window - 1)) // bs
            needed += [(r, b) for b in range(first, math.ceil((req.prefix + req.query) / bs))]
        ids = 1 + torch.randperm(len(needed), generator=g)
        for (r, b), i in zip(needed, ids.tolist()):
            self.swa_block_table[r, b] = i
        self.swa_cache = _random_cache(len(needed) + 1, bs, g)

        # Compressed cache of the kv source, paged by the kernel block size.
        self.comp_cache = self.comp_block_table = None
        self.topk = None
        if self.flash_spec is not None:
            kb = self.flash_spec.block_size
            per_block = kb // self.ratio
            width = math.ceil(cfg.model_config.max_model_len / kb)
            self.comp_block_table = torch.zeros(R, width, dtype=torch.int32)
            counts = [math.ceil(int(s) // self.ratio / per_block) for s in self.seq_lens]
            ids = (1 + torch.randperm(sum(counts), generator=g)).tolist()
            for r, c in enumerate(counts):
                self.comp_block_table[r, :c] = torch.tensor(ids[:c], dtype=torch.int32)
                ids = ids[c:]
            self.comp_cache = _random_cache(sum(counts) + 1, per_block, g)
            if self.ratio != 128:
                self.topk = self._indexer_output(g)

    def _indexer_output(self, g):
        """What the index source's indexer writes: local entry ids per token."""
        buf = self.layer.topk_indices_buffer
        topk = torch.full((self.num_tokens, buf.shape[-1]), -1, dtype=torch.int32)
        for t, p in enumerate(self.positions.tolist()):
            n = (p + 1) // self.ratio
            k = min(n, buf.shape[-1])
            topk[t, :k] = torch.randperm(n, generator=g)[:k].to(torch.int32)
        return topk

    # -- vLLM's metadata ---------------------------------------------------------

    def _common(self, block_table, block_size):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        req, pos = self.req_of_token, self.positions
        slot_mapping = (block_table[req, pos // block_size].long() * block_size
                        + pos % block_size)
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc.clone(),
            query_start_loc_cpu=self.query_start_loc.clone(),
            seq_lens=self.seq_lens.clone(),
            num_reqs=len(self.requests),
            num_actual_tokens=self.num_tokens,
            max_query_len=max(r.query for r in self.requests),
            max_seq_len=int(self.seq_lens.max()),
            block_table_tensor=block_table.clone(),
            slot_mapping=slot_mapping,
            positions=self.positions.clone(),
            seq_lens_cpu_upper_bound=self.seq_lens.clone(),
        )

    def build_metadata(self) -> dict:
        """vLLM's builders' output, keyed by the prefixes vLLM's layers look it up by."""
        from vllm.config import set_current_vllm_config

        from _cpu_model import cuda_construction_stand_ins

        with cuda_construction_stand_ins(), set_current_vllm_config(self.cfg):
            md = {self.layer.swa_cache_layer.prefix: self.swa_builder.build(
                0, self._common(self.swa_block_table, self.swa_spec.block_size))}
            if self.flash_builder is not None:
                md[self.md_prefix] = self.flash_builder.build(
                    0, self._common(self.comp_block_table, self.flash_spec.block_size))
        return md

    def bind(self) -> None:
        """Hand the caches and the indexer's output to the layer (as vLLM binds them)."""
        self.layer.swa_cache_layer.kv_cache = self.swa_cache
        if self.comp_cache is not None:
            owner = self.cfg.compilation_config.static_forward_context[self.md_prefix]
            owner.kv_cache = self.comp_cache
        if self.topk is not None:
            self.layer.topk_indices_buffer.fill_(-7)  # rows past the batch: never read
            self.layer.topk_indices_buffer[: self.num_tokens] = self.topk

    # -- the attention each token should get --------------------------------------

    def compressed_entries(self, t: int) -> list[int]:
        """Local compressed-entry ids token ``t`` attends to."""
        if self.comp_cache is None:
            return []
        n = (int(self.positions[t]) + 1) // self.ratio
        if self.topk is None:  # C128A: every entry so far
            return list(range(n))
        return [int(x) for x in self.topk[t] if x >= 0]

    def keys(self, t: int) -> torch.Tensor:
        """The rows token ``t`` attends to, read back from the caches ([n, 512])."""
        from dsv4 import formats

        if not hasattr(self, "_rows"):  # every slot of each cache, dequantized once
            self._rows = [formats.dequantize_fp8_ds_mla_cache(c)
                          for c in (self.swa_cache, self.comp_cache) if c is not None]
        r, p = int(self.req_of_token[t]), int(self.positions[t])
        bs = self.swa_spec.block_size
        win = torch.arange(max(0, p - self.window + 1), p + 1)
        slots = [self.swa_block_table[r, win // bs].long() * bs + win % bs]
        ent = torch.tensor(self.compressed_entries(t), dtype=torch.long)
        rows = [self._rows[0][slots[0]]]
        if ent.numel():
            per_block = self.comp_cache.shape[1]
            slots = self.comp_block_table[r, ent // per_block].long() * per_block + ent % per_block
            rows.append(self._rows[1][slots])
        return torch.cat(rows)

    def expected(self, q, sink, scale) -> torch.Tensor:
        """float64 softmax-with-sink attention of every token over its keys."""
        out = torch.zeros(q.shape, dtype=torch.float64)
        sink = sink.double()
        for t in range(self.num_tokens):
            k = self.keys(t).double()
            s = (q[t].double() @ k.T) * scale
            m = torch.maximum(s.max(dim=1).values, sink)
            p = torch.exp(s - m[:, None])
            out[t] = (p @ k) / (p.sum(dim=1) + torch.exp(sink - m))[:, None]
        return out
