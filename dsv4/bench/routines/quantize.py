"""Rate of dsv4.quantize_nvfp4 against the device copy bandwidth measured in the same run.

Each shape rotates over >= 4 inputs and >= 512 MB so every call streams from HBM; the
kernel time is a CUDA-graph replay with L2 evicted (dsv4.bench.timing; eager calls of
small shapes measure the host), the eager time printed beside it. Bytes: dsv4.bench.traffic.
"""

from __future__ import annotations

import argparse
import sys

import torch

from .. import traffic
from ..report import Table, dump_record, print_tables, to_markdown

SUMMARY = "quantize_nvfp4 against the same-run device copy bandwidth"
SHAPES = [(8192, 7168), (16384, 4096), (128, 7168), (8192, 2048)]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", help="also write the rows and the ceiling here")
    ap.add_argument("--markdown", default=None, help="also write the table as markdown here")


def table(rows: list[dict], ceiling: float) -> Table:
    return Table(f"quantize_nvfp4; device copy ceiling (read + write) {ceiling:.2f} TB/s",
                 ["M", "K", "graph us", "eager us", "MB", "TB/s", "% copy"],
                 [[r["M"], r["K"], f"{r['us']:.1f}", f"{r['eager_us']:.1f}", f"{r['bytes'] / 1e6:.1f}",
                   f"{r['tbps']:.2f}", f"{r['pct_copy']:.1f}%"] for r in rows], align="r" * 7)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("dsv4: quantize: needs a CUDA device", file=sys.stderr)
        return 1
    import dsv4

    from ..timing import copy_bandwidth_tbps, time_us

    ceiling = copy_bandwidth_tbps()
    rows = []
    for m, k in SHAPES:
        n_inputs = max(4, (512 << 20) // (m * k * 2))
        xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) * 5 for _ in range(n_inputs)]
        g = torch.tensor([0.01], device="cuda")
        calls = [lambda x=x: dsv4.quantize_nvfp4(x, g) for x in xs]
        us = time_us({"q": calls})["q"].us
        eager_us = time_us({"q": calls}, cuda_graph=False)["q"].us
        t = traffic.quantize_nvfp4(m, k)
        rows.append(dict(M=m, K=k, us=us, eager_us=eager_us, bytes=t.bytes, tbps=t.tbps(us),
                         pct_copy=100 * t.tbps(us) / ceiling))
        del xs
    tab = table(rows, ceiling)
    print_tables([tab])
    if args.json:
        dump_record(dict(copy_tbps=ceiling, rows=rows), args.json)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown([tab]))
    return 0
