"""The decode-step routine's results: step estimates (the sum over a model's layer
schedule), the tables (:mod:`dsv4.bench.report`) and the notes printed under them.

A ``--cpu-reference`` run shows this machinery on the CPU with dsv4's float32 reference
kernels; its times are wall clock of tiny shapes, not performance, so its tables carry
no speedup or rate columns and say so in their titles."""

from __future__ import annotations

import math
from typing import Optional

from ..cases import attention_keys
from ..experts import MOE_LABELS
from ..incumbents import MOE_INCUMBENTS
from ..models import KINDS
from ..report import Table, fmt_ctx, fmt_ms, fmt_ratio, fmt_us
from .decode_step_sweep import KIND_LABEL, N_SETS_GPU, Sweep

# What the step estimate leaves out (printed and written to the JSON).
NOT_INCLUDED = [
    "indexer (CSA top-k selection) and compressor (building compressed KV entries)",
    "attention projections (q/kv down and up projections, grouped output projection), RoPE, norms",
    "KV cache writes",
    "shared expert, router/gate, routed_scaling_factor",
    "mHC hyper-connections, embedding, LM head, MTP layer, sampling",
    "expert-parallel all-to-all / all-reduce communication",
]
CPU_LINE = ("CPU reference run: it shows the tables, JSON and plots on the CPU, with tiny shapes and dsv4's float32 "
            "reference kernels beside torch's bf16 ops; its times are CPU wall time, not performance, and no "
            "speedups are shown.")


def step_estimate(layers: dict, attn_us: dict, moe_us: Optional[float]) -> Optional[dict]:
    """Sum over the layer schedule: attention per type x its layer count + routed MoE x
    every layer. ``attn_us`` maps "swa"/"csa"/"hca" to one call's microseconds.
    Returns {"total_us", "swa_us", "csa_us", "hca_us", "moe_us"} (per-step totals per
    component) or None when a needed number is missing."""
    parts = {}
    for kind in KINDS:
        n = layers.get(kind, 0)
        if n == 0:
            parts[kind + "_us"] = 0.0
            continue
        us = attn_us.get(kind)
        if us is None or not math.isfinite(us):
            return None
        parts[kind + "_us"] = n * us
    if moe_us is None or not math.isfinite(moe_us):
        return None
    parts["moe_us"] = sum(layers.values()) * moe_us
    parts["total_us"] = sum(parts.values())
    return parts


def find(rows, **key):
    for r in rows:
        if all(r.get(k) == v for k, v in key.items()):
            return r
    return None


def step_rows(sweep: Sweep) -> list[dict]:
    """One row per (model, MoE case, context, batch): the step estimate of each side."""
    out = []
    a = sweep.args
    for m in a.models:
        layers = sweep.shapes[m].layers
        for fmt, act in a.moe:
            for ctx in a.context:
                for b in a.batch:
                    row = dict(model=m, format=fmt, activation=act, batch=b, context=ctx, layers=dict(layers))
                    for impl in ("dsv4", "torch", "vllm"):
                        attn = {}
                        for kind in KINDS:
                            r = find(sweep.rows, model=m, component="attn_" + kind, batch=b,
                                     context=None if kind == "swa" else ctx)
                            attn[kind] = r.get(impl + "_us") if r else None
                        moe = find(sweep.rows, model=m, component="moe", format=fmt, activation=act, batch=b)
                        row[impl] = step_estimate(layers, attn, moe.get(impl + "_us") if moe else None)
                    d, t, v = row["dsv4"], row["torch"], row["vllm"]
                    # a CPU reference run times reference kernels against torch: no speedup
                    row["speedup"] = t["total_us"] / d["total_us"] if d and t and not sweep.cpu else None
                    row["vllm_ratio"] = v["total_us"] / d["total_us"] if d and v else None
                    out.append(row)
    return out


def component_label(sweep: Sweep, r: dict) -> str:
    s = sweep.shapes[r["model"]]
    if r["component"] == "moe":
        return (f"MoE {MOE_LABELS[(r['format'], r['activation'])]}, EP{sweep.args.ep} "
                f"({s.local_experts(sweep.args.ep)} local)")
    kind = r["component"][5:]
    k_win, k_comp = attention_keys(kind, s, r["context"] or max(sweep.args.context))
    keys = f"{k_win}" if kind == "swa" else f"{k_win}+{k_comp}"
    return f"{KIND_LABEL[kind]} {fmt_ctx(r['context'])} ({keys} keys)"


def _pair(d, t, ratio: Optional[float], fmt=fmt_us) -> str:
    return f"{fmt(d)} / {fmt(t)}" + (f" ({fmt_ratio(ratio)})" if ratio else "")


def build_tables(sweep: Sweep, steps: list[dict], copy_tbps) -> tuple[list, list]:
    """(summary tables, detail tables) of :mod:`dsv4.bench.report`."""
    a, cpu = sweep.args, sweep.cpu
    summary, detail = [], []
    if cpu:
        layer_title = "one layer, CPU wall time in us, dsv4 float32 reference kernels / torch bf16 (not performance)"
        step_title = "decode step estimate, CPU wall time in ms, reference / torch (not performance)"
    else:
        layer_title = "one layer, us, dsv4 / torch baseline (speedup)"
        step_title = "decode step estimate, ms, dsv4 / torch (speedup)"
    cols = lambda first: [first] + [f"B={b}" for b in a.batch]  # noqa: E731
    for m in a.models:
        s = sweep.shapes[m]
        mine = [r for r in sweep.rows if r["model"] == m]
        labels = list(dict.fromkeys(component_label(sweep, r) for r in mine))
        by = {(component_label(sweep, r), r["batch"]): r for r in mine}
        rows = []
        for lab in labels:
            cells = [lab]
            for b in a.batch:
                r = by.get((lab, b))
                if r is None or r.get("dsv4_us") is None:
                    cells.append("error" if r is not None and r.get("error") else "-")
                    continue
                t = r.get("torch_us")
                cells.append(_pair(r["dsv4_us"], t, t / r["dsv4_us"] if t and not cpu else None))
            rows.append(cells)
        summary.append(Table(f"{s.name}: {layer_title}", cols("component"), rows))
        lay = s.layers
        for case in a.moe:
            rows = []
            for ctx in a.context:
                cells = [fmt_ctx(ctx)]
                for b in a.batch:
                    st = find(steps, model=m, format=case[0], activation=case[1], batch=b, context=ctx)
                    d, t = st["dsv4"], st["torch"]
                    cells.append(_pair(d and d["total_us"], t and t["total_us"], st["speedup"], fmt_ms))
                rows.append(cells)
            summary.append(Table(f"{s.name}: {step_title}, MoE {MOE_LABELS[case]}", cols("context"), rows,
                                 f"{lay['swa']} SWA + {lay['csa']} CSA + {lay['hca']} HCA attention layers, "
                                 f"{sum(lay.values())} routed-MoE layers; kernels only (see 'not included')"))
        if a.vs and any(r.get("vllm_us") for r in mine):
            summary += _vllm_tables(sweep, steps, m, labels, by)
        detail.append(_detail_table(sweep, m, mine, copy_tbps))
    return summary, detail


def _vllm_tables(sweep: Sweep, steps: list[dict], m: str, labels: list, by: dict) -> list:
    a, s = sweep.args, sweep.shapes[m]
    rows = []
    for lab in labels:
        cells = [lab]
        for b in a.batch:
            r = by.get((lab, b))
            v = r.get("vllm_us") if r else None
            cells.append(f"{fmt_us(r['dsv4_us'])} / {fmt_us(v)} ({v / r['dsv4_us']:.2f}x)" if v else "-")
        rows.append(cells)
    out = [Table(f"{s.name}: one layer, us, dsv4 / vLLM 0.33 kernels (ratio = vLLM / dsv4)",
                 ["component"] + [f"B={b}" for b in a.batch], rows,
                 "vLLM 0.33 kernels: FlashMLA SM90 sparse decode (attention); Humming W4A16 (NVFP4 W4A16) and "
                 "Humming W4A8 (MXFP4 W4A8, with vLLM's GEMM1 input quantization) for the MoE, their GEMMs + "
                 "activation only; same inputs, same timer call")]
    for case in a.moe:
        if not any(r.get("vllm_us") for r in sweep.rows if r["model"] == m and r["component"] == "moe"
                   and (r["format"], r["activation"]) == case):
            continue
        rows = []
        for ctx in a.context:
            cells = [fmt_ctx(ctx)]
            for b in a.batch:
                st = find(steps, model=m, format=case[0], activation=case[1], batch=b, context=ctx)
                d, v = st["dsv4"], st["vllm"]
                cells.append(f"{fmt_ms(d and d['total_us'])} / {fmt_ms(v and v['total_us'])}"
                             + (f" ({st['vllm_ratio']:.2f}x)" if st["vllm_ratio"] else ""))
            rows.append(cells)
        out.append(Table(f"{s.name}: decode step estimate, ms, dsv4 / vLLM 0.33 kernels (ratio), MoE "
                         f"{MOE_LABELS[case]} vs {MOE_INCUMBENTS[case]}", ["context"] + [f"B={b}" for b in a.batch],
                         rows, "the same sum over the layer schedule with each layer's incumbent time"))
    return out


def _detail_table(sweep: Sweep, m: str, mine: list, copy_tbps) -> Table:
    cpu = sweep.cpu
    unit = "us (CPU)" if cpu else "us"
    rows = []
    for r in mine:
        d, t = r.get("dsv4_us"), r.get("torch_us")
        diff = r.get("max_abs_diff", r.get("rel_diff"))
        note = r.get("error") or r.get("torch_note") or ""
        if r.get("dsv4_timing") == "eager" or r.get("torch_timing") == "eager":
            note = (note + " eager timing (graph capture failed)").strip()
        cells = [component_label(sweep, r), str(r["batch"]), fmt_us(d)]
        if not cpu:
            pct = f"{100 * r['tbps'] / copy_tbps:.0f}%" if copy_tbps and r.get("tbps") else "-"
            cells += [f"{r['tbps']:.2f}" if r.get("tbps") else "-", pct,
                      f"{r['tflops']:.1f}" if r.get("tflops") else "-"]
        cells.append(fmt_us(t))
        if not cpu:
            cells.append(fmt_ratio(t / d) if d and t else "-")
        cells.append("-" if diff is None else f"{diff:.2g}")
        if not cpu:
            cells += [fmt_us(r.get("vllm_us")), f"{r['vllm_us'] / d:.2f}x" if d and r.get("vllm_us") else "-"]
        rows.append(cells + [note])
    if cpu:
        header = ["component", "B", f"reference {unit}", f"torch {unit}", "diff", "note"]
        caption = ("CPU wall time of tiny shapes, not performance; diff = max |reference - torch| (attention) or "
                   "max |diff| / max |torch| (MoE)")
    else:
        header = ["component", "B", f"dsv4 {unit}", "TB/s", "% copy", "TFLOP/s", f"torch {unit}", "speedup", "diff",
                  "vLLM us", "vs vLLM", "note"]
        caption = ("TB/s = bytes read (cache rows / touched FP4 experts) + q/out per time; % of the device copy "
                   "bandwidth measured in this run; diff = max |dsv4 - torch| (attention) or max |diff| / max "
                   "|torch| (MoE)")
    return Table(f"{sweep.shapes[m].name}: all cases", header, rows, caption)


def notes(sweep: Sweep) -> list[str]:
    a = sweep.args
    out = []
    if sweep.cpu:
        out.append(CPU_LINE + " Tiny shapes: hidden 256, intermediate 128, top-k / 16.")
    else:
        out.append(f"timing: each input set's call captured in a CUDA graph; {a.iters} replays over "
                   f"{N_SETS_GPU} rotating input sets, the mean of each set's median, L2 evicted before each "
                   "replay (in a real step the rest of the model streams through L2 between two calls of a layer).")
    out.append("attention: fp8_ds_mla paged caches in vLLM's block sizes (window and C4A pools: 64 entries per "
               "block, C128A pool: 2), shared by all sequences, slot ids drawn at random offsets; torch baseline = "
               "bf16 gather + bf16 matmuls + fp32 softmax with the sink, over a bf16 copy of the same cache rows.")
    out.append(f"MoE: one token per sequence (B tokens per call), random top-6 routing over all experts, expert map = "
               f"rank 0 of EP{a.ep} (~6/{a.ep} local slots per token); torch baseline = bf16 torch._grouped_mm MoE "
               "over the dequantized local experts.")
    if any(f == "mxfp4" for f, _ in a.moe):
        out.append("MXFP4 experts: DeepSeek V4's native format in vLLM's layout (e2m1 codes, one e8m0 scale per 32), "
                   "random codes and scales; W4A8 quantizes GEMM1's input and the SwiGLU output to FP8 per token and "
                   "128 elements (GEMM1 scales rounded up to powers of two, vLLM 0.33.0's Hopper default), W4A16 "
                   "keeps bf16 activations.")
    if sweep.vs_line:
        out.append(sweep.vs_line)
    out.append("step estimate = sum over the layer schedule of one attention call per layer (its type) + one "
               "routed-MoE call per layer; not included: " + "; ".join(NOT_INCLUDED) + ".")
    return out
