#!/bin/bash
# Split-count sweep of the sparse MQA decode (DSV4_ATTN_SPLITS), GPU, from the repo root:
#   bash scripts/attn_splits_sweep.sh
# Needs dsv4/_C.abi3.so built with DSV4_ATTN_SPLITS (the knob and the test-only op's
# `forced` argument; checked first) and FlashMLA in .anchors (DSV4_ANCHORS, default .anchors).
# One process per forced value (the variables are read once per process): unset (the rule,
# with FlashMLA), then 1 2 3 4 5 6 8 10 12 16. Results: ${OUT:-/tmp}/splits/forced_*.jsonl and
# summary.txt. Budget: ~7.5 min wall in all (each process starts no case past the deadline and
# is killed 30 s after it); SWEEP, ITERS, BUDGET_S override.
set -u
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
export DSV4_ANCHORS=${DSV4_ANCHORS:-.anchors}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset DSV4_ATTN_SPLITS DSV4_ATTN_PRICED_SPLITS
PY=${PYTHON:-python}
S=scripts/attn_splits_sweep.py
O=${OUT:-/tmp}/splits
SWEEP=${SWEEP:-1,2,3,4,5,6,8,10,12,16}
ITERS=${ITERS:-50}
BUDGET_S=${BUDGET_S:-450}
mkdir -p "$O" && rm -f "$O"/forced_*.jsonl "$O"/summary.txt
count() { local n; n=$(grep -c "\"$1\"" "$O/forced_$2.jsonl" 2>/dev/null); echo "${n:-0}"; }
START=$(date +%s)
DEADLINE=$((START + BUDGET_S - 40))  # leaves the last process and the summary their time
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader 2>/dev/null
git log -1 --format='tree %h %s' 2>/dev/null | cut -c1-120
# The build must have the knob: an older _C ignores DSV4_ATTN_SPLITS without a word.
if ! $PY -c "
import torch, dsv4
assert dsv4.HAS_CUDA_EXTENSION, 'dsv4._C not loaded'
assert torch.ops.dsv4_testing.sparse_mqa_num_splits(1, 18, 132, True, 4) == 4
print('dsv4._C has DSV4_ATTN_SPLITS (sparse_mqa_num_splits takes forced)')
"; then
  echo "splits.sh: dsv4/_C.abi3.so predates DSV4_ATTN_SPLITS (or does not load): stopping"; exit 2
fi
for f in auto ${SWEEP//,/ }; do
  now=$(date +%s)
  left=$((DEADLINE + 30 - now))
  if [ "$left" -lt 20 ]; then echo "== forced $f: skipped, budget spent"; continue; fi
  if [ "$f" = auto ]; then
    timeout "$left" $PY $S run --forced auto --sweep "$SWEEP" --out "$O" --iters "$ITERS" --deadline "$DEADLINE"
  else
    DSV4_ATTN_SPLITS=$f timeout "$left" $PY $S run --forced "$f" --sweep "$SWEEP" --out "$O" --iters "$ITERS" \
      --deadline "$DEADLINE"
  fi > "$O/log_$f.txt" 2>&1
  rc=$?
  echo "== forced $f: rc=$rc, $(( $(date +%s) - now )) s; $(count dsv4_us "$f") timed, $(count skipped "$f") skipped," \
    "$(count error "$f") errors"
  [ "$rc" -ne 0 ] && tail -5 "$O/log_$f.txt"
done
echo "== total $(( $(date +%s) - START )) s"
$PY $S summary "$O"
