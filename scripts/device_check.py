"""Build, GPU-test, fuzz and benchmark dsv4 on the GPU machine in one command.

    python3 scripts/device_check.py [--build] [--families quantize,attention,fmha,moe,...]
        [--sanitize FAMILIES] [--fuzz] [--compare "ARGS"] [--decode-latency "ARGS"]
        [--bench] [--quick] [--out DIR]

Without --build it uses the dsv4/_C.abi3.so that is already in the tree (built on
another machine and copied along). Every step's log goes to --out; the summary table
(one line per step: each family's pytest summary line, sanitizer error counts, fuzz
mismatches, where the tables are) is printed last.

* --sanitize FAMILIES: those families' GPU tests under compute-sanitizer memcheck and
  racecheck (error counts must be 0; CUDA-graph tests excluded, they need the caching
  allocator that memcheck runs without);
* --fuzz: scripts/gpu_fuzz.py with its defaults (2,000 attention, 500 MoE, 2,000 quantize);
* --compare "ARGS": python -m dsv4.bench compare ARGS (the incumbents side by side; set
  DSV4_ANCHORS or pass --anchors inside ARGS);
* --decode-latency "ARGS": scripts/decode_latency.py ARGS --out-dir OUT/decode_latency;
* --bench: the per-family benchmark routines (python -m dsv4.bench quantize / attention / moe).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# family -> (GPU test files, benchmark routine of python -m dsv4.bench, extra benchmark arguments)
FAMILIES = {
    "quantize": (["tests/test_quantize.py", "tests/test_formats.py"], "quantize", []),
    "attention": (["tests/test_attention.py", "tests/test_batch_invariant.py", "tests/test_reference.py"],
                  "attention", ["--skip-fmha"]),
    "fmha": (["tests/test_fmha.py"], "attention", ["--only-fmha"]),
    "moe": (["tests/test_moe.py", "tests/test_moe_config.py", "tests/test_mxfp4.py", "tests/test_mxfp4_w4a8.py"],
            "moe", []),
    "checks": (["tests/test_value_checks.py", "tests/test_ops_registry.py"], None, []),
    "incumbents": (["tests/test_incumbents.py"], None, []),
}


def run(cmd: list[str], log: str, env: dict | None = None, timeout: int = 1800) -> tuple[int, str, float]:
    print(f"\n$ {' '.join(cmd)}", flush=True)
    t0 = time.time()
    # the tree is used in place (not pip-installed) on the GPU machine
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode(errors="replace") + f"\nTIMEOUT after {timeout}s"
    with open(log, "w") as f:
        f.write(out)
    print(out[-3000:], flush=True)
    return rc, out, time.time() - t0


def last_line(out: str, pattern: str) -> str:
    lines = [ln for ln in out.splitlines() if re.search(pattern, ln)]
    return lines[-1].strip("= ") if lines else "(no summary line)"


def tests_of(families: list[str]) -> list[str]:
    return [t for f in families for t in FAMILIES[f][0] if os.path.exists(os.path.join(ROOT, t))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", action="store_true", help="build the extension here (needs nvcc)")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma list of test families")
    p.add_argument("--sanitize", default="", help="comma list of families to run under compute-sanitizer")
    p.add_argument("--sanitize-k", default=None, help="pytest -k expression for the sanitizer runs")
    p.add_argument("--fuzz", action="store_true")
    p.add_argument("--compare", default=None, metavar="ARGS", help="run python -m dsv4.bench compare ARGS")
    p.add_argument("--decode-latency", default=None, metavar="ARGS", help="run scripts/decode_latency.py ARGS")
    p.add_argument("--bench", action="store_true", help="also run the per-family benchmark routines")
    p.add_argument("--quick", action="store_true", help="pass --quick to the benchmarks that take it")
    p.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "out")))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    fams = [f for f in args.families.split(",") if f]
    bad = [f for f in fams + [f for f in args.sanitize.split(",") if f] if f not in FAMILIES]
    if bad:
        p.error(f"unknown families {bad}; known: {', '.join(FAMILIES)}")
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

    failed = 0
    for f in fams:
        tests = tests_of([f])
        if not tests:
            continue
        rc, out, dt = run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                           *tests], f"{args.out}/gpu_tests_{f}.log")
        failed += rc not in (0, 5)
        summary.append((f"GPU tests {f}", f"{last_line(out, r'passed|failed|error|no tests ran')} ({dt:.0f}s)"))

    for f in [f for f in args.sanitize.split(",") if f]:
        for tool in ("memcheck", "racecheck"):
            cmd = ["compute-sanitizer", "--tool", tool, "--print-limit", "20", sys.executable, "-m", "pytest",
                   "-m", "gpu", "-q", "-x", "-p", "no:cacheprovider", *tests_of([f])]
            k = "not graph" + (f" and ({args.sanitize_k})" if args.sanitize_k else "")
            cmd += ["-k", k]
            _, out, dt = run(cmd, f"{args.out}/sanitize_{f}_{tool}.log", env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
            counts = [int(n) for n in re.findall(r"(?:ERROR SUMMARY: |RACECHECK SUMMARY: .*\()(\d+) error", out)]
            verdict = f"{sum(counts)} errors over {len(counts)} processes" if counts else "NO SUMMARY (did it run?)"
            summary.append((f"sanitizer {tool} {f}", f"{verdict}; pytest: {last_line(out, r'passed|failed')} ({dt:.0f}s)"))

    if args.fuzz:
        rc, out, dt = run([sys.executable, "scripts/gpu_fuzz.py", "--json", f"{args.out}/fuzz.json"],
                          f"{args.out}/fuzz.log")
        lines = [ln for ln in out.splitlines() if re.match(r"^\w+: \d+ configurations", ln)]
        summary.append(("fuzz", ("; ".join(lines) or f"rc={rc} (no summary)") + f" ({dt:.0f}s)"))

    if args.compare is not None:
        cmd = [sys.executable, "-m", "dsv4.bench", "compare", "--json", f"{args.out}/compare.json", "--markdown",
               f"{args.out}/compare.md", *shlex.split(args.compare)]
        rc, out, dt = run(cmd, f"{args.out}/compare.log")
        summary.append(("compare", f"rc={rc} ({dt:.0f}s): {last_line(out, r'compared cases slower')}"))

    if args.decode_latency is not None:
        cmd = [sys.executable, "scripts/decode_latency.py", "--out-dir", f"{args.out}/decode_latency",
               *shlex.split(args.decode_latency)]
        rc, out, dt = run(cmd, f"{args.out}/decode_latency.log")
        summary.append(("decode_latency", f"rc={rc} ({dt:.0f}s), files in {args.out}/decode_latency"))

    if args.bench:
        for f in fams:
            _, bench, extra = FAMILIES[f]
            if bench is None:
                continue
            quick = ["--quick"] if args.quick and f in ("attention", "moe") else []
            cmd = [sys.executable, "-m", "dsv4.bench", bench, "--json", f"{args.out}/bench_{f}.json", *extra, *quick]
            rc, out, dt = run(cmd, f"{args.out}/bench_{f}.log")
            summary.append((f"bench {f}", f"rc={rc} ({dt:.0f}s), table in {args.out}/bench_{f}.log"))
    return report(summary, 1 if failed else 0)


def report(summary: list[tuple[str, str]], rc: int) -> int:
    width = max(len(k) for k, _ in summary)
    print("\n==== dsv4 device check ====")
    for k, v in summary:
        print(f"{k:<{width}}  {v}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
