#!/usr/bin/env python3
"""Executable model of the synchronization protocol of sparse_mqa_fwd_ring32_kernel
(csrc/attention/sparse_mqa_ring32.cuh of ../2026-12-07-attention-ring32.patch, before its round-count fix).

Processes (one per warp, as the hardware runs them):
  producer warps P0..P3 (warpgroup 0), consumer-0 warps C0w0..C0w3 (WG1), consumer-1
  warps C1w0..C1w3 (WG2), plus one "tensor core" process per consumer warpgroup that
  completes committed wgmma groups in order (a group's smem reads are in flight from the
  first warp's issue until its completion event).

Each role's op sequence is transcribed from the kernel source (line numbers in comments).

Barriers:
  mbarrier: count, pending, phase (= number of completed phases). try_wait.parity(p) passes
    iff (phase & 1) != p  (sync.cuh mbar_wait; PTX: the phase with parity p has completed).
    On every pass we check phase == use + 1 (no stale pass: "use" the code means).
  named barrier (bar.sync / bar.arrive, 256 threads = 8 warps): hardware counting in warps;
    an instance completes with its 8th warp; every instance is checked to consist of the
    4 warps of each consumer for the same (item, round, tag).

Data: every shared resource carries per-writer-warp versions; reads check RAW (all the
rows they need hold the version they mean), writes check WAR (every read of the previous
version that the code performs has finished), wgmma reads are intervals.

Usage: python3 ring32_model.py [--seeds N] [--variant NAME]
"""
import argparse
import random
import sys
from collections import defaultdict

# ---------------------------------------------------------------------------------------
# indices as in the kernel
READY = lambda hb: hb                 # ready[hb], hb = 2 sb + half = 4 set + 2 c + half
FREED = lambda hb: 8 + hb             # kRing32Free = 8
MASKR = lambda sb: 16 + sb            # kRing32MaskReady = 16
K_BAR_Q, K_BAR_MAX0, K_BAR_MAX1, K_BAR_P0, K_BAR_P1, K_BAR_SUM = 1, 2, 3, 4, 5, 6


def half_step(step):  # sparse_mqa_producer.cuh:235
    buf = step & 1
    half = 1 if step in (1, 2) else 0
    return buf, half, 2 * buf + half


class ModelError(Exception):
    pass


class MBar:
    def __init__(self, name, count):
        self.name, self.count, self.pending, self.phase = name, count, count, 0

    def arrive(self, n):
        self.pending -= n
        if self.pending < 0:
            raise ModelError(f"{self.name}: more arrivals than the count")
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count


# ---------------------------------------------------------------------------------------
# Role programs (generators of ops). Op tuples:
#  ('mwait', bar, parity, use)      mbarrier try_wait.parity loop; use = the phase index meant
#  ('marrive', bar, n)
#  ('nb_arrive', id, tag) / ('nb_sync', id, tag)
#  ('write', res, ver)             generic store (atomic step), WAR-checked
#  ('read', res, ver, need)        generic load, RAW-checked (need: writer warps whose rows are read)
#  ('wg', reads)                   wgmma issue + commit of a group that reads [(res, ver, need)]
#  ('wg_wait', n)                  wgmma.wait_group n
#  ('qload', item)                 cp.async of Q rows of `item` issued (may land any time)
#  ('cpwait',)                     cp.async.wait_all: this warp's Q rows landed
ALLW = (0, 1, 2, 3)


def producer(w, items, variant):
    rb = 0
    for R in items:                                    # ring32.cuh:245-250
        for r in range(R):                             # producer_loop_ring32, :176
            gr = rb + r
            st = gr & 1
            for step in range(4):                      # :203
                c, half, hb4 = half_step(step)
                sb = 2 * st + c
                hb = 4 * st + hb4
                if variant == 'mask_before_wait' and step < 2:
                    yield ('write', ('mask', sb, w), gr)
                    yield ('marrive', MASKR(sb), 1)
                # load_sub_half_fp8: global loads, then wait_free (:127)
                if variant == 'prod_parity_off' and gr >= 2:
                    use = (gr >> 1) - 1
                    yield ('mwait', FREED(hb), (use + 1) & 1, use)
                elif variant == 'prod_skip_wait_gr2' and gr >= 4:
                    use = (gr >> 1) - 1
                    yield ('mwait', FREED(hb), use & 1, use)
                elif variant not in ('prod_parity_off', 'prod_skip_wait_gr2') and gr >= 2:  # :209
                    use = (gr >> 1) - 1
                    yield ('mwait', FREED(hb), use & 1, use)
                if variant != 'mask_before_wait' and ((step >= 2) if variant == 'mask_on_second_half' else (step < 2)):  # :210-213 (lane 0)
                    yield ('write', ('mask', sb, w), gr)
                    yield ('marrive', MASKR(sb), 1)
                yield ('write', ('half', hb, w), gr)    # :128-138 (this warp's 8 rows)
                yield ('marrive', READY(hb), 32)        # :139-140 fence + arrive
        rb += R


def hbof(st, c, half):
    return 4 * st + 2 * c + half


def consumer(g, w, items, variant):
    """One warp w of consumer warpgroup g (ring32.cuh:428-611)."""
    first, second = g, 1 - g
    other = 1 - g
    yield ('qload', 0)                                  # :428
    rb = 0
    n = len(items)
    for it, R in enumerate(items):
        tag = lambda gr, x: (it, gr, x)
        yield ('cpwait',)                               # :446
        yield ('nb_sync', K_BAR_Q, (it, -1, 'Q'))       # :448
        Qv = ('Q', it)

        def s_group(gr, half):
            st = gr & 1
            return [(('half', hbof(st, g, half)), gr, ALLW), (('Q',), it, 'all')]

        if g == 0:
            if R > 0:                                   # :454-457 compute_s(round_base)
                st = rb & 1
                u = rb >> 1
                yield ('mwait', READY(hbof(st, 0, first)), u & 1, u)
                yield ('wg', s_group(rb, first))
                yield ('mwait', READY(hbof(st, 0, second)), u & 1, u)
                yield ('wg', s_group(rb, second))
                yield ('wg_wait', 0)
            for r in range(R):
                gr = rb + r
                st = gr & 1
                u = gr >> 1
                sb = 2 * st + 0
                yield ('mwait', MASKR(sb), u & 1, u)     # mask_and_max :336
                yield ('read', ('mask', sb), gr, ALLW)   # :337 (32-bit word: all 4 producer bytes)
                yield ('write', ('smax_fw', st, w), gr)  # :466
                yield ('nb_arrive', K_BAR_MAX0, (it, gr, 'max0'))   # :469
                # pv_regs(kv_of(2 set)) :474 : V = buffer 2set, consumer-0 half (left)
                yield ('wg', [(('half', hbof(st, 0, 0)), gr, ALLW)])
                yield ('wg_wait', 0)                     # :475
                yield ('marrive', FREED(hbof(st, 0, 0)), 32)   # :477 release 0L
                yield ('nb_sync', K_BAR_MAX1, (it, gr, 'max1'))  # :479
                yield ('read', ('smax_bw', st), gr, (w,))     # :480
                yield ('write', ('P', 0, w), gr)                  # store_p :488
                if variant != 'c1_no_p0_sync':
                    yield ('nb_arrive', K_BAR_P0, (it, gr, 'p0'))     # :489
                yield ('nb_sync', K_BAR_P1, (it, gr, 'p1'))       # :491
                # pv_smem(p_other, kv_of(2 set + 1)) :492 : P_1, buffer 2set+1 left half
                yield ('wg', [(('P', 1), gr, ALLW), (('half', hbof(st, 1, 0)), gr, ALLW)])
                if r + 1 < R:
                    gn = gr + 1
                    stn = gn & 1
                    un = gn >> 1
                    yield ('mwait', READY(hbof(stn, 0, first)), un & 1, un)   # :499
                    yield ('wg', s_group(gn, first))                          # :501-502
                    if variant == 'c0_release_1L_early':
                        yield ('marrive', FREED(hbof(st, 1, 0)), 32)
                        yield ('wg_wait', 1)
                    else:
                        yield ('wg_wait', 1)                                      # :503
                        yield ('marrive', FREED(hbof(st, 1, 0)), 32)              # :504 release 1L
                    yield ('mwait', READY(hbof(stn, 0, second)), un & 1, un)  # :505
                    yield ('wg', s_group(gn, second))                         # :506-507
                    yield ('wg_wait', 0)                                      # :508
                else:
                    yield ('wg_wait', 0)                                      # :510
                    yield ('marrive', FREED(hbof(st, 1, 0)), 32)              # :511
        else:
            for r in range(R):
                gr = rb + r
                st = gr & 1
                u = gr >> 1
                sb = 2 * st + 1
                # compute_s(gr) :519 (first = right half of buffer 2set+1)
                yield ('mwait', READY(hbof(st, 1, first)), u & 1, u)
                yield ('wg', s_group(gr, first))
                yield ('mwait', READY(hbof(st, 1, second)), u & 1, u)
                yield ('wg', s_group(gr, second))
                yield ('wg_wait', 0)                                     # :520
                yield ('mwait', MASKR(sb), u & 1, u)                     # :523
                yield ('read', ('mask', sb), gr, ALLW)
                yield ('nb_sync', K_BAR_MAX0, (it, gr, 'max0'))          # :524
                yield ('read', ('smax_fw', st), gr, (w,))             # :525
                yield ('write', ('smax_bw', st, w), gr)                  # :530
                yield ('nb_arrive', K_BAR_MAX1, (it, gr, 'max1'))        # :533
                # pv_regs(kv_of(2set+1)) :537: consumer-1 half (right) of buffer 2set+1
                yield ('wg', [(('half', hbof(st, 1, 1)), gr, ALLW)])
                yield ('write', ('P', 1, w), gr)                         # store_p :538
                yield ('nb_arrive', K_BAR_P1, (it, gr, 'p1'))            # :539
                if variant != 'c1_no_p0_sync':
                    yield ('nb_sync', K_BAR_P0, (it, gr, 'p0'))              # :540
                # pv_smem(p_other, kv_of(2set)) :541: P_0, right half of buffer 2set
                yield ('wg', [(('P', 0), gr, ALLW), (('half', hbof(st, 0, 1)), gr, ALLW)])
                if variant == 'c1_release_both_at_wait1':
                    yield ('wg_wait', 1)
                    yield ('marrive', FREED(hbof(st, 1, 1)), 32)
                    yield ('marrive', FREED(hbof(st, 0, 1)), 32)
                    yield ('wg_wait', 0)
                else:
                    yield ('wg_wait', 1)                                     # :542
                    yield ('marrive', FREED(hbof(st, 1, 1)), 32)             # :543 release 1R
                    yield ('wg_wait', 0)                                     # :544
                    yield ('marrive', FREED(hbof(st, 0, 1)), 32)             # :546 release 0R
        # epilogue sums :551-562
        if variant == 'q_before_sum' and it + 1 < n:
            yield ('qload', it + 1)
        yield ('write', ('ssum', g, w), it)
        yield ('nb_sync', K_BAR_SUM, (it, -1, 'sum'))
        yield ('read', ('ssum', other), it, (w,))
        if variant == 'q_before_sum' and it + 1 < n:
            pass
        elif it + 1 < n:
            yield ('qload', it + 1)                                      # :563
        rb += R


# ---------------------------------------------------------------------------------------
class Sim:
    def __init__(self, items, seed, variant, policy):
        self.items = items
        self.variant = variant
        self.rng = random.Random(seed)
        self.policy = policy
        self.bars = {}
        for hb in range(8):
            self.bars[READY(hb)] = MBar(f"ready[{hb}]", 128)
            self.bars[FREED(hb)] = MBar(f"freed[{hb}]", 128)
        for sb in range(4):
            self.bars[MASKR(sb)] = MBar(f"mask_ready[{sb}]", 4)
        # named barriers: id -> list of (proc, kind, tag); waiting syncers blocked until done
        self.nb = defaultdict(list)
        self.nb_done = {}  # proc -> True when its sync instance completed
        self.procs = {}
        for w in range(4):
            self.procs[('P', w)] = producer(w, items, variant)
        for g in range(2):
            for w in range(4):
                self.procs[('C', g, w)] = consumer(g, w, items, variant)
        self.cur = {k: None for k in self.procs}
        self.blocked_sync = {}
        # data state
        self.ver = {}            # (res..., writer) -> version
        self.reads_started = defaultdict(int)   # (res, ver) -> count of reads started
        self.reads_done = defaultdict(int)
        self.inflight_reads = defaultdict(int)  # (res, ver) -> reads in flight (wgmma)
        # expected number of reads of each version before it may be overwritten
        # wgmma groups per consumer warpgroup
        self.groups = {0: [], 1: []}   # list of dict(reads, issued=set(w), done)
        self.gidx = {(g, w): 0 for g in range(2) for w in range(4)}  # next group index per warp
        self.qpending = {}  # (g,w) -> item of issued not-landed Q copies
        self.steps = 0
        self.ahead = []

    # ---- data checks
    def res_key(self, res, writer):
        return tuple(res) + (writer,)

    def do_write(self, proc, res, ver):
        # WAR: every read of the version this write replaces has finished
        kind = res[0]
        prev = self.ver.get(res)
        if kind == 'half':
            hb, w = res[1], res[2]
            old = ver - 2
            if old >= 0:
                key = (('half', hb), old)
                if self.inflight_reads[key] or self.reads_done[key] != 2:
                    raise ModelError(f"WAR half {hb} warp {w}: writing round {ver} while round {old} reads "
                                     f"done={self.reads_done[key]} inflight={self.inflight_reads[key]} (need 2 done)")
            if prev is not None and prev != old:
                raise ModelError(f"half {hb} warp {w}: overwrote round {prev} with {ver}")
        elif kind == 'mask':
            sb, w = res[1], res[2]
            old = ver - 2
            if old >= 0:
                key = (('mask', sb), old)
                if self.reads_done[key] != 4:
                    raise ModelError(f"WAR mask {sb} byte {w}: writing round {ver}, reads of round {old} done "
                                     f"{self.reads_done[key]}/4")
        elif kind == 'P':
            c, w = res[1], res[2]
            # previous version written by this consumer: its previous round (any earlier gr)
            if prev is not None:
                key = (('P', c), prev)
                if self.inflight_reads[key] or self.reads_done[key] != 1:
                    raise ModelError(f"WAR P{c} warp {w}: writing round {ver} while P of round {prev} "
                                     f"reads done={self.reads_done[key]} inflight={self.inflight_reads[key]}")
        elif kind in ('smax_fw', 'smax_bw', 'ssum'):
            _, a, w = res
            if prev is not None:
                key = ((kind, a, w), prev)
                if self.reads_done[key] != 1:
                    raise ModelError(f"WAR {kind}[{a}] warp {w}: writing {ver}, read of {prev} not done")
        self.ver[res] = ver

    def check_read(self, res, ver, need):
        kind = res[0]
        if kind == 'Q':
            for g in range(2):
                for w in range(4):
                    v = self.ver.get(('Q', g, w))
                    if v != ver or (g, w) in self.qpending:
                        raise ModelError(f"RAW Q: S of item {ver} reads Q rows of warp {g}.{w} = {v} "
                                         f"(pending {self.qpending.get((g, w))})")
            return
        for w in need:
            v = self.ver.get(tuple(res) + (w,))
            if v != ver:
                raise ModelError(f"RAW {res} rows of warp {w}: need round {ver}, hold {v}")

    def q_land(self, gw):
        it = self.qpending.pop(gw)
        self.ver[('Q',) + gw] = it

    def q_issue(self, gw, it):
        # WAR: all S reads of the previous item finished (the copies may land at once)
        if it > 0:
            key = (('Q',), it - 1)
            need = 4 * max(self.items[it - 1], 0)  # 2 S halves per round per consumer
            if self.inflight_reads[key] or self.reads_done[key] != need:
                raise ModelError(f"WAR Q: item {it} copies issued while item {it - 1}'s S reads done "
                                 f"{self.reads_done[key]}/{need} inflight {self.inflight_reads[key]}")
        self.qpending[gw] = it

    # ---- scheduling
    def enabled(self, p):
        op = self.cur[p]
        if op is None:
            return False
        k = op[0]
        if k == 'mwait':
            b = self.bars[op[1]]
            return (b.phase & 1) != op[2]
        if k == 'nb_wait':
            return self.nb_done.get(p, False)
        if k == 'wg_wait':
            g, w = p[1], p[2]
            mine = self.groups[g][:self.gidx[(g, w)]]
            pend = sum(1 for gr in mine if not gr['done'])
            return pend <= op[1]
        return True

    def advance(self, p):
        try:
            self.cur[p] = next(self.procs[p])
        except StopIteration:
            self.cur[p] = None

    def exec(self, p):
        op = self.cur[p]
        k = op[0]
        if k == 'mwait':
            b = self.bars[op[1]]
            use = op[3]
            if b.phase != use + 1:
                raise ModelError(f"{p}: wait on {b.name} parity {op[2]} passed at phase count {b.phase}, "
                                 f"meant use {use} (needs exactly {use + 1}): stale or two phases ahead")
        elif k == 'marrive':
            self.bars[op[1]].arrive(op[2])
        elif k in ('nb_arrive', 'nb_sync'):
            bid, tag = op[1], op[2]
            inst = self.nb[bid]
            inst.append((p, k, tag))
            if len(inst) == 8:
                # verify the instance: one tag, 4 warps of each consumer
                tags = {t for (_, _, t) in inst}
                if len(tags) != 1:
                    raise ModelError(f"named barrier {bid} instance mixes {tags}")
                if sorted(q[1] for (q, _, _) in inst) != [0, 0, 0, 0, 1, 1, 1, 1]:
                    raise ModelError(f"named barrier {bid}: instance of {[(q, kk) for (q, kk, _) in inst]}")
                for (q, kk, _) in inst:
                    if kk == 'nb_sync':
                        self.nb_done[q] = True
                self.nb[bid] = []
            if k == 'nb_sync':
                self.cur[p] = ('nb_wait', bid)
                return  # stay on the wait
        elif k == 'nb_wait':
            self.nb_done[p] = False
        elif k == 'write':
            self.do_write(p, op[1], op[2])
        elif k == 'read':
            res, ver, need = op[1], op[2], op[3]
            self.check_read(res, ver, need)
            if res[0] in ('smax_fw', 'smax_bw', 'ssum'):
                self.reads_done[((res[0], res[1], need[0]), ver)] += 1
            else:
                self.reads_done[(tuple(res), ver)] += 1
        elif k == 'wg':
            g, w = p[1], p[2]
            i = self.gidx[(g, w)]
            if i == len(self.groups[g]):
                # first warp to issue: the group's reads start now
                for (res, ver, need) in op[1]:
                    self.check_read(res, ver, need)
                    self.reads_started[(tuple(res), ver)] += 1
                    self.inflight_reads[(tuple(res), ver)] += 1
                self.groups[g].append({'reads': op[1], 'issued': {w}, 'done': False})
            else:
                grp = self.groups[g][i]
                if grp['reads'] != op[1]:
                    raise ModelError(f"{p}: warps of WG{g} issue different groups")
                grp['issued'].add(w)
            self.gidx[(g, w)] = i + 1
        elif k == 'wg_wait':
            pass
        elif k == 'qload':
            self.q_issue((p[1], p[2]), op[1])
        elif k == 'cpwait':
            if (p[1], p[2]) in self.qpending:
                self.q_land((p[1], p[2]))
        else:
            raise AssertionError(op)
        self.advance(p)

    def tc_candidates(self):
        out = []
        for g in range(2):
            for grp in self.groups[g]:
                if grp['done']:
                    continue
                if len(grp['issued']) == 4:
                    out.append(('TC', g))
                break  # in order
        return out

    def tc_exec(self, g):
        for grp in self.groups[g]:
            if not grp['done']:
                grp['done'] = True
                for (res, ver, need) in grp['reads']:
                    self.inflight_reads[(tuple(res), ver)] -= 1
                    self.reads_done[(tuple(res), ver)] += 1
                return

    def run(self, max_steps=2_000_000):
        for p in self.procs:
            self.advance(p)
        while True:
            cands = [p for p in self.procs if self.enabled(p)]
            qland = [('QL',) + gw for gw in self.qpending]
            tcs = self.tc_candidates()
            allc = cands + tcs + qland
            if not allc:
                live = [p for p in self.procs if self.cur[p] is not None]
                if live:
                    desc = {str(p): self.cur[p] for p in live}
                    bars = {b.name: (b.phase, b.pending) for b in self.bars.values()}
                    raise ModelError(f"DEADLOCK: {desc}\n bars {bars}")
                return self.steps
            x = self.policy(self, allc)
            self.steps += 1
            if x[0] == 'TC':
                self.tc_exec(x[1])
            elif x[0] == 'QL':
                self.q_land((x[1], x[2]))
            else:
                self.exec(x)
            if self.steps > max_steps:
                raise ModelError("step limit")


# ---- scheduling policies
def pol_uniform(sim, c):
    return sim.rng.choice(c)


def make_biased(weights):
    def pol(sim, c):
        ws = []
        for x in c:
            if x[0] == 'P':
                ws.append(weights['P'])
            elif x[0] == 'C':
                ws.append(weights['C%d' % x[1]] * (weights.get('w%d' % x[2], 1.0)))
            elif x[0] == 'TC':
                ws.append(weights['TC'])
            else:
                ws.append(weights['QL'])
        return sim.rng.choices(c, ws)[0]
    return pol


POLICIES = {
    'uniform': pol_uniform,
    'fast_producer': make_biased({'P': 20, 'C0': 1, 'C1': 1, 'TC': 1, 'QL': 0.05}),
    'slow_producer': make_biased({'P': 0.05, 'C0': 1, 'C1': 1, 'TC': 5, 'QL': 0.05}),
    'slow_tc': make_biased({'P': 5, 'C0': 5, 'C1': 5, 'TC': 0.02, 'QL': 0.01}),
    'fast_c0': make_biased({'P': 1, 'C0': 20, 'C1': 1, 'TC': 1, 'QL': 0.1}),
    'fast_c1': make_biased({'P': 1, 'C0': 1, 'C1': 20, 'TC': 1, 'QL': 0.1}),
    'skew_warps': make_biased({'P': 1, 'C0': 1, 'C1': 1, 'TC': 1, 'QL': 0.1, 'w0': 30, 'w3': 0.03}),
}

CASES = [
    [1], [2], [3], [4], [5], [8],
    [0], [0, 1], [1, 0], [1, 1], [1, 1, 1], [2, 1], [1, 2], [3, 3], [3, 0, 2], [2, 3, 1, 4],
    [0, 0, 3], [1, 2, 3, 4, 5], [7, 1, 0, 2], [4, 4, 4, 4],
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--seeds', type=int, default=200)
    ap.add_argument('--random-cases', type=int, default=40)
    ap.add_argument('--variant', default=None)
    args = ap.parse_args()
    rng = random.Random(1234)
    cases = list(CASES) + [[rng.choice([0, 1, 1, 2, 3, 5, 9]) for _ in range(rng.randint(1, 5))]
                           for _ in range(args.random_cases)]
    total = 0
    fails = 0
    for case in cases:
        for pname, pol in POLICIES.items():
            for seed in range(args.seeds):
                sim = Sim(case, seed * 7919 + len(pname) * 101, args.variant, pol)
                try:
                    sim.run()
                except ModelError as e:
                    fails += 1
                    print(f"FAIL case={case} policy={pname} seed={seed}: {e}")
                    if fails > 20 or args.variant:
                        print(f"{total} schedules passed before the first failure")
                        sys.exit(1)
                    break
                total += 1
    print(f"{total} schedules over {len(cases)} item lists x {len(POLICIES)} policies: {fails} failures")


if __name__ == '__main__':
    main()
