"""Routed-MoE inputs of every benchmark and the calls made on them.

Experts: ModelOpt NVFP4 or DeepSeek V4's native MXFP4, each in vLLM's stacked layout
(``dsv4.formats``, ``dsv4.formats.mxfp4``), for the local experts of one expert-parallel
rank. Routing: random distinct top-6 over the GLOBAL experts and the expert map of EP
rank 0 (experts [0, E_local) local, the rest -1), so ~6 / ep of a token's routes are local.
The activation modes and their labels come from :mod:`dsv4.moe.modes`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import formats
from ..formats import mxfp4
from ..moe import modes
from .models import BENCH_EP, ModelShape

__all__ = ["random_nvfp4_experts", "random_mxfp4_experts", "random_experts", "quantized_experts", "MOE_WEIGHTS",
           "moe_weights", "MOE_LABELS",
           "MOE_FORMAT_NAMES", "moe_format_list", "moe_cases", "prepare", "MoeSetup", "act_scales", "moe_routing",
           "dsv4_moe", "moe_bf16_baseline"]

NVFP4_KEYS = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")


def random_nvfp4_experts(E: int, N: int, K: int, device, gen: torch.Generator) -> dict:
    """Random ModelOpt NVFP4 experts in vLLM's stacked layout, drawn directly as codes and
    e4m3 block scales (quantizing float weights for 384 experts of Pro takes longer; whether
    the timing depends on the values is what ``compare --moe-weights quantized`` measures).
    Values stay O(0.02) like real weights; equal gate/up global scales."""

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen, device=device)

    def scales(*shape):  # e4m3 block scales in [16, 64)
        return (16 + 48 * torch.rand(shape, generator=gen, device=device)).to(torch.float8_e4m3fn)

    g = torch.full((E,), 2e-4, dtype=torch.float32, device=device)
    return dict(w13=codes(E, 2 * N, K // 2), w13_scale=scales(E, 2 * N, K // 16), w13_scale_2=g,
                w2=codes(E, K, N // 2), w2_scale=scales(E, K, N // 16), w2_scale_2=g.clone())


def random_mxfp4_experts(E: int, N: int, K: int, device, gen: torch.Generator) -> dict:
    """Random MXFP4 experts in vLLM 0.33.0's DeepSeek V4 layout (``Mxfp4MoEMethod``'s
    stacked parameters, ``dsv4.formats.mxfp4``: ``w13`` uint8 [E, 2N, K/2] gate rows then up rows,
    ``w13_scale`` uint8 e8m0 [E, 2N, K/32], ``w2`` uint8 [E, K, N/2], ``w2_scale`` uint8
    [E, K, N/32]), drawn directly as codes and e8m0 bytes in [118, 122] (values O(0.02);
    quantizing float weights would take longer than a sweep). Every block then lies
    within 4 binades of its matrix's largest: every W4A8 path folds them exactly."""
    return mxfp4.random_mxfp4_moe_weights(E, N, K, generator=gen, device=device, quantize=False)


_RANDOM = {"nvfp4": random_nvfp4_experts, "mxfp4": random_mxfp4_experts}


def random_experts(fmt: str, E: int, N: int, K: int, device, seed: int = 1) -> dict:
    """``E`` random experts of ``fmt`` ("nvfp4" or "mxfp4") drawn as codes and scales
    (the decode-step and compare routines' experts)."""
    if fmt not in _RANDOM:
        raise ValueError(f"dsv4: fmt must be one of {', '.join(_RANDOM)}, got {fmt!r}")
    return _RANDOM[fmt](E, N, K, device, torch.Generator(device=device).manual_seed(seed))


def quantized_experts(fmt: str, E: int, N: int, K: int, device) -> dict:
    """``E`` experts of ``fmt`` quantized from random float weights, 8 at a time (seeds
    100, 101, ...; the moe routine's experts). NVFP4 ones carry ModelOpt's activation
    input scales (``w13_input_scale``, ``w2_input_scale``), which W4A4 uses."""
    parts = []
    for i, e0 in enumerate(range(0, E, 8)):
        gen = torch.Generator(device=device).manual_seed(100 + i)
        n = min(8, E - e0)
        parts.append(formats.random_nvfp4_moe_weights(n, N, K, generator=gen, device=device) if fmt == "nvfp4"
                     else mxfp4.random_mxfp4_moe_weights(n, N, K, generator=gen, device=device))
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


# How a benchmark makes its experts (compare --moe-weights): random codes and scale bytes
# (random_experts) or random normal weights quantized to the format (quantized_experts).
# Both sides of a side by side run the same experts. Whether the values move the timing (the
# tensor cores' power draw depends on the operands' bits) is what the choice measures.
MOE_WEIGHTS = ("codes", "quantized")


def moe_weights(kind: str, fmt: str, E: int, N: int, K: int, device) -> dict:
    """``E`` experts of ``fmt`` made the ``kind`` way of :data:`MOE_WEIGHTS`."""
    if kind not in MOE_WEIGHTS:
        raise ValueError(f"dsv4: kind must be one of {', '.join(MOE_WEIGHTS)}, got {kind!r}")
    return random_experts(fmt, E, N, K, device) if kind == "codes" else quantized_experts(fmt, E, N, K, device)


# The MoE cases, (weight format, dsv4 activation mode), and their labels ("NVFP4 W4A16",
# "MXFP4 W4A8", ...), from dsv4.moe.modes.
MOE_LABELS = {(fmt, act): modes.label(fmt, act) for fmt, acts in modes.ACTIVATIONS.items() for act in acts}
# The benchmarks' --moe-format names: "nvfp4" runs the NVFP4 activation modes asked for
# (--activation), an MXFP4 name one mode.
MOE_FORMAT_NAMES = {"nvfp4": None, "mxfp4-w4a8": ("mxfp4", "fp8"), "mxfp4-w4a16": ("mxfp4", "bf16")}


def moe_format_list(text: str) -> list[str]:
    """argparse type of --moe-format: 'nvfp4,mxfp4-w4a8' -> ['nvfp4', 'mxfp4-w4a8'] (order
    kept, repeats dropped); every item one of :data:`MOE_FORMAT_NAMES`."""
    items = [v.strip() for v in text.split(",")]
    bad = [v for v in items if v not in MOE_FORMAT_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(MOE_FORMAT_NAMES)}, got "
                                         f"{text!r}")
    return list(dict.fromkeys(items))


def moe_cases(names, nvfp4_acts=("bf16",)) -> list[tuple[str, str]]:
    """--moe-format names -> the (weight format, activation mode) cases, in order: "nvfp4"
    gives one case per NVFP4 mode in ``nvfp4_acts`` ("bf16" W4A16, "nvfp4" W4A4)."""
    out = []
    for name in names:
        out += [("nvfp4", a) for a in nvfp4_acts] if name == "nvfp4" else [MOE_FORMAT_NAMES[name]]
    return list(dict.fromkeys(out))


def prepare(w: dict, fmt: str, act: str):
    """dsv4's prepared weights of experts ``w`` for activation mode ``act``: one NVFP4
    layout serves both NVFP4 modes (``Nvfp4MoeWeights``, N padded to a multiple of 64:
    V4.1-Flash TP8's 288 -> 320); MXFP4 is prepared per mode."""
    from .. import prepare_moe_weights, prepare_nvfp4_moe_weights

    if fmt == "nvfp4":
        return prepare_nvfp4_moe_weights(*(w[k] for k in NVFP4_KEYS))
    return prepare_moe_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], format=fmt, activation=act)


def act_scales(w: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 activation global scales for the W4A4 mode: the experts' own ModelOpt input
    scales when they carry them (:func:`quantized_experts`), else amax / (6 * 448) of a
    unit normal x (amax ~5) and of a SwiGLU output clamped at 10 (amax ~20)."""
    if "w13_input_scale" in w:
        return w["w13_input_scale"], w["w2_input_scale"]
    return torch.tensor([5.0 / 2688], device=device), torch.tensor([20.0 / 2688], device=device)


@dataclass
class MoeSetup:
    """Experts of one format prepared for each activation mode asked for, their activation
    scales, and their bf16 dequantization for the torch baseline (None when it did not
    fit; ``note`` says so)."""

    fmt: str
    weights: dict  # activation mode -> prepared weights
    scales: tuple  # W4A4's activation global scales (act_scales)
    w13_bf16: Optional[torch.Tensor] = None  # [E, 2N, K]
    w2_bf16: Optional[torch.Tensor] = None  # [E, K, N]
    note: str = ""
    raw: Optional[dict] = field(default=None, repr=False)  # the vLLM-layout experts, when kept

    @staticmethod
    def build(w: dict, fmt: str, acts, *, bf16: bool = True, keep_raw: bool = False) -> "MoeSetup":
        device = w["w13"].device
        prepared = prepare(w, fmt, acts[0]) if fmt == "nvfp4" else None
        s = MoeSetup(fmt, {a: prepared if fmt == "nvfp4" else prepare(w, fmt, a) for a in acts},
                     act_scales(w, device), raw=w if keep_raw else None)
        if bf16:
            s.w13_bf16, s.w2_bf16, s.note = _dequantize_bf16(w, fmt)
        return s


def _dequantize_bf16(w: dict, fmt: str):
    """bf16 copies of w13 [E, 2N, K] and w2 [E, K, N], dequantized per expert (they are
    ~3.6x the FP4 weights); (None, None, why) when they do not fit."""
    E, two_n, half_k = w["w13"].shape
    N, K, device = two_n // 2, 2 * half_k, w["w13"].device
    try:
        w13 = torch.empty(E, 2 * N, K, dtype=torch.bfloat16, device=device)
        w2 = torch.empty(E, K, N, dtype=torch.bfloat16, device=device)
        for e in range(E):
            s = slice(e, e + 1)
            if fmt == "nvfp4":
                w13[s] = formats.dequantize_experts(w["w13"][s], w["w13_scale"][s], w["w13_scale_2"][s])
                w2[s] = formats.dequantize_experts(w["w2"][s], w["w2_scale"][s], w["w2_scale_2"][s])
            else:
                w13[s] = mxfp4.dequantize_mxfp4_experts(w["w13"][s], w["w13_scale"][s])
                w2[s] = mxfp4.dequantize_mxfp4_experts(w["w2"][s], w["w2_scale"][s])
    except torch.OutOfMemoryError:
        return None, None, f"bf16 baseline skipped: {E} bf16 experts do not fit in device memory"
    return w13, w2, ""


ROUTINGS = ("uniform", "balanced")


def moe_routing(model: ModelShape, M: int, gen: torch.Generator, device=None, ep: int = BENCH_EP,
                routing: str = "uniform") -> dict:
    """Inputs of one routed-MoE call for ``M`` tokens, drawn with ``gen`` on its device,
    then moved to ``device`` (default: the generator's): ``x`` bf16 [M, K], distinct top-k
    ``ids`` int32 [M, k] over the global experts with normalised ``tw`` fp32 [M, k], and
    ``emap`` int32 [E_global] of EP rank 0. ``n_local`` = local (token, expert) routes,
    ``touched`` = distinct local experts used (host sync).

    ``routing``: "uniform" draws each token's experts at random (the top-k of random
    scores); "balanced" sends token m to experts (k * m + j) mod E_global, j < k, so every
    expert gets M * k / E_global slots (exactly when E_global divides M * k, else within
    one): token tiles then fill exactly where that count is a multiple of the tile, which
    isolates what a partial last tile costs (docs/perf-history/2026-12-06-mxfp4-w4a8-remainder-tiles.md)."""
    if routing not in ROUTINGS:
        raise ValueError(f"dsv4: routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    device = gen.device if device is None else device
    e_local, k = model.local_experts(ep), model.experts_per_token
    x = torch.randn(M, model.hidden, generator=gen, device=gen.device).to(torch.bfloat16)
    tw, ids = torch.rand(M, model.n_experts, generator=gen, device=gen.device).topk(k, dim=1)
    if routing == "balanced":
        ids = (torch.arange(M, device=gen.device)[:, None] * k + torch.arange(k, device=gen.device)) % model.n_experts
    tw = (tw / tw.sum(1, keepdim=True)).float()
    emap = torch.full((model.n_experts,), -1, dtype=torch.int32, device=device)
    emap[:e_local] = torch.arange(e_local, dtype=torch.int32, device=device)
    local = ids[ids < e_local]
    return dict(x=x.to(device), ids=ids.to(torch.int32).to(device), tw=tw.to(device), emap=emap,
                n_local=int(local.numel()), touched=int(torch.unique(local).numel()))


def dsv4_moe(inp: dict, fmt: str, act: str, prepared, out: torch.Tensor, *, swiglu_limit: float,
             scales: Optional[tuple] = None, cta="auto") -> torch.Tensor:
    """One dsv4 routed-MoE call on :func:`moe_routing` inputs: ``dsv4.nvfp4_moe`` for NVFP4
    experts (mode ``act``; W4A4 takes ``scales``, :func:`act_scales`), ``dsv4.routed_moe``
    for MXFP4 ones (the mode they were prepared for)."""
    from .. import nvfp4_moe, routed_moe

    common = dict(swiglu_limit=swiglu_limit, expert_map=inp["emap"], cta_mode=cta, out=out, check_ids=False)
    if fmt == "mxfp4":
        return routed_moe(inp["x"], inp["ids"], inp["tw"], prepared, **common)
    kw = dict(a13_scale=scales[0], a2_scale=scales[1]) if act == "nvfp4" else {}
    return nvfp4_moe(inp["x"], inp["ids"], inp["tw"], prepared, activation=act, **common, **kw)


def moe_bf16_baseline(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      expert_map: Optional[torch.Tensor], w13: torch.Tensor, w2: torch.Tensor,
                      swiglu_limit: Optional[float]) -> torch.Tensor:
    """bf16 grouped-GEMM MoE in torch, written without host syncs so it can be captured in
    a CUDA graph: sort slots by local expert, ``torch._grouped_mm`` for x @ w13^T, clamped
    SwiGLU, ``_grouped_mm`` for @ w2^T, weighted combine. w13 [E, 2N, K] (gate rows
    first), w2 [E, K, N] bf16. Returns bf16 [M, K]."""
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
