"""Build, GPU-test and benchmark dsv4 on the GPU machine in one command.

    python3 scripts/device_check.py [--build] [--sanitize] [--families quantize,attention,fmha,moe]
                                    [--quick] [--out DIR]

Without --build it uses the dsv4/_C.abi3.so that is already in the tree (built on
another machine and copied along). --sanitize also runs the GPU tests under
compute-sanitizer memcheck and racecheck and reports their error counts (must be 0).
The summary table is printed last.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# family -> (GPU tests, benchmark, extra benchmark arguments)
FAMILIES = {
    "quantize": ("tests/test_quantize.py", "scripts/bench_quantize.py", []),
    "attention": ("tests/test_attention.py", "scripts/bench_attention.py", ["--skip-fmha"]),
    "fmha": ("tests/test_fmha.py", "scripts/bench_attention.py", ["--only-fmha"]),
    "moe": ("tests/test_moe.py", "scripts/bench_moe.py", []),
}


def run(cmd: list[str], log: str, env: dict | None = None, timeout: int = 1800) -> tuple[int, str, float]:
    print(f"\n$ {' '.join(cmd)}", flush=True)
    t0 = time.time()
    # the tree is used in place (not pip-installed) on the GPU machine
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    with open(log, "w") as f:
        f.write(out)
    print(out[-4000:], flush=True)
    return proc.returncode, out, time.time() - t0


def last_line(out: str, pattern: str) -> str:
    lines = [ln for ln in out.splitlines() if re.search(pattern, ln)]
    return lines[-1].strip("= ") if lines else "(no summary line)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", action="store_true", help="build the extension here (needs nvcc + nvidia-cutlass)")
    p.add_argument("--sanitize", action="store_true", help="also run the GPU tests under compute-sanitizer")
    p.add_argument("--sanitize-k", default=None, help="pytest -k expression for the sanitizer runs")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma list of kernel families")
    p.add_argument("--quick", action="store_true", help="pass --quick to the benchmarks that take it")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "out")))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    fams = [f for f in args.families.split(",") if f and os.path.exists(os.path.join(ROOT, FAMILIES[f][0]))]
    summary: list[tuple[str, str]] = []

    if args.build:
        rc, out, dt = run([sys.executable, "setup.py", "build_ext", "--inplace"], f"{args.out}/build.log",
                          env={"DSV4_CUDA": "1", "DSV4_PTXAS_VERBOSE": "1"})
        summary.append(("build", f"rc={rc} in {dt:.0f}s"))
        if rc:
            return report(summary, 1)

    rc, out, _ = run([sys.executable, "-c",
                      "import torch, dsv4; assert dsv4.HAS_CUDA_EXTENSION, dsv4._ops.EXTENSION_ERROR; "
                      "print(torch.__version__, torch.cuda.get_device_name(), 'SMs', "
                      "torch.cuda.get_device_properties(0).multi_processor_count)"], f"{args.out}/import.log")
    summary.append(("extension", out.strip().splitlines()[-1] if rc == 0 else "IMPORT FAILED"))
    if rc:
        return report(summary, 1)

    tests = [FAMILIES[f][0] for f in fams]
    rc_tests, out, dt = run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", *tests], f"{args.out}/gpu_tests.log")
    summary.append(("GPU tests", f"{last_line(out, r'passed|failed|error')} ({dt:.0f}s)"))

    if args.sanitize:
        for tool in ("memcheck", "racecheck"):
            cmd = ["compute-sanitizer", "--tool", tool, "--print-limit", "20", sys.executable, "-m", "pytest",
                   "-m", "gpu", "-q", "-x", *tests]
            # Without the caching allocator every out-of-bounds access is visible to
            # memcheck; CUDA-graph tests need it (no cudaMalloc during capture).
            k = "not graph" + (f" and ({args.sanitize_k})" if args.sanitize_k else "")
            cmd += ["-k", k]
            _, out, dt = run(cmd, f"{args.out}/sanitize_{tool}.log", env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
            counts = [int(n) for n in re.findall(r"(?:ERROR SUMMARY: |RACECHECK SUMMARY: .*\()(\d+) error", out)]
            verdict = f"{sum(counts)} errors over {len(counts)} processes" if counts else "NO SUMMARY (did it run?)"
            summary.append((f"sanitizer {tool}", f"{verdict}; pytest: {last_line(out, r'passed|failed')} ({dt:.0f}s)"))

    if not args.no_bench:
        for f in fams:
            _, bench, extra = FAMILIES[f]
            if not os.path.exists(os.path.join(ROOT, bench)):
                continue
            quick = ["--quick"] if args.quick and f in ("attention", "moe") else []
            cmd = [sys.executable, bench, "--json", f"{args.out}/bench_{f}.json", *extra, *quick]
            rc, out, dt = run(cmd, f"{args.out}/bench_{f}.log")
            summary.append((f"bench {f}", f"rc={rc} ({dt:.0f}s), table in {args.out}/bench_{f}.log"))
    return report(summary, 0 if rc_tests == 0 else 1)


def report(summary: list[tuple[str, str]], rc: int) -> int:
    width = max(len(k) for k, _ in summary)
    print("\n==== dsv4 device check ====")
    for k, v in summary:
        print(f"{k:<{width}}  {v}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
