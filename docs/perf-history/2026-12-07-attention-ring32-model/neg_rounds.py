# Bug check: ring32_rounds(tt) = t1 - t0 can be -1 (batch-invariant, odd tile count, a split at/after the
# last pair). Model the CTA item list [3, -1, 2] exactly as the kernel would run it.
import sys
sys.path.insert(0, '.')
from ring32_model import Sim, POLICIES, ModelError

def token_tiles(n, split, pps):  # sparse_mqa_schedule.cuh:239-256, batch-invariant branch
    pairs = (n + 1) // 2
    p0 = min(split * pps, pairs)
    p1 = min(p0 + pps, pairs)
    t0 = 2 * p0
    t1 = 2 * p1 if 2 * p1 < n else n
    return t0, t1

print("batch-invariant (pairs_per_split 4), num_splits 2:")
for n in range(0, 12):
    rr = [token_tiles(n, s, 4) for s in range(2)]
    print(f"  tiles {n:2d}: splits (t0,t1) {rr}  ring32_rounds {[t1 - t0 for t0, t1 in rr]}  "
          f"token_rounds {[(t1 - t0 + 1) >> 1 for t0, t1 in rr]}")

for case in ([3, -1, 2], [1, -1, 1], [2, -1, 3, 1]):
    res = {}
    for pname, pol in POLICIES.items():
        for seed in range(20):
            try:
                Sim(case, seed, None, pol).run()
                res['ok'] = res.get('ok', 0) + 1
            except ModelError as e:
                k = str(e).split(':')[0][:60]
                res[k] = res.get(k, 0) + 1
                ex = str(e)[:300]
    print(case, res)
    print("   e.g.", ex)
