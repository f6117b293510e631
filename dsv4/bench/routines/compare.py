"""dsv4 side by side with the kernels vLLM 0.33.0 runs on Hopper (FlashMLA SM90, Humming).

Every case: dsv4 and the incumbent timed in the same :func:`dsv4.bench.timing.time_us`
call (same inputs, same process, interleaved, CUDA-graph replay, cold L2), the ratio
``incumbent us / dsv4 us`` (> 1: dsv4 faster), and the largest output difference of the
two on that case's first input set. Decode cases: :func:`dsv4.bench.cases.decode_case`
(vLLM's block sizes and index rows). MoE: NVFP4 W4A16 vs Humming W4A16 and MXFP4 W4A8
(DeepSeek V4's native experts) vs Humming W4A8, the two paths vLLM 0.33.0 takes on Hopper.
Without the incumbents (see :mod:`dsv4.bench.anchors`) dsv4 runs alone and one line says
why; ``--dry-run`` lists the cases and the incumbents found without a GPU.

``--predecessor gemm`` (attention rows): each timed graph holds V4's q projection
(:class:`dsv4.bench.cases.QProjection`, the bf16 GEMM ``[tokens, q_lora_rank] x
[q_lora_rank, heads * 512]`` that writes q) right before the attention call, for dsv4 and
FlashMLA alike, and the same GEMM alone is a third variant of the same
:func:`~dsv4.bench.timing.time_us` call. A row then reports the pair times (GEMM +
attention), the GEMM alone, and as ``dsv4_us`` / ``incumbent_us`` / ``ratio`` each pair
minus the GEMM alone: the attention's share of the pair, which a launch overlap with the
GEMM (programmatic dependent launch) makes smaller than the attention call alone.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from typing import Optional

import torch

from ...formats.kv_cache import FP8_DS_MLA_VIEW_LAST_DIM
from .. import traffic
from ..argtypes import anchor_paths, context_list, int_list, name_list
from ..cases import PREDECESSORS, DecodePools, QProjection, decode_case, dsv4_decode, prefill_case
from ..experts import (MOE_LABELS, MOE_WEIGHTS, dsv4_moe, moe_cases, moe_format_list, moe_routing, moe_weights,
                       prepare)
from ..incumbents import MOE_INCUMBENTS
from ..models import HEAD_DIM, KINDS, MODELS, MOE_MODELS, SCHEDULED, SOFTMAX_SCALE
from ..report import dump_record
from .compare_tables import fmt_case, line, markdown, render

SUMMARY = "dsv4 side by side with the kernels vLLM 0.33.0 runs on Hopper (FlashMLA SM90, Humming)"
ONLY = ("decode", "prefill", "moe")
DEFAULT_BATCH = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DEFAULT_CONTEXT = [4096, 32768, 131072]
DEFAULT_TOKENS = [4096, 16384]
DEFAULT_MOE_M = [1, 8, 32, 64, 128, 512, 2048, 8192, 16384]
DEFAULT_MOE_FORMATS = ["nvfp4", "mxfp4-w4a8"]
N_SETS = 4


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def with_predecessor(variants: dict, pre: Optional[list]) -> dict:
    """The timed variants of one attention case: unchanged without a predecessor; else each
    call i of every variant preceded by ``pre[i]`` (the GEMM writing that input set's q, so
    both are captured into one graph), and ``pre`` alone as the variant ``"gemm"``."""
    if pre is None:
        return variants
    out = {}
    for name, calls in variants.items():
        if len(calls) != len(pre):
            raise ValueError(f"dsv4: {len(pre)} predecessor calls for {len(calls)} {name} calls")
        out[name] = [(lambda f=f, g=g: (g(), f())[1]) for f, g in zip(calls, pre)]
    out["gemm"] = list(pre)
    return out


def attention_fields(t: dict, incumbent: str = "FlashMLA") -> dict:
    """Row fields from the timings of :func:`with_predecessor`'s variants: ``dsv4_us`` and
    ``incumbent_us`` (+ ``ratio``) are the attention's times; with a ``"gemm"`` variant
    they are each pair minus the GEMM alone, and the row also holds the pair times
    (``pair_us``, ``incumbent_pair_us``, ``ratio_pair``) and ``predecessor_us``."""
    gemm = t["gemm"].us if "gemm" in t else None
    row = dict(dsv4_us=t["dsv4"].us - (gemm or 0.0), method=t["dsv4"].method)
    if gemm is not None:
        row.update(predecessor="gemm", predecessor_us=gemm, pair_us=t["dsv4"].us)
    if "flashmla" in t:
        inc = t["flashmla"].us
        row.update(incumbent=incumbent, incumbent_us=inc - (gemm or 0.0))
        row["ratio"] = row["incumbent_us"] / row["dsv4_us"] if row["dsv4_us"] > 0 else math.nan
        if gemm is not None:
            row.update(incumbent_pair_us=inc, ratio_pair=inc / t["dsv4"].us)
    return row


def decode_rows(anchors, models, kinds, batches, contexts, iters: int, invariant: bool = False,
                predecessor: str = "none") -> list[dict]:
    from ..incumbents import FlashMLADecode
    from ..timing import time_us

    dev = "cuda"
    pools = DecodePools.for_cases(max(batches), max(contexts), dev)
    rows = []
    for mname in models:
        m = MODELS[mname]
        qproj = QProjection.build(m, dev, torch.Generator(device=dev).manual_seed(5)) if predecessor == "gemm" \
            else None
        for kind in kinds:
            for ctx in (contexts if kind != "swa" else [contexts[0]]):
                for b in batches:
                    gen = torch.Generator(device=dev).manual_seed(1000 * b + ctx % 997)
                    sets = [decode_case(kind, m, b, ctx, pools, gen) for _ in range(N_SETS)]
                    outs = {k: [torch.empty_like(s["q"]) for s in sets] for k in ("dsv4", "flashmla", "inv")}
                    variants = {"dsv4": [lambda s=s, o=o: dsv4_decode(s, o) for s, o in zip(sets, outs["dsv4"])]}
                    if invariant:
                        variants["inv"] = [lambda s=s, o=o: dsv4_decode(s, o, batch_invariant=True)
                                           for s, o in zip(sets, outs["inv"])]
                    if anchors.flashmla:
                        variants["flashmla"] = [FlashMLADecode(s, SOFTMAX_SCALE, o)
                                                for s, o in zip(sets, outs["flashmla"])]
                    pre = None if qproj is None else [qproj.writer(s["q"], gen) for s in sets]
                    t = time_us(with_predecessor(variants, pre), iters=iters)
                    fields = attention_fields(t)
                    us = fields["dsv4_us"]
                    tr = traffic.decode_attention(b, m.heads, sets[0]["keys"])
                    row = dict(op="decode", model=m.name, kind=kind, context=ctx if kind != "swa" else None,
                               batch=b, keys=sets[0]["keys"], **fields, tflops=tr.tflops(us), tbps=tr.tbps(us))
                    if "inv" in t:
                        inv = t["inv"].us - fields.get("predecessor_us", 0.0)
                        row.update(invariant_us=inv, invariant_cost=inv / us)
                    if "flashmla" in t:
                        row["maxdiff"] = _maxdiff(outs["dsv4"][0], outs["flashmla"][0])
                    rows.append(row)
                    print(line(row), flush=True)
        del qproj
    del pools
    torch.cuda.empty_cache()
    return rows


def prefill_rows(anchors, models, tokens, iters: int, copy_tbps: float, predecessor: str = "none") -> list[dict]:
    from ...attention import sparse_mqa_prefill
    from ..incumbents import flashmla_prefill
    from ..timing import time_us

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(7)
    kv = torch.randn(1 << 16, HEAD_DIM, generator=gen, device=dev).to(torch.bfloat16)  # 64 MB > L2
    rows = []
    for mname in models:
        m = MODELS[mname]
        qproj = QProjection.build(m, dev, gen) if predecessor == "gemm" else None
        for T in tokens:
            sets = [prefill_case(m, T, 0, gen, dev, kv=kv) for _ in range(2)]
            outs = {k: [torch.empty_like(s["q"]) for s in sets] for k in ("dsv4", "flashmla")}
            variants = {"dsv4": [(lambda s=s, o=o: sparse_mqa_prefill(s["q"], s["kv"], s["idx"], s["lens"],
                                                                       s["sink"], SOFTMAX_SCALE, out=o))
                                 for s, o in zip(sets, outs["dsv4"])]}
            if anchors.flashmla:
                variants["flashmla"] = [(lambda s=s, o=o: flashmla_prefill(s["q"], s["kv"], s["idx"], s["lens"],
                                                                            s["sink"], SOFTMAX_SCALE, o))
                                        for s, o in zip(sets, outs["flashmla"])]
            pre = None if qproj is None else [qproj.writer(s["q"], gen) for s in sets]
            t = time_us(with_predecessor(variants, pre), iters=iters)
            fields = attention_fields(t)
            topk, us = sets[0]["topk"], fields["dsv4_us"]
            tr = traffic.prefill_attention(T, m.heads, topk)
            # vLLM gathers and dequantizes the KV rows a prefill chunk can reference into the
            # bf16 workspace first (a CuTe-DSL/Triton kernel not runnable without vLLM): its
            # cost here is a bandwidth estimate, fp8 rows read + bf16 rows written at the
            # measured copy rate, for a fresh T-token request (T window rows + T/4 compressed).
            row_bytes = FP8_DS_MLA_VIEW_LAST_DIM + 2 * HEAD_DIM  # fp8 row read, bf16 row written
            gather_us = (T + T // 4) * row_bytes / (copy_tbps * 1e12) * 1e6
            row = dict(op="prefill", model=m.name, kind=f"topk {topk}", context=None, batch=T, keys=topk, **fields,
                       tflops=tr.tflops(us), tbps=tr.tbps(us), gather_est_us=gather_us)
            if "flashmla" in t:
                fm = fields["incumbent_us"]
                row.update(ratio_with_gather=(fm + gather_us) / (us + gather_us),
                           maxdiff=_maxdiff(outs["dsv4"][0], outs["flashmla"][0]))
            rows.append(row)
            print(line(row), flush=True)
        del qproj
    return rows


def moe_rows(anchors, models, Ms, iters: int, cases=(("nvfp4", "bf16"),), *, weights: str) -> list[dict]:
    from ..incumbents import HummingW4A8, HummingW4A16, moe_incumbent_missing
    from ..timing import time_us

    dev = "cuda"
    rows = []
    for case in cases:
        fmt, act = case
        kind, inc_name = MOE_LABELS[case], MOE_INCUMBENTS[case]
        for mname in models:
            m = MOE_MODELS[mname]
            w = moe_weights(weights, fmt, m.local_experts(), m.moe_inter, m.hidden, dev)
            prepared = prepare(w, fmt, act)
            hum, why = None, moe_incumbent_missing(anchors, case, ep=m.local_experts() < m.n_experts)
            if why is None:
                try:
                    hum = (HummingW4A16 if fmt == "nvfp4" else HummingW4A8)(w, m.n_experts, m.swiglu_limit)
                except Exception as e:  # report, keep dsv4's numbers
                    why = f"{inc_name} conversion failed: {type(e).__name__}: {e}"
                    print(f"{m.moe_name()}: {why}", flush=True)
            del w
            for M in Ms:
                sets = [moe_routing(m, M, torch.Generator(device=dev).manual_seed(seed)) for seed in range(N_SETS)]
                outs = [torch.empty(M, m.hidden, dtype=torch.bfloat16, device=dev) for _ in sets]
                variants = {"dsv4": [(lambda s=s, o=o: dsv4_moe(s, fmt, act, prepared, o, swiglu_limit=m.swiglu_limit))
                                     for s, o in zip(sets, outs)]}
                applies, apply_error = None, None
                if hum is not None:
                    # the incumbent's whole call (vLLM's apply: routing prep, GEMMs, weighted sum),
                    # and its GEMMs alone as timed before 2026-12-04 (routing prep outside, no sum);
                    # dsv4's call is always the whole op. Each is dropped alone if it fails.
                    try:
                        plans = [hum.plan(s["ids"], s["emap"]) for s in sets]
                        variants["humming_experts"] = [(lambda s=s, p=p: hum.experts(s["x"], p))
                                                       for s, p in zip(sets, plans)]
                    except Exception as e:
                        why = f"{inc_name} failed at M={M}: {type(e).__name__}: {e}"
                        print(why, flush=True)
                    try:
                        applies = [hum.apply_plan(s["ids"], s["emap"], anchors) for s in sets]
                        for s, p in zip(sets, applies):  # once outside the timer: a failure lands here
                            hum.apply(s["x"], s["tw"], p)
                        variants["humming"] = [(lambda s=s, p=p: hum.apply(s["x"], s["tw"], p))
                                               for s, p in zip(sets, applies)]
                    except Exception as e:
                        apply_error = f"{inc_name} whole call failed at M={M}: {type(e).__name__}: {e}"
                        print(apply_error, flush=True)
                        applies = None
                t = time_us(variants, iters=iters)
                us = t["dsv4"].us
                tr = traffic.moe(sum(s["n_local"] for s in sets) / N_SETS, sum(s["touched"] for s in sets) / N_SETS,
                                 m.hidden, m.moe_inter, fmt)
                row = dict(op="moe", model=m.moe_name(), kind=kind, format=fmt, activation=act, context=None, batch=M,
                           keys=None, dsv4_us=us, method=t["dsv4"].method, tflops=tr.tflops(us), tbps=tr.tbps(us))
                if "humming" in t or "humming_experts" in t:
                    row.update(incumbent=inc_name, incumbent_path=f"vLLM {'grouped' if hum.ep else 'indexed'} apply")
                    if "humming" in t:
                        row.update(incumbent_us=t["humming"].us, ratio=t["humming"].us / us)
                        ref = hum.apply(sets[0]["x"], sets[0]["tw"], applies[0])
                    else:  # the GEMMs' rows summed in torch (the parity tests' reference)
                        row["missing"] = apply_error
                        ref = hum(sets[0]["x"], sets[0]["tw"], plans[0])
                    if "humming_experts" in t:
                        row.update(incumbent_experts_us=t["humming_experts"].us,
                                   ratio_experts=t["humming_experts"].us / us)
                    row.update(maxdiff=_maxdiff(outs[0], ref),
                               rel_l2=float((outs[0].float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)))
                elif why:
                    row["missing"] = why
                rows.append(row)
                print(line(row), flush=True)
            del prepared, hum
            torch.cuda.empty_cache()
    return rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--anchors", default=None,
                    help="incumbent folders (os.pathsep-separated; made by scripts/fetch_anchors.py); else "
                         "$DSV4_ANCHORS or an installed vllm==0.33.0 / humming-kernels==0.1.19")
    ap.add_argument("--only", type=name_list(ONLY), default=list(ONLY),
                    help="sections to run, comma-separated: decode, prefill, moe (default all)")
    ap.add_argument("--models", type=name_list(SCHEDULED), default=list(SCHEDULED),
                    help="attention models (decode, prefill): flash, pro (default both)")
    ap.add_argument("--kinds", type=name_list(KINDS), default=list(KINDS),
                    help="decode layer types: swa, csa, hca (default all)")
    ap.add_argument("--batch", type=int_list, default=DEFAULT_BATCH,
                    help="decode batch sizes (default 1,2,4,...,256)")
    ap.add_argument("--context", type=context_list, default=DEFAULT_CONTEXT,
                    help="decode context lengths, K = 1024 (default 4K,32K,128K; SWA runs the first only)")
    ap.add_argument("--tokens", type=int_list, default=DEFAULT_TOKENS, help="prefill tokens T (default 4096,16384)")
    ap.add_argument("--moe-models", type=name_list(MOE_MODELS), default=list(MOE_MODELS),
                    help="MoE models: flash, pro, v41flash (the local experts of EP8 rank 0), v41flash-tp8 (one "
                         "tensor-parallel rank of 8: all 384 experts, N = 288) (default all)")
    ap.add_argument("--moe-m", type=int_list, default=DEFAULT_MOE_M,
                    help="MoE tokens M (default 1,8,32,64,128,512,2048,8192,16384)")
    ap.add_argument("--moe-format", type=moe_format_list, default=DEFAULT_MOE_FORMATS,
                    help="MoE row sets: nvfp4 (NVFP4 W4A16 vs Humming W4A16), mxfp4-w4a8 (MXFP4 W4A8 vs Humming "
                         "W4A8), mxfp4-w4a16 (MXFP4 W4A16 vs Humming W4A8, what vLLM runs for MXFP4 "
                         "checkpoints); default nvfp4,mxfp4-w4a8")
    ap.add_argument("--moe-weights", choices=MOE_WEIGHTS, default="codes",
                    help="the experts both sides run: codes (random FP4 codes and scale bytes, quick to make; "
                         "the runs of record) or quantized (random normal weights quantized to the format, as "
                         "python -m dsv4.bench moe runs them: slower to make, closer to a checkpoint's values); "
                         "default codes")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per case (at least 30 are run; default 30)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="decode: also time sparse_mqa_decode(batch_invariant=True) in the same call")
    ap.add_argument("--predecessor", choices=PREDECESSORS, default="none",
                    help="attention rows: 'gemm' captures V4's q projection (bf16 [tokens, q_lora_rank] x "
                         "[q_lora_rank, heads * 512], writing q) before every attention call of both sides and "
                         "times it alone in the same call; the rows give the pair times and each pair minus the "
                         "GEMM alone, so a launch overlap with the predecessor shows (default none)")
    ap.add_argument("--json", default=None, help="write rows, ceilings and the incumbents line here")
    ap.add_argument("--markdown", default=None, help="also write the tables as markdown here")
    ap.add_argument("--from-json", default=None, help="render the tables of an earlier --json run; time nothing")
    ap.add_argument("--dry-run", action="store_true", help="list the cases and the incumbents; time nothing")


def predecessor_line(args) -> str:
    """The header line of a --predecessor run ('' without one): the GEMM per model."""
    if args.predecessor == "none" or not ({"decode", "prefill"} & set(args.only)):
        return ""
    shapes = ", ".join(f"{MODELS[m].name} {QProjection.shape_text(MODELS[m])}" for m in args.models)
    return (f"predecessor: V4's q projection before every attention call, bf16 {shapes} (T = query tokens); "
            "dsv4 / incumbent us = pair - GEMM alone")


def _listed(args) -> list[dict]:
    """The cases of ``args`` without numbers (--dry-run, or no CUDA device)."""
    rows = []
    if "decode" in args.only:
        for m in args.models:
            for k in args.kinds:
                for c in (args.context if k != "swa" else args.context[:1]):
                    rows += [dict(op="decode", model=MODELS[m].name, kind=k, context=c if k != "swa" else None,
                                  batch=b, dsv4_us=None) for b in args.batch]
    if "prefill" in args.only:
        rows += [dict(op="prefill", model=MODELS[m].name, kind=f"topk {MODELS[m].prefill_topk}", batch=t,
                      dsv4_us=None) for m in args.models for t in args.tokens]
    if "moe" in args.only:
        rows += [dict(op="moe", model=MOE_MODELS[m].moe_name(), kind=MOE_LABELS[c], batch=M, dsv4_us=None,
                      incumbent=MOE_INCUMBENTS[c])
                 for c in moe_cases(args.moe_format) for m in args.moe_models for M in args.moe_m]
    return rows


def run(args: argparse.Namespace) -> int:
    from ..anchors import find_anchors

    if args.from_json:
        with open(args.from_json) as f:
            d = json.load(f)
        print(render(d["rows"], d["anchors"], d["ceilings"]))
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(markdown(d["rows"], d["ceilings"]))
        return 0
    gpu = torch.cuda.is_available()
    anchors = find_anchors(anchor_paths(args.anchors), load=gpu and not args.dry_run)
    head = anchors.summary()
    w4a8 = "moe" in args.only and any(f.startswith("mxfp4") for f in args.moe_format)
    if (not anchors.flashmla or anchors.humming is None or (w4a8 and not anchors.vllm_c)) and gpu \
            and not args.dry_run:
        head += " -> the missing incumbents' columns stay empty (dsv4 runs alone there)"
    mode = predecessor_line(args)
    if mode:
        head += "\n" + mode
    if "moe" in args.only:
        head += f"\nMoE experts: {args.moe_weights} (--moe-weights), the same for both sides"
    if args.dry_run or not gpu:
        rows = _listed(args)
        reason = "--dry-run" if args.dry_run else "no CUDA device"
        print(render(rows, f"{head}\n({reason}: {len(rows)} cases listed, nothing timed)"))
        return 0
    from ... import HAS_CUDA_EXTENSION

    if not HAS_CUDA_EXTENSION:
        print("dsv4: compare: the dsv4 CUDA extension is not built (pip install -e . with nvcc and CUDA torch)",
              file=sys.stderr)
        return 1
    from ..timing import bf16_gemm_tflops, copy_bandwidth_tbps, fp8_gemm_tflops

    torch.backends.cuda.matmul.allow_tf32 = False
    ceilings = {"copy TB/s": copy_bandwidth_tbps(), "bf16 GEMM TFLOP/s": bf16_gemm_tflops()}
    if "moe" in args.only and any(act == "fp8" for _, act in moe_cases(args.moe_format)):
        # the W4A8 rows' tensor-core ceiling: dense e4m3 GEMM 8192^3 (torch._scaled_mm)
        ceilings["fp8 GEMM TFLOP/s"] = fp8_gemm_tflops()
    print(head, flush=True)
    print("ceilings: " + ", ".join(f"{k} {v:.2f}" for k, v in ceilings.items()), flush=True)
    iters = max(30, args.iters)
    rows = []

    def save():  # after every section, so a run cut short keeps what it measured
        for r in rows:
            if "tflops" in r:  # of the dense GEMM ceiling of the row's tensor-core inputs
                fp8 = r.get("activation") == "fp8" and "fp8 GEMM TFLOP/s" in ceilings
                r["pct_gemm"] = 100 * r["tflops"] / ceilings["fp8 GEMM TFLOP/s" if fp8 else "bf16 GEMM TFLOP/s"]
                r["pct_gemm_of"] = "fp8" if fp8 else "bf16"
            if "tbps" in r:
                r["pct_copy"] = 100 * r["tbps"] / ceilings["copy TB/s"]
        if args.json:
            dump_record(dict(anchors=head, ceilings=ceilings, predecessor=args.predecessor,
                             moe_weights=args.moe_weights, rows=rows), args.json)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(markdown(rows, ceilings))

    if "decode" in args.only:
        rows += decode_rows(anchors, args.models, args.kinds, args.batch, args.context, iters,
                            invariant=args.batch_invariant, predecessor=args.predecessor)
        save()
    if "prefill" in args.only:
        rows += prefill_rows(anchors, args.models, args.tokens, iters, ceilings["copy TB/s"],
                             predecessor=args.predecessor)
        save()
    if "moe" in args.only:
        rows += moe_rows(anchors, args.moe_models, args.moe_m, iters, moe_cases(args.moe_format),
                         weights=args.moe_weights)
        save()
    print(render(rows, head, ceilings))
    slower = [r for r in rows if "ratio" in r and not math.isnan(r["ratio"]) and r["ratio"] < 1.0]
    print(f"{len(slower)} of {sum('ratio' in r for r in rows)} compared cases slower than the incumbent"
          + (": " + "; ".join(fmt_case(r) for r in slower) if slower else ""))
    return 0
