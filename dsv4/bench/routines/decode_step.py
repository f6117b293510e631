"""Decode latency of DeepSeek V4 (V4-Flash, V4-Pro) with the dsv4 kernels, per layer type
and per decode step, against torch baselines measured in the same run (the README's main
job; scripts/decode_latency.py runs this routine with the same flags).

Measures, for each model, batch size and context length:
  * attention of one layer of each type (sparse MQA decode over the fp8 paged caches, in
    vLLM's block sizes): SWA (128 window keys), CSA (window + indexer top-k compressed
    entries, ratio 4), HCA (window + all context // 128 compressed entries);
  * the routed-expert MoE of one layer (the E/ep local experts, random top-6 routing over
    all experts, the others masked by an expert map), for each expert format asked for:
    NVFP4 (W4A16 / W4A4) and DeepSeek V4's native MXFP4 (W4A8, vLLM 0.33.0's Hopper
    numerics, and W4A16);
  * baselines: torch bf16 sparse MQA over gathered rows of a bf16 cache, and the bf16
    grouped-GEMM MoE (torch._grouped_mm);
and estimates one decode step as the sum over the model's layer schedule.

Timing: each input set's call captured in a CUDA graph, --iters replays with L2 evicted
before each one, the mean of each set's median (dsv4.bench.timing, the one timer). --vs vllm also times the
kernels vLLM 0.33.0 runs (FlashMLA SM90; Humming W4A16 for NVFP4 W4A16, Humming W4A8 for
MXFP4 W4A8) on the same inputs. Writes tables (console, .txt, .md), a JSON file and PNG
plots into --out-dir. Exit status: 1 no usable GPU (without --cpu-reference), 2 argument
or --out-dir error, 3 some cases failed.

--cpu-reference runs without a GPU: tiny shapes, dsv4's float32 reference kernels beside
torch's bf16 ops on the CPU. It shows the tables, JSON and plots; its times are CPU wall
time, not performance, and it prints no speedups.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys

import torch

from ..argtypes import context_list, gpu_problem, int_list, out_dir_problem
from ..experts import MOE_LABELS, moe_cases, moe_format_list
from ..models import KINDS, MODELS, SCHEDULED
from ..report import console, fmt_ctx, print_tables, to_markdown, to_text

SUMMARY = ("decode latency of V4-Flash / V4-Pro per layer type and estimated decode step, vs torch baselines "
           "(the README's main job)")
GPU_DEFAULTS = dict(batch=[1, 8, 32, 64, 128], context=[4096, 32768, 131072], iters=50)
# --cpu-reference: tiny shapes so the float32 reference kernels finish in seconds.
CPU_DEFAULTS = dict(batch=[1, 2], context=[512, 2048], iters=3)
OUTPUTS = (("json", "decode_latency.json"), ("txt", "decode_latency.txt"), ("md", "decode_latency.md"),
           ("components_png", "latency_vs_batch.png"), ("steps_png", "step_breakdown.png"))


def layers_override(text: str) -> tuple[str, dict]:
    """'pro=0,30,31' -> ("pro", {"swa": 0, "csa": 30, "hca": 31})."""
    m = re.fullmatch(rf"({'|'.join(SCHEDULED)})=(\d+),(\d+),(\d+)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"expected MODEL=SWA,CSA,HCA layer counts (e.g. pro=0,30,31), got {text!r}")
    counts = dict(zip(KINDS, (int(g) for g in m.groups()[1:])))
    if sum(counts.values()) == 0:
        raise argparse.ArgumentTypeError(f"at least one layer needed, got {text!r}")
    return m.group(1), counts


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", choices=[*SCHEDULED, "both"], default="both",
                    help="model shapes (dsv4.bench.models): " + ", ".join(f"{k} = {MODELS[k].name}" for k in SCHEDULED)
                         + ", both (default)")
    ap.add_argument("--batch", type=int_list, default=None,
                    help="decode batch sizes (default 1,8,32,64,128; --cpu-reference: 1,2)")
    ap.add_argument("--context", type=context_list, default=None,
                    help="context lengths, K = 1024, M = 1024^2, each in [128, 1M] (default 4K,32K,128K; "
                         "--cpu-reference: 512,2K)")
    ap.add_argument("--ep", type=int, default=8, help="expert-parallel size: this GPU holds n_experts/ep experts "
                                                      "(must divide 256 / 384; default 8)")
    ap.add_argument("--moe-format", type=moe_format_list, default=["nvfp4"],
                    help="MoE expert formats, comma-separated: nvfp4 (in the --activation modes), mxfp4-w4a8 "
                         "(DeepSeek V4's MXFP4 experts, FP8 activations: vLLM 0.33.0's Hopper numerics), mxfp4-w4a16; "
                         "default nvfp4. The step estimate uses each")
    ap.add_argument("--activation", choices=["bf16", "nvfp4", "both"], default=None,
                    help="NVFP4 MoE activation mode: bf16 (W4A16, the default), nvfp4 (W4A4) or both")
    ap.add_argument("--out-dir", default="decode_latency_results",
                    help="where the JSON, tables and plots go (created; default decode_latency_results, which "
                         ".gitignore lists; a path that cannot hold them is refused before the sweep, status 2)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per case (default 50; CPU: 3)")
    ap.add_argument("--layers", type=layers_override, action="append", default=[], metavar="MODEL=SWA,CSA,HCA",
                    help="override a model's layer schedule, e.g. pro=0,30,31 (default: the checkpoints' "
                         "config.json, dsv4.bench.models); repeatable")
    ap.add_argument("--vs", choices=["vllm"], default=None,
                    help="also time the kernels vLLM 0.33.0 runs on Hopper (FlashMLA SM90 attention; Humming W4A16 "
                         "for the NVFP4 W4A16 MoE, Humming W4A8 for MXFP4 W4A8) on the same inputs, in the same timer "
                         "call (see scripts/fetch_anchors.py)")
    ap.add_argument("--anchors", default=None,
                    help="with --vs vllm: folders holding the incumbents (os.pathsep-separated; else $DSV4_ANCHORS "
                         "or an installed vllm==0.33.0 / humming-kernels==0.1.19)")
    ap.add_argument("--cpu-reference", action="store_true",
                    help="no GPU: tiny shapes on the CPU, dsv4 ops run their float32 reference kernels; shows the "
                         "tables, JSON and plots, its times are not performance (no speedups shown)")


def check(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Fills the defaults of the mode (GPU or --cpu-reference) and refuses inconsistent
    flags (status 2)."""
    defaults = CPU_DEFAULTS if args.cpu_reference else GPU_DEFAULTS
    args.batch = sorted(set(args.batch or defaults["batch"]))
    args.context = sorted(set(args.context or defaults["context"]))
    if args.iters is None:
        args.iters = defaults["iters"]
    if args.iters < 1:
        ap.error(f"--iters must be >= 1, got {args.iters}")
    args.models = list(SCHEDULED) if args.model == "both" else [args.model]
    if args.activation is not None and "nvfp4" not in args.moe_format:
        ap.error(f"--activation picks the NVFP4 MoE modes, but --moe-format {','.join(args.moe_format)} has no nvfp4")
    activation = args.activation or "bf16"
    args.moe = moe_cases(args.moe_format, ["bf16", "nvfp4"] if activation == "both" else [activation])
    for m in args.models:
        n = MODELS[m].n_experts
        if args.ep < 1 or n % args.ep:
            ap.error(f"--ep must divide the number of experts of {MODELS[m].name} ({n}), got {args.ep}")


def run(args: argparse.Namespace) -> int:
    if not args.cpu_reference:
        why = gpu_problem()
        if why:
            print(f"dsv4: decode-step: {why}; nothing measured (--cpu-reference runs the tiny CPU reference run "
                  "instead)", file=sys.stderr)
            return 1
    why = out_dir_problem(args.out_dir)
    if why:
        print(f"dsv4: decode-step: {why}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if args.cpu_reference:  # tiny ops: one thread is faster and does not collapse on a busy machine
        torch.set_num_threads(1)
    try:
        return _sweep(args)
    finally:
        torch.set_num_threads(threads)


def _device_info(sweep) -> dict:
    import dsv4

    info = dict(torch=torch.__version__, dsv4=dsv4.__version__, python=platform.python_version(),
                host=platform.node())
    if not sweep.cpu:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm_count=p.multi_processor_count, memory_gb=round(p.total_memory / 1e9, 1))
    return info


def _sweep(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .decode_step_plots import plot_components, plot_steps, plot_vllm_ratio
    from .decode_step_sweep import Sweep, num
    from .decode_step_tables import CPU_LINE, NOT_INCLUDED, build_tables, notes, step_rows

    device = "cpu" if args.cpu_reference else "cuda"
    sweep = Sweep(args, device)
    con = console(150)
    t0 = datetime.datetime.now()
    copy_tbps = None
    if sweep.cpu:
        con.print(CPU_LINE, highlight=False)
    else:
        from ..timing import copy_bandwidth_tbps

        torch.backends.cuda.matmul.allow_tf32 = False
        copy_tbps = copy_bandwidth_tbps()
        con.print(f"{torch.cuda.get_device_name()}: device copy ceiling {copy_tbps:.2f} TB/s (read + write)")
    if sweep.vs_line:
        con.print(sweep.vs_line, highlight=False)
    con.print(f"{' + '.join(sweep.shapes[m].name for m in args.models)}: batch {args.batch}, context "
              f"{[fmt_ctx(c) for c in args.context]}, EP{args.ep}, MoE {'/'.join(MOE_LABELS[c] for c in args.moe)}, "
              f"{sweep.n_cases()} cases", highlight=False)
    with Progress(TextColumn("[bold]decode latency"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=Console(stderr=True)) as bar:
        task = bar.add_task("", total=sweep.n_cases())
        sweep.run(lambda label, done: bar.update(task, description=label, advance=done))

    steps = step_rows(sweep)
    summary, detail = build_tables(sweep, steps, copy_tbps)
    print_tables(summary, con)
    for line in notes(sweep):
        con.print(f"- {line}", highlight=False)

    paths = {k: os.path.join(args.out_dir, f) for k, f in OUTPUTS}
    meta = dict(mode="cpu-reference" if sweep.cpu else "cuda", started=t0.isoformat(timespec="seconds"),
                seconds=round((datetime.datetime.now() - t0).total_seconds(), 1), argv=args.argv,
                batch=args.batch, context=args.context, ep=args.ep, moe_format=args.moe_format,
                moe_cases=[dict(format=f, activation=act, label=MOE_LABELS[(f, act)]) for f, act in args.moe],
                iters=args.iters, input_sets=sweep.n_sets, copy_tbps=copy_tbps, device=_device_info(sweep),
                notes=notes(sweep), not_included=NOT_INCLUDED,
                layer_schedule_source="compress_ratios of each checkpoint's HF config.json (dsv4.bench.models)",
                layer_overrides=dict(args.layers))
    models = {m: dict(name=s.name, hidden=s.hidden, heads=s.heads, index_topk=s.index_topk, n_experts=s.n_experts,
                      local_experts=s.local_experts(args.ep), moe_intermediate=s.moe_inter, layers=s.layers,
                      moe_layers=sum(s.layers.values())) for m, s in sweep.shapes.items()}
    components = [{k: (num(v) if isinstance(v, float) else v) for k, v in r.items()} for r in sweep.rows]
    with open(paths["json"], "w") as f:  # first: the numbers survive a failing plot
        json.dump(dict(meta=meta, models=models, components=components, steps=steps), f, indent=1)
    with open(paths["txt"], "w") as f:
        f.write(to_text(summary + detail, 200, notes=notes(sweep)))
    with open(paths["md"], "w") as f:
        f.write(to_markdown(summary + detail, notes=notes(sweep)))
    plot_components(sweep, paths["components_png"])
    plot_steps(sweep, steps, paths["steps_png"])
    ratio_png = os.path.join(args.out_dir, "ratio_vs_vllm.png")
    if plot_vllm_ratio(sweep, ratio_png):
        paths["ratio_png"] = ratio_png
    con.print("wrote " + ", ".join(paths.values()), highlight=False)
    errors = [r for r in sweep.rows if r.get("error")]
    if errors:
        con.print(f"{len(errors)} case(s) failed, first: {errors[0]['error']}", highlight=False)
        return 3
    return 0
