#!/bin/bash
# Attention variants side by side, one GPU call from the repo root (issue 34):
#   VARIANTS="today=DSV4_ATTN_CROSSOVER=0 crossover=DSV4_ATTN_CROSSOVER=1" bash scripts/attn_ab.sh
#   VARIANTS="main=so:/tmp/so/main.so branch=so:/tmp/so/branch.so" bash scripts/attn_ab.sh
# For each variant (NAME=VAR=VALUE[,VAR=VALUE...], or NAME=so:PATH for another build of
# dsv4/_C.abi3.so, carried; the first one the reference): one process of
# scripts/attn_splits_sweep.py at the rule's split count (its cases: V4-Pro CSA / HCA at 4K
# and 128K over B = 1-256, V4-Pro SWA, V4-Flash HCA / CSA 4K; FlashMLA in the same timed
# call), the variables set in that process only. Then per case: dsv4 us per variant and
# FlashMLA / dsv4 per variant (the same call's FlashMLA, so clock drift between processes
# cancels). Needs FlashMLA in .anchors (DSV4_ANCHORS). Results under ${OUT:-/tmp}/attn_ab;
# summary.txt printed last. Budget: BUDGET_S per process (default 150).
set -u
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
export DSV4_ANCHORS=${DSV4_ANCHORS:-.anchors}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
VARIANTS=${VARIANTS:?VARIANTS="NAME=VAR=VALUE[,VAR=VALUE] ..." names the variants; the first is the reference}
BUDGET_S=${BUDGET_S:-150}; ITERS=${ITERS:-50}
O=${OUT:-/tmp}/attn_ab; mkdir -p "$O"; S=$O/summary.txt; : > "$S"; rm -f "$O/tree.so"
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader >> "$S" 2>/dev/null
git log -1 --format='tree %h %s' 2>/dev/null | cut -c1-100 >> "$S"
names=()
for v in $VARIANTS; do
  n=${v%%=*}; sets=${v#*=}; names+=("$n"); mkdir -p "$O/$n"
  deadline=$(( $(date +%s) + BUDGET_S - 25 ))
  if [ "${sets#so:}" != "$sets" ]; then  # a build: its library for this process only
    [ -f "$O/tree.so" ] || [ ! -f dsv4/_C.abi3.so ] || cp dsv4/_C.abi3.so "$O/tree.so"
    cp "${sets#so:}" dsv4/_C.abi3.so; sets=
  fi
  ( for kv in ${sets//,/ }; do export "$kv"; done
    timeout "$BUDGET_S" python scripts/attn_splits_sweep.py run --forced auto --sweep 1 --out "$O/$n" \
      --iters "$ITERS" --deadline "$deadline" ) > "$O/log_$n.txt" 2>&1
  rc=$?
  [ -f "$O/tree.so" ] && cp "$O/tree.so" dsv4/_C.abi3.so
  echo "variant $n (${sets:-${v#*=}}): rc=$rc, $(grep -c dsv4_us "$O/$n/forced_auto.jsonl" 2>/dev/null) cases" >> "$S"
done
python - "$O" "${names[@]}" >> "$S" 2>&1 <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
runs = {}
for n in names:
    try:
        runs[n] = {r["case"]: r for r in map(json.loads, open(f"{out}/{n}/forced_auto.jsonl")) if "dsv4_us" in r}
    except OSError:
        runs[n] = {}
cases = list(runs[names[0]])
w = max(len(n) for n in names) + 11  # room for "FlashMLA/<name>" and a space
head = "case".ljust(28) + "".join(f"{n + ' us':>16s}{'FlashMLA/' + n:>{w}s}" for n in names)
print(head)
for c in cases:
    row = c.ljust(28)
    for n in names:
        r = runs[n].get(c)
        if r is None:
            row += f"{'-':>16s}{'-':>{w}s}"
            continue
        fm = r.get("flashmla_us")
        row += f"{r['dsv4_us']:16.1f}" + (f"{fm / r['dsv4_us']:{w}.2f}" if fm else f"{'-':>{w}s}")
    print(row)
PY
cat "$S"
