"""Makes the anchors folder: the incumbent kernels dsv4 is measured against, extracted
from the vllm==0.33.0 and humming-kernels==0.1.19 wheels (dsv4.bench.anchors).

    python scripts/fetch_anchors.py [--dest .anchors] [--moe-c-dest .anchors-moe-c]
        [--vllm-c-dest .anchors-vllm-c] [--wheel-dir DIR]

then point the benchmarks at it with ``--anchors .anchors`` or ``DSV4_ANCHORS=.anchors``.
Both default folders are gitignored. ``--moe-c-dest`` adds vLLM's 46 MB MoE library
(Marlin, moe_align_block_size) in a folder of its own; ``--vllm-c-dest`` vLLM's 92 MB
kernel library (its ``per_token_group_quant_fp8``, which the Humming W4A8 rows need) in
another. Each of those two is above what one GPU-machine call carries (64 MiB): carry it
compressed in parts over two calls of a warm machine.
"""

from __future__ import annotations

import argparse
import os
import sys

from dsv4.bench.anchors import fetch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=".anchors", help="folder for FlashMLA + humming (default .anchors)")
    ap.add_argument("--moe-c-dest", default=None, help="also extract vLLM's MoE library into this folder")
    ap.add_argument("--vllm-c-dest", default=None,
                    help="also extract vLLM's kernel library (the W4A8 incumbent's input quantizer) into this folder")
    ap.add_argument("--wheel-dir", default=None, help="use the wheels already in this folder (no download)")
    args = ap.parse_args(argv)
    try:
        taken = fetch(args.dest, moe_c_dest=args.moe_c_dest, vllm_c_dest=args.vllm_c_dest,
                      wheel_dir=args.wheel_dir)
    except Exception as e:
        print(f"fetch_anchors: {e}", file=sys.stderr)
        return 1
    by_dir: dict = {}
    for d, name, size in taken:
        by_dir.setdefault(d, []).append((name, size))
    for d, items in by_dir.items():
        total = sum(s for _, s in items)
        libs = [n for n, _ in items if n.endswith(".so") or n.endswith("interface.py")]
        print(f"{d}: {len(items)} files, {total / 2**20:.1f} MiB ({', '.join(libs) or 'python package'}"
              f"{', humming/ package' if any(n.startswith('humming/') for n, _ in items) else ''})")
    print(f"use: --anchors {os.pathsep.join(by_dir)}  or  DSV4_ANCHORS={os.pathsep.join(by_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
