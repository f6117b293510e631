"""Rates of dsv4's routed-expert MoE on the GPU: NVFP4 experts (dsv4.nvfp4_moe, W4A16 and
W4A4) and DeepSeek V4's native MXFP4 experts (dsv4.routed_moe, W4A8 and W4A16), against a
bf16 grouped-GEMM baseline in the same run.

Shapes (dsv4.bench.models): the local experts of EP8 rank 0 (V4-Flash 32 of 256, V4-Pro 48
of 384, V4.1-Flash 48 of 384), quantized from random float weights; random top-6 routing
over the GLOBAL experts and an expert map making E_local of them local (~1/8 of the slots,
as on one EP8 rank); --routing balanced gives every expert M * 6 / E_global slots instead
(dsv4.bench.experts.moe_routing), to time full token tiles against partial ones. Decode M
in {1, 8, 32, 64, 128}; prefill M in {2048, 8192, 16384}.

Baseline: bf16 torch._grouped_mm over the dequantized local weights + torch clamped SwiGLU
(routing sort / gather and the weighted combine in torch too). Per case: us of eager
calls (4 rotating input sets, the mean of each set's median, L2 evicted before each call,
dsv4.bench.timing) and, at decode sizes (every size with --graph), of CUDA-graph replays;
weight bandwidth, useful TFLOP/s (dsv4.bench.traffic) and their % of the copy bandwidth and
bf16 GEMM rate measured in this process; speedup over the baseline; 2-CTA vs 1-CTA at
prefill. The experts are random normal weights quantized to the format (--moe-weights codes:
random codes and scale bytes, as the compare routine draws them by default). The 2-CTA /
1-CTA prefill modes exist for the bf16 / nvfp4 kernels (MXFP4 W4A16 runs on them), not for
W4A8.

--variants times every case under each set of DSV4_MOE_* switches (sk -> DSV4_MOE_SPLITK:
split-K persistent GEMM grid off/on; pdl -> DSV4_MOE_PDL: programmatic dependent launch
off/on; dx -> DSV4_MOE_DIRECT_X: bf16 GEMM1 reading x rows itself instead of a gather
kernel; ws -> DSV4_MOE_WS: 0 runs the one-warpgroup prefill GEMMs instead of the
warp-specialized ones; bn -> DSV4_MOE_BLOCK_N: the token tile (both formats), 8, 16 or 64;
rows -> DSV4_MOE_GEMM2_ROWS: GEMM2's weight tiles per CTA (NVFP4: where N <= 512), 1, 2, 4 or 8;
res -> DSV4_MOE_GEMM2_RESIDENT: 0 fetches GEMM2's token tile per weight tile; fr ->
DSV4_MOE_FUSED_ROUTE: 0 keeps MXFP4 W4A8's routing kernel at decode sizes; pair ->
DSV4_MOE_GEMM1_PAIRS: 1 runs MXFP4 W4A8's GEMM1 on pairs of 64-token tiles; pair2 ->
DSV4_MOE_GEMM2_PAIRS: 1 runs its GEMM2 on them too (where GEMM1's pairs run); lz ->
DSV4_MOE_LATE_ZERO: 1 has GEMM1's pair kernel write the all-remote tokens' zero rows;
README.md, "Environment variables"). The library reads them once per
process, so each variant runs in a child process of its own and the rows are merged.
--profile prints per-kernel device times (torch.profiler, CUDA-graph replays, warm L2) of every size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from .. import traffic
from ..argtypes import name_list
from ..experts import MOE_LABELS, MoeSetup, dsv4_moe, moe_bf16_baseline, moe_cases, moe_format_list, moe_routing
from ..experts import MOE_WEIGHTS, ROUTINGS, moe_weights
from ..models import MOE_MODELS
from ..report import Table, dump_record, print_tables, to_markdown

SUMMARY = "routed-expert MoE (NVFP4, MXFP4) rates against a bf16 grouped-GEMM baseline and the same-run ceilings"
SWITCHES = {"sk": "DSV4_MOE_SPLITK", "pdl": "DSV4_MOE_PDL", "dx": "DSV4_MOE_DIRECT_X", "ws": "DSV4_MOE_WS",
            "bn": "DSV4_MOE_BLOCK_N", "rows": "DSV4_MOE_GEMM2_ROWS", "res": "DSV4_MOE_GEMM2_RESIDENT",
            "fr": "DSV4_MOE_FUSED_ROUTE", "pair": "DSV4_MOE_GEMM1_PAIRS",
            "pair2": "DSV4_MOE_GEMM2_PAIRS", "lz": "DSV4_MOE_LATE_ZERO"}
VALUES = {"bn": ("8", "16", "64"), "rows": ("1", "2", "4", "8")}  # the others: "0", "1"
N_SETS = 4


def sizes(text: str) -> list[int]:
    """'1,64' -> [1, 64]; '' -> [] (none)."""
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of token counts, got {text!r}") from None
    if any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
    return out


def variant_env(v: str) -> dict[str, str]:
    """The DSV4_MOE_* switches of one variant, e.g. 'sk=0,pdl=1' ('' = library defaults)."""
    env = {}
    for kv in filter(None, (p.strip() for p in v.split(","))):
        k, sep, val = (s.strip() for s in kv.partition("="))
        if k not in SWITCHES or not sep or val not in VALUES.get(k, ("0", "1")):
            raise ValueError(f"dsv4: moe --variants item {kv!r} must be k=0 or k=1 with k one of "
                             f"{sorted(set(SWITCHES) - set(VALUES))}, or "
                             + ", ".join(f"{c}={'|'.join(VALUES[c])}" for c in VALUES))
        env[SWITCHES[k]] = val
    return env


def child_argv(argv: list[str], variant: str, json_path: str) -> list[str]:
    """argv for the child process that runs one variant: the same options, one --variants, its own --json."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--variants", "--json"):
            skip = True
        elif not a.startswith(("--variants=", "--json=")):
            out.append(a)
    return out + ["--variants", variant, "--json", json_path]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="short run: decode 1,64,128 and prefill 8192")
    ap.add_argument("--moe-format", type=moe_format_list, default=None,
                    help="comma-separated: nvfp4, mxfp4-w4a8, mxfp4-w4a16 (default nvfp4; with --vs vllm: nvfp4,"
                         "mxfp4-w4a8, the formats with a vLLM incumbent)")
    ap.add_argument("--activation", default="bf16", choices=["bf16", "nvfp4", "both"],
                    help="the NVFP4 experts' activation modes: bf16 (W4A16, default), nvfp4 (W4A4) or both")
    ap.add_argument("--models", type=name_list(MOE_MODELS), default=["flash", "pro"],
                    help="models, comma-separated: flash, pro, v41flash (EP8 rank 0), v41flash-tp8 (a TP8 rank) "
                         "(default flash,pro)")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per case (default 30)")
    ap.add_argument("--json", help="also write the rows and ceilings here")
    ap.add_argument("--markdown", default=None, help="also write the table as markdown here")
    ap.add_argument("--decode", type=sizes, default=None, help="decode M, comma-separated (default 1,8,32,64,128; "
                                                               "--quick 1,64,128)")
    ap.add_argument("--prefill", type=sizes, default=None,
                    help="prefill M, comma-separated (default 2048,8192,16384; --quick 8192); '' = none")
    ap.add_argument("--variants", default="", help="';'-separated sets of k=v switches, e.g. 'sk=0,pdl=0;sk=1,pdl=1' "
                                                   f"(k one of {', '.join(SWITCHES)}; v 0 or 1, bn: a token tile)")
    ap.add_argument("--profile", action="store_true", help="per-kernel device times at every size")
    ap.add_argument("--moe-weights", choices=MOE_WEIGHTS, default=None,
                    help="the experts: quantized (random normal weights quantized to the format; the default) or "
                         "codes (random FP4 codes and scale bytes); with --vs vllm passed on to compare, whose "
                         "default is codes")
    ap.add_argument("--graph", action="store_true",
                    help="also time CUDA-graph replay at the prefill sizes (always at the decode sizes)")
    ap.add_argument("--routing", choices=ROUTINGS, default="uniform",
                    help="uniform: random top-k per token (default); balanced: every expert gets M * k / E_global slots "
                         "(the model column says so)")
    ap.add_argument("--vs", choices=["vllm"], default=None,
                    help="side by side with vLLM 0.33.0's Humming W4A16 (NVFP4) and W4A8 (MXFP4) MoE instead: runs "
                         "the compare routine's MoE section (--anchors / DSV4_ANCHORS)")
    ap.add_argument("--anchors", default=None, help="with --vs vllm: anchor folders (see scripts/fetch_anchors.py)")


def check(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    names = args.moe_format or ["nvfp4"]
    if args.activation != "bf16" and "nvfp4" not in names:
        ap.error(f"--activation {args.activation} picks the NVFP4 modes, but --moe-format {','.join(names)} has no "
                 "nvfp4")
    args.variant_list = [v.strip() for v in args.variants.split(";")] if args.variants else [""]
    for v in args.variant_list:
        try:
            variant_env(v)
        except ValueError as ex:
            ap.error(str(ex))


def run_variants(argv: list[str], variants: list[str], json_out) -> int:
    """One child process per variant (the switches are read once per process); merged table."""
    rows, ceilings = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, v in enumerate(variants):
            path = os.path.join(tmp, f"variant{i}.json")
            print(f"\n=== variant {v or 'default'}: {variant_env(v) or 'library defaults'}", flush=True)
            subprocess.run([sys.executable, "-m", "dsv4.bench", "moe", *child_argv(argv, v, path)], check=True)
            with open(path) as f:
                data = json.load(f)
            rows += data["rows"]
            ceilings.append((data["copy_tbps"], data["gemm_tflops"]))
    copy_tbps, gemm_tflops = min(c[0] for c in ceilings), min(c[1] for c in ceilings)
    if json_out:
        dump_record(dict(copy_tbps=copy_tbps, gemm_tflops=gemm_tflops, rows=rows), json_out)
    print("\n=== all variants (each row's % uses its own process's ceilings)")
    print_tables([table(rows, copy_tbps, gemm_tflops)])
    return 0


def table(rows: list[dict], copy_tbps: float, gemm_tflops: float) -> Table:
    t = Table(f"dsv4 routed MoE; copy ceiling {copy_tbps:.2f} TB/s, bf16 GEMM ceiling {gemm_tflops:.0f} TFLOP/s "
              "(same process)", ["model", "M", "experts", "variant", "cta", "us", "graph us", "TB/s", "% copy",
                                 "TFLOP/s", "% gemm", "base us", "base TB/s", "speedup", "eager x", "2cta/1cta"],
              caption="us = eager call (host overhead included); graph = CUDA-graph replay (decode rows); TB/s, "
                      "TFLOP/s and % use graph time where measured. speedup = eager baseline us / dsv4 us (graph "
                      "where measured).", align="lrllr" + "r" * 11)
    for r in rows:
        t.rows.append([r["model"], r["M"], r["experts"], r["variant"] or "default", r["cta"], f"{r['us']:.1f}",
                       "" if r["graph_us"] is None else f"{r['graph_us']:.1f}", f"{r['tbps']:.2f}",
                       f"{r['pct_copy']:.0f}%", f"{r['tflops']:.1f}", f"{r['pct_gemm']:.0f}%", f"{r['base_us']:.1f}",
                       f"{r['base_tbps']:.2f}", f"{r['speedup']:.2f}x", f"{r['speedup_eager']:.2f}x",
                       f"{r['two_vs_one']:.2f}x" if r["two_vs_one"] else ""])
    return t


def profile_kernels(name, M, variant, fn, iters=20):
    """Mean device time per call of each kernel of one MoE call (CUDA graph replay)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            key = ev.name.split("<")[0].split("(")[0].replace("void ", "").replace("dsv4::moe::", "")
            if "gemm" in ev.name:
                key += "1" if "true" in ev.name else "2"
            times[key] = times.get(key, 0.0) + ev.time_range.elapsed_us() / iters
    parts = ", ".join(f"{k} {v:.1f}" for k, v in times.items())
    print(f"profile {name} M={M} [{variant or 'default'}]: sum {sum(times.values()):.1f} us: {parts}", flush=True)


def _vs_vllm(args) -> int:
    from ..cli import run_routine

    decode = [1, 8, 32, 64, 128, 512] if args.decode is None else args.decode
    prefill = [2048, 8192, 16384] if args.prefill is None else args.prefill
    argv = ["--only", "moe", "--moe-models", ",".join(args.models), "--moe-m", ",".join(map(str, decode + prefill)),
            "--iters", str(args.iters)]
    argv += ["--moe-format", ",".join(args.moe_format)] if args.moe_format else []
    argv += ["--moe-weights", args.moe_weights] if args.moe_weights else []
    argv += (["--json", args.json] if args.json else []) + (["--anchors", args.anchors] if args.anchors else [])
    return run_routine("compare", argv)


def run(args: argparse.Namespace) -> int:
    if args.vs:
        return _vs_vllm(args)
    args.moe_weights = args.moe_weights or "quantized"  # this routine's default (compare's: codes)
    if not torch.cuda.is_available():
        print("dsv4: moe: needs a CUDA device", file=sys.stderr)
        return 1
    if len(args.variant_list) > 1:
        return run_variants(args.argv, args.variant_list, args.json)
    variant = args.variant_list[0]
    for env in SWITCHES.values():  # '' = the library's defaults, whatever the shell exported
        os.environ.pop(env, None)
    os.environ.update(variant_env(variant))  # before the first dsv4 call, which reads them
    from ..timing import bf16_gemm_tflops, copy_bandwidth_tbps

    acts = ["bf16", "nvfp4"] if args.activation == "both" else [args.activation]
    cases = moe_cases(args.moe_format or ["nvfp4"], acts)
    decode = args.decode if args.decode is not None else [1, 64, 128] if args.quick else [1, 8, 32, 64, 128]
    prefill = args.prefill if args.prefill is not None else [8192] if args.quick else [2048, 8192, 16384]
    copy_tbps, gemm_tflops = copy_bandwidth_tbps(), bf16_gemm_tflops()
    print(f"ceilings in this process: copy {copy_tbps:.2f} TB/s (read+write), bf16 GEMM {gemm_tflops:.0f} TFLOP/s",
          flush=True)
    print(f"experts: {args.moe_weights} (--moe-weights)", flush=True)
    rows = []
    for name in args.models:
        for fmt in dict.fromkeys(f for f, _ in cases):
            acts = [a for f, a in cases if f == fmt]
            rows += _model_rows(args, MOE_MODELS[name], fmt, acts, decode, prefill, variant, copy_tbps, gemm_tflops)
            torch.cuda.empty_cache()  # the experts of one (model, format) are freed with its rows' frame
    if args.json:
        dump_record(dict(copy_tbps=copy_tbps, gemm_tflops=gemm_tflops, moe_weights=args.moe_weights, rows=rows),
                    args.json)
    t = table(rows, copy_tbps, gemm_tflops)
    print_tables([t])
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown([t]))
    return 0


def _model_rows(args, m, fmt, acts, decode, prefill, variant, copy_tbps, gemm_tflops) -> list[dict]:
    from ..timing import time_us

    K, N, E = m.hidden, m.moe_inter, m.local_experts()
    label = m.moe_name() + ("" if args.routing == "uniform" else f" ({args.routing})")
    setup = MoeSetup.build(moe_weights(args.moe_weights, fmt, E, N, K, "cuda"), fmt, acts)
    rows = []
    for M in decode + prefill:
        sets = [moe_routing(m, M, torch.Generator().manual_seed(seed), "cuda", routing=args.routing)
                for seed in range(N_SETS)]
        touched = sum(s["touched"] for s in sets) / N_SETS
        n_local = sum(s["n_local"] for s in sets) / N_SETS
        ours, base = traffic.moe(n_local, touched, K, N, fmt), traffic.moe(n_local, touched, K, N, "bf16")
        try:
            base_us = time_us({"b": [lambda s=s: moe_bf16_baseline(s["x"], s["ids"], s["tw"], s["emap"],
                                                                   setup.w13_bf16, setup.w2_bf16, m.swiglu_limit)
                                     for s in sets]}, iters=args.iters, cuda_graph=False)["b"].us
        except Exception as ex:  # keep the dsv4 numbers if the baseline cannot run
            print(f"baseline failed at M={M}: {ex}", flush=True)
            base_us = float("nan")
        for act in acts:
            modes = ["auto"] if M in decode or act == "fp8" else ["auto", 1, 2]
            outs = [torch.empty(M, K, dtype=torch.bfloat16, device="cuda") for _ in sets]

            def run(i, cta, act=act, outs=outs):
                dsv4_moe(sets[i], fmt, act, setup.weights[act], outs[i], swiglu_limit=m.swiglu_limit,
                         scales=setup.scales, cta=cta)

            # The modes round-robin, so the 2-CTA / 1-CTA ratio is not skewed by drift.
            res = {cta: t.us for cta, t in time_us({cta: [lambda i=i, cta=cta: run(i, cta) for i in range(N_SETS)]
                                                      for cta in modes}, iters=args.iters, cuda_graph=False).items()}
            graph_us = None
            if M in decode or args.graph:  # decode runs under CUDA graphs in vLLM: time the replay too
                try:
                    graph_us = time_us({"g": [lambda i=i: run(i, "auto") for i in range(N_SETS)]},
                                       iters=args.iters)["g"].us
                except Exception as ex:
                    print(f"graph timing failed at M={M}: {ex}", flush=True)
            for cta, us in res.items():
                t_us = graph_us if graph_us is not None else us
                row = dict(model=label, M=M, format=fmt, act=act, experts=MOE_LABELS[(fmt, act)],
                           variant=variant, cta=str(cta), us=us, graph_us=graph_us, tbps=ours.tbps(t_us),
                           pct_copy=100 * ours.tbps(t_us) / copy_tbps, tflops=ours.tflops(t_us),
                           pct_gemm=100 * ours.tflops(t_us) / gemm_tflops, base_us=base_us,
                           base_tbps=base.tbps(base_us), speedup=base_us / t_us, speedup_eager=base_us / us,
                           two_vs_one=(res[1] / res[2]) if (cta == 2 and 1 in res) else None)
                rows.append(row)
                print(row, flush=True)
    if args.profile:
        for M in decode + prefill:
            inp = moe_routing(m, M, torch.Generator().manual_seed(0), "cuda", routing=args.routing)
            out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda")
            act = acts[0]
            try:
                profile_kernels(f"{label} {MOE_LABELS[(fmt, act)]}", M, variant,
                                lambda: dsv4_moe(inp, fmt, act, setup.weights[act], out, swiglu_limit=m.swiglu_limit,
                                                 scales=setup.scales))
            except Exception as ex:  # keep the timings if the profiler cannot run here
                print(f"profile failed at M={M}: {ex}", flush=True)
    return rows
