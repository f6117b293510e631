"""The kernels one decode-attention case launches, dsv4 beside FlashMLA, and how long each runs.

A time of the compare routine is one graph replay, from the first kernel's start to the
last one's end; this lists what is inside it, on the same case
(:func:`dsv4.bench.cases.decode_case`). Each variant runs ``iters`` times warm (same
inputs back to back) and ``iters`` times cold (L2 evicted before each call), under
``torch.profiler``; the table gives, per variant and kernel, the median GPU duration.
With ``--ncu`` the profiler stays off and each variant runs 3 times after a warm-up,
inside an NVTX range named after it, for an outer Nsight Compute run, e.g.
``ncu --clock-control none --nvtx --nvtx-include "dsv4/" --nvtx-include "flashmla/" python -m
dsv4.bench profile --ncu`` (a trailing "/" names a push/pop range).

With ``--graph`` each variant is timed as the compare routine times it (captured in a CUDA
graph, L2 evicted, an event pair around the replay) with the profiler on, and the table
splits each replay's event time into the lead (the L2 flush's last kernel end to the
variant's first kernel start), the span (its first kernel start to its last kernel end) and
the rest (event time - lead - span: the end event after the last kernel); "kernels" is the
sum of the variant's kernel durations (below the span where kernels overlap under PDL).
Where the event time is well above the span, the difference is outside the kernels.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict

import torch

from ..argtypes import anchor_paths
from ..cases import DecodePools, decode_case, dsv4_decode
from ..models import KINDS, MODELS, SCHEDULED, SOFTMAX_SCALE
from ..report import Table, print_tables, to_markdown

SUMMARY = "the kernels inside one decode-attention case, dsv4 beside FlashMLA, with their GPU times"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="flash", choices=SCHEDULED, help="model shape (default flash)")
    ap.add_argument("--kind", default="swa", choices=KINDS, help="layer type (default swa)")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding (default 1)")
    ap.add_argument("--context", type=int, default=4096, help="context length in tokens (default 4096)")
    ap.add_argument("--iters", type=int, default=20, help="profiled calls per variant and L2 mode (default 20)")
    ap.add_argument("--anchors", default=None,
                    help="incumbent folders (os.pathsep-separated), as the compare routine takes them")
    ap.add_argument("--ncu", action="store_true", help="no profiler: NVTX ranges for an outer ncu run")
    ap.add_argument("--graph", action="store_true",
                    help="graph replays timed as the compare routine does, each split into lead, kernel span and rest")
    ap.add_argument("--markdown", default=None, help="also write the kernel table as markdown here")


def _variants(args, anchors) -> dict:
    from ..incumbents import FlashMLADecode

    m = MODELS[args.model]
    pools = DecodePools.for_cases(args.batch, args.context, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    s = decode_case(args.kind, m, args.batch, args.context, pools, gen)
    out = torch.empty_like(s["q"])
    v = {"dsv4": lambda: dsv4_decode(s, out)}
    if anchors.flashmla:
        v["flashmla"] = FlashMLADecode(s, SOFTMAX_SCALE, torch.empty_like(s["q"]))
    return v


def kernel_rows(variants: dict, iters: int) -> list[tuple]:
    """[(variant/mode, kernel, calls, median us)] of each variant, warm and cold L2."""
    from torch.profiler import ProfilerActivity, profile

    from ..timing import l2_flush

    for f in variants.values():  # planners, workspaces, lazy loads
        f()
    l2_flush()
    torch.cuda.synchronize()
    rows = []
    # One profiler session per (variant, mode), so every kernel it records is that
    # variant's, apart from the L2 flush's own reduction (left out by name).
    for name, f in variants.items():
        for mode in ("warm", "cold"):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    if mode == "cold":
                        l2_flush()
                    f()
                torch.cuda.synchronize()
            durs = defaultdict(list)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA and not (mode == "cold" and "reduce" in e.name):
                    durs[e.name].append(e.device_time)
            rows += [(f"{name}/{mode}", k, len(v), statistics.median(v)) for k, v in durs.items()]
    return rows


def _is_flush(name: str) -> bool:
    """The L2 flush's kernels (dsv4.bench.timing.l2_flush: an amax over a buffer, and its memset)."""
    return "reduce" in name or name.startswith("Memset")


def split_replays(kernels: list[tuple], is_flush=_is_flush) -> list[dict]:
    """Per replay, from the profiler's kernels [(name, start us, end us)] of a run of
    (flush, replay) pairs: ``lead`` (the flush's last kernel end to the replay's first
    kernel start), ``span`` (the replay's first kernel start to its last kernel end) and
    ``kernels`` (the sum of its kernel durations). A replay is the kernels after a flush up
    to the next flush; kernels before the first flush are left out."""
    out, flush_end, cur = [], None, []

    def close():
        if cur and flush_end is not None:
            first, last = min(k[1] for k in cur), max(k[2] for k in cur)
            out.append(dict(lead=first - flush_end, span=last - first, kernels=sum(k[2] - k[1] for k in cur)))

    prev_flush = False
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        if is_flush(name):
            if not prev_flush:
                close()
                cur = []
            flush_end = end if not prev_flush else max(flush_end, end)
            prev_flush = True
        else:
            cur.append((name, start, end))
            prev_flush = False
    close()
    return out


def replay_rows(variants: dict, iters: int) -> list[tuple]:
    """[(variant, event us, lead us, span us, rest us, kernels us)] medians over ``iters``
    replays of each variant's graph, timed as :func:`dsv4.bench.timing.time_us` times it."""
    from torch.profiler import ProfilerActivity, profile

    from ..timing import l2_flush

    rows = []
    for name, f in variants.items():
        f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        for _ in range(3):
            l2_flush()
            g.replay()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for s, e in ev:
                l2_flush()
                s.record()
                g.replay()
                e.record()
            torch.cuda.synchronize()
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        reps = split_replays(kernels)
        event_us = statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev)
        med = {k: statistics.median(r[k] for r in reps) if reps else float("nan") for k in ("lead", "span", "kernels")}
        rows.append((name, event_us, med["lead"], med["span"], event_us - med["lead"] - med["span"], med["kernels"]))
        del g
    return rows


def replay_table(case: str, rows: list[tuple], iters: int) -> Table:
    return Table(f"{case}: graph replays as the compare routine times them ({iters} each, L2 evicted), medians, us",
                 ["variant", "event", "lead", "span", "rest", "kernels"],
                 [[v, *(f"{x:.2f}" for x in xs)] for v, *xs in rows])


def table(case: str, rows: list[tuple], iters: int) -> Table:
    return Table(f"{case}: median GPU time per kernel ({iters} calls each, warm and cold L2)",
                 ["variant", "us", "calls", "kernel"], [[v, f"{us:.2f}", str(n), k[:110]] for v, k, n, us in rows],
                 align="lrrl")


def run(args: argparse.Namespace) -> int:
    from ..anchors import find_anchors

    if not torch.cuda.is_available():
        print("dsv4: profile: needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.ncu and args.graph:
        print("dsv4: profile: --ncu and --graph are two different runs; give one", file=sys.stderr)
        return 2
    anchors = find_anchors(anchor_paths(args.anchors))
    variants = _variants(args, anchors)
    if args.ncu:
        for name, f in variants.items():
            f()
            torch.cuda.synchronize()
            for _ in range(3):
                torch.cuda.nvtx.range_push(name)
                f()
                torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
        return 0
    case = f"{MODELS[args.model].name} {args.kind} ctx={args.context} B={args.batch}"
    lines = [anchors.summary()]
    if args.graph:
        rows = replay_rows(variants, args.iters)
        t = replay_table(case, rows, args.iters)
        if any(math.isnan(r[2]) for r in rows):
            lines.append("dsv4: profile --graph: the profiler recorded no kernel of some variant's graph replays "
                         "(nan): this torch / CUPTI does not trace kernels inside CUDA graphs")
    else:
        t = table(case, kernel_rows(variants, args.iters), args.iters)
    print_tables([t], lines=lines)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown([t]))
    return 0
