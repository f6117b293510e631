#!/bin/bash
# Issue 33, MXFP4 W4A8 two chunks of wgmmas in flight (DSV4_MOE_MMA_DEPTH), one GPU call from
# the repo root (docs/perf-history/2026-12-05-mxfp4-w4a8-overlap-wg.md, "Written for the next run"):
#   1. the bitwise / forced-grid tests and the config tests;
#   2. dsv4-only timing at depth 1 and 2 (one process each), and, if ALT_SO names a second
#      build (e.g. kDepthTwoCtasPerSm = 2 in csrc/moe/mxfp4_gemm.cuh), depth 2 with it;
#   3. ncu of GEMM1 and GEMM2 at both depths (the test suite's V4-Flash shape, M = 8192):
#      stall reasons, scheduler, speed of light, occupancy.
# Carry dsv4/_C.abi3.so (and ALT_SO). Results under ${OUT:-/tmp}; summary.txt printed last.
set -u
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
O=${OUT:-/tmp}; S=$O/summary.txt; : > "$S"
ALT_SO=${ALT_SO:-}
python -m pytest -q -p no:cacheprovider tests/test_mxfp4_w4a8.py -k "mma_depth or forced_grids" \
  tests/test_moe_config.py > "$O/pytest.txt" 2>&1
echo "pytest: $(tail -1 "$O/pytest.txt")" >> "$S"
M="--moe-format mxfp4-w4a8 --models flash,pro,v41flash,v41flash-tp8 --decode 64,512 --prefill 2048,8192,16384"
timeout 300 python -m dsv4.bench moe $M --variants 'depth=1;depth=2' --json "$O/depth.json" > "$O/bench_depth.txt" 2>&1
echo "bench rc=$?" >> "$S"
if [ -n "$ALT_SO" ]; then
  cp dsv4/_C.abi3.so /tmp/main.so && cp "$ALT_SO" dsv4/_C.abi3.so
  timeout 150 python -m dsv4.bench moe $M --variants 'depth=2' --json "$O/depth_alt.json" > "$O/bench_alt.txt" 2>&1
  echo "bench $ALT_SO rc=$?" >> "$S"
  cp /tmp/main.so dsv4/_C.abi3.so
fi
cat > /tmp/mxfp4_one.py <<'PY'
import sys, torch
sys.path[:0] = [".", "tests"]  # a script run by path: the repo root is not on sys.path
import test_mxfp4_w4a8 as t
from dsv4.moe import routed_moe
w, p = t._gpu_model("flash")
x, ids, tw, emap = t._gpu_case("flash", 8192, seed=5, use_map=False)
for _ in range(3):
    routed_moe(x, ids, tw, p)
torch.cuda.synchronize()
PY
for d in 1 2; do
  DSV4_MOE_BLOCK_N=64 DSV4_MOE_SPLITK=0 DSV4_MOE_MMA_DEPTH=$d timeout 120 ncu --clock-control none -k regex:mxfp4_gemm \
    --launch-skip 2 --launch-count 2 --section WarpStateStats --section SchedulerStats --section SpeedOfLight \
    --section Occupancy --section LaunchStats python /tmp/mxfp4_one.py > "$O/ncu_depth$d.txt" 2>&1
  echo "ncu depth=$d rc=$?" >> "$S"
  grep -E "mxfp4_gemm|Duration|Stall|Registers Per|Achieved Occ|Eligible|Issued Warp|Compute \(SM\) Thr|Memory Thr" \
    "$O/ncu_depth$d.txt" | head -60 >> "$S"
done
echo "=== bench" >> "$S"
sed -n '/=== all variants/,$p' "$O/bench_depth.txt" >> "$S"
[ -n "$ALT_SO" ] && tail -25 "$O/bench_alt.txt" >> "$S"
cat "$S"
