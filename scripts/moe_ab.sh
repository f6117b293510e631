#!/bin/bash
# MoE builds side by side, one GPU call from the repo root (issue 33):
#   BUILDS="main=devrun/main.so branch=dsv4/_C.abi3.so" bash scripts/moe_ab.sh
# For each build (NAME=PATH of a dsv4/_C.abi3.so, carried): the MXFP4 W4A8 routed_moe's
# outputs on fixed cases (uniform routing with and without an expert map, skewed routing,
# ue8m0 off, M = 1 to 8192) and NVFP4 nvfp4_moe's (both activation modes, decode and
# 64-token tiles, tensor parallel 8) compared bit for bit with the first build's, then the
# dsv4-only benchmark (python -m dsv4.bench moe, MXFP4 W4A8 and NVFP4; BENCH overrides its
# arguments), one process per build. Results
# under ${OUT:-/tmp}/ab; summary.txt printed last (with --profile in BENCH, each kernel's time
# per build too: under PDL a kernel's time includes its wait for the one before it, so read
# the op's time for the total). Budget: DUMP_S and BENCH_S per process.
# A build NAME may name a variant of the same library instead: ENV_NAME="VAR=VALUE ..."
# is set for its processes (the bitwise dump and the benchmark). The benchmark resets
# every variable of its own --variants switches (dsv4/bench/routines/moe.py SWITCHES) to
# the library's default, so ENV_NAME reaches only its dump for those: time them with
# BENCH="... --variants 'k=0;k=1'" instead.
set -u
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
O=${OUT:-/tmp}/ab; mkdir -p "$O"; S=$O/summary.txt; : > "$S"
BUILDS=${BUILDS:?BUILDS="NAME=PATH ..." names the builds; the first is the reference}
BENCH=${BENCH:---moe-format mxfp4-w4a8,nvfp4 --models flash,pro --decode 1,64 --prefill 2048,8192 --iters 20}
DUMP_S=${DUMP_S:-60}; BENCH_S=${BENCH_S:-200}  # two builds fit one 600 s call
eval "bench_args=($BENCH)"  # shell words: a quoted --variants 'k=0;k=1' stays one argument
T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader >> "$S"
git log -1 --format='tree %h %s' 2>/dev/null | cut -c1-100 >> "$S"
cp dsv4/_C.abi3.so "$O/tree.so"
cat > "$O/dump.py" <<'PY'
import sys, torch
sys.path[:0] = [".", "tests"]  # run by path: the repo root is not on sys.path
import test_mxfp4_w4a8 as t
from dsv4.moe import routed_moe
cases = [("flash", 1, "map"), ("flash", 8, "map"), ("flash", 64, "map"), ("flash", 300, "nomap"), ("flash", 2048, "map"),
         ("flash", 8192, "map"), ("flash", 4096, "nomap"), ("pro", 513, "map"), ("pro", 2048, "map"),
         ("v41_tp8", 777, "nomap"), ("v41_tp8", 8192, "nomap"), ("flash", 2048, "skewed"), ("v41_tp8", 2048, "skewed")]
res = {}
for name, M, kind in cases:
    w, p = t._gpu_model(name)
    if kind == "skewed":
        x, ids, tw, emap = t._gpu_case(name, M, seed=M + 13, routing="skewed")
    else:
        x, ids, tw, emap = t._gpu_case(name, M, seed=M + 11, use_map=kind == "map")
    kw = {} if emap is None else {"expert_map": emap}
    for ue8m0 in (True, False) if M in (64, 2048) and kind == "map" else (True,):
        res[(name, M, kind, ue8m0)] = routed_moe(x, ids, tw, p, ue8m0=ue8m0, **kw).cpu()
# NVFP4 (nvfp4_moe): 64-token tiles partly and fully filled, decode tiles, both activation
# modes, and V4.1-Flash at tensor parallel 8 (N = 288 padded to 320; 24 local experts of 384)
import test_moe as nt
for shape, M, act in (("FLASH", 5, "nvfp4"), ("FLASH", 64, "bf16"), ("FLASH", 1500, "bf16"), ("FLASH", 1500, "nvfp4"),
                      ("PRO", 2048, "bf16"), ("FLASH", 4096, "bf16")):
    w, p = nt._gpu_model(getattr(nt, shape))
    x, ids, tw, emap = nt._case(getattr(nt, shape), M, "uniform", True, seed=M + 17)
    res[("nvfp4", shape, M, act)] = nt.nvfp4_moe(x, ids, tw, p, **nt._call_kwargs(w, act, 10.0, emap)).cpu()
for act in ("bf16", "nvfp4"):
    for M in (2048, 2500):
        _, m, x, ids, tw, _, call = nt._tp8_inputs(act, M)
        res[("nvfp4", "TP8", M, act)] = routed_moe(x, ids, tw, m, **call).cpu()
torch.save(res, sys.argv[1])
print("dumped", len(res), "outputs")
PY
first=
for b in $BUILDS; do
  n=${b%%=*}; f=${b#*=}; [ "$f" = dsv4/_C.abi3.so ] && f=$O/tree.so
  cp "$f" dsv4/_C.abi3.so
  ev=ENV_$n
  env ${!ev:-} timeout "$DUMP_S" python "$O/dump.py" "$O/out_$n.pt" > "$O/dump_$n.txt" 2>&1
  echo "dump $n rc=$? at $(( $(date +%s) - T0 )) s: $(tail -1 "$O/dump_$n.txt")" >> "$S"
  if [ -z "$first" ]; then first=$n; continue; fi
  python - "$O/out_$first.pt" "$O/out_$n.pt" >> "$S" 2>&1 <<'PY'
import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
bad = [k for k in a if k in b and not torch.equal(a[k], b[k])]
print("  bitwise against the first build: %d of %d outputs compared, %d differ %s" % (len(set(a) & set(b)), len(a), len(bad), bad[:4]))
PY
done
for b in $BUILDS; do
  n=${b%%=*}; f=${b#*=}; [ "$f" = dsv4/_C.abi3.so ] && f=$O/tree.so
  cp "$f" dsv4/_C.abi3.so
  ev=ENV_$n
  env ${!ev:-} timeout "$BENCH_S" python -m dsv4.bench moe "${bench_args[@]}" --json "$O/bench_$n.json" > "$O/bench_$n.txt" 2>&1
  echo "bench $n rc=$? at $(( $(date +%s) - T0 )) s" >> "$S"
done
cp "$O/tree.so" dsv4/_C.abi3.so
python - "$O" $BUILDS >> "$S" 2>&1 <<'PY'
import json, re, sys
O, names = sys.argv[1], [b.split("=", 1)[0] for b in sys.argv[2:]]
def rows(n):
    try:
        data = json.load(open(f"{O}/bench_{n}.json"))
    except (OSError, ValueError):
        return {}
    out = {}
    # graph replay where measured (decode rows), else the eager call; one row per CTA mode
    # (the NVFP4 rows repeat with cta 1 and 2 beside auto)
    for r in data.get("rows", []):
        key = (r["model"], r["M"], r["experts"], str(r.get("cta", "auto")), r.get("variant", ""))
        out[key] = r["graph_us"] if r.get("graph_us") else r["us"]
    return out
def cells(times, ref):  # each build's time and the first build's over it (time alone where
    # the first build has no such row or kernel, e.g. a kernel only a later build runs)
    return "".join(("%9.1f %5.2fx" % (times[n], ref / times[n]) if ref else "%9.1f       " % times[n])
                   if times.get(n) else "-".rjust(16) for n in names)
table = {n: rows(n) for n in names}
print("dsv4 us, and the first build's time over each build's")
print("case (model, M, experts, cta, variant)".ljust(64) + "".join(n.rjust(16) for n in names))
for k in sorted(table[names[0]], key=str):
    print(str(k).ljust(64) + cells({n: table[n].get(k) for n in names}, table[names[0]][k]))
# with --profile: each kernel's time (torch.profiler) per build, and the first build's over each
prof = {}
for n in names:
    try:
        lines = open(f"{O}/bench_{n}.txt").read().splitlines()
    except OSError:
        continue
    for ln in lines:
        m = re.match(r"profile (.*) M=(\d+) \[(.*)\]: sum [\d.]+ us: (.*)", ln)
        if not m:
            continue
        for part in m.group(4).split(", "):
            kernel, _, us = part.rpartition(" ")
            times = prof.setdefault((m.group(1), int(m.group(2)), m.group(3), kernel.strip().split("::")[-1]), {})
            times[n] = times.get(n, 0.0) + float(us)
if prof:
    print("per kernel (--profile), us, and the first build's time over each build's")
    for k in sorted(prof, key=str):
        print(str(k)[:90].ljust(92) + cells(prof[k], prof[k].get(names[0])))
PY
cat "$S"
