"""Split-count sweep of dsv4's sparse MQA decode (DSV4_ATTN_SPLITS), for refitting the rule
of csrc/attention/sparse_mqa_splits.h. Run by scripts/attn_splits_sweep.sh, one process per
forced value (the variables are read once per process):

  python scripts/attn_splits_sweep.py run --forced auto|N --sweep 1,2,... --out DIR
  python scripts/attn_splits_sweep.py summary DIR
  python scripts/attn_splits_sweep.py cpu-check      # the cases and the plan, no GPU

Inputs as the compare routine's decode rows build them (dsv4.bench.routines.compare
decode_rows: DecodePools.for_cases over its default batches and contexts, decode_case with
the same seeds, N_SETS input sets); timer dsv4.bench.timing.time_us (CUDA-graph replay, cold
L2); FlashMLA's decode (dsv4.bench.incumbents.FlashMLADecode) in the same time_us call in
every process where it is found, so a process's dsv4 time can also be read relative to
FlashMLA's in the same call (clock drift between processes cancels there).

Per case and process one JSON line: case, forced, splits_used (the test-only op
dsv4_testing::sparse_mqa_num_splits with the same arguments as the call: the count the
launcher picks), splits_seen (the count the call really used, read from the bytes it
requested from the caching allocator: lse + splits x (fp32 partials + partial lse)),
dsv4_us, flashmla_us (same call), maxdiff against FlashMLA. A forced value that the call
clamps to a count a smaller swept value also reaches is not timed again (skipped).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dsv4.formats.kv_cache import HEAD_DIM  # noqa: E402

# (model, kind, context, batches): V4-Pro CSA / HCA at 4K and 128K over the compare's batches,
# V4-Pro HCA 32K, V4-Pro SWA, V4-Flash HCA 4K and CSA 4K at a few batches.
PRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GROUPS = [
    ("pro", "csa", 4096, PRO_BATCHES),
    ("pro", "csa", 131072, PRO_BATCHES),
    ("pro", "hca", 4096, PRO_BATCHES),
    ("pro", "hca", 131072, PRO_BATCHES),
    ("pro", "hca", 32768, (16, 32, 64)),
    ("pro", "swa", 4096, (1, 32, 128)),
    ("flash", "hca", 4096, (16, 32, 64)),
    ("flash", "csa", 4096, (8, 16, 32)),
]
TILE_KEYS = 64  # csrc/attention/sparse_mqa_params.cuh kTileKeys


def cases():
    """[(name, model key, kind, context, batch)] in sweep order."""
    from dsv4.bench.models import MODELS

    out = []
    for mkey, kind, ctx, batches in GROUPS:
        where = "" if kind == "swa" else f" {ctx // 1024}K"
        for b in batches:
            out.append((f"{MODELS[mkey].name} {kind.upper()}{where} B={b}", mkey, kind, ctx, b))
    return out


def build_sets(pools, mkey, kind, ctx, b, n_sets, device):
    """The compare routine's decode inputs of one case (decode_rows: same seed, same sets)."""
    import torch
    from dsv4.bench.cases import decode_case
    from dsv4.bench.models import MODELS

    gen = torch.Generator(device=device).manual_seed(1000 * b + ctx % 997)
    return [decode_case(kind, MODELS[mkey], b, ctx, pools, gen) for _ in range(n_sets)]


def geometry(s):
    """(base_ctas, max_tiles) as the launcher computes them (sparse_mqa.cu run()): work items
    per split = tokens x head blocks of 64; tiles = the index rows' widths in 64-key tiles."""
    b, s_q, h, _ = s["q"].shape
    tiles = sum(-(-idx.shape[-1] // TILE_KEYS) for idx in (s["swa_idx"], s["extra_idx"]) if idx is not None)
    return b * s_q * (h // 64), tiles


def clamp(forced, tiles):
    """DSV4_ATTN_SPLITS's clamp (attention::choose_splits), for the CPU plan (cpu-check runs
    without the extension; a GPU run asks the build's test-only op)."""
    return max(1, min(forced, (tiles + 1) // 2, 64))


def timed_under(forced, used, sweep):
    """The smaller swept value that already times the count `forced` clamps to (`used`),
    or None where `forced` is the first to reach it: each count is timed once per case."""
    lower = [v for v in sweep if v < forced]
    if used < forced and lower and lower[-1] >= used:
        return min(v for v in sweep if v >= used)
    return None


def splits_used(base, tiles, sms, priced, forced):
    """The count the launcher picks (attn_splits_sweep.sh checked that the build's op takes
    `forced`)."""
    import torch

    return int(torch.ops.dsv4_testing.sparse_mqa_num_splits(base, tiles, sms, priced, forced))


def splits_seen(call, tokens, heads):
    """The split count one eager call used, from the bytes it requested from torch's
    caching allocator: lse [tokens, H] fp32, and with splits > 1 part_o [splits, tokens, H,
    512] + part_lse [splits, tokens, H] fp32 (sparse_mqa.cu run()). None where unreadable."""
    import torch

    torch.cuda.synchronize()
    if "requested_bytes.all.peak" not in torch.cuda.memory_stats():
        return None
    torch.cuda.reset_peak_memory_stats()
    cur = torch.cuda.memory_stats()["requested_bytes.all.current"]
    call()
    torch.cuda.synchronize()
    extra = torch.cuda.memory_stats()["requested_bytes.all.peak"] - cur - tokens * heads * 4
    if extra == 0:
        return 1
    per = tokens * heads * (HEAD_DIM * 4 + 4)
    return extra // per if extra > 0 and extra % per == 0 else None


def load_flashmla():
    """(available, source or why): FlashMLA's library alone (dsv4.bench.anchors locates it;
    the other incumbents are not loaded)."""
    import torch
    from dsv4.bench.anchors import find_anchors

    a = find_anchors(None, load=False)
    if not a.flashmla:
        return False, a.missing.get("flashmla", "not found")
    path = a.sources["flashmla"]
    try:
        torch.ops.load_library(path)
    except Exception as e:
        return False, f"{path} failed to load: {type(e).__name__}: {e}"
    return True, path


def cmd_run(args) -> int:
    import torch

    # the launcher reads DSV4_ATTN_SPLITS (set by attn_splits_sweep.sh to --forced) once per
    # process; its meta line below records the DSV4_* environment this process ran under
    forced = None if args.forced == "auto" else int(args.forced)
    import dsv4
    from dsv4 import _ops

    if not dsv4.HAS_CUDA_EXTENSION:
        print(f"splits_sweep: no dsv4 CUDA extension: {_ops.EXTENSION_ERROR}", file=sys.stderr)
        return 2
    from dsv4.bench.cases import DecodePools, dsv4_decode
    from dsv4.bench.incumbents import FlashMLADecode
    from dsv4.bench.models import SOFTMAX_SCALE
    from dsv4.bench.routines.compare import DEFAULT_BATCH, DEFAULT_CONTEXT, N_SETS
    from dsv4.bench.timing import time_us

    sweep = sorted(int(v) for v in args.sweep.split(",") if v)
    dev = "cuda"
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    priced = True  # attn_splits_sweep.sh unsets DSV4_ATTN_PRICED_SPLITS: the rule's cost model
    want_fm = forced is None or args.flashmla_every
    fm, fm_src = load_flashmla() if want_fm else (False, "not asked (--flashmla-every 0)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"forced_{args.forced}.jsonl")
    f = open(path, "w")

    def emit(rec):
        f.write(json.dumps(rec) + "\n")
        f.flush()

    emit(dict(meta=dict(forced=forced, device=props.name, sms=sms, torch=torch.__version__, priced=priced,
                        flashmla=fm, flashmla_source=fm_src, iters=args.iters, warmup=args.warmup, sweep=sweep,
                        env={k: v for k, v in os.environ.items() if k.startswith("DSV4_")})))
    print(f"== DSV4_ATTN_SPLITS={args.forced if forced is not None else '(unset)'}: {props.name}, {sms} SMs, FlashMLA: "
          f"{'yes' if fm else 'no'} ({fm_src})", flush=True)
    t0 = time.time()
    pools = DecodePools.for_cases(max(DEFAULT_BATCH), max(DEFAULT_CONTEXT), dev)  # = the compare's default run
    print(f"pools {time.time() - t0:.1f} s", flush=True)
    failures = 0
    for name, mkey, kind, ctx, b in cases():
        if args.deadline and time.time() > args.deadline:
            print(f"deadline reached before {name}: stopping", flush=True)
            emit(dict(case=name, forced=forced, error="deadline"))
            break
        rec = dict(case=name, model=mkey, kind=kind, context=ctx, batch=b, forced=forced)
        try:
            sets = build_sets(pools, mkey, kind, ctx, b, N_SETS, dev)
            base, tiles = geometry(sets[0])
            used = splits_used(base, tiles, sms, priced, forced)
            rec.update(base_ctas=base, max_tiles=tiles, pairs=(tiles + 1) // 2, splits_used=used)
            owner = None if forced is None else timed_under(forced, used, sweep)
            if owner is not None:
                rec["skipped"] = f"clamped to {used}: timed under DSV4_ATTN_SPLITS={owner}"
                emit(rec)
                continue
            outs = [torch.empty_like(s["q"]) for s in sets]
            heads = sets[0]["q"].shape[2]
            rec["splits_seen"] = splits_seen(lambda: dsv4_decode(sets[0], outs[0]), b, heads)
            variants = {"dsv4": [lambda s=s, o=o: dsv4_decode(s, o) for s, o in zip(sets, outs)]}
            fm_outs = None
            if fm:
                fm_outs = [torch.empty_like(s["q"]) for s in sets]
                variants["flashmla"] = [FlashMLADecode(s, SOFTMAX_SCALE, o) for s, o in zip(sets, fm_outs)]
            t = time_us(variants, iters=args.iters, warmup=args.warmup)
            rec.update(dsv4_us=t["dsv4"].us, method=t["dsv4"].method)
            if "flashmla" in t:
                rec["flashmla_us"] = t["flashmla"].us
                rec["maxdiff"] = float((outs[0].float() - fm_outs[0].float()).abs().max())
            emit(rec)
            fm_txt = f"  FlashMLA {rec['flashmla_us']:7.1f} us  maxdiff {rec['maxdiff']:.3g}" if fm else ""
            seen = rec["splits_seen"]
            print(f"{name:28s} splits {used:2d} (seen {seen}) {rec['dsv4_us']:7.1f} us{fm_txt}", flush=True)
            del sets, outs, fm_outs, variants
        except Exception as e:
            failures += 1
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            emit(rec)
            print(f"{name}: FAILED {rec['error'].splitlines()[0]}", flush=True)
            traceback.print_exc()
            try:
                torch.cuda.synchronize()
            except Exception as e2:  # a sticky CUDA error: nothing more can run in this process
                print(f"CUDA unusable after {name} ({type(e2).__name__}): stopping this process", flush=True)
                break
    f.close()
    print(f"== {path}: done in {time.time() - t0:.0f} s, {failures} failures", flush=True)
    return 1 if failures else 0


def _fmt(v, spec="7.1f"):
    return format(v, spec) if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)) else "-"


def cmd_summary(args) -> int:
    recs, metas = [], []
    def order_key(p):  # auto first, then the counts in order
        tag = os.path.basename(p)[len("forced_"):-len(".jsonl")]
        return (0, 0) if tag == "auto" else (1, int(tag)) if tag.isdigit() else (2, 0)

    for p in sorted(glob.glob(os.path.join(args.dir, "forced_*.jsonl")), key=order_key):
        with open(p) as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                (metas if "meta" in r else recs).append(r["meta"] if "meta" in r else r)
    if not recs:
        print(f"no results under {args.dir}")
        return 1
    order = []
    for r in recs:
        if r["case"] not in order and r.get("error") != "deadline":
            order.append(r["case"])
    by = {c: [r for r in recs if r["case"] == c] for c in order}
    out = []
    dev = {m.get("device") for m in metas}
    out.append(f"split-count sweep: {', '.join(sorted(d for d in dev if d))}; processes: "
               + ", ".join("auto" if m["forced"] is None else str(m["forced"]) for m in metas))
    out.append("auto = the rule's choice (DSV4_ATTN_SPLITS unset); best = the fastest forced count (splits used); "
               "FM = FlashMLA in the auto process's time_us calls; norm = the count that wins on dsv4/FM of the "
               "same call (shown where it differs)")
    head = (f"{'case':28s} {'pairs':>5s} {'auto s':>6s} {'auto us':>8s} {'best s':>6s} {'best us':>8s} "
            f"{'auto/best':>9s} {'FM us':>8s} {'FM/best':>8s} {'FM/auto':>8s}  notes")
    out += [head, "-" * len(head)]
    matrix_rows, counts = [], set()
    for c in order:
        rs = by[c]
        auto = next((r for r in rs if r["forced"] is None and "dsv4_us" in r), None)
        timed = [r for r in rs if r["forced"] is not None and "dsv4_us" in r]
        notes = []
        tag = lambda r: "auto" if r["forced"] is None else str(r["forced"])  # noqa: E731
        errs = [r for r in rs if "error" in r and r["error"] != "deadline"]
        if errs:
            notes.append("errors at " + ",".join(tag(r) for r in errs))
        late = [r for r in rs if r.get("error") == "deadline"]
        if late:
            notes.append("deadline at " + ",".join(tag(r) for r in late))
        for r in rs:
            if "dsv4_us" in r and r.get("splits_seen") not in (None, r.get("splits_used")):
                notes.append(f"forced {r['forced']}: seen {r['splits_seen']} != used {r['splits_used']}")
            if "dsv4_us" in r and r.get("splits_seen") is None:
                notes.append(f"forced {r['forced']}: splits not seen")
        ref = auto.get("maxdiff") if auto else None  # dsv4 vs FlashMLA; a wrong split shows here
        for r in timed:
            if ref is not None and r.get("maxdiff") is not None and r["maxdiff"] > max(4 * ref, 1e-2):
                notes.append(f"forced {r['forced']}: maxdiff {r['maxdiff']:.3g} (auto {ref:.3g})")
        best = min(timed, key=lambda r: r["dsv4_us"]) if timed else None
        normed = [r for r in timed if r.get("flashmla_us")]
        if best is not None and len(normed) == len(timed) and normed:
            nb = min(normed, key=lambda r: r["dsv4_us"] / r["flashmla_us"])
            if nb["splits_used"] != best["splits_used"]:
                notes.append(f"norm s={nb['splits_used']}")
            fms = [r["flashmla_us"] for r in normed]
            if max(fms) > 1.03 * min(fms):
                notes.append(f"FM spread {min(fms):.1f}-{max(fms):.1f}")
        fm = auto.get("flashmla_us") if auto else None
        a_us = auto["dsv4_us"] if auto else None
        b_us = best["dsv4_us"] if best else None
        pairs = (auto or best or rs[0]).get("pairs")
        out.append(f"{c:28s} {_fmt(pairs, '5d')} {_fmt(auto['splits_used'] if auto else None, '6d')} "
                   f"{_fmt(a_us, '8.1f')} {_fmt(best['splits_used'] if best else None, '6d')} {_fmt(b_us, '8.1f')} "
                   f"{_fmt(a_us / b_us if a_us and b_us else None, '9.3f')} {_fmt(fm, '8.1f')} "
                   f"{_fmt(fm / b_us if fm and b_us else None, '8.3f')} {_fmt(fm / a_us if fm and a_us else None, '8.3f')}"
                   f"  {'; '.join(notes)}")
        cell = {}
        for r in timed:
            cell[r["splits_used"]] = r["dsv4_us"]
            counts.add(r["splits_used"])
        matrix_rows.append((c, cell, auto["splits_used"] if auto else None, best["splits_used"] if best else None))
    out.append("")
    out.append("dsv4 us by split count used (forced processes); * = the rule's choice, < = fastest")
    cols = sorted(counts)
    head = f"{'case':28s} " + " ".join(f"{'s=' + str(s):>8s}" for s in cols)
    out += [head, "-" * len(head)]
    for c, cell, a, b in matrix_rows:
        parts = []
        for s in cols:
            v = cell.get(s)
            mark = ("*" if s == a else "") + ("<" if s == b else "")
            parts.append(f"{(_fmt(v, '.1f') + mark) if v is not None else '':>8s}")
        out.append(f"{c:28s} " + " ".join(parts))
    text = "\n".join(out)
    print(text)
    with open(os.path.join(args.dir, "summary.txt"), "w") as fh:
        fh.write(text + "\n")
    return 0


def cmd_cpu_check(args) -> int:
    """The cases, their geometry and the plan of the sweep, built on the CPU with the same
    builders (small pools, one input set each): no GPU, no extension needed."""
    import torch
    from dsv4.bench.cases import DecodePools
    from dsv4.bench.routines.compare import DEFAULT_BATCH, DEFAULT_CONTEXT

    sweep = sorted(int(v) for v in args.sweep.split(",") if v)
    pools = DecodePools.for_cases(max(DEFAULT_BATCH), max(DEFAULT_CONTEXT), "cpu", above_l2=False)
    timed_total = 0
    for name, mkey, kind, ctx, b in cases():
        s = build_sets(pools, mkey, kind, ctx, b, 1, "cpu")[0]
        base, tiles = geometry(s)
        plan = []
        for v in sweep:
            used = clamp(v, tiles)
            if timed_under(v, used, sweep) is None:
                plan.append(used)
        timed_total += len(plan) + 1
        assert s["q"].dtype == torch.bfloat16 and s["q"].shape == (b, 1, 128 if mkey == "pro" else 64, HEAD_DIM)
        print(f"{name:28s} base {base:4d} tiles {tiles:3d} keys {s['keys']:5d}  timed forced counts {plan}")
    print(f"{len(cases())} cases, {timed_total} timed (case, process) pairs with auto")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--forced", required=True, help="auto (DSV4_ATTN_SPLITS unset) or the count it is set to")
    r.add_argument("--sweep", default="1,2,3,4,5,6,8,10,12,16", help="every forced value of the sweep (for skips)")
    r.add_argument("--out", required=True)
    r.add_argument("--iters", type=int, default=50)
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--deadline", type=float, default=0.0, help="epoch seconds: start no case after it")
    r.add_argument("--flashmla-every", type=int, default=1, help="1: FlashMLA in every process (drift reference)")
    s = sub.add_parser("summary")
    s.add_argument("dir")
    c = sub.add_parser("cpu-check")
    c.add_argument("--sweep", default="1,2,3,4,5,6,8,10,12,16")
    args = ap.parse_args(argv)
    return {"run": cmd_run, "summary": cmd_summary, "cpu-check": cmd_cpu_check}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
