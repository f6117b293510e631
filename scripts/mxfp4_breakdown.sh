#!/bin/bash
# Issue 33: where the MXFP4 W4A8 op's time goes at prefill, one GPU call from the repo root
# (docs/perf-history/2026-12-05-mxfp4-w4a8-overlap-wg.md, the H100 look-back): ncu
# SpeedOfLight + Occupancy of every dsv4 MoE kernel of one mxfp4_moe call (after warm
# calls), the test suite's V4-Flash weights (16 experts) with its expert map (16 of 256
# local: ~3 token tiles per local expert at M = 8192, as the benchmark's EP8 cases) at
# M = 2048 and 8192, and without it (every slot local: 48 tiles per expert) at 8192; then
# GEMM1's stall reasons and memory traffic in the EP8-like call at M = 8192.
# Carry dsv4/_C.abi3.so. Results under ${OUT:-/tmp}; the per-kernel lines printed.
set -u
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
O=${OUT:-/tmp}
cat > /tmp/moe_one.py <<'PY'
import sys, torch
sys.path[:0] = [".", "tests"]
import test_mxfp4_w4a8 as t
from dsv4.moe import routed_moe
M, use_map = int(sys.argv[1]), sys.argv[2] == "map"
w, p = t._gpu_model("flash")
x, ids, tw, emap = t._gpu_case("flash", M, seed=5, use_map=use_map)
kw = {} if emap is None else {"expert_map": emap}
for _ in range(2):  # warm: first-use setup outside the profiled call
    routed_moe(x, ids, tw, p, **kw)
torch.cuda.synchronize()
torch.cuda.profiler.start()  # ncu --profile-from-start off: only this call's kernels
routed_moe(x, ids, tw, p, **kw)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
PY
for c in "8192 map" "2048 map" "8192 nomap"; do
  f=$O/ncu_moe_${c// /_}.txt
  timeout 100 ncu --clock-control none -k regex:"mxfp4|moe_" --profile-from-start off \
    --section SpeedOfLight --section Occupancy python /tmp/moe_one.py $c > "$f" 2>&1
  echo "== $c rc=$?"
  grep -E "^  [a-z_ ]*(void )?[a-z_0-9]+(<|\()|Duration|Compute \(SM\) Thr|DRAM Thr|L2 Cache Thr|Achieved Occ" "$f" | head -60
done
# GEMM1 of the EP8-like call in depth: what its warps wait on, and its memory traffic
f=$O/ncu_gemm1_8192_map.txt
timeout 100 ncu --clock-control none -k regex:"mxfp4_gemm_kernel" --profile-from-start off --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section SpeedOfLight python /tmp/moe_one.py 8192 map > "$f" 2>&1
echo "== GEMM1 8192 map rc=$?"
grep -E "^  [a-z_ ]*(void )?[a-z_0-9]+(<|\()|Duration|Stall|Eligible|Issued Warp|Mem Busy|Max Bandwidth|L2 Hit|L1/TEX Hit|DRAM Thr" "$f" | head -40
# ... and its stall reasons, per issued instruction (the WarpStateStats section's metrics by name)
f=$O/ncu_gemm1_stalls.txt
timeout 100 ncu --clock-control none -k regex:"mxfp4_gemm_kernel" --profile-from-start off \
  --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' python /tmp/moe_one.py 8192 map > "$f" 2>&1
echo "== GEMM1 stalls rc=$?"
grep -E "stalled" "$f" | awk '{print $NF, $1}' | sort -g -r | head -12
