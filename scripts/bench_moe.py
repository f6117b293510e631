"""Benchmark of dsv4's routed-expert MoE on the H200: NVFP4 experts (dsv4.nvfp4_moe, W4A16
and W4A4) and DeepSeek V4's native MXFP4 experts (dsv4.routed_moe, W4A8 and W4A16).

Shapes: V4-Flash (K=4096, N=2048, 256 global experts, EP8 -> 32 local) and V4-Pro
(K=7168, N=3072, 384 global, EP8 -> 48 local); random top-6 routing over the GLOBAL
experts, an expert_map making E_local of them local (so ~1/8 of the slots are
local, as on one EP8 rank). Decode M in {1, 8, 32, 64, 128}; prefill M in
{2048, 8192, 16384}.

Baseline in the same run: bf16 torch._grouped_mm over the dequantized local
weights (of the format measured) + torch clamped SwiGLU (routing sort/gather and the weighted combine in
torch too). Reported per case: median us over >= 30 event-timed calls after
warm-up with 4 rotating input sets, L2 evicted before each call (dsv4.bench.timing); effective weight bandwidth = bytes of the
distinct local experts touched (FP4 codes + block scales for dsv4; bf16 for the
baseline) / time; useful TFLOP/s = 6*K*N flops per local slot / time; % of the copy
bandwidth and of the dense bf16 GEMM rate measured in this process; speedup over
the baseline; 2-CTA vs 1-CTA at prefill.

Usage: python scripts/bench_moe.py [--quick] [--moe-format nvfp4,mxfp4-w4a8,mxfp4-w4a16]
    [--activation bf16|nvfp4|both] [--models flash,pro] [--decode 1,64] [--prefill 8192]
    [--variants "sk=0,pdl=0;sk=1,pdl=1"] [--profile] [--vs vllm]

--moe-format picks the experts: nvfp4 (in the --activation modes: bf16 = W4A16, nvfp4 =
W4A4), mxfp4-w4a8 (FP8 activations, vLLM 0.33.0's Hopper numerics for DeepSeek V4's MXFP4
checkpoints), mxfp4-w4a16; default nvfp4. The 2-CTA / 1-CTA prefill modes exist for the
bf16 / nvfp4 kernels (MXFP4 W4A16 runs on them), not for W4A8.

--variants times every case under each set of DSV4_MOE_* switches (sk -> DSV4_MOE_SPLITK:
split-K persistent GEMM grid off/on; pdl -> DSV4_MOE_PDL: programmatic dependent launch off/on;
dx -> DSV4_MOE_DIRECT_X: bf16 decode GEMM1 reading x itself instead of a gather kernel;
ws -> DSV4_MOE_WS: 0 runs the previous one-warpgroup prefill GEMMs instead of the
warp-specialized ones; README.md, "Environment variables"). The library reads them once per
process, so each variant runs in a child process of its own and the rows are merged; without
--variants the library's defaults run. --profile prints per-kernel device times
(torch.profiler) of the first model's decode sizes under each variant.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from dsv4 import formats, nvfp4_moe, prepare_moe_weights, prepare_nvfp4_moe_weights, routed_moe
from dsv4.formats import mxfp4
from dsv4.bench import inputs as I
from dsv4.bench.timing import bf16_gemm_tflops, copy_bandwidth_tbps, time_us
from dsv4.latency import moe_bf16_baseline

MODELS = {
    "flash": dict(K=4096, N=2048, E_global=256, E_local=32),
    "pro": dict(K=7168, N=3072, E_global=384, E_local=48),
}
TOPK = 6
LIMIT = 10.0
KEYS = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")


def _random_experts(fmt, E, N, K, gen, device):
    if fmt == "nvfp4":
        return formats.random_nvfp4_moe_weights(E, N, K, generator=gen, device=device)
    return mxfp4.random_mxfp4_moe_weights(E, N, K, generator=gen, device=device)


def _dequantize(fmt, w, name, i):
    s = slice(i, i + 1)
    if fmt == "nvfp4":
        return formats.dequantize_experts(w[name][s], w[name + "_scale"][s], w[name + "_scale_2"][s])
    return mxfp4.dequantize_mxfp4_experts(w[name][s], w[name + "_scale"][s])


def make_weights(m, fmt, acts, device="cuda"):
    """Random experts of ``fmt`` (quantized from float weights, 8 experts at a time), the
    dsv4 weights prepared for each activation mode in ``acts``, and the baseline's bf16
    weights [E, 2N, K] and [E, K, N] (used transposed, K-contiguous)."""
    parts = []
    for i, e0 in enumerate(range(0, m["E_local"], 8)):
        gen = torch.Generator(device=device).manual_seed(100 + i)
        parts.append(_random_experts(fmt, min(8, m["E_local"] - e0), m["N"], m["K"], gen, device))
    w = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    if fmt == "nvfp4":  # one layout serves both activation modes
        nv = prepare_nvfp4_moe_weights(*(w[k] for k in KEYS))
        prepared = {act: nv for act in acts}
    else:
        prepared = {act: prepare_moe_weights(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], format=fmt,
                                             activation=act) for act in acts}
    w13 = torch.cat([_dequantize(fmt, w, "w13", i).to(torch.bfloat16) for i in range(m["E_local"])])
    w2 = torch.cat([_dequantize(fmt, w, "w2", i).to(torch.bfloat16) for i in range(m["E_local"])])
    return w, prepared, w13, w2


def act_scales(w, act):
    """The NVFP4 activation global scales of W4A4 (the test weights carry them); none otherwise."""
    return dict(a13_scale=w["w13_input_scale"], a2_scale=w["w2_input_scale"]) if act == "nvfp4" else {}


def moe_call(fmt, act, prepared, s, out, cta="auto", **kw):
    """One dsv4 MoE call on input set ``s``: dsv4.nvfp4_moe for NVFP4 experts (the mode
    chosen per call), dsv4.routed_moe for MXFP4 (the mode they were prepared for)."""
    if fmt == "nvfp4":
        nvfp4_moe(s["x"], s["ids"], s["tw"], prepared, expert_map=s["emap"], cta_mode=cta, out=out, activation=act,
                  swiglu_limit=LIMIT, check_ids=False, **kw)
    else:
        routed_moe(s["x"], s["ids"], s["tw"], prepared, expert_map=s["emap"], cta_mode=cta, out=out,
                   swiglu_limit=LIMIT, check_ids=False)


def make_inputs(m, M, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, m["K"], generator=gen).to(torch.bfloat16).cuda()
    scores = torch.rand(M, m["E_global"], generator=gen)
    tw, ids = scores.topk(TOPK, dim=-1)
    tw = (tw / tw.sum(-1, keepdim=True)).float().cuda()
    ids = ids.to(torch.int32).cuda()
    emap = torch.full((m["E_global"],), -1, dtype=torch.int32)
    emap[: m["E_local"]] = torch.arange(m["E_local"], dtype=torch.int32)  # rank 0 of EP8
    emap = emap.cuda()
    local = emap.long()[ids.long()]
    touched = int((torch.bincount(local[local >= 0], minlength=m["E_local"]) > 0).sum())
    n_local = int((local >= 0).sum())
    return dict(x=x, ids=ids, tw=tw, emap=emap, touched=touched, n_local=n_local)


def baseline(inp, w13, w2, E, N):
    """bf16 grouped-GEMM MoE in torch (the reference point of the issue)."""
    return moe_bf16_baseline(inp["x"], inp["ids"], inp["tw"], inp["emap"], w13, w2, LIMIT)


SWITCHES = {"sk": "DSV4_MOE_SPLITK", "pdl": "DSV4_MOE_PDL", "dx": "DSV4_MOE_DIRECT_X", "ws": "DSV4_MOE_WS"}


def variant_env(v: str) -> dict[str, str]:
    """The DSV4_MOE_* switches of one variant, e.g. 'sk=0,pdl=1' ('' = library defaults)."""
    env = {}
    for kv in filter(None, (p.strip() for p in v.split(","))):
        k, sep, val = (s.strip() for s in kv.partition("="))
        if k not in SWITCHES or not sep or val not in ("0", "1"):
            raise ValueError(f"bench_moe: variant item {kv!r} must be k=0 or k=1 with k one of {sorted(SWITCHES)}")
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


def run_variants(argv: list[str], variants: list[str], json_out: str | None) -> int:
    """One child process per variant (the switches are read once per process); merged table."""
    rows, ceilings = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, v in enumerate(variants):
            path = os.path.join(tmp, f"variant{i}.json")
            print(f"\n=== variant {v or 'default'}: {variant_env(v) or 'library defaults'}", flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), *child_argv(argv, v, path)], check=True)
            with open(path) as f:
                data = json.load(f)
            rows += data["rows"]
            ceilings.append((data["copy_tbps"], data["gemm_tflops"]))
    copy_tbps, gemm_tflops = min(c[0] for c in ceilings), min(c[1] for c in ceilings)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(dict(copy_tbps=copy_tbps, gemm_tflops=gemm_tflops, rows=rows), f, indent=1)
    print("\n=== all variants (each row's % uses its own process's ceilings)")
    print_table(rows, copy_tbps, gemm_tflops)
    return 0


def print_table(rows, copy_tbps, gemm_tflops):
    print()
    print(f"copy ceiling {copy_tbps:.2f} TB/s, bf16 GEMM ceiling {gemm_tflops:.0f} TFLOP/s (same process)")
    print("us = eager call (host overhead included); graph = CUDA-graph replay (decode rows); TB/s, TFLOP/s")
    print("and % use graph time where measured. speedup = eager baseline us / dsv4 us (graph where measured).")
    hdr = (f"{'model':9} {'M':>6} {'experts':12} {'variant':15} {'cta':4} {'us':>9} {'graph us':>9} {'TB/s':>6} "
           f"{'%copy':>6} {'TFLOP/s':>8} {'%gemm':>6} {'base us':>9} {'base TB/s':>9} {'speedup':>7} {'eager x':>7} "
           f"{'2cta/1cta':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        tv = f"{r['two_vs_one']:.2f}x" if r["two_vs_one"] else ""
        gu = f"{r['graph_us']:.1f}" if r["graph_us"] is not None else ""
        print(f"{r['model']:9} {r['M']:>6} {r['experts']:12} {r['variant'] or 'default':15} {r['cta']:4} {r['us']:>9.1f} {gu:>9} {r['tbps']:>6.2f} "
              f"{r['pct_copy']:>5.0f}% {r['tflops']:>8.1f} {r['pct_gemm']:>5.0f}% {r['base_us']:>9.1f} "
              f"{r['base_tbps']:>9.2f} {r['speedup']:>6.2f}x {r['speedup_eager']:>6.2f}x {tv:>9}")


def profile_kernels(name, M, variant, fn, iters=20):
    """Mean device time per call of each kernel of one nvfp4_moe call (CUDA graph replay)."""
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run: a few decode and one prefill size")
    ap.add_argument("--moe-format", type=I.moe_format_list, default=None,
                    help="comma-separated: nvfp4, mxfp4-w4a8, mxfp4-w4a16 (default nvfp4; with --vs vllm: nvfp4,"
                         "mxfp4-w4a8, the formats with a vLLM incumbent)")
    ap.add_argument("--activation", default="bf16", choices=["bf16", "nvfp4", "both"],
                    help="the NVFP4 experts' activation modes: bf16 (W4A16), nvfp4 (W4A4)")
    ap.add_argument("--models", default="flash,pro")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", help="also write the rows and ceilings here")
    ap.add_argument("--decode", help="comma-separated decode M (default 1,8,32,64,128; --quick 1,64,128)")
    ap.add_argument("--prefill", help="comma-separated prefill M (default 2048,8192,16384; --quick 8192); '' = none")
    ap.add_argument("--variants", default="", help="';'-separated sets of k=v switches, e.g. 'sk=0,pdl=0;sk=1,pdl=1'")
    ap.add_argument("--profile", action="store_true", help="per-kernel device times at decode sizes")
    ap.add_argument("--vs", choices=["vllm"], default=None,
                    help="side by side with vLLM 0.33.0's Humming W4A16 (NVFP4) and W4A8 (MXFP4) MoE "
                         "(python -m dsv4.bench.compare; --anchors / DSV4_ANCHORS)")
    ap.add_argument("--anchors", default=None, help="with --vs vllm: anchor folders (see scripts/fetch_anchors.py)")
    return ap


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    args = ap.parse_args(argv)
    names = args.moe_format or ["nvfp4"]
    if args.activation != "bf16" and "nvfp4" not in names:
        ap.error(f"--activation {args.activation} picks the NVFP4 modes, but --moe-format {','.join(names)} has no "
                 "nvfp4")
    if args.vs:
        from dsv4.bench import compare

        decode = "1,8,32,64,128,512" if args.decode is None else args.decode
        prefill = "2048,8192,16384" if args.prefill is None else args.prefill
        Ms = ",".join(v for v in (decode, prefill) if v)
        argv = ["--only", "moe", "--moe-models", args.models, "--moe-m", Ms, "--iters", str(args.iters)]
        argv += ["--moe-format", ",".join(args.moe_format)] if args.moe_format else []
        argv += (["--json", args.json] if args.json else []) + (["--anchors", args.anchors] if args.anchors else [])
        return compare.main(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA device")
    acts = ["bf16", "nvfp4"] if args.activation == "both" else [args.activation]
    cases = I.moe_cases(names, acts)
    decode = [1, 64, 128] if args.quick else [1, 8, 32, 64, 128]
    prefill = [8192] if args.quick else [2048, 8192, 16384]
    if args.decode is not None:
        decode = [int(v) for v in args.decode.split(",") if v]
    if args.prefill is not None:
        prefill = [int(v) for v in args.prefill.split(",") if v]
    variants = [v.strip() for v in args.variants.split(";")] if args.variants else [""]
    for v in variants:
        variant_env(v)  # a bad item fails here, before any timing
    if len(variants) > 1:
        return run_variants(argv, variants, args.json)
    variant = variants[0]
    for env in SWITCHES.values():  # '' = the library's defaults, whatever the shell exported
        os.environ.pop(env, None)
    os.environ.update(variant_env(variant))  # before the first dsv4 call, which reads them

    copy_tbps = copy_bandwidth_tbps()
    gemm_tflops = bf16_gemm_tflops()
    print(f"ceilings in this process: copy {copy_tbps:.2f} TB/s (read+write), bf16 GEMM {gemm_tflops:.0f} TFLOP/s",
          flush=True)
    rows = []
    for name in args.models.split(","):
        m = MODELS[name]
        K, N, E = m["K"], m["N"], m["E_local"]
        for fmt in dict.fromkeys(f for f, _ in cases):
            fmt_acts = [a for f, a in cases if f == fmt]
            w, prepared, w13, w2 = make_weights(m, fmt, fmt_acts)
            fp4_bytes = 3 * N * K * I.MOE_FORMATS[fmt][1]  # codes + block scales per element
            bf16_bytes = 3 * N * K * 2
            for M in decode + prefill:
                sets = [make_inputs(m, M, seed) for seed in range(4)]
                touched = sum(s["touched"] for s in sets) / 4
                n_local = sum(s["n_local"] for s in sets) / 4
                flops = n_local * 6 * K * N
                try:
                    base_us = time_us({"b": [lambda i=i: baseline(sets[i], w13, w2, E, N) for i in range(4)]},
                                      iters=args.iters, cuda_graph=False)["b"].us
                except Exception as ex:  # keep the dsv4 numbers if the baseline cannot run
                    print(f"baseline failed at M={M}: {ex}", flush=True)
                    base_us = float("nan")
                for act in fmt_acts:
                    modes = ["auto"] if M in decode or act == "fp8" else ["auto", 1, 2]
                    kw = act_scales(w, act)
                    outs = [torch.empty(M, K, dtype=torch.bfloat16, device="cuda") for _ in range(4)]

                    def run(i, cta):
                        moe_call(fmt, act, prepared[act], sets[i], outs[i], cta, **kw)

                    # The modes round-robin, so the 2-CTA / 1-CTA ratio is not skewed by drift.
                    res = {cta: t.us for cta, t in time_us({cta: [lambda i=i, cta=cta: run(i, cta) for i in range(4)]
                                                              for cta in modes}, iters=args.iters,
                                                             cuda_graph=False).items()}
                    graph_us = None
                    if M in decode:  # decode runs under CUDA graphs in vLLM: time the replay too
                        try:
                            graph_us = time_us({"g": [lambda i=i: run(i, "auto") for i in range(4)]},
                                               iters=args.iters)["g"].us
                        except Exception as ex:
                            print(f"graph timing failed at M={M}: {ex}", flush=True)
                    for cta, us in res.items():
                        t_us = graph_us if graph_us is not None else us
                        tbps = touched * fp4_bytes / (t_us * 1e-6) / 1e12
                        tflops = flops / (t_us * 1e-6) / 1e12
                        row = dict(model=f"{name}-{E}", M=M, format=fmt, act=act, experts=I.MOE_LABELS[(fmt, act)],
                                   variant=variant, cta=str(cta), us=us, graph_us=graph_us, tbps=tbps,
                                   pct_copy=100 * tbps / copy_tbps, tflops=tflops, pct_gemm=100 * tflops / gemm_tflops,
                                   base_us=base_us, base_tbps=touched * bf16_bytes / (base_us * 1e-6) / 1e12,
                                   speedup=base_us / t_us, speedup_eager=base_us / us,
                                   two_vs_one=(res[1] / res[2]) if (cta == 2 and 1 in res) else None)
                        rows.append(row)
                        print(row, flush=True)
            if args.profile:
                for M in decode:
                    inp = make_inputs(m, M, 0)
                    out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda")
                    act = fmt_acts[0]
                    try:
                        profile_kernels(f"{name} {I.MOE_LABELS[(fmt, act)]}", M, variant,
                                        lambda: moe_call(fmt, act, prepared[act], inp, out, **act_scales(w, act)))
                    except Exception as ex:  # keep the timings if the profiler cannot run here
                        print(f"profile failed at M={M}: {ex}", flush=True)
            del w, prepared, w13, w2
            torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_tbps=copy_tbps, gemm_tflops=gemm_tflops, rows=rows), f, indent=1)
    print_table(rows, copy_tbps, gemm_tflops)

if __name__ == "__main__":
    sys.exit(main())
