"""ncu of the sparse prefill kernels, dsv4's and FlashMLA's SM90 one, on the same inputs
(issue 34; ../shared/research/attention-vs-flashmla.md section 4, plan step 1).

One process per (model, kernel) so that ncu sees exactly the launch it profiles:

    python scripts/attn_prefill_ncu.py run --model pro --kernel dsv4   # what ncu wraps
    python scripts/attn_prefill_ncu.py profile --out DIR               # the whole sweep

``profile`` runs ``ncu --clock-control none`` on the second launch of each kernel (the first
one warms the code and the caches) for V4-Pro and V4-Flash at T = 4096, writes one report
per case under DIR and prints a short table: duration, tensor-pipe and shared-memory
utilisation, issue slots busy, instructions executed, and the top warp stall reasons.
Needs FlashMLA in the anchors (``DSV4_ANCHORS``); the device's ncu (no GPU here).
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys

KERNELS = {"dsv4": "regex:sparse_mqa_fwd_kernel", "flashmla": "regex:sparse_attn_fwd"}
SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "InstructionStats", "MemoryWorkloadAnalysis"]
# (label, metric name prefixes in the raw page, first found wins): names differ between ncu
# versions (Hopper's wgmma pipe is "gmma" in recent ones), so nothing is asked for by name
# at profile time (an unknown name aborts ncu); the sections collect them.
COLUMNS = [
    ("us", ["gpu__time_duration.sum"]),
    ("tensor %", ["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                  "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                  "sm__inst_executed_pipe_tensor"]),
    ("smem %", ["l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
                "l1tex__data_pipe_lsu_wavefronts_mem_shared"]),
    ("issue %", ["sm__inst_issued.avg.pct_of_peak_sustained_active", "smsp__issue_active.avg.pct_of_peak"]),
    ("instructions", ["smsp__inst_executed.sum"]),
    ("stall barrier", ["smsp__average_warp_latency_issue_stalled_barrier",
                       "smsp__average_warps_issue_stalled_barrier"]),
    ("stall long sb", ["smsp__average_warp_latency_issue_stalled_long_scoreboard",
                       "smsp__average_warps_issue_stalled_long_scoreboard"]),
    ("stall wait", ["smsp__average_warp_latency_issue_stalled_wait", "smsp__average_warps_issue_stalled_wait"]),
    ("stall math", ["smsp__average_warp_latency_issue_stalled_math_pipe_throttle",
                    "smsp__average_warps_issue_stalled_math_pipe_throttle"]),
    ("stall mio", ["smsp__average_warp_latency_issue_stalled_mio_throttle",
                   "smsp__average_warps_issue_stalled_mio_throttle"]),
    ("stall membar", ["smsp__average_warp_latency_issue_stalled_membar", "smsp__average_warps_issue_stalled_membar"]),
    # Where the gathered rows come from: a prefill's rows (64 MB here, above L2) are re-read by
    # every token that selects them, beside the streams of Q and the output.
    ("dram %", ["gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                "dram__throughput.avg.pct_of_peak_sustained_elapsed"]),
    ("L2 hit %", ["lts__t_sector_hit_rate.pct"]),
]


def pick(raw: dict, prefixes: list[str]) -> str:
    """The first raw-page value whose metric name starts with one of the prefixes, in order."""
    for pre in prefixes:
        for name, v in raw.items():
            if name.startswith(pre):
                return v
    return "-"


def run(model: str, kernel: str, tokens: int) -> None:
    import torch

    sys.path.insert(0, os.getcwd())
    from dsv4.attention import sparse_mqa_prefill
    from dsv4.bench.anchors import find_anchors
    from dsv4.bench.cases import prefill_case
    from dsv4.bench.incumbents import flashmla_prefill
    from dsv4.bench.models import HEAD_DIM, MODELS, SOFTMAX_SCALE

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(7)
    kv = torch.randn(1 << 16, HEAD_DIM, generator=gen, device=dev).to(torch.bfloat16)  # as the compare routine
    s = prefill_case(MODELS[model], tokens, 0, gen, dev, kv=kv)
    out = torch.empty_like(s["q"])
    if kernel == "flashmla":
        if not find_anchors().flashmla:
            sys.exit("attn_prefill_ncu: FlashMLA not found (DSV4_ANCHORS)")
        call = lambda: flashmla_prefill(s["q"], s["kv"], s["idx"], s["lens"], s["sink"], SOFTMAX_SCALE, out)
    else:
        call = lambda: sparse_mqa_prefill(s["q"], s["kv"], s["idx"], s["lens"], s["sink"], SOFTMAX_SCALE, out=out)
    for _ in range(2):
        call()
    torch.cuda.synchronize()


def profile(out_dir: str, models: list[str], tokens: int, kernels: list[str]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for model in models:
        for kernel in kernels:
            regex = KERNELS[kernel]
            rep = os.path.join(out_dir, f"prefill_{model}_{kernel}")
            cmd = ["ncu", "--clock-control", "none", "-k", regex, "--launch-skip", "1", "--launch-count", "1"]
            for sec in SECTIONS:
                cmd += ["--section", sec]
            cmd += ["-f", "-o", rep, sys.executable, __file__, "run", "--model", model, "--kernel", kernel,
                    "--tokens", str(tokens)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{model} {kernel}: ncu rc={r.returncode}: {(r.stderr or r.stdout)[-400:]}")
                continue
            q = subprocess.run(["ncu", "-i", rep + ".ncu-rep", "--csv", "--page", "raw"],
                               capture_output=True, text=True)
            table = list(csv.reader(io.StringIO(q.stdout)))
            # rows: metric names, units, then one row per profiled launch (the last is ours)
            raw = dict(zip(table[0], table[-1])) if len(table) >= 3 else {}
            rows.append((model, kernel, {label: pick(raw, pre) for label, pre in COLUMNS}))
    labels = [label for label, _ in COLUMNS]
    print("model kernel | " + " | ".join(labels))
    for model, kernel, v in rows:
        print(f"{model} {kernel} | " + " | ".join(str(v[label]) for label in labels))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", choices=["flash", "pro"], required=True)
    r.add_argument("--kernel", choices=list(KERNELS), required=True)
    r.add_argument("--tokens", type=int, default=4096)
    p = sub.add_parser("profile")
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="pro,flash")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--kernels", default=",".join(KERNELS), help="of " + ", ".join(KERNELS))
    a = ap.parse_args()
    if a.cmd == "run":
        run(a.model, a.kernel, a.tokens)
        return
    kernels = a.kernels.split(",")
    if set(kernels) - set(KERNELS):
        ap.error(f"--kernels takes {', '.join(KERNELS)}, got {a.kernels!r}")
    profile(a.out, a.models.split(","), a.tokens, kernels)


if __name__ == "__main__":
    main()
