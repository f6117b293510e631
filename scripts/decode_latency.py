"""Decode latency of DeepSeek V4 (V4-Flash, V4-Pro) with the dsv4 kernels, per layer
type and per decode step, against torch baselines measured in the same run.

Measures, for each model, batch size and context length:
  * attention of one layer of each type (sparse MQA decode over the fp8 paged cache):
    SWA (128 window keys), CSA (window + indexer top-k compressed entries, ratio 4),
    HCA (window + all context // 128 compressed entries);
  * the routed-expert MoE of one layer (the E/ep local experts, random top-6 routing
    over all experts, the others masked by an expert map), for each expert format asked
    for: NVFP4 (W4A16 / W4A4) and DeepSeek V4's native MXFP4 (W4A8, vLLM 0.33.0's Hopper
    numerics, and W4A16);
  * baselines: torch bf16 sparse MQA over gathered rows of a bf16 cache, and the bf16
    grouped-GEMM MoE (torch._grouped_mm);
and estimates one decode step as the sum over the model's layer schedule.

Timing: each input set's call captured in a CUDA graph, median of --iters replays with
L2 evicted before each one (dsv4.bench.timing, the one timer). --vs vllm also times the kernels
vLLM 0.33.0 runs (FlashMLA SM90; Humming W4A16 for NVFP4 W4A16, Humming W4A8 for MXFP4
W4A8) on the same inputs. Writes a table (console
and .txt/.md), a JSON file and two PNG plots into --out-dir.

Usage: python scripts/decode_latency.py [--model flash|pro|both] [--batch 1,8,32,64,128]
       [--context 4K,32K,128K] [--ep 8] [--moe-format nvfp4,mxfp4-w4a8,mxfp4-w4a16]
       [--activation bf16|nvfp4|both] [--out-dir DIR]
       [--iters 50] [--layers pro=0,30,31] [--cpu-reference]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import re
import sys
import tempfile

import torch

import dsv4
import dsv4._ops
from dsv4 import latency as L
from dsv4.bench import inputs as I
from dsv4.bench.incumbents import MOE_INCUMBENTS

GPU_DEFAULTS = dict(batch=[1, 8, 32, 64, 128], context=[4096, 32768, 131072], iters=50)
# --cpu-reference: tiny shapes so the float32 reference kernels finish in seconds.
CPU_DEFAULTS = dict(batch=[1, 2], context=[512, 2048], iters=3)
N_SETS_GPU = 4  # rotating input sets per case
N_SETS_CPU = 2
KINDS = ("swa", "csa", "hca")
KIND_LABEL = {"swa": "SWA attn", "csa": "CSA attn", "hca": "HCA attn", "moe": "routed MoE"}
MOE_LABEL = I.MOE_LABELS  # (format, activation mode) -> "NVFP4 W4A16", "MXFP4 W4A8", ...


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; every item a positive decimal integer (no empty items)."""
    items = [v.strip() for v in text.split(",")]
    if not all(re.fullmatch(r"\d+", v) for v in items) or any(int(v) == 0 for v in items):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of positive integers like 1,8,32, got {text!r}")
    return [int(v) for v in items]


def context_list(text: str) -> list[int]:
    """'4K,32K,128K' or '4096,32768' -> token counts (K = 1024, M = 1024^2)."""
    values = []
    for v in (s.strip() for s in text.split(",")):
        m = re.fullmatch(r"(\d+)([kKmM]?)", v)
        if not m:
            raise argparse.ArgumentTypeError(f"expected context lengths like 4K,32K,128K or 4096, got {text!r}")
        values.append(int(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20}[m.group(2).lower()])
    for v in values:
        if not L.WINDOW <= v <= 1 << 20:
            raise argparse.ArgumentTypeError(f"context lengths must lie in [{L.WINDOW}, 1M] tokens, got {v}")
    return values


def layers_override(text: str) -> tuple[str, dict]:
    """'pro=0,30,31' -> ("pro", {"swa": 0, "csa": 30, "hca": 31})."""
    m = re.fullmatch(r"(flash|pro)=(\d+),(\d+),(\d+)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"expected MODEL=SWA,CSA,HCA layer counts (e.g. pro=0,30,31), got {text!r}")
    counts = dict(zip(KINDS, (int(g) for g in m.groups()[1:])))
    if sum(counts.values()) == 0:
        raise argparse.ArgumentTypeError(f"at least one layer needed, got {text!r}")
    return m.group(1), counts


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Decode latency of DeepSeek V4 with the dsv4 kernels vs torch baselines: per layer type, "
                    "routed MoE, and an estimated full decode step.")
    ap.add_argument("--model", choices=["flash", "pro", "both"], default="both")
    ap.add_argument("--batch", type=int_list, default=None,
                    help="decode batch sizes (default 1,8,32,64,128; --cpu-reference: 1,2)")
    ap.add_argument("--context", type=context_list, default=None,
                    help="context lengths, K = 1024 (default 4K,32K,128K; --cpu-reference: 512,2K)")
    ap.add_argument("--ep", type=int, default=8, help="expert-parallel size: this GPU holds n_experts/ep experts")
    ap.add_argument("--moe-format", type=I.moe_format_list, default=["nvfp4"],
                    help="MoE expert formats, comma-separated: nvfp4 (in the --activation modes), mxfp4-w4a8 "
                         "(DeepSeek V4's MXFP4 experts, FP8 activations: vLLM 0.33.0's Hopper numerics), mxfp4-w4a16; "
                         "default nvfp4. The step estimate uses each")
    ap.add_argument("--activation", choices=["bf16", "nvfp4", "both"], default=None,
                    help="NVFP4 MoE activation mode: bf16 (W4A16, the default) or nvfp4 (W4A4)")
    ap.add_argument("--out-dir", default="decode_latency_results",
                    help="where the JSON, table and plots go (the default is in .gitignore)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per case (default 50; CPU: 3)")
    ap.add_argument("--layers", type=layers_override, action="append", default=[], metavar="MODEL=SWA,CSA,HCA",
                    help="override a model's layer schedule (default: the checkpoints' config.json, "
                         "see dsv4/latency.py LAYER_SCHEDULE)")
    ap.add_argument("--vs", choices=["vllm"], default=None,
                    help="also time the kernels vLLM 0.33.0 runs on Hopper (FlashMLA SM90 attention; Humming W4A16 "
                         "for the NVFP4 W4A16 MoE, Humming W4A8 for MXFP4 W4A8) on the same inputs, in the same timer "
                         "call (see scripts/fetch_anchors.py)")
    ap.add_argument("--anchors", default=None,
                    help="with --vs vllm: folders holding the incumbents (os.pathsep-separated; else $DSV4_ANCHORS "
                         "or an installed vllm==0.33.0 / humming-kernels==0.1.19)")
    ap.add_argument("--cpu-reference", action="store_true",
                    help="no GPU: tiny shapes on the CPU, dsv4 ops run their float32 reference kernels")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    defaults = CPU_DEFAULTS if args.cpu_reference else GPU_DEFAULTS
    args.batch = args.batch or defaults["batch"]
    args.context = args.context or defaults["context"]
    if args.iters is None:
        args.iters = defaults["iters"]
    if args.iters < 1:
        ap.error(f"--iters must be >= 1, got {args.iters}")
    args.models = ["flash", "pro"] if args.model == "both" else [args.model]
    if args.activation is not None and "nvfp4" not in args.moe_format:
        ap.error(f"--activation picks the NVFP4 MoE modes, but --moe-format {','.join(args.moe_format)} has no nvfp4")
    activation = args.activation or "bf16"
    args.moe = I.moe_cases(args.moe_format, ["bf16", "nvfp4"] if activation == "both" else [activation])
    for m in args.models:
        n = L.MODELS[m].n_experts
        if args.ep < 1 or n % args.ep:
            ap.error(f"--ep must divide the number of experts of {L.MODELS[m].name} ({n}), got {args.ep}")
    args.batch = sorted(set(args.batch))
    args.context = sorted(set(args.context))
    return args


def out_dir_problem(path: str) -> str | None:
    """Creates --out-dir; why it cannot hold the results, in one line, or None."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as ex:
        return f"--out-dir {path!r} cannot hold the results: {ex.strerror or ex}"
    return None


def gpu_problem() -> str | None:
    """Why the CUDA run cannot happen here, in one line, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU available (torch.cuda.is_available() is False)"
    if not dsv4._ops.HAS_CUDA_EXTENSION:
        return f"the dsv4 CUDA extension is not built ({dsv4._ops.EXTENSION_ERROR})"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"the dsv4 kernels target sm_90a (Hopper), this GPU is sm_{major}{minor}"
    return None


# --------------------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------------------


def num(x):
    """JSON-safe float (NaN/inf -> None)."""
    return float(x) if x is not None and math.isfinite(x) else None


class Sweep:
    def __init__(self, args, device: str):
        self.args, self.device = args, device
        self.cpu = device == "cpu"
        if self.cpu:
            self.timer = functools.partial(L.cpu_median_us, iters=args.iters, warmup=1)
            self.n_sets = N_SETS_CPU
        else:
            self.timer = functools.partial(L.graph_replay_us, iters=args.iters, warmup=5)
            self.n_sets = N_SETS_GPU
        self.shapes = {}
        overrides = dict(args.layers)
        for m in args.models:
            s = L.MODELS[m]
            s = dataclasses.replace(s, layers=overrides.get(m, s.layers))
            self.shapes[m] = L.tiny_shape(s) if self.cpu else s
        self.rows: list[dict] = []
        self.seed = 0
        self.anchors = None
        self.humming = None
        self.vs_line = None  # one line: the incumbents found, or why the comparison is missing
        if args.vs:
            if self.cpu:
                self.vs_line = "--vs vllm: no comparison in a CPU reference run (the incumbents are CUDA kernels)"
            else:
                from dsv4.bench.anchors import find_anchors

                self.anchors = find_anchors(args.anchors.split(os.pathsep) if args.anchors else None)
                self.vs_line = "--vs vllm: " + self.anchors.summary()

    def timed(self, ours: list, theirs) -> tuple:
        """(dsv4 us, how, incumbent us or None): both in one timer call when the incumbent
        runs (same inputs, interleaved), else dsv4 alone."""
        if self.cpu or theirs is None:
            us, how = self.timer(ours)
            return us, how, None
        from dsv4.bench.timing import time_us

        t = time_us({"dsv4": ours, "vllm": theirs}, iters=self.args.iters, warmup=5)
        return t["dsv4"].us, t["dsv4"].method, t["vllm"].us

    def gen(self) -> torch.Generator:
        self.seed += 1
        return torch.Generator(device=self.device).manual_seed(1000 + self.seed)

    def n_cases(self) -> int:
        b, c = len(self.args.batch), len(self.args.context)
        return len(self.args.models) * (len(self.args.moe) * b + b * (1 + 2 * c))

    def mem_budget(self) -> int:
        """Bytes the torch attention baseline may take for its temporaries."""
        if self.cpu:
            return 2 << 30
        free, _ = torch.cuda.mem_get_info()
        return free // 2

    def run(self, progress) -> None:
        a = self.args
        max_span = max(a.context) // L.CSA_RATIO
        if self.cpu:
            pools = L.KvPools.build(1024, max(4096, 2 * max_span), self.device)
        else:  # pools far larger than L2; each sequence's run of entries at a random offset
            pools = L.KvPools.build(1 << 18, max(1 << 21, 2 * max_span), self.device)
        for m in a.models:
            shape = self.shapes[m]
            for fmt in dict.fromkeys(f for f, _ in a.moe):
                progress(f"{shape.name}: building {shape.n_experts // a.ep} {fmt.upper()} experts", 0)
                self.run_moe(m, shape, fmt, [act for f, act in a.moe if f == fmt], progress)
                self.free()
            for kind in KINDS:
                for ctx in ([None] if kind == "swa" else a.context):
                    for b in a.batch:
                        label = f"{shape.name} {KIND_LABEL[kind]} {fmt_ctx(ctx)} B={b}"
                        progress(label, 0)
                        self.rows.append(self.safe(lambda: self.attention_case(m, shape, kind, b, ctx, pools),
                                                   dict(model=m, component="attn_" + kind, batch=b, context=ctx)))
                        progress(label, 1)
            self.free()
        self.free()
        order = {"attn_swa": 0, "attn_csa": 1, "attn_hca": 2, "moe": 3}
        moe_order = {c: i for i, c in enumerate(a.moe)}
        self.rows.sort(key=lambda r: (a.models.index(r["model"]), order[r["component"]],
                                      moe_order.get((r.get("format"), r.get("activation")), -1),
                                      r["context"] or 0, r["batch"]))

    def safe(self, fn, ident: dict) -> dict:
        """One failing case must not lose the rest of the sweep."""
        try:
            return fn()
        except Exception as ex:  # recorded in the row and the table notes
            return dict(ident, dsv4_us=None, torch_us=None, error=f"{type(ex).__name__}: {ex}"[:300])

    def free(self) -> None:
        gc.collect()
        if not self.cpu:
            torch.cuda.empty_cache()

    def attention_case(self, m, shape, kind, b, ctx, pools) -> dict:
        gen = self.gen()
        ctx_in = ctx if ctx is not None else max(self.args.context)  # SWA: any context >= 128
        sets = [L.attention_inputs(kind, shape, b, ctx_in, pools, gen) for _ in range(self.n_sets)]
        outs = [torch.empty_like(s["q"]) for s in sets]
        k_win, k_comp = L.attention_keys(kind, shape, ctx_in)
        keys = k_win + k_comp
        theirs = None
        if self.anchors is not None and self.anchors.flashmla:
            from dsv4.bench.incumbents import FlashMLADecode

            fm_outs = [torch.empty_like(s["q"]) for s in sets]
            theirs = [FlashMLADecode(L.flashmla_case(s, pools), L.SOFTMAX_SCALE, o) for s, o in zip(sets, fm_outs)]
        us, how, vllm_us = self.timed([functools.partial(L.dsv4_attention, s, pools, o) for s, o in zip(sets, outs)],
                                      theirs)
        flops, nbytes = L.attention_traffic(b, shape.heads, keys)
        row = dict(model=m, component="attn_" + kind, batch=b, context=ctx, window_keys=k_win,
                   compressed_keys=k_comp, dsv4_us=us, dsv4_timing=how, flops=flops, bytes=nbytes,
                   tflops=flops / us / 1e6, tbps=nbytes / us / 1e6, torch_us=None, vllm_us=vllm_us)
        if vllm_us is not None:
            row.update(vllm_kernel="FlashMLA SM90", vllm_ratio=vllm_us / us,
                       vllm_max_abs_diff=num((outs[0].float() - fm_outs[0].float()).abs().max().item()))
        need = L.torch_attention_bytes(b, shape.heads, keys) * self.n_sets  # one graph pool per set
        if need > self.mem_budget():
            row["torch_note"] = f"torch baseline skipped: needs ~{need / 1e9:.1f} GB of temporaries"
        else:
            row["torch_us"], row["torch_timing"] = self.timer(
                [functools.partial(L.torch_attention, s, pools) for s in sets])
            ref = L.torch_attention(sets[0], pools)
            L.dsv4_attention(sets[0], pools, outs[0])
            row["max_abs_diff"] = num((outs[0].float() - ref.float()).abs().max().item())
        return row

    def run_moe(self, m, shape, fmt, acts, progress) -> None:
        a = self.args
        ident = dict(model=m, component="moe", format=fmt, batch=None, context=None)
        cases = [(fmt, act) for act in acts if (fmt, act) in MOE_INCUMBENTS]  # at most one per format
        why = self.incumbent_missing(cases[0]) if cases else "no incumbent"
        wanted = [MOE_INCUMBENTS[c] for c in cases]
        try:
            setup = L.MoeSetup.build(shape, a.ep, self.device, fmt=fmt, acts=acts, keep_raw=why is None)
        except Exception as ex:
            for act in acts:
                for b in a.batch:
                    self.rows.append(dict(ident, activation=act, batch=b, dsv4_us=None, torch_us=None,
                                          error=f"{type(ex).__name__}: {ex}"[:300]))
                    progress(f"{shape.name} MoE failed", 1)
            return
        emap = setup.expert_map(self.device)
        scales = L.moe_act_scales(self.device)
        self.humming = None
        if wanted and why is None:
            from dsv4.bench.incumbents import HummingW4A8, HummingW4A16

            try:
                cls = HummingW4A16 if fmt == "nvfp4" else HummingW4A8
                self.humming = cls(setup.raw, shape.n_experts, shape.swiglu_limit)
            except Exception as ex:  # the comparison is missing, dsv4's numbers are kept
                self.vs_line += f"; {wanted[0]} conversion failed for {shape.name}: {type(ex).__name__}: {ex}"[:300]
            setup.raw = None
        elif wanted and self.anchors is not None and why not in self.vs_line:
            self.vs_line += f"; {wanted[0]} missing: {why}"
        baseline: dict = {}  # per batch: the bf16 baseline does not depend on the activation mode
        for act in acts:
            for b in a.batch:
                label = f"{shape.name} MoE {MOE_LABEL[(fmt, act)]} EP{a.ep} B={b}"
                progress(label, 0)
                self.rows.append(self.safe(lambda: self.moe_case(m, setup, act, b, emap, scales, baseline),
                                           dict(ident, activation=act, batch=b)))
                progress(label, 1)

    def incumbent_missing(self, case):
        """Why the incumbent of MoE ``case`` cannot run here (None: it can)."""
        if self.anchors is None:
            return "CPU reference run" if self.cpu else "no --vs vllm"
        from dsv4.bench.incumbents import moe_incumbent_missing

        return moe_incumbent_missing(self.anchors, case)

    def moe_case(self, m, setup, act, b, emap, scales, baseline) -> dict:
        shape = setup.shape
        gen = self.gen()
        sets = [L.moe_inputs(setup, b, gen, emap) for _ in range(self.n_sets)]
        outs = [torch.empty_like(s["x"]) for s in sets]
        theirs, plans = None, None
        incumbent = MOE_INCUMBENTS.get((setup.fmt, act))
        if incumbent is not None and self.humming is not None:  # the same numerics on both sides
            plans = [self.humming.plan(s["ids"], s["emap"]) for s in sets]
            theirs = [functools.partial(self.humming.experts, s["x"], pl) for s, pl in zip(sets, plans)]
        us, how, vllm_us = self.timed([functools.partial(L.dsv4_moe, s, setup, act, o, scales)
                                       for s, o in zip(sets, outs)], theirs)
        touched, slots = zip(*(L.moe_touched(s, setup.e_local) for s in sets))
        touched, slots = sum(touched) / len(sets), sum(slots) / len(sets)
        nbytes = touched * L.moe_expert_bytes(shape, setup.fmt)
        flops = slots * 6 * shape.moe_inter * shape.hidden
        row = dict(model=m, component="moe", format=setup.fmt, activation=act, batch=b, context=None,
                   ep=self.args.ep, local_experts=setup.e_local, local_slots=slots, touched_experts=touched,
                   dsv4_us=us, dsv4_timing=how, flops=flops, bytes=nbytes, tflops=flops / us / 1e6,
                   tbps=nbytes / us / 1e6, torch_us=None, vllm_us=vllm_us)
        if vllm_us is not None:
            # Humming's time covers its two GEMMs, the activation and (W4A8) vLLM's GEMM1
            # input quantization; routing prep and the weighted sum (vLLM's own kernels)
            # are not in it; dsv4's covers the whole op
            ref = self.humming(sets[0]["x"], sets[0]["tw"], plans[0]).float()
            row.update(vllm_kernel=incumbent, vllm_ratio=vllm_us / us,
                       vllm_rel_diff=num(((outs[0].float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
                                         .item()))
        if setup.w13_bf16 is None:
            row["torch_note"] = setup.note
            return row
        if b not in baseline:
            def base(s):
                return L.moe_bf16_baseline(s["x"], s["ids"], s["tw"], s["emap"], setup.w13_bf16, setup.w2_bf16,
                                           shape.swiglu_limit)
            baseline[b] = self.timer([functools.partial(base, s) for s in sets]) + (base,)
        row["torch_us"], row["torch_timing"], base = baseline[b]
        row["torch_bytes"] = touched * L.moe_expert_bytes(shape, "bf16")
        ref = base(sets[0]).float()
        L.dsv4_moe(sets[0], setup, act, outs[0], scales)
        row["rel_diff"] = num(((outs[0].float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item())
        return row


def fmt_ctx(ctx) -> str:
    if ctx is None:
        return "any ctx"
    if ctx % (1 << 20) == 0:
        return f"{ctx >> 20}M"
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


# --------------------------------------------------------------------------------------
# results: step estimates, tables, JSON, plots
# --------------------------------------------------------------------------------------


def find(rows, **key):
    for r in rows:
        if all(r.get(k) == v for k, v in key.items()):
            return r
    return None


def step_rows(sweep: Sweep) -> list[dict]:
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
                        row[impl] = L.step_estimate(layers, attn, moe.get(impl + "_us") if moe else None)
                    d, t, v = row["dsv4"], row["torch"], row["vllm"]
                    row["speedup"] = t["total_us"] / d["total_us"] if d and t else None
                    row["vllm_ratio"] = v["total_us"] / d["total_us"] if d and v else None
                    out.append(row)
    return out


def fmt_us(x) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def fmt_ratio(x) -> str:
    """Speedup label: two significant digits below 1 (a CPU reference run is 100x slower
    than torch, and '0.0x' would hide by how much)."""
    return f"{x:.1f}x" if x >= 1 else f"{x:.2g}x"


def fmt_ms(x) -> str:
    return "-" if x is None else f"{x / 1e3:.2f}"


def component_label(sweep, r) -> str:
    s = sweep.shapes[r["model"]]
    if r["component"] == "moe":
        return (f"MoE {MOE_LABEL[(r['format'], r['activation'])]}, EP{sweep.args.ep} "
                f"({s.n_experts // sweep.args.ep} local)")
    kind = r["component"][5:]
    k_win, k_comp = L.attention_keys(kind, s, r["context"] or max(sweep.args.context))
    keys = f"{k_win}" if kind == "swa" else f"{k_win}+{k_comp}"
    return f"{KIND_LABEL[kind]} {fmt_ctx(r['context'])} ({keys} keys)"


def build_tables(sweep: Sweep, steps: list[dict], copy_tbps) -> tuple[list, list]:
    """(summary tables, detail tables); each table = (title, header, rows of str, caption)."""
    a = sweep.args
    unit = "us" if not sweep.cpu else "us (CPU)"
    summary, detail = [], []
    for m in a.models:
        s = sweep.shapes[m]
        rows, seen = [], []
        for r in sweep.rows:
            if r["model"] != m:
                continue
            lab = component_label(sweep, r)
            if lab not in seen:
                seen.append(lab)
        for lab in seen:
            cells = [lab]
            for b in a.batch:
                r = next((r for r in sweep.rows if r["model"] == m and r["batch"] == b
                          and component_label(sweep, r) == lab), None)
                if r is None or r.get("dsv4_us") is None:
                    cells.append("error" if r is not None and r.get("error") else "-")
                    continue
                t = r.get("torch_us")
                cells.append(f"{fmt_us(r['dsv4_us'])} / {fmt_us(t)}" + (f" ({fmt_ratio(t / r['dsv4_us'])})" if t else ""))
            rows.append(cells)
        summary.append((f"{s.name}: one layer, {unit}, dsv4 / torch baseline (speedup)",
                        ["component"] + [f"B={b}" for b in a.batch], rows, None))
        lay = s.layers
        for case in a.moe:
            rows = []
            for ctx in a.context:
                cells = [fmt_ctx(ctx)]
                for b in a.batch:
                    st = find(steps, model=m, format=case[0], activation=case[1], batch=b, context=ctx)
                    d, t = st["dsv4"], st["torch"]
                    cells.append(f"{fmt_ms(d and d['total_us'])} / {fmt_ms(t and t['total_us'])}"
                                 + (f" ({fmt_ratio(st['speedup'])})" if st["speedup"] else ""))
                rows.append(cells)
            summary.append((f"{s.name}: decode step estimate, ms{' (CPU)' if sweep.cpu else ''}, dsv4 / torch "
                            f"(speedup), MoE {MOE_LABEL[case]}",
                            ["context"] + [f"B={b}" for b in a.batch], rows,
                            f"{lay['swa']} SWA + {lay['csa']} CSA + {lay['hca']} HCA attention layers, "
                            f"{sum(lay.values())} routed-MoE layers; kernels only (see 'not included')"))
        if a.vs and any(r.get("vllm_us") for r in sweep.rows if r["model"] == m):
            rows = []
            for lab in seen:
                cells = [lab]
                for b in a.batch:
                    r = next((r for r in sweep.rows if r["model"] == m and r["batch"] == b
                              and component_label(sweep, r) == lab), None)
                    v = r.get("vllm_us") if r else None
                    cells.append(f"{fmt_us(r['dsv4_us'])} / {fmt_us(v)} ({v / r['dsv4_us']:.2f}x)" if v else "-")
                rows.append(cells)
            summary.append((f"{s.name}: one layer, us, dsv4 / vLLM 0.33 kernels (ratio = vLLM / dsv4)",
                            ["component"] + [f"B={b}" for b in a.batch], rows,
                            "vLLM 0.33 kernels: FlashMLA SM90 sparse decode (attention); Humming W4A16 (NVFP4 "
                            "W4A16) and Humming W4A8 (MXFP4 W4A8, with vLLM's GEMM1 input quantization) for the MoE, "
                            "their GEMMs + activation only; same inputs, same timer call"))
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
                summary.append((f"{s.name}: decode step estimate, ms, dsv4 / vLLM 0.33 kernels (ratio), MoE "
                                f"{MOE_LABEL[case]} vs {MOE_INCUMBENTS[case]}",
                                ["context"] + [f"B={b}" for b in a.batch], rows,
                                "the same sum over the layer schedule with each layer's incumbent time"))
        rows = []
        for r in sweep.rows:
            if r["model"] != m:
                continue
            d, t = r.get("dsv4_us"), r.get("torch_us")
            pct = f"{100 * r['tbps'] / copy_tbps:.0f}%" if copy_tbps and r.get("tbps") else "-"
            diff = r.get("max_abs_diff", r.get("rel_diff"))
            note = r.get("error") or r.get("torch_note") or ""
            if r.get("dsv4_timing") == "eager" or r.get("torch_timing") == "eager":
                note = (note + " eager timing (graph capture failed)").strip()
            rows.append([component_label(sweep, r), str(r["batch"]), fmt_us(d),
                         f"{r['tbps']:.2f}" if r.get("tbps") else "-", pct,
                         f"{r['tflops']:.1f}" if r.get("tflops") else "-", fmt_us(t),
                         fmt_ratio(t / d) if d and t else "-", "-" if diff is None else f"{diff:.2g}",
                         fmt_us(r.get("vllm_us")), f"{r['vllm_us'] / d:.2f}x" if d and r.get("vllm_us") else "-",
                         note])
        detail.append((f"{s.name}: all cases", ["component", "B", f"dsv4 {unit}", "TB/s", "% copy", "TFLOP/s",
                                                f"torch {unit}", "speedup", "diff", "vLLM us", "vs vLLM", "note"],
                       rows,
                       "TB/s = bytes read (cache rows / touched FP4 experts) + q/out per time; % of the device "
                       "copy bandwidth measured in this run; diff = max |dsv4 - torch| (attention) or max |diff| / "
                       "max |torch| (MoE)"))
    return summary, detail


def render_rich(console, tables) -> None:
    from rich.table import Table

    for title, header, rows, caption in tables:
        t = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
        for i, h in enumerate(header):
            t.add_column(h, justify="left" if i == 0 or h == "note" else "right")
        for r in rows:
            t.add_row(*r)
        console.print(t)


def render_markdown(tables) -> str:
    parts = []
    for title, header, rows, caption in tables:
        parts.append(f"**{title}**\n")
        parts.append("| " + " | ".join(header) + " |")
        parts.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
        parts += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
        if caption:
            parts.append(f"\n{caption}")
        parts.append("")
    return "\n".join(parts)


def notes(sweep: Sweep) -> list[str]:
    a = sweep.args
    out = []
    if sweep.cpu:
        out.append("CPU reference run: tiny shapes (hidden 256, intermediate 128, top-k / 16); dsv4 ops run their "
                   "float32 reference kernels; times are CPU wall time, not GPU latency.")
    else:
        out.append(f"timing: each input set's call captured in a CUDA graph; median of {a.iters} replays over "
                   f"{N_SETS_GPU} rotating input sets, L2 evicted before each replay (in a real step the rest of "
                   "the model streams through L2 between two calls of a layer).")
    out.append("attention: fp8_ds_mla paged caches (window + compressed pools shared by all sequences, slot ids "
               "drawn at random offsets); torch baseline = bf16 gather + bf16 matmuls + fp32 softmax with the "
               "sink, over a bf16 copy of the same cache rows.")
    out.append(f"MoE: one token per sequence (B tokens per call), random top-6 routing over all experts, expert map = rank 0 of "
               f"EP{a.ep} (~6/{a.ep} local slots per token); torch baseline = bf16 torch._grouped_mm MoE over "
               "the dequantized local experts.")
    if any(f == "mxfp4" for f, _ in a.moe):
        out.append("MXFP4 experts: DeepSeek V4's native format in vLLM's layout (e2m1 codes, one e8m0 scale per 32), "
                   "random codes and scales; W4A8 quantizes GEMM1's input and the SwiGLU output to FP8 per token and "
                   "128 elements (GEMM1 scales rounded up to powers of two, vLLM 0.33.0's Hopper default), W4A16 "
                   "keeps bf16 activations.")
    if sweep.vs_line:
        out.append(sweep.vs_line)
    out.append("step estimate = sum over the layer schedule of one attention call per layer (its type) + one "
               "routed-MoE call per layer; not included: " + "; ".join(L.NOT_INCLUDED) + ".")
    return out


def plot_components(sweep: Sweep, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = sweep.args
    comps = ["attn_swa", "attn_csa", "attn_hca", "moe"]
    fig, axes = plt.subplots(len(a.models), 4, figsize=(18, 4.2 * len(a.models)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, m in enumerate(a.models):
        for j, comp in enumerate(comps):
            ax = axes[i][j]
            if comp == "moe":
                series = [(MOE_LABEL[(f, act)], dict(component=comp, format=f, activation=act)) for f, act in a.moe]
            elif comp == "attn_swa":
                series = [("any ctx", dict(component=comp, context=None))]
            else:
                series = [(fmt_ctx(c), dict(component=comp, context=c)) for c in a.context]
            for k, (lab, key) in enumerate(series):
                rs = [find(sweep.rows, model=m, batch=b, **key) for b in a.batch]
                for impl, style in (("dsv4", "o-"), ("torch", "s--")):
                    if comp == "moe" and impl == "torch" and k > 0:
                        continue  # one baseline line: it does not depend on the format or activation mode
                    pts = [(b, r[impl + "_us"]) for b, r in zip(a.batch, rs) if r and r.get(impl + "_us")]
                    if pts:
                        name = f"dsv4 {lab}" if impl == "dsv4" else (f"torch {lab}" if comp != "moe" else
                                                                    "torch bf16 grouped-GEMM")
                        ax.plot(*zip(*pts), style, color=colors[k % len(colors)] if impl == "dsv4" or comp != "moe"
                                else "black", label=name, alpha=1.0 if impl == "dsv4" else 0.6)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(a.batch, [str(b) for b in a.batch])
            ax.set_xlabel("batch (sequences decoding)")
            ax.set_ylabel("us per layer" + (" (CPU)" if sweep.cpu else ""))
            ax.set_title(f"{sweep.shapes[m].name}: {KIND_LABEL[comp.replace('attn_', '')]}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    fig.suptitle("Decode latency per layer: dsv4 kernels (solid) vs torch baselines (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_vllm_ratio(sweep: Sweep, path: str) -> bool:
    """Per-case ratio vLLM 0.33 kernels time / dsv4 time vs batch (> 1: dsv4 faster).
    Returns False (no file) when nothing was compared."""
    a = sweep.args
    if not any(r.get("vllm_us") for r in sweep.rows):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(a.models), figsize=(8 * len(a.models), 4.5), squeeze=False)
    for i, m in enumerate(a.models):
        ax = axes[0][i]
        series = [("SWA", dict(component="attn_swa", context=None))]
        series += [(f"{k.upper()} {fmt_ctx(c)}", dict(component="attn_" + k, context=c))
                   for k in ("csa", "hca") for c in a.context]
        series += [(f"MoE {MOE_LABEL[c]}", dict(component="moe", format=c[0], activation=c[1]))
                   for c in a.moe if c in MOE_INCUMBENTS]
        for lab, key in series:
            pts = [(b, r["vllm_us"] / r["dsv4_us"]) for b in a.batch
                   for r in [find(sweep.rows, model=m, batch=b, **key)] if r and r.get("vllm_us") and r.get("dsv4_us")]
            if pts:
                ax.plot(*zip(*pts), "s-" if "MoE" in lab else "o-", label=lab, linewidth=2 if "MoE" in lab else 1)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(a.batch, [str(b) for b in a.batch])
        ax.set_xlabel("batch (sequences decoding)")
        ax.set_ylabel("vLLM 0.33 kernel time / dsv4 time")
        ax.set_title(f"{sweep.shapes[m].name}: > 1 = dsv4 faster (FlashMLA SM90, Humming)", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def step_yscale(totals) -> str:
    """'log' when the tallest bar is over 20x the shortest, so that both stay visible (a
    CPU reference run: float32 reference kernels vs torch); else 'linear', where the
    stacked parts read in proportion."""
    pos = [t for t in totals if t > 0]
    return "log" if pos and max(pos) > 20 * min(pos) else "linear"


def plot_steps(sweep: Sweep, steps: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = sweep.args
    case = a.moe[0]
    parts = [("swa_us", "SWA attn"), ("csa_us", "CSA attn"), ("hca_us", "HCA attn"), ("moe_us", "routed MoE")]
    colors = ["#8da0cb", "#66c2a5", "#fc8d62", "#e78ac3"]
    fig, axes = plt.subplots(len(a.models), 1, figsize=(max(10, 1.1 * len(a.batch) * len(a.context) + 2),
                                                        4.5 * len(a.models)), squeeze=False)
    for i, m in enumerate(a.models):
        ax = axes[i][0]
        labels, totals = [], []
        for x, (ctx, b) in enumerate((c, b) for c in a.context for b in a.batch):
            st = find(steps, model=m, format=case[0], activation=case[1], batch=b, context=ctx)
            labels.append(f"B={b}\n{fmt_ctx(ctx)}")
            for impl, dx, hatch in (("dsv4", -0.2, None), ("torch", 0.2, "//")):
                est = st[impl]
                if not est:
                    continue
                bottom = 0.0
                for (key, name), c in zip(parts, colors):
                    v = est[key] / 1e3
                    ax.bar(x + dx, v, 0.38, bottom=bottom, color=c, hatch=hatch, edgecolor="white" if hatch else c,
                           label=name if (x == 0 and impl == "dsv4") else None)
                    bottom += v
                ax.text(x + dx, bottom, f"{bottom:.2f}", ha="center", va="bottom", fontsize=6, rotation=90)
                totals.append(bottom)
        scale = step_yscale(totals)
        if scale == "log":  # room below the shortest total and above the labels of the tallest
            ax.set_yscale("log")
            ax.set_ylim(min(t for t in totals if t > 0) / 4, max(totals) * 4)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("ms per decode step" + (" (CPU)" if sweep.cpu else "")
                      + (", log scale" if scale == "log" else ""))
        lay = sweep.shapes[m].layers
        ax.set_title(f"{sweep.shapes[m].name}: estimated decode step, left bar dsv4, right (hatched) bar torch\n"
                     f"MoE {MOE_LABEL[case]} EP{a.ep}; {lay['swa']} SWA + {lay['csa']} CSA + {lay['hca']} HCA layers; "
                     "kernels only", fontsize=9)
        if scale == "linear":
            ax.margins(y=0.12)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def device_info(sweep: Sweep) -> dict:
    info = dict(torch=torch.__version__, dsv4=dsv4.__version__, python=platform.python_version(),
                host=platform.node())
    if not sweep.cpu:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm_count=p.multi_processor_count, memory_gb=round(p.total_memory / 1e9, 1))
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.cpu_reference:
        why = gpu_problem()
        if why:
            print(f"decode_latency.py: {why}; nothing measured (use --cpu-reference for a tiny CPU run of the "
                  "references).", file=sys.stderr)
            return 1
    try:
        import matplotlib  # noqa: F401
        import rich  # noqa: F401
    except ImportError as ex:
        print(f"decode_latency.py: missing output dependency ({ex}); pip install rich matplotlib "
              "(the 'bench' extra)", file=sys.stderr)
        return 1
    why = out_dir_problem(args.out_dir)
    if why:
        print(f"decode_latency.py: {why}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if args.cpu_reference:  # tiny ops: one thread is faster and does not collapse on a busy machine
        torch.set_num_threads(1)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    device = "cpu" if args.cpu_reference else "cuda"
    sweep = Sweep(args, device)
    console = Console(width=max(Console().width, 150))
    t0 = datetime.datetime.now()

    copy_tbps = None
    if not sweep.cpu:
        from dsv4.bench.timing import copy_bandwidth_tbps

        torch.backends.cuda.matmul.allow_tf32 = False
        copy_tbps = copy_bandwidth_tbps()
        console.print(f"{torch.cuda.get_device_name()}: device copy ceiling {copy_tbps:.2f} TB/s (read + write)")

    if sweep.vs_line:
        console.print(sweep.vs_line, highlight=False)
    console.print(f"{' + '.join(sweep.shapes[m].name for m in args.models)}: batch {args.batch}, context "
                  f"{[fmt_ctx(c) for c in args.context]}, EP{args.ep}, MoE {'/'.join(MOE_LABEL[c] for c in args.moe)}, "
                  f"{sweep.n_cases()} cases", highlight=False)
    with Progress(TextColumn("[bold]decode latency"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=Console(stderr=True)) as bar:
        task = bar.add_task("", total=sweep.n_cases())
        sweep.run(lambda label, done: bar.update(task, description=label, advance=done))

    steps = step_rows(sweep)
    summary, detail = build_tables(sweep, steps, copy_tbps)
    render_rich(console, summary)
    for line in notes(sweep):
        console.print(f"- {line}", highlight=False)

    paths = {k: os.path.join(args.out_dir, f) for k, f in
             (("json", "decode_latency.json"), ("txt", "decode_latency.txt"), ("md", "decode_latency.md"),
              ("components_png", "latency_vs_batch.png"), ("steps_png", "step_breakdown.png"))}
    meta = dict(mode="cpu-reference" if sweep.cpu else "cuda", started=t0.isoformat(timespec="seconds"),
                seconds=round((datetime.datetime.now() - t0).total_seconds(), 1), argv=args.argv,
                batch=args.batch, context=args.context, ep=args.ep, moe_format=args.moe_format,
                moe_cases=[dict(format=f, activation=act, label=MOE_LABEL[(f, act)]) for f, act in args.moe],
                iters=args.iters,
                input_sets=sweep.n_sets, copy_tbps=copy_tbps, device=device_info(sweep), notes=notes(sweep),
                not_included=L.NOT_INCLUDED,
                layer_schedule_source="compress_ratios of each checkpoint's HF config.json "
                                      "(dsv4/latency.py LAYER_SCHEDULE)",
                layer_overrides=dict(args.layers))
    models = {m: dict(name=s.name, hidden=s.hidden, heads=s.heads, index_topk=s.index_topk, n_experts=s.n_experts,
                      local_experts=s.n_experts // args.ep, moe_intermediate=s.moe_inter, layers=s.layers,
                      moe_layers=s.n_layers) for m, s in sweep.shapes.items()}
    components = [{k: (num(v) if isinstance(v, float) else v) for k, v in r.items()} for r in sweep.rows]
    with open(paths["json"], "w") as f:  # first: the numbers survive a failing plot
        json.dump(dict(meta=meta, models=models, components=components, steps=steps), f, indent=1)
    with open(paths["txt"], "w") as f:
        file_console = Console(file=f, width=200, no_color=True)
        render_rich(file_console, summary + detail)
        for line in notes(sweep):
            file_console.print(f"- {line}", highlight=False, soft_wrap=True)
    with open(paths["md"], "w") as f:
        f.write(render_markdown(summary + detail) + "\n" + "\n".join(f"- {n}" for n in notes(sweep)) + "\n")
    plot_components(sweep, paths["components_png"])
    plot_steps(sweep, steps, paths["steps_png"])
    ratio_png = os.path.join(args.out_dir, "ratio_vs_vllm.png")
    if plot_vllm_ratio(sweep, ratio_png):
        paths["ratio_png"] = ratio_png
    console.print("wrote " + ", ".join(paths.values()), highlight=False)
    errors = [r for r in sweep.rows if r.get("error")]
    if errors:
        console.print(f"{len(errors)} case(s) failed, first: {errors[0]['error']}", highlight=False)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
