"""Useful work of one call, per op family: the FLOPs and bytes every benchmark report
divides by its time (docs/perf.md: "useful work only": FLOPs without padding, bytes each
token reads once).

* attention (``sparse_mqa_decode``, ``sparse_mqa_prefill``, ``dense_fmha``): 2 * D FLOPs
  for q.k and 2 * D for p.v per visible key and query head;
* routed MoE: 6 * K * N FLOPs per local (token, expert) route; bytes = the weights of the
  distinct local experts touched (codes + block scales);
* ``quantize_nvfp4``: bf16 in, e2m1 codes + e4m3 scales out; no FLOPs counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formats.kv_cache import FP8_DS_MLA_VIEW_LAST_DIM
from .models import HEAD_DIM

__all__ = ["Traffic", "WEIGHT_BYTES", "decode_attention", "prefill_attention", "dense_fmha", "moe",
           "moe_expert_bytes", "quantize_nvfp4"]

# Weight bytes per element of each expert format: bf16; NVFP4 = e2m1 code (1/2 B) + one
# e4m3 scale per 16 (1/16 B); MXFP4 = code + one e8m0 scale per 32 (1/32 B).
WEIGHT_BYTES = {"bf16": 2.0, "nvfp4": 9 / 16, "mxfp4": 17 / 32}
_IDX = 4  # int32 index per key
_BF16 = 2


@dataclass(frozen=True)
class Traffic:
    """Useful FLOPs and bytes of one call."""

    flops: float
    bytes: float

    def tflops(self, us: float) -> float:
        return self.flops / (us * 1e-6) / 1e12

    def tbps(self, us: float) -> float:
        return self.bytes / (us * 1e-6) / 1e12


def decode_attention(batch: int, heads: int, keys: int) -> Traffic:
    """One ``sparse_mqa_decode`` call over the fp8_ds_mla cache (s_q = 1): each token reads
    its ``keys`` cached rows once (584 B) with their int32 index, q and out (bf16) and lse
    (fp32)."""
    flops = 2 * heads * 2 * HEAD_DIM * keys * batch
    nbytes = batch * (keys * (FP8_DS_MLA_VIEW_LAST_DIM + _IDX) + 2 * heads * HEAD_DIM * _BF16 + heads * 4)
    return Traffic(flops, nbytes)


def prefill_attention(tokens: int, heads: int, keys: int) -> Traffic:
    """One ``sparse_mqa_prefill`` call over gathered bf16 rows: ``keys`` indices per token,
    each row (1024 B) and index read once per token, q and out bf16, lse fp32."""
    flops = 2 * heads * 2 * HEAD_DIM * keys * tokens
    nbytes = tokens * (keys * (HEAD_DIM * _BF16 + _IDX) + 2 * heads * HEAD_DIM * _BF16 + heads * 4)
    return Traffic(flops, nbytes)


def dense_fmha(tokens: int, heads_q: int, head_dim: int, keys: int, kv_rows: int, heads_kv: int,
               shared_kv: bool) -> Traffic:
    """One ``dense_fmha`` call: ``keys`` = visible (query, key) pairs summed over all
    queries; bytes = q and out (bf16), lse (fp32) and the K (and V unless ``shared_kv``,
    the D = 512 MQA case) rows once."""
    flops = 4 * head_dim * heads_q * keys
    kv = kv_rows * heads_kv * head_dim * _BF16 * (1 if shared_kv else 2)
    return Traffic(flops, 2 * tokens * heads_q * head_dim * _BF16 + tokens * heads_q * 4 + kv)


def moe_expert_bytes(hidden: int, inter: int, fmt: str) -> float:
    """Weight bytes of one expert (w13 and w2: 3 * N * K elements) in ``fmt``
    (:data:`WEIGHT_BYTES`)."""
    return 3 * inter * hidden * WEIGHT_BYTES[fmt]


def moe(local_routes: float, touched_experts: float, hidden: int, inter: int, fmt: str) -> Traffic:
    """One routed-MoE call: ``local_routes`` (token, local expert) pairs, each 6 * K * N
    FLOPs (GEMM1 2 * 2N * K, GEMM2 2 * K * N); bytes = the ``touched_experts`` distinct
    local experts' weights in ``fmt`` (activations are small beside them)."""
    return Traffic(local_routes * 6 * hidden * inter, touched_experts * moe_expert_bytes(hidden, inter, fmt))


def quantize_nvfp4(m: int, k: int) -> Traffic:
    """One ``quantize_nvfp4`` call on bf16 [m, k]: read 2 B per element, write 1/2 B of
    codes and 1/16 B of scales."""
    return Traffic(0, m * k * _BF16 + m * k // 2 + m * k // 16)
