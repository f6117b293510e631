#!/usr/bin/env python3
"""Exhaustive interleavings of the ring32 protocol at warpgroup granularity (producer WG,
consumer WG 0, consumer WG 1, the two tensor-core queues, Q copy landings), for small item
lists. Op sequences come from ring32_model.py's role generators (warp 0's program; arrive
counts scaled to the warpgroup, writes cover all rows). Every reachable state is visited
(DFS with a visited set); checks as in ring32_model.py: RAW / WAR on every buffer half, mask,
P tile, maxima and sums slot, Q; parity waits pass only on the meant phase; named-barrier
instances pair the same (item, round); no deadlock.

Usage: python3 ring32_exhaustive.py [item lists as e.g. 1 2 3 1,1 2,1]
"""
import sys
from ring32_model import producer, consumer, READY, FREED, MASKR

sys.setrecursionlimit(100000)


def wg_program(gen):
    out = []
    for op in gen:
        k = op[0]
        if k == 'marrive':
            out.append(('marrive', op[1], 128 if op[2] == 32 else 4))
        elif k == 'write':
            res = op[1]
            out.append(('write', res[:-1], op[2]))  # all rows of the resource
        elif k == 'read':
            out.append(('read', op[1], op[2]))
        elif k == 'wg':
            out.append(('wg', tuple((tuple(r), v) for (r, v, _) in op[1])))
        else:
            out.append(op)
    return out


class Err(Exception):
    pass


def explore(items, variant=None, limit=5_000_000):
    progs = [wg_program(producer(0, items, variant)),
             wg_program(consumer(0, 0, items, variant)),
             wg_program(consumer(1, 0, items, variant))]
    nq_reads = {it: 4 * max(R, 0) for it, R in enumerate(items)}
    # state: pcs(3), bar phases/pending (20), nb(list per id of (proc,kind,tag)), nb_done(3),
    #        groups per consumer: tuple of (reads, done), ver (frozenset items), rd (reads done), inflight,
    #        qpend (per consumer: item or None)
    init_bars = tuple([(0, 128)] * 16 + [(0, 4)] * 4)
    start = ((0, 0, 0), init_bars, tuple(() for _ in range(7)), (False, False, False),
             ((), ()), (), (), (), (None, None), (0, 0))
    seen = set()
    stack = [start]
    n_states = 0
    terminal = 0

    def get(tup, key, default=None):
        for k, v in tup:
            if k == key:
                return v
        return default

    def put(tup, key, val):
        d = dict(tup)
        d[key] = val
        return tuple(sorted(d.items(), key=repr))

    while stack:
        st = stack.pop()
        if st in seen:
            continue
        seen.add(st)
        n_states += 1
        if n_states > limit:
            raise Err("state limit")
        pcs, bars, nb, nbd, groups, ver, rd, infl, qpend, gidx = st
        succ = []
        # process steps
        for pi in range(3):
            pc = pcs[pi]
            if pc != int(pc) or pc >= len(progs[pi]):
                continue
            op = progs[pi][pc]
            k = op[0]
            npcs = list(pcs)
            npcs[pi] += 1
            nbars, nnb, nnbd, ngroups, nver, nrd, ninfl, nqp, ngidx = bars, nb, nbd, groups, ver, rd, infl, qpend, gidx
            if k == 'mwait':
                ph, pend = bars[op[1]]
                if (ph & 1) == op[2]:
                    continue
                if ph != op[3] + 1:
                    raise Err(f"proc {pi} pc {pc} {op}: passed at phase count {ph}")
            elif k == 'marrive':
                ph, pend = bars[op[1]]
                pend -= op[2]
                if pend < 0:
                    raise Err("over-arrival")
                cnt = 128 if op[1] < 16 else 4
                if pend == 0:
                    ph, pend = ph + 1, cnt
                nbars = bars[:op[1]] + ((ph, pend),) + bars[op[1] + 1:]
            elif k in ('nb_arrive', 'nb_sync'):
                bid, tag = op[1], op[2]
                inst = nb[bid] + ((pi, k, tag),)
                wait_here = k == 'nb_sync'
                if len(inst) == 2:
                    if inst[0][2] != inst[1][2] or inst[0][0] == inst[1][0]:
                        raise Err(f"named barrier {bid} instance {inst}")
                    l = list(nbd)
                    for (q, kk, _) in inst:
                        if kk == 'nb_sync':
                            l[q] = True
                    nnbd = tuple(l)
                    inst = ()
                nnb = nb[:bid] + (inst,) + nb[bid + 1:]
                if wait_here:
                    # the sync completes when nnbd[pi] is True: model as a follow-up 'nbw' op
                    npcs[pi] = pcs[pi] + 0.5
            elif k == 'write':
                res, v = op[1], op[2]
                kind = res[0]
                prev = get(ver, res)
                if kind == 'half':
                    old = v - 2
                    if old >= 0:
                        key = (('half', res[1]), old)
                        if get(infl, key, 0) or get(rd, key, 0) != 2:
                            raise Err(f"WAR {res} round {v}: reads of {old} done {get(rd, key, 0)}")
                elif kind == 'mask':
                    old = v - 2
                    if old >= 0 and get(rd, (('mask', res[1]), old), 0) != 1:
                        raise Err(f"WAR {res} round {v}")
                elif kind == 'P':
                    if prev is not None:
                        key = (('P', res[1]), prev)
                        if get(infl, key, 0) or get(rd, key, 0) != 1:
                            raise Err(f"WAR P{res[1]} round {v}")
                else:
                    if prev is not None and get(rd, (res, prev), 0) != 1:
                        raise Err(f"WAR {res} {v}")
                nver = put(ver, res, v)
            elif k == 'read':
                res, v = op[1], op[2]
                if get(ver, tuple(res)) != v:
                    raise Err(f"RAW {res}: need {v}, hold {get(ver, tuple(res))}")
                nrd = put(rd, (tuple(res), v), get(rd, (tuple(res), v), 0) + 1)
            elif k == 'wg':
                g = pi - 1
                for (res, v) in op[1]:
                    if res[0] == 'Q':
                        if get(ver, ('Q',)) != v or any(x is not None for x in qpend):
                            raise Err(f"RAW Q item {v}")
                    elif get(ver, res) != v:
                        raise Err(f"RAW {res}: need {v}, hold {get(ver, res)}")
                for (res, v) in op[1]:
                    ninfl = put(ninfl, (res, v), get(ninfl, (res, v), 0) + 1)
                gl = list(groups)
                gl[g] = groups[g] + ((op[1], False),)
                ngroups = tuple(gl)
            elif k == 'wg_wait':
                g = pi - 1
                pend = sum(1 for (_, d) in groups[g] if not d)
                if pend > op[1]:
                    continue
            elif k == 'qload':
                it = op[1]
                if it > 0:
                    key = (('Q',), it - 1)
                    if get(infl, key, 0) or get(rd, key, 0) != nq_reads[it - 1]:
                        raise Err(f"WAR Q item {it}")
                l = list(qpend)
                l[pi - 1] = it
                nqp = tuple(l)
            elif k == 'cpwait':
                if qpend[pi - 1] is not None:
                    it = qpend[pi - 1]
                    l = list(qpend)
                    l[pi - 1] = None
                    nqp = tuple(l)
                    other = qpend[2 - pi]
                    # Q counts as landed for the item once both consumers' copies landed
                    nver = put(ver, ('Qpart', pi - 1), it)
                    if get(nver, ('Qpart', 2 - pi)) == it:
                        nver = put(nver, ('Q',), it)
            else:
                raise AssertionError(op)
            succ.append((tuple(npcs), nbars, nnb, nnbd, ngroups, nver, nrd, ninfl, nqp, gidx))
        # named-barrier wait continuation (pc x.5)
        for pi in range(3):
            if pcs[pi] != int(pcs[pi]):
                if nbd[pi]:
                    npcs = list(pcs)
                    npcs[pi] = int(pcs[pi] + 0.5)
                    l = list(nbd)
                    l[pi] = False
                    succ.append((tuple(npcs), bars, nb, tuple(l), groups, ver, rd, infl, qpend, gidx))
                # remove the op-step successor computed above for a half pc (none: index float)
        # tensor core completions (in order)
        for g in range(2):
            gl = groups[g]
            for i, (reads, done) in enumerate(gl):
                if not done:
                    ninfl, nrd = infl, rd
                    for (res, v) in reads:
                        ninfl = put(ninfl, (res, v), get(ninfl, (res, v)) - 1)
                        nrd = put(nrd, (res, v), get(nrd, (res, v), 0) + 1)
                    ng = list(groups)
                    ng[g] = gl[:i] + ((reads, True),) + gl[i + 1:]
                    succ.append((pcs, bars, nb, nbd, tuple(ng), ver, nrd, ninfl, qpend, gidx))
                    break
        # Q copy landings (any time after issue)
        for c in range(2):
            if qpend[c] is not None:
                it = qpend[c]
                l = list(qpend)
                l[c] = None
                nver = put(ver, ('Qpart', c), it)
                if get(nver, ('Qpart', 1 - c)) == it:
                    nver = put(nver, ('Q',), it)
                succ.append((pcs, bars, nb, nbd, groups, nver, rd, infl, tuple(l), gidx))
        if not succ:
            if all(pcs[i] >= len(progs[i]) for i in range(3)):
                terminal += 1
                continue
            raise Err(f"DEADLOCK pcs={pcs} ops={[progs[i][int(pcs[i])] if pcs[i] < len(progs[i]) else None for i in range(3)]}")
        stack.extend(succ)
    return n_states, terminal


def main():
    args = sys.argv[1:] or ['1', '2', '3', '4', '0,1', '1,1', '2,1', '1,2', '3,1', '1,0,2', '2,2']
    variant = None
    if args and args[0].startswith('--variant='):
        variant = args[0].split('=', 1)[1]
        args = args[1:]
    for a in args:
        items = [int(x) for x in a.split(',')]
        try:
            n, t = explore(items, variant)
            print(f"items {items}: {n} states, {t} terminal, no violation, no deadlock", flush=True)
        except Err as e:
            print(f"items {items}: VIOLATION {e}", flush=True)


if __name__ == '__main__':
    main()
