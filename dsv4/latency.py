"""Decode-latency building blocks: model shapes, layer schedules, input builders,
torch baselines and timers. Used by ``scripts/decode_latency.py``.

Everything here is device-generic (the same builders feed the CUDA run and the tiny
``--cpu-reference`` run) except :func:`graph_replay_us`, which needs CUDA.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from . import formats, nvfp4_moe, prepare_moe_weights, prepare_nvfp4_moe_weights, routed_moe
from .formats import mxfp4
from .attention import sparse_mqa_decode
from .bench.inputs import MOE_FORMATS

HEAD_DIM = 512
SOFTMAX_SCALE = HEAD_DIM**-0.5
WINDOW = 128  # sliding window, every layer
CSA_RATIO = 4
HCA_RATIO = 128
BLOCK_SIZE = 64  # fp8_ds_mla block size of the benchmark pools
FP8_ROW_BYTES = formats.FP8_DS_MLA_VIEW_LAST_DIM  # 576 data + 8 scale bytes per cached token
VLLM_KEYS = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")


# --------------------------------------------------------------------------------------
# model facts
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int  # K of the MoE
    heads: int  # query heads (one shared KV head)
    index_topk: int  # compressed entries a CSA layer attends to
    n_experts: int  # routed experts (global)
    moe_inter: int  # N of the MoE (per gate/up half)
    layers: dict = field(default_factory=dict)  # {"swa": n, "csa": n, "hca": n}
    experts_per_token: int = 6
    swiglu_limit: float = 10.0

    @property
    def n_layers(self) -> int:
        return sum(self.layers.values())


# Per-model count of each attention layer type. Source: the `compress_ratios` list of the
# published HF config.json of each checkpoint (0 = sliding window only, 4 = CSA, 128 = HCA;
# its last entry is the MTP layer, not counted). vLLM 0.33.0 reads the same list
# (vllm/transformers_utils/deepseek_v4_utils.py:get_compress_ratios ->
# vllm/models/deepseek_v4/attention.py); the checkpoint configs are not in vLLM's source:
#   V4-Flash (43 layers): [0, 0] + [4, 128] * 20 + [4] (+ MTP 0) -> 2 SWA, 21 CSA, 20 HCA
#   V4-Pro   (61 layers): [128, 128] + [4, 128] * 29 + [4] (+ MTP 0) -> 0 SWA, 30 CSA, 31 HCA
# Every layer is an MoE layer (no dense layers; the first 3 use hash routing, which
# still runs the same routed-experts kernel). Override with --layers MODEL=SWA,CSA,HCA.
LAYER_SCHEDULE = {
    "flash": {"swa": 2, "csa": 21, "hca": 20},
    "pro": {"swa": 0, "csa": 30, "hca": 31},
}

MODELS = {
    "flash": ModelShape("V4-Flash", hidden=4096, heads=64, index_topk=512, n_experts=256, moe_inter=2048,
                        layers=LAYER_SCHEDULE["flash"]),
    "pro": ModelShape("V4-Pro", hidden=7168, heads=128, index_topk=1024, n_experts=384, moe_inter=3072,
                      layers=LAYER_SCHEDULE["pro"]),
}


def tiny_shape(shape: ModelShape) -> ModelShape:
    """Shrunk shape for the CPU reference run. Heads and head dim stay (the ops only
    take 64/128 heads of 512); the MoE and the indexer top-k shrink; the expert count
    and layer schedule stay so the EP split and the step sum are the same arithmetic."""
    return replace(shape, name=shape.name + " (tiny CPU shape)", hidden=256, moe_inter=128,
                   index_topk=shape.index_topk // 16)


# What the step estimate leaves out (printed and written to the JSON).
NOT_INCLUDED = [
    "indexer (CSA top-k selection) and compressor (building compressed KV entries)",
    "attention projections (q/kv down and up projections, grouped output projection), RoPE, norms",
    "KV cache writes",
    "shared expert, router/gate, routed_scaling_factor",
    "mHC hyper-connections, embedding, LM head, MTP layer, sampling",
    "expert-parallel all-to-all / all-reduce communication",
]


# --------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------


def attention_keys(kind: str, shape: ModelShape, context: Optional[int]) -> tuple[int, int]:
    """(window keys, compressed keys) one decode token at position ``context - 1`` attends
    to. A compressed entry w (ratio r) is visible iff w < context // r."""
    win = min(WINDOW, context) if context else WINDOW
    if kind == "swa":
        return win, 0
    if kind == "csa":
        return win, min(shape.index_topk, context // CSA_RATIO)
    if kind == "hca":
        return win, context // HCA_RATIO
    raise ValueError(f"unknown attention kind {kind!r}")


@dataclass
class KvPools:
    """One shared paged pool per cache (window, compressed), plus a bf16 copy of both
    rows for the torch baseline ([window slots | compressed slots]). Sequences draw
    their slot ids from the shared pools: indices only need to point at valid slots,
    so batch 128 at 128K never needs 128 private caches."""

    win: torch.Tensor  # fp8_ds_mla uint8 [nb, 64, 584]
    comp: torch.Tensor  # fp8_ds_mla uint8 [nb, 64, 584]
    rows_bf16: torch.Tensor  # bf16 [win slots + comp slots, 512], the same values dequantized

    @property
    def n_win(self) -> int:
        return self.win.shape[0] * self.win.shape[1]

    @property
    def n_comp(self) -> int:
        return self.comp.shape[0] * self.comp.shape[1]

    @staticmethod
    def build(n_win: int, n_comp: int, device, seed: int = 0) -> "KvPools":
        gen = torch.Generator(device=device).manual_seed(seed)
        pools, bf16 = [], []
        for n in (n_win, n_comp):
            nb = -(-n // BLOCK_SIZE)
            cache = formats.new_fp8_ds_mla_cache(nb, BLOCK_SIZE, device=device)
            rows = torch.empty(nb * BLOCK_SIZE, HEAD_DIM, dtype=torch.bfloat16, device=device)
            chunk = 1 << 16  # bounds the float32 temporaries of the quantizer
            for s in range(0, nb * BLOCK_SIZE, chunk):
                slots = torch.arange(s, min(s + chunk, nb * BLOCK_SIZE), device=device)
                formats.write_fp8_ds_mla(cache, slots, torch.randn(len(slots), HEAD_DIM, device=device,
                                                                   generator=gen))
                rows[s:s + len(slots)] = formats.read_fp8_ds_mla(cache, slots)
            pools.append(cache)
            bf16.append(rows)
        return KvPools(pools[0], pools[1], torch.cat(bf16))


def attention_inputs(kind: str, shape: ModelShape, batch: int, context: int, pools: KvPools,
                     gen: torch.Generator) -> dict:
    """Random decode inputs for one layer of type ``kind``, in the index-row widths vLLM
    0.33.0 passes (dsv4.bench.inputs): the window row is 128 wide, a CSA row the
    indexer's top-k, an HCA row ``c128a_width(context)``, -1 padded past the visible
    entries, int32 lengths. Each sequence's window is 128 consecutive slots and its
    compressed entries a run of ``context // ratio`` consecutive slots at a random offset
    of the pools (as its pages would be); CSA picks a random top-k subset of its run,
    HCA takes the whole run."""
    from .bench.inputs import c128a_width

    device = pools.win.device
    k_win, k_comp = attention_keys(kind, shape, context)

    def rand_start(pool_slots, span):
        return torch.randint(0, pool_slots - span + 1, (batch, 1), generator=gen, device=device)

    win_idx = rand_start(pools.n_win, k_win) + torch.arange(k_win, device=device)
    inp = dict(
        q=torch.randn(batch, 1, shape.heads, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16),
        sink=torch.randn(shape.heads, generator=gen, device=device),
        win_idx=win_idx.to(torch.int32).view(batch, 1, k_win),
        win_len=torch.full((batch,), k_win, dtype=torch.int32, device=device),
        comp_idx=None, comp_len=None, comp_keys=0,
    )
    if kind != "swa":
        span = context // (CSA_RATIO if kind == "csa" else HCA_RATIO)
        if k_comp == span:
            offs = torch.arange(span, device=device).expand(batch, span)
        else:  # random subset (in random order, like an indexer's top-k output)
            offs = torch.rand(batch, span, generator=gen, device=device).topk(k_comp, dim=1).indices
        width = shape.index_topk if kind == "csa" else c128a_width(context)
        comp_idx = torch.full((batch, width), -1, dtype=torch.int32, device=device)
        comp_idx[:, :k_comp] = (rand_start(pools.n_comp, span) + offs).to(torch.int32)
        inp["comp_idx"] = comp_idx.view(batch, 1, width)
        inp["comp_len"] = torch.full((batch,), k_comp, dtype=torch.int32, device=device)
        inp["comp_keys"] = k_comp
    return inp


def dsv4_attention(inp: dict, pools: KvPools, out: torch.Tensor) -> None:
    """Our kernel, called the way vLLM calls it: window cache + window indices as the
    main list, compressed cache + compressed indices as the extra list."""
    extra = inp["comp_idx"] is not None
    sparse_mqa_decode(inp["q"], pools.win, inp["win_idx"], inp["win_len"], inp["sink"], SOFTMAX_SCALE,
                      extra_kv_cache=pools.comp if extra else None,
                      extra_indices=inp["comp_idx"] if extra else None,
                      extra_topk_length=inp["comp_len"] if extra else None, out=out)


def flashmla_case(inp: dict, pools: KvPools) -> dict:
    """The same inputs in the form of dsv4.bench.inputs.decode_case (FlashMLA's wrapper)."""
    extra = inp["comp_idx"] is not None
    return dict(q=inp["q"], sink=inp["sink"], swa_cache=pools.win, swa_idx=inp["win_idx"], swa_len=inp["win_len"],
                extra_cache=pools.comp if extra else None, extra_idx=inp["comp_idx"], extra_len=inp["comp_len"])


def torch_attention(inp: dict, pools: KvPools) -> torch.Tensor:
    """Baseline: plain torch bf16 sparse MQA over gathered rows of a bf16 cache
    (gather, bf16 matmuls, fp32 softmax with the sink as an extra logit). No host
    sync, so it runs under CUDA graphs like the kernel."""
    q = inp["q"]
    b, _, h, d = q.shape
    idx = inp["win_idx"].view(b, -1)
    if inp["comp_idx"] is not None:  # compressed rows sit after the window rows; -1 padding left out
        idx = torch.cat([idx, inp["comp_idx"].view(b, -1)[:, :inp["comp_keys"]] + pools.n_win], dim=1)
    kv = pools.rows_bf16[idx.long()]  # [b, keys, d]
    s = torch.matmul(q.view(b, h, d), kv.transpose(1, 2)).float() * SOFTMAX_SCALE  # [b, h, keys]
    s = torch.cat([s, inp["sink"].view(1, h, 1).expand(b, h, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1].to(torch.bfloat16)  # the sink only adds to the denominator
    return torch.matmul(p, kv).view(b, 1, h, d)


def torch_attention_bytes(batch: int, heads: int, keys: int) -> int:
    """Peak temporaries of :func:`torch_attention` (gathered rows + score tensors)."""
    return batch * keys * HEAD_DIM * 2 + batch * heads * (keys + 1) * (2 + 4 + 4 + 4 + 2)


def attention_traffic(batch: int, heads: int, keys: int) -> tuple[int, int]:
    """(useful FLOPs, bytes) of one fp8-cache decode call: 2*512 FLOPs for q.k and
    2*512 for p.v per key and head; bytes = cached rows read once per token (584 B) +
    their int32 index + q + out + lse."""
    flops = 2 * heads * 2 * HEAD_DIM * keys * batch
    nbytes = batch * (keys * (FP8_ROW_BYTES + 4) + 2 * heads * HEAD_DIM * 2 + heads * 4)
    return flops, nbytes


# --------------------------------------------------------------------------------------
# MoE
# --------------------------------------------------------------------------------------


@dataclass
class MoeSetup:
    shape: ModelShape
    ep: int
    fmt: str  # the experts' format: "nvfp4" or "mxfp4" (dsv4.bench.inputs.MOE_FORMATS)
    weights: dict  # activation mode -> the prepared weights (Nvfp4MoeWeights for NVFP4, MoeWeights for MXFP4)
    w13_bf16: Optional[torch.Tensor]  # [E_local, 2N, K] dequantized, None if it did not fit
    w2_bf16: Optional[torch.Tensor]  # [E_local, K, N]
    note: str = ""
    raw: Optional[dict] = None  # the vLLM-layout experts (kept for the incumbent's own conversion)

    @property
    def e_local(self) -> int:
        return self.shape.n_experts // self.ep

    @staticmethod
    def build(shape: ModelShape, ep: int, device, fmt: str = "nvfp4", acts=("bf16",), seed: int = 1,
              keep_raw: bool = False) -> "MoeSetup":
        """Random experts of ``fmt`` in vLLM's stacked layout, prepared for each activation
        mode in ``acts`` (NVFP4: "bf16", "nvfp4", one layout; MXFP4: "fp8", "bf16"), and
        their bf16 dequantization for the torch baseline."""
        if fmt not in MOE_FORMATS:
            raise ValueError(f"dsv4: fmt must be one of {', '.join(MOE_FORMATS)}, got {fmt!r}")
        E, N, K = shape.n_experts // ep, shape.moe_inter, shape.hidden
        gen = torch.Generator(device=device).manual_seed(seed)
        w = MOE_FORMATS[fmt][0](E, N, K, device, gen)
        if fmt == "nvfp4":
            nv = prepare_nvfp4_moe_weights(*(w[k] for k in VLLM_KEYS))
            weights = {act: nv for act in acts}
        else:
            weights = {act: prepare_moe_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], format=fmt,
                                                activation=act) for act in acts}
        w13_bf16 = w2_bf16 = None
        note = ""
        try:  # the baseline's bf16 weights are ~3.6x the FP4 ones: dequantize per expert
            w13_bf16 = torch.empty(E, 2 * N, K, dtype=torch.bfloat16, device=device)
            w2_bf16 = torch.empty(E, K, N, dtype=torch.bfloat16, device=device)
            for e in range(E):
                s = slice(e, e + 1)
                if fmt == "nvfp4":
                    w13_bf16[s] = formats.dequantize_experts(w["w13"][s], w["w13_scale"][s], w["w13_scale_2"][s])
                    w2_bf16[s] = formats.dequantize_experts(w["w2"][s], w["w2_scale"][s], w["w2_scale_2"][s])
                else:
                    w13_bf16[s] = mxfp4.dequantize_mxfp4_experts(w["w13"][s], w["w13_scale"][s])
                    w2_bf16[s] = mxfp4.dequantize_mxfp4_experts(w["w2"][s], w["w2_scale"][s])
        except torch.OutOfMemoryError:
            w13_bf16 = w2_bf16 = None
            note = f"bf16 baseline skipped: {E} bf16 experts do not fit in device memory"
        return MoeSetup(shape, ep, fmt, weights, w13_bf16, w2_bf16, note, w if keep_raw else None)

    def expert_map(self, device) -> torch.Tensor:
        """Rank 0 of EP: global experts [0, E_local) are local, the rest -1."""
        emap = torch.full((self.shape.n_experts,), -1, dtype=torch.int32, device=device)
        emap[: self.e_local] = torch.arange(self.e_local, dtype=torch.int32, device=device)
        return emap


def moe_inputs(setup: MoeSetup, batch: int, gen: torch.Generator, emap: torch.Tensor) -> dict:
    """Random top-6 routing over the GLOBAL experts (distinct per token); the expert
    map keeps ~1/ep of the slots local, as on one EP rank."""
    device = emap.device
    s = setup.shape
    x = torch.randn(batch, s.hidden, generator=gen, device=device).to(torch.bfloat16)
    tw, ids = torch.rand(batch, s.n_experts, generator=gen, device=device).topk(s.experts_per_token, dim=1)
    return dict(x=x, ids=ids.to(torch.int32), tw=(tw / tw.sum(1, keepdim=True)).float(), emap=emap)


def moe_act_scales(device) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 activation global scales for the W4A4 mode: amax / (6 * 448) of a unit
    normal x (amax ~5) and of a SwiGLU output clamped at 10 (amax ~20 here)."""
    return (torch.tensor([5.0 / 2688], device=device), torch.tensor([20.0 / 2688], device=device))


def dsv4_moe(inp: dict, setup: MoeSetup, activation: str, out: torch.Tensor, act_scales=None) -> None:
    """One routed-MoE call: dsv4.nvfp4_moe for NVFP4 experts (``act_scales`` are W4A4's
    activation global scales), dsv4.routed_moe for MXFP4 ones (W4A8 with vLLM's default
    UE8M0 GEMM1 scales, or W4A16)."""
    common = dict(swiglu_limit=setup.shape.swiglu_limit, expert_map=inp["emap"], out=out, check_ids=False)
    if setup.fmt == "mxfp4":
        routed_moe(inp["x"], inp["ids"], inp["tw"], setup.weights[activation], **common)
        return
    kw = {}
    if activation == "nvfp4":
        kw = dict(a13_scale=act_scales[0], a2_scale=act_scales[1])
    nvfp4_moe(inp["x"], inp["ids"], inp["tw"], setup.weights[activation], activation=activation, **common, **kw)


def moe_bf16_baseline(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      expert_map: Optional[torch.Tensor], w13: torch.Tensor, w2: torch.Tensor,
                      swiglu_limit: Optional[float]) -> torch.Tensor:
    """bf16 grouped-GEMM MoE in torch (the baseline of scripts/bench_moe.py, written
    without host syncs so it can be captured in a CUDA graph): sort slots by local
    expert, ``torch._grouped_mm`` for x @ w13^T, clamped SwiGLU, ``_grouped_mm`` for
    @ w2^T, weighted combine. w13 [E, 2N, K] (gate rows first), w2 [E, K, N] bf16."""
    M, k = topk_ids.shape
    E, N = w13.shape[0], w2.shape[2]
    ids = topk_ids.long()
    local = (expert_map.long()[ids] if expert_map is not None else ids).reshape(-1)
    key = torch.where(local >= 0, local, E)  # non-local slots sort last, past the last group
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    offs = torch.cumsum(counts[:E], 0).to(torch.int32)
    h = torch._grouped_mm(x[order // k], w13.transpose(-2, -1), offs=offs)
    g, u = h[:, :N].float(), h[:, N:].float()
    if swiglu_limit is not None:
        g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
    a = (torch.nn.functional.silu(g) * u).to(torch.bfloat16)
    y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    # rows past the last offset are not computed by _grouped_mm: where() drops them
    valid = (key[order] < E).unsqueeze(1)
    y = torch.where(valid, y.float() * topk_weights.reshape(-1)[order].unsqueeze(1), 0.0)
    out = torch.zeros(M, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, order // k, y)
    return out.to(torch.bfloat16)


def moe_touched(inp: dict, e_local: int) -> tuple[int, int]:
    """(distinct local experts touched, local slots) of one input set (host sync)."""
    local = inp["emap"].long()[inp["ids"].long()]
    local = local[local >= 0]
    return int(torch.unique(local).numel()), int(local.numel())


def moe_expert_bytes(shape: ModelShape, fmt: str) -> float:
    """Weight bytes of one expert: 3*N*K elements; "bf16" 2 B each, "nvfp4" / "mxfp4" the
    codes + block scales (dsv4.bench.inputs.MOE_FORMATS: 9/16 B, 17/32 B)."""
    n = 3 * shape.moe_inter * shape.hidden
    return n * 2 if fmt == "bf16" else n * MOE_FORMATS[fmt][1]


# --------------------------------------------------------------------------------------
# timers
# --------------------------------------------------------------------------------------


def graph_replay_us(fns: Sequence[Callable[[], object]], *, iters: int = 50, warmup: int = 5,
                    flush_l2: bool = True) -> tuple[float, str]:
    """Median microseconds of one call, as a decode step runs it (dsv4.bench.timing, the
    one timer): each input set's call captured once in a CUDA graph and replayed in
    rotation, L2 evicted before each timed replay (in a real step the rest of the model
    streams through L2 between two calls of one layer). Falls back to eager calls if
    capture fails. Returns (us, "cuda-graph" | "eager")."""
    from .bench.timing import time_us

    t = time_us({"f": list(fns)}, iters=iters, warmup=warmup, cold_l2=flush_l2)["f"]
    return t.us, t.method


def cpu_median_us(fns: Sequence[Callable[[], object]], *, iters: int = 3, warmup: int = 1) -> tuple[float, str]:
    """Median wall time of one call on the CPU (rotating input sets)."""
    n = len(fns)
    for i in range(warmup):
        fns[i % n]()
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        fns[i % n]()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, "cpu"


# --------------------------------------------------------------------------------------
# step estimate
# --------------------------------------------------------------------------------------


def step_estimate(layers: dict, attn_us: dict, moe_us: Optional[float]) -> Optional[dict]:
    """Sum over the layer schedule: attention per type x its layer count + routed MoE x
    every layer. ``attn_us`` maps "swa"/"csa"/"hca" to one call's microseconds.
    Returns {"total_us", "swa_us", "csa_us", "hca_us", "moe_us"} (per-step totals per
    component) or None when a needed number is missing."""
    parts = {}
    for kind in ("swa", "csa", "hca"):
        n = layers.get(kind, 0)
        if n == 0:
            parts[kind + "_us"] = 0.0
            continue
        us = attn_us.get(kind)
        if us is None or not math.isfinite(us):
            return None
        parts[kind + "_us"] = n * us
    n_moe = sum(layers.values())
    if moe_us is None or not math.isfinite(moe_us):
        return None
    parts["moe_us"] = n_moe * moe_us
    parts["total_us"] = sum(parts.values())
    return parts
