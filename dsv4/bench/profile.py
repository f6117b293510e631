"""The kernels one decode-attention case launches, dsv4 beside FlashMLA, and how long each runs.

    python -m dsv4.bench.profile [--model flash|pro] [--kind swa|csa|hca] [--batch 1]
        [--context 4096] [--iters 20] [--anchors DIR] [--ncu]

A time in :mod:`dsv4.bench.compare` is one graph replay, from the first kernel's start to
the last one's end; this lists what is inside it. Each variant runs ``iters`` times warm
(same inputs back to back) and ``iters`` times cold (L2 evicted before each call), under
``torch.profiler``; the table gives, per variant and kernel, the median GPU duration.
With ``--ncu`` the profiler stays off and each variant runs 3 times after a warm-up,
inside an NVTX range named after it, for an outer Nsight Compute run, e.g.
``ncu --clock-control none --nvtx --nvtx-include "dsv4/" --nvtx-include "flashmla/" python -m
dsv4.bench.profile --ncu`` (a trailing "/" names a push/pop range).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

from . import inputs as I
from .anchors import find_anchors

SCALE = 512**-0.5


def _variants(args, anchors) -> dict:
    from ..attention import sparse_mqa_decode
    from .incumbents import FlashMLADecode

    m = I.ATTN_MODELS[args.model]
    pools = I.DecodePools.for_cases(args.batch, args.context, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    s = I.decode_case(args.kind, m, args.batch, args.context, pools, gen)
    out = torch.empty_like(s["q"])
    v = {"dsv4": lambda: sparse_mqa_decode(s["q"], s["swa_cache"], s["swa_idx"], s["swa_len"], s["sink"], SCALE,
                                           extra_kv_cache=s["extra_cache"], extra_indices=s["extra_idx"],
                                           extra_topk_length=s["extra_len"], out=out)}
    if anchors.flashmla:
        v["flashmla"] = FlashMLADecode(s, SCALE, torch.empty_like(s["q"]))
    return v


def _kernel_table(variants: dict, iters: int) -> list[tuple]:
    from torch.profiler import ProfilerActivity, profile

    from .timing import l2_flush

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flash", choices=sorted(I.ATTN_MODELS))
    ap.add_argument("--kind", default="swa", choices=("swa", "csa", "hca"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--anchors", default=None, help="incumbent folder(s), as dsv4.bench.compare takes them")
    ap.add_argument("--ncu", action="store_true", help="no profiler: NVTX ranges for an outer ncu run")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("dsv4.bench.profile: needs a CUDA GPU")
        return 1
    anchors = find_anchors(args.anchors)
    variants = _variants(args, anchors)
    case = f"{args.model} {args.kind} ctx={args.context} B={args.batch}"
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
    print(f"# {case}: median GPU time per kernel ({args.iters} calls each, warm and cold L2)")
    for launch, kernel, n, us in _kernel_table(variants, args.iters):
        print(f"{launch:16s} {us:8.2f} us  x{n:<4d} {kernel[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
