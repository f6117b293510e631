"""dsv4 side by side with the kernels vLLM 0.33.0 runs on Hopper (FlashMLA SM90, Humming).

    python -m dsv4.bench.compare [--anchors DIR[:DIR]] [--only decode,prefill,moe]
        [--models flash,pro] [--batch 1,2,...] [--context 4K,32K,128K] [--tokens 4096,16384]
        [--moe-models flash,pro,v41flash] [--moe-m 1,8,...] [--moe-format nvfp4,mxfp4-w4a8]
        [--iters 30] [--json PATH] [--dry-run]

Every case: dsv4 and the incumbent timed in the same :func:`dsv4.bench.timing.time_us`
call (same inputs, same process, interleaved, CUDA-graph replay, cold L2), the ratio
``incumbent us / dsv4 us`` (> 1: dsv4 faster), and the largest output difference of the
two on that case's first input set. MoE: NVFP4 W4A16 vs Humming W4A16 and MXFP4 W4A8
(DeepSeek V4's native experts) vs Humming W4A8, the two paths vLLM 0.33.0 takes on
Hopper. Without the incumbents (see :mod:`dsv4.bench.anchors`) dsv4 runs alone and one
line says why; ``--dry-run`` lists the cases and the incumbents found without a GPU.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from typing import Optional

import torch

from . import inputs as I
from .anchors import Anchors, find_anchors
from .incumbents import MOE_INCUMBENTS

SCALE = 512**-0.5
DEFAULT_BATCH = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DEFAULT_CONTEXT = [4096, 32768, 131072]
DEFAULT_TOKENS = [4096, 16384]
DEFAULT_MOE_M = [1, 8, 32, 64, 128, 512, 2048, 8192, 16384]
N_SETS = 4


def _ctx(text: str) -> int:
    t = text.strip().upper()
    mult = 1 << 10 if t.endswith("K") else 1 << 20 if t.endswith("M") else 1
    return int(t.rstrip("KM")) * mult


def _list(text: str, conv=int) -> list:
    vals = [v.strip() for v in text.split(",")]
    if not vals or any(not v for v in vals):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list without empty items, got {text!r}")
    try:
        out = [conv(v) for v in vals]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of sizes, got {text!r}") from None
    if conv is not str and any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return out


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


# --------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------


def decode_rows(anchors: Anchors, models, kinds, batches, contexts, iters: int,
                invariant: bool = False) -> list[dict]:
    from ..attention import sparse_mqa_decode
    from .incumbents import FlashMLADecode
    from .timing import time_us

    dev = "cuda"
    pools = I.DecodePools.for_cases(max(batches), max(contexts), dev)
    rows = []
    for mname in models:
        m = I.ATTN_MODELS[mname]
        for kind in kinds:
            for ctx in (contexts if kind != "swa" else [contexts[0]]):
                for b in batches:
                    gen = torch.Generator(device=dev).manual_seed(1000 * b + ctx % 997)
                    sets = [I.decode_case(kind, m, b, ctx, pools, gen) for _ in range(N_SETS)]
                    outs = {k: [torch.empty_like(s["q"]) for s in sets] for k in ("dsv4", "flashmla", "inv")}

                    def ours(s, o, inv=False):
                        return lambda: sparse_mqa_decode(s["q"], s["swa_cache"], s["swa_idx"], s["swa_len"],
                                                         s["sink"], SCALE, extra_kv_cache=s["extra_cache"],
                                                         extra_indices=s["extra_idx"],
                                                         extra_topk_length=s["extra_len"], out=o,
                                                         batch_invariant=inv)

                    variants = {"dsv4": [ours(s, o) for s, o in zip(sets, outs["dsv4"])]}
                    if invariant:
                        variants["inv"] = [ours(s, o, True) for s, o in zip(sets, outs["inv"])]
                    if anchors.flashmla:
                        variants["flashmla"] = [FlashMLADecode(s, SCALE, o) for s, o in zip(sets, outs["flashmla"])]
                    t = time_us(variants, iters=iters)
                    keys = sets[0]["keys"]
                    flops = 2 * m.heads * 2 * 512 * keys * b
                    nbytes = b * (keys * (584 + 4) + 2 * m.heads * 512 * 2 + m.heads * 4)
                    row = dict(op="decode", model=m.name, kind=kind, context=ctx if kind != "swa" else None,
                               batch=b, keys=keys, dsv4_us=t["dsv4"].us, method=t["dsv4"].method,
                               tflops=flops / (t["dsv4"].us * 1e-6) / 1e12,
                               tbps=nbytes / (t["dsv4"].us * 1e-6) / 1e12)
                    if "inv" in t:
                        row.update(invariant_us=t["inv"].us, invariant_cost=t["inv"].us / t["dsv4"].us)
                    if "flashmla" in t:
                        row.update(incumbent="FlashMLA", incumbent_us=t["flashmla"].us,
                                   ratio=t["flashmla"].us / t["dsv4"].us,
                                   maxdiff=_maxdiff(outs["dsv4"][0], outs["flashmla"][0]))
                    rows.append(row)
                    print(_line(row), flush=True)
    del pools
    torch.cuda.empty_cache()
    return rows


def prefill_rows(anchors: Anchors, models, tokens, iters: int, copy_tbps: float) -> list[dict]:
    from ..attention import sparse_mqa_prefill
    from .incumbents import flashmla_prefill
    from .timing import time_us

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(7)
    kv = torch.randn(1 << 16, 512, generator=gen, device=dev).to(torch.bfloat16)  # 64 MB > L2
    rows = []
    for mname in models:
        m = I.ATTN_MODELS[mname]
        for T in tokens:
            sets = [I.prefill_case(m, T, 0, gen, dev, kv=kv) for _ in range(2)]
            outs = {k: [torch.empty_like(s["q"]) for s in sets] for k in ("dsv4", "flashmla")}
            variants = {"dsv4": [(lambda s=s, o=o: sparse_mqa_prefill(s["q"], s["kv"], s["idx"], s["lens"],
                                                                       s["sink"], SCALE, out=o))
                                 for s, o in zip(sets, outs["dsv4"])]}
            if anchors.flashmla:
                variants["flashmla"] = [(lambda s=s, o=o: flashmla_prefill(s["q"], s["kv"], s["idx"], s["lens"],
                                                                            s["sink"], SCALE, o))
                                        for s, o in zip(sets, outs["flashmla"])]
            t = time_us(variants, iters=iters)
            topk = sets[0]["topk"]
            flops = 2 * m.heads * 2 * 512 * topk * T
            # vLLM gathers and dequantizes the KV rows a prefill chunk can reference into the
            # bf16 workspace first (a CuTe-DSL/Triton kernel not runnable without vLLM): its
            # cost here is a bandwidth estimate, fp8 rows read + bf16 rows written at the
            # measured copy rate, for a fresh T-token request (T window rows + T/4 compressed).
            gather_us = (T + T // 4) * (584 + 1024) / (copy_tbps * 1e12) * 1e6
            row = dict(op="prefill", model=m.name, kind=f"topk {topk}", context=None, batch=T, keys=topk,
                       dsv4_us=t["dsv4"].us, method=t["dsv4"].method, tflops=flops / (t["dsv4"].us * 1e-6) / 1e12,
                       gather_est_us=gather_us)
            if "flashmla" in t:
                fm = t["flashmla"].us
                row.update(incumbent="FlashMLA", incumbent_us=fm, ratio=fm / t["dsv4"].us,
                           ratio_with_gather=(fm + gather_us) / (t["dsv4"].us + gather_us),
                           maxdiff=_maxdiff(outs["dsv4"][0], outs["flashmla"][0]))
            rows.append(row)
            print(_line(row), flush=True)
    return rows


DEFAULT_MOE_FORMATS = ["nvfp4", "mxfp4-w4a8"]
MOE_FORMAT_CHOICES = ("nvfp4", "mxfp4-w4a8", "mxfp4-w4a16")  # all have an incumbent (MOE_INCUMBENTS)
NVFP4_KEYS = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")


def moe_rows(anchors: Anchors, models, Ms, iters: int, cases=(("nvfp4", "bf16"),)) -> list[dict]:
    from .. import nvfp4_moe, prepare_moe_weights, prepare_nvfp4_moe_weights, routed_moe
    from .incumbents import HummingW4A8, HummingW4A16, moe_incumbent_missing
    from .timing import time_us

    dev = "cuda"
    rows = []
    for case in cases:
        fmt, act = case
        kind, inc_name = I.MOE_LABELS[case], MOE_INCUMBENTS[case]
        for mname in models:
            m = I.MOE_MODELS[mname]
            w = I.moe_experts(m, dev, fmt=fmt)
            if fmt == "nvfp4":
                prepared = prepare_nvfp4_moe_weights(*(w[k] for k in NVFP4_KEYS))
                op = nvfp4_moe
            else:
                prepared = prepare_moe_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], format=fmt,
                                               activation=act)
                op = routed_moe
            hum, why = None, moe_incumbent_missing(anchors, case)
            if why is None:
                try:
                    hum = (HummingW4A16 if fmt == "nvfp4" else HummingW4A8)(w, m.E_global, m.swiglu_limit)
                except Exception as e:  # report, keep dsv4's numbers
                    why = f"{inc_name} conversion failed: {type(e).__name__}: {e}"
                    print(f"{m.name}: {why}", flush=True)
            del w
            for M in Ms:
                sets = [I.moe_routing(m, M, dev, seed) for seed in range(N_SETS)]
                outs = [torch.empty(M, m.K, dtype=torch.bfloat16, device=dev) for _ in sets]
                variants = {"dsv4": [(lambda s=s, o=o: op(s["x"], s["ids"], s["tw"], prepared, expert_map=s["emap"],
                                                          swiglu_limit=m.swiglu_limit, check_ids=False, out=o))
                                     for s, o in zip(sets, outs)]}
                plans = None
                if hum is not None:
                    try:
                        plans = [hum.plan(s["ids"], s["emap"]) for s in sets]
                        variants["humming"] = [(lambda s=s, p=p: hum.experts(s["x"], p)) for s, p in zip(sets, plans)]
                    except Exception as e:
                        why = f"{inc_name} failed at M={M}: {type(e).__name__}: {e}"
                        print(why, flush=True)
                        plans = None
                t = time_us(variants, iters=iters)
                n_local = sum(s["n_local"] for s in sets) / N_SETS
                touched = sum(s["touched"] for s in sets) / N_SETS
                flops = n_local * 6 * m.K * m.N
                wbytes = touched * 3 * m.N * m.K * I.MOE_FORMATS[fmt][1]
                row = dict(op="moe", model=m.name, kind=kind, format=fmt, activation=act, context=None, batch=M,
                           keys=None, dsv4_us=t["dsv4"].us, method=t["dsv4"].method,
                           tflops=flops / (t["dsv4"].us * 1e-6) / 1e12, tbps=wbytes / (t["dsv4"].us * 1e-6) / 1e12)
                if "humming" in t:
                    ref = hum(sets[0]["x"], sets[0]["tw"], plans[0])
                    row.update(incumbent=inc_name, incumbent_us=t["humming"].us,
                               ratio=t["humming"].us / t["dsv4"].us, maxdiff=_maxdiff(outs[0], ref),
                               rel_l2=float((outs[0].float() - ref.float()).norm()
                                            / ref.float().norm().clamp_min(1e-30)))
                elif why:
                    row["missing"] = why
                rows.append(row)
                print(_line(row), flush=True)
            del prepared, hum
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------


def _fmt_case(r: dict) -> str:
    if r["op"] == "decode":
        ctx = f" {r['context'] // 1024}K" if r["context"] else ""
        return f"{r['model']} {r['kind'].upper()}{ctx} B={r['batch']}"
    if r["op"] == "prefill":
        return f"{r['model']} prefill {r['kind']} T={r['batch']}"
    return f"{r['model']} {r['kind']} M={r['batch']}"


def _line(r: dict) -> str:
    s = f"{_fmt_case(r)}: dsv4 {r['dsv4_us']:.1f} us"
    if "ratio" in r:
        s += f", {r['incumbent']} {r['incumbent_us']:.1f} us, ratio {r['ratio']:.2f}x, max|diff| {r['maxdiff']:.3g}"
    if "invariant_us" in r:
        s += f", batch-invariant {r['invariant_us']:.1f} us ({r['invariant_cost']:.2f}x dsv4)"
    return s


def render(rows: list[dict], anchors_line: str, ceilings: Optional[dict] = None) -> str:
    """The comparison table (rich, plain text), the incumbents line first."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dsv4 vs the kernels vLLM 0.33.0 runs on Hopper (ratio = incumbent us / dsv4 us)")
    for col in ("case", "dsv4 us", "TFLOP/s", "incumbent", "incumbent us", "ratio", "max|diff|"):
        table.add_column(col, justify="left" if col in ("case", "incumbent") else "right")
    for r in rows:
        have = "ratio" in r
        table.add_row(_fmt_case(r), f"{r['dsv4_us']:.1f}" if r.get("dsv4_us") is not None else "-",
                      f"{r['tflops']:.0f}" if r.get("tflops") is not None else "-",
                      r.get("incumbent", "missing"), f"{r['incumbent_us']:.1f}" if have else "-",
                      f"{r['ratio']:.2f}x" if have else "-", f"{r['maxdiff']:.3g}" if have else "-")
    console = Console(record=True, width=140, file=io.StringIO())  # the caller prints the export
    console.print(anchors_line)
    if ceilings:
        console.print("ceilings (same process): " + ", ".join(f"{k} {v:.2f}" for k, v in ceilings.items()))
    console.print(table)
    return console.export_text()


def markdown(rows: list[dict], ceilings: Optional[dict] = None) -> str:
    """Markdown tables of compared rows, one per op (docs/perf.md's side-by-side tables)."""
    out = []
    if ceilings:
        out.append("Ceilings measured in the same process: " + ", ".join(f"{k} {v:.2f}" for k, v in ceilings.items())
                   + ".\n")
    moe_kinds = list(dict.fromkeys(r["kind"] for r in rows if r["op"] == "moe"))
    sections = [("decode", None, "Decode attention (s_q = 1), dsv4 vs FlashMLA SM90"),
                ("prefill", None, "Sparse prefill, dsv4 vs FlashMLA SM90")]
    sections += [("moe", k, f"Routed-expert MoE ({k}), dsv4 vs {_moe_incumbent_label(k)}") for k in moe_kinds]
    for op, kind, title in sections:
        sel = [r for r in rows if r["op"] == op and (kind is None or r["kind"] == kind)]
        if not sel:
            continue
        out.append(f"#### {title}\n")
        if op == "decode":
            out.append("| model | layer | context | B | dsv4 us | FlashMLA us | ratio | dsv4 TFLOP/s | % bf16 peak |")
            out.append("|---|---|---|---:|---:|---:|---:|---:|---:|")
            for r in sel:
                ctx = f"{r['context'] // 1024}K" if r.get("context") else "any"
                out.append(f"| {r['model']} | {r['kind'].upper()} | {ctx} | {r['batch']} | {r['dsv4_us']:.1f} | "
                           f"{r.get('incumbent_us', float('nan')):.1f} | {_ratio(r)} | {r['tflops']:.0f} | "
                           f"{r.get('pct_gemm', float('nan')):.0f} |")
        elif op == "prefill":
            out.append("| model | indices | T | dsv4 us | FlashMLA us | ratio | ratio incl. gather (est.) | "
                       "dsv4 TFLOP/s | % bf16 peak |")
            out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
            for r in sel:
                rg = f"{r['ratio_with_gather']:.2f}x" if "ratio_with_gather" in r else "-"
                out.append(f"| {r['model']} | {r['keys']} | {r['batch']} | {r['dsv4_us']:.1f} | "
                           f"{r.get('incumbent_us', float('nan')):.1f} | {_ratio(r)} | {rg} | {r['tflops']:.0f} | "
                           f"{r.get('pct_gemm', float('nan')):.0f} |")
        else:
            out.append("| experts | M | dsv4 us | Humming us | ratio | dsv4 TFLOP/s | % bf16 peak | dsv4 TB/s "
                       "(weights) | % copy | rel. L2 vs Humming |")
            out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for r in sel:
                l2 = f"{r['rel_l2']:.1e}" if "rel_l2" in r else "-"
                out.append(f"| {r['model']} | {r['batch']} | {r['dsv4_us']:.1f} | "
                           f"{r.get('incumbent_us', float('nan')):.1f} | {_ratio(r)} | {r['tflops']:.0f} | "
                           f"{r.get('pct_gemm', float('nan')):.0f} | {r['tbps']:.2f} | "
                           f"{r.get('pct_copy', float('nan')):.0f} | {l2} |")
        out.append("")
    return "\n".join(out)


def _moe_incumbent_label(kind: str) -> str:
    return next((v for case, v in MOE_INCUMBENTS.items() if I.MOE_LABELS[case] == kind), "no incumbent")


def _ratio(r: dict) -> str:
    if "ratio" not in r:
        return "-"
    return f"**{r['ratio']:.2f}x**" if r["ratio"] < 1.0 else f"{r['ratio']:.2f}x"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dsv4.bench.compare", description=__doc__.splitlines()[0])
    ap.add_argument("--anchors", default=None, help="anchor folders (os.pathsep-separated); else $DSV4_ANCHORS")
    ap.add_argument("--only", type=lambda s: _list(s, str), default=["decode", "prefill", "moe"])
    ap.add_argument("--models", type=lambda s: _list(s, str), default=["flash", "pro"])
    ap.add_argument("--kinds", type=lambda s: _list(s, str), default=["swa", "csa", "hca"])
    ap.add_argument("--batch", type=_list, default=DEFAULT_BATCH)
    ap.add_argument("--context", type=lambda s: _list(s, _ctx), default=DEFAULT_CONTEXT)
    ap.add_argument("--tokens", type=_list, default=DEFAULT_TOKENS)
    ap.add_argument("--moe-models", type=lambda s: _list(s, str), default=["flash", "pro", "v41flash"])
    ap.add_argument("--moe-m", type=_list, default=DEFAULT_MOE_M)
    ap.add_argument("--moe-format", type=I.moe_format_list, default=DEFAULT_MOE_FORMATS,
                    help="MoE row sets: nvfp4 (NVFP4 W4A16 vs Humming W4A16), mxfp4-w4a8 (MXFP4 W4A8 vs Humming "
                         "W4A8), mxfp4-w4a16 (MXFP4 W4A16 vs Humming W4A8, what vLLM runs for MXFP4 "
                         "checkpoints); default nvfp4,mxfp4-w4a8")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--batch-invariant", action="store_true",
                    help="decode: also time sparse_mqa_decode(batch_invariant=True) in the same call")
    ap.add_argument("--json", default=None, help="write rows, ceilings and the incumbents line here")
    ap.add_argument("--markdown", default=None, help="also write the tables as markdown here")
    ap.add_argument("--from-json", default=None, help="render the tables of an earlier --json run; time nothing")
    ap.add_argument("--dry-run", action="store_true", help="list the cases and the incumbents; time nothing")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name, vals, allowed in (("--only", args.only, ("decode", "prefill", "moe")),
                                ("--models", args.models, tuple(I.ATTN_MODELS)),
                                ("--kinds", args.kinds, ("swa", "csa", "hca")),
                                ("--moe-models", args.moe_models, tuple(I.MOE_MODELS)),
                                ("--moe-format", args.moe_format, MOE_FORMAT_CHOICES)):
        bad = [v for v in vals if v not in allowed]
        if bad:
            print(f"dsv4.bench.compare: {name} takes {', '.join(allowed)}; got {', '.join(bad)}", file=sys.stderr)
            return 2
    if args.from_json:
        with open(args.from_json) as f:
            d = json.load(f)
        print(render(d["rows"], d["anchors"], d["ceilings"]))
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(markdown(d["rows"], d["ceilings"]))
        return 0
    gpu = torch.cuda.is_available()
    anchors = find_anchors(args.anchors.split(":") if args.anchors else None, load=gpu and not args.dry_run)
    line = anchors.summary()
    w4a8 = "moe" in args.only and any(f.startswith("mxfp4") for f in args.moe_format)
    if (not anchors.flashmla or anchors.humming is None or (w4a8 and not anchors.vllm_c)) and gpu \
            and not args.dry_run:
        line += " -> the missing incumbents' columns stay empty (dsv4 runs alone there)"
    if args.dry_run or not gpu:
        rows = []
        if "decode" in args.only:
            for m in args.models:
                for k in args.kinds:
                    for c in (args.context if k != "swa" else args.context[:1]):
                        rows += [dict(op="decode", model=I.ATTN_MODELS[m].name, kind=k,
                                      context=c if k != "swa" else None, batch=b, dsv4_us=None) for b in args.batch]
        if "prefill" in args.only:
            rows += [dict(op="prefill", model=I.ATTN_MODELS[m].name, kind=f"topk {I.WINDOW + I.ATTN_MODELS[m].index_topk}",
                          batch=t, dsv4_us=None) for m in args.models for t in args.tokens]
        if "moe" in args.only:
            rows += [dict(op="moe", model=I.MOE_MODELS[m].name, kind=I.MOE_LABELS[c], batch=M, dsv4_us=None,
                          incumbent=MOE_INCUMBENTS[c])
                     for c in I.moe_cases(args.moe_format) for m in args.moe_models for M in args.moe_m]
        reason = "--dry-run" if args.dry_run else "no CUDA device"
        print(render(rows, f"{line}\n({reason}: {len(rows)} cases listed, nothing timed)"))
        return 0
    from .. import HAS_CUDA_EXTENSION
    if not HAS_CUDA_EXTENSION:
        print("dsv4.bench.compare: the dsv4 CUDA extension is not built (pip install -e . with nvcc and CUDA "
              "torch)", file=sys.stderr)
        return 1
    from .timing import bf16_gemm_tflops, copy_bandwidth_tbps

    torch.backends.cuda.matmul.allow_tf32 = False
    ceilings = {"copy TB/s": copy_bandwidth_tbps(), "bf16 GEMM TFLOP/s": bf16_gemm_tflops()}
    print(line, flush=True)
    print("ceilings: " + ", ".join(f"{k} {v:.2f}" for k, v in ceilings.items()), flush=True)
    iters = max(30, args.iters)
    rows = []

    def save():  # after every section, so a run cut short keeps what it measured
        for r in rows:
            if "tflops" in r:
                r["pct_gemm"] = 100 * r["tflops"] / ceilings["bf16 GEMM TFLOP/s"]
            if "tbps" in r:
                r["pct_copy"] = 100 * r["tbps"] / ceilings["copy TB/s"]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(anchors=line, ceilings=ceilings, rows=rows), f, indent=1)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(markdown(rows, ceilings))

    if "decode" in args.only:
        rows += decode_rows(anchors, args.models, args.kinds, args.batch, args.context, iters,
                            invariant=args.batch_invariant)
        save()
    if "prefill" in args.only:
        rows += prefill_rows(anchors, args.models, args.tokens, iters, ceilings["copy TB/s"])
        save()
    if "moe" in args.only:
        rows += moe_rows(anchors, args.moe_models, args.moe_m, iters, I.moe_cases(args.moe_format))
        save()
    print(render(rows, line, ceilings))
    slower = [r for r in rows if "ratio" in r and not math.isnan(r["ratio"]) and r["ratio"] < 1.0]
    print(f"{len(slower)} of {sum('ratio' in r for r in rows)} compared cases slower than the incumbent"
          + (": " + "; ".join(_fmt_case(r) for r in slower) if slower else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
