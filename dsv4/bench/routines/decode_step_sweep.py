"""The measurements of the decode-step routine (:mod:`dsv4.bench.routines.decode_step`):
one row per (model, component, batch, context), dsv4 beside the torch baseline and, with
``--vs vllm``, the incumbent, all on the same inputs."""

from __future__ import annotations

import dataclasses
import functools
import gc
import math

import torch

from .. import traffic
from ..argtypes import anchor_paths
from ..cases import DecodePools, decode_case, dsv4_decode, torch_decode, torch_decode_bytes
from ..experts import MOE_LABELS, MoeSetup, dsv4_moe, moe_bf16_baseline, moe_routing, random_experts
from ..incumbents import MOE_INCUMBENTS
from ..models import KINDS, MODELS, SOFTMAX_SCALE, tiny_shape
from ..report import fmt_ctx
from ..timing import cpu_median_us, time_us

N_SETS_GPU = 4  # rotating input sets per case
N_SETS_CPU = 2
KIND_LABEL = {"swa": "SWA attn", "csa": "CSA attn", "hca": "HCA attn", "moe": "routed MoE"}


def num(x):
    """JSON-safe float (NaN/inf -> None)."""
    return float(x) if x is not None and math.isfinite(x) else None


class Sweep:
    """Every case of one run. ``device`` "cuda" times with :func:`dsv4.bench.timing.time_us`
    (CUDA-graph replays, L2 evicted before each); "cpu" is the reference run (tiny shapes,
    float32 reference kernels, wall clock)."""

    def __init__(self, args, device: str):
        self.args, self.device = args, device
        self.cpu = device == "cpu"
        self.n_sets = N_SETS_CPU if self.cpu else N_SETS_GPU
        overrides = dict(args.layers)
        self.shapes = {}
        for m in args.models:
            s = dataclasses.replace(MODELS[m], layers=overrides.get(m, MODELS[m].layers))
            self.shapes[m] = tiny_shape(s) if self.cpu else s
        self.rows: list[dict] = []
        self.seed = 0
        self.anchors = None
        self.humming = None
        self.vs_line = None  # one line: the incumbents found, or why the comparison is missing
        if args.vs:
            if self.cpu:
                self.vs_line = "--vs vllm: no comparison in a CPU reference run (the incumbents are CUDA kernels)"
            else:
                from ..anchors import find_anchors

                self.anchors = find_anchors(anchor_paths(args.anchors))
                self.vs_line = "--vs vllm: " + self.anchors.summary()

    def timer(self, fns: list) -> tuple:
        """(us, how) of one call, rotating over ``fns`` (one per input set)."""
        if self.cpu:
            t = cpu_median_us(fns, iters=self.args.iters, warmup=1)
        else:
            t = time_us({"f": fns}, iters=self.args.iters, warmup=5)["f"]
        return t.us, t.method

    def timed(self, ours: list, theirs) -> tuple:
        """(dsv4 us, how, incumbent us or None): both in one timer call when the incumbent
        runs (same inputs, interleaved), else dsv4 alone."""
        if self.cpu or theirs is None:
            return (*self.timer(ours), None)
        t = time_us({"dsv4": ours, "vllm": theirs}, iters=self.args.iters, warmup=5)
        return t["dsv4"].us, t["dsv4"].method, t["vllm"].us

    def gen(self) -> torch.Generator:
        self.seed += 1
        return torch.Generator(device=self.device).manual_seed(1000 + self.seed)

    def n_cases(self) -> int:
        b, c = len(self.args.batch), len(self.args.context)
        return len(self.args.models) * (len(self.args.moe) * b + b * (1 + 2 * c))

    def mem_budget(self) -> int:
        """Bytes the torch attention baseline may take for its temporaries."""
        if self.cpu:
            return 2 << 30
        free, _ = torch.cuda.mem_get_info()
        return free // 2

    def run(self, progress) -> None:
        a = self.args
        pools = DecodePools.for_cases(max(a.batch), max(a.context), self.device, above_l2=not self.cpu,
                                      bf16_rows=True)
        for m in a.models:
            shape = self.shapes[m]
            for fmt in dict.fromkeys(f for f, _ in a.moe):
                progress(f"{shape.name}: building {shape.local_experts(a.ep)} {fmt.upper()} experts", 0)
                self.run_moe(m, shape, fmt, [act for f, act in a.moe if f == fmt], progress)
                self.free()
            for kind in KINDS:
                for ctx in ([None] if kind == "swa" else a.context):
                    for b in a.batch:
                        label = f"{shape.name} {KIND_LABEL[kind]} {fmt_ctx(ctx)} B={b}"
                        progress(label, 0)
                        self.rows.append(self.safe(lambda: self.attention_case(m, shape, kind, b, ctx, pools),
                                                   dict(model=m, component="attn_" + kind, batch=b, context=ctx)))
                        progress(label, 1)
            self.free()
        self.free()
        order = {"attn_swa": 0, "attn_csa": 1, "attn_hca": 2, "moe": 3}
        moe_order = {c: i for i, c in enumerate(a.moe)}
        self.rows.sort(key=lambda r: (a.models.index(r["model"]), order[r["component"]],
                                      moe_order.get((r.get("format"), r.get("activation")), -1),
                                      r["context"] or 0, r["batch"]))

    def safe(self, fn, ident: dict) -> dict:
        """One failing case must not lose the rest of the sweep."""
        try:
            return fn()
        except Exception as ex:  # recorded in the row and the table notes
            return dict(ident, dsv4_us=None, torch_us=None, error=f"{type(ex).__name__}: {ex}"[:300])

    def free(self) -> None:
        gc.collect()
        if not self.cpu:
            torch.cuda.empty_cache()

    def attention_case(self, m, shape, kind, b, ctx, pools) -> dict:
        gen = self.gen()
        ctx_in = ctx if ctx is not None else max(self.args.context)  # SWA: any context >= 128
        sets = [decode_case(kind, shape, b, ctx_in, pools, gen) for _ in range(self.n_sets)]
        outs = [torch.empty_like(s["q"]) for s in sets]
        keys = sets[0]["keys"]
        theirs = None
        if self.anchors is not None and self.anchors.flashmla:
            from ..incumbents import FlashMLADecode

            fm_outs = [torch.empty_like(s["q"]) for s in sets]
            theirs = [FlashMLADecode(s, SOFTMAX_SCALE, o) for s, o in zip(sets, fm_outs)]
        us, how, vllm_us = self.timed([functools.partial(dsv4_decode, s, o) for s, o in zip(sets, outs)], theirs)
        t = traffic.decode_attention(b, shape.heads, keys)
        row = dict(model=m, component="attn_" + kind, batch=b, context=ctx, window_keys=sets[0]["window_keys"],
                   compressed_keys=sets[0]["compressed_keys"], dsv4_us=us, dsv4_timing=how, flops=t.flops,
                   bytes=t.bytes, tflops=t.tflops(us), tbps=t.tbps(us), torch_us=None, vllm_us=vllm_us)
        if vllm_us is not None:
            row.update(vllm_kernel="FlashMLA SM90", vllm_ratio=vllm_us / us,
                       vllm_max_abs_diff=num((outs[0].float() - fm_outs[0].float()).abs().max().item()))
        need = torch_decode_bytes(b, shape.heads, keys) * self.n_sets  # one graph pool per set
        if need > self.mem_budget():
            row["torch_note"] = f"torch baseline skipped: needs ~{need / 1e9:.1f} GB of temporaries"
        else:
            row["torch_us"], row["torch_timing"] = self.timer([functools.partial(torch_decode, s, pools)
                                                               for s in sets])
            ref = torch_decode(sets[0], pools)
            dsv4_decode(sets[0], outs[0])
            row["max_abs_diff"] = num((outs[0].float() - ref.float()).abs().max().item())
        return row

    def run_moe(self, m, shape, fmt, acts, progress) -> None:
        a = self.args
        ident = dict(model=m, component="moe", format=fmt, batch=None, context=None)
        cases = [(fmt, act) for act in acts if (fmt, act) in MOE_INCUMBENTS]  # at most one per format
        why = self.incumbent_missing(cases[0]) if cases else "no incumbent"
        wanted = [MOE_INCUMBENTS[c] for c in cases]
        try:
            w = random_experts(fmt, shape.local_experts(a.ep), shape.moe_inter, shape.hidden, self.device)
            setup = MoeSetup.build(w, fmt, acts, keep_raw=why is None)
            del w
        except Exception as ex:
            for act in acts:
                for b in a.batch:
                    self.rows.append(dict(ident, activation=act, batch=b, dsv4_us=None, torch_us=None,
                                          error=f"{type(ex).__name__}: {ex}"[:300]))
                    progress(f"{shape.name} MoE failed", 1)
            return
        self.humming = None
        if wanted and why is None:
            from ..incumbents import HummingW4A8, HummingW4A16

            try:
                cls = HummingW4A16 if fmt == "nvfp4" else HummingW4A8
                self.humming = cls(setup.raw, shape.n_experts, shape.swiglu_limit)
            except Exception as ex:  # the comparison is missing, dsv4's numbers are kept
                self.vs_line += f"; {wanted[0]} conversion failed for {shape.name}: {type(ex).__name__}: {ex}"[:300]
            setup.raw = None
        elif wanted and self.anchors is not None and why not in self.vs_line:
            self.vs_line += f"; {wanted[0]} missing: {why}"
        baseline: dict = {}  # per batch: the bf16 baseline does not depend on the activation mode
        for act in acts:
            for b in a.batch:
                label = f"{shape.name} MoE {MOE_LABELS[(fmt, act)]} EP{a.ep} B={b}"
                progress(label, 0)
                self.rows.append(self.safe(lambda: self.moe_case(m, shape, setup, act, b, baseline),
                                           dict(ident, activation=act, batch=b)))
                progress(label, 1)

    def incumbent_missing(self, case):
        """Why the incumbent of MoE ``case`` cannot run here (None: it can)."""
        if self.anchors is None:
            return "CPU reference run" if self.cpu else "no --vs vllm"
        from ..incumbents import moe_incumbent_missing

        return moe_incumbent_missing(self.anchors, case, ep=self.args.ep > 1)

    def moe_case(self, m, shape, setup, act, b, baseline) -> dict:
        gen = self.gen()
        ep = self.args.ep
        sets = [moe_routing(shape, b, gen, ep=ep) for _ in range(self.n_sets)]
        outs = [torch.empty_like(s["x"]) for s in sets]
        theirs, plans = None, None
        incumbent = MOE_INCUMBENTS.get((setup.fmt, act))
        if incumbent is not None and self.humming is not None:  # the same numerics on both sides
            plans = [self.humming.apply_plan(s["ids"], s["emap"], self.anchors) for s in sets]
            theirs = [functools.partial(self.humming.apply, s["x"], s["tw"], pl) for s, pl in zip(sets, plans)]
        call = functools.partial(dsv4_moe, fmt=setup.fmt, act=act, prepared=setup.weights[act],
                                 swiglu_limit=shape.swiglu_limit, scales=setup.scales)
        us, how, vllm_us = self.timed([functools.partial(call, s, out=o) for s, o in zip(sets, outs)], theirs)
        touched = sum(s["touched"] for s in sets) / len(sets)
        slots = sum(s["n_local"] for s in sets) / len(sets)
        t = traffic.moe(slots, touched, shape.hidden, shape.moe_inter, setup.fmt)
        row = dict(model=m, component="moe", format=setup.fmt, activation=act, batch=b, context=None, ep=ep,
                   local_experts=shape.local_experts(ep), local_slots=slots, touched_experts=touched, dsv4_us=us,
                   dsv4_timing=how, flops=t.flops, bytes=t.bytes, tflops=t.tflops(us), tbps=t.tbps(us),
                   torch_us=None, vllm_us=vllm_us)
        if vllm_us is not None:
            # both times cover the whole routed-expert call: vLLM's apply (routing prep, the
            # Humming GEMMs, the weighted sum; dsv4.bench.incumbents) and dsv4's op
            ref = self.humming.apply(sets[0]["x"], sets[0]["tw"], plans[0]).float()
            row.update(vllm_kernel=incumbent, vllm_ratio=vllm_us / us,
                       vllm_rel_diff=num(((outs[0].float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
                                         .item()))
        if setup.w13_bf16 is None:
            row["torch_note"] = setup.note
            return row
        if b not in baseline:
            def base(s):
                return moe_bf16_baseline(s["x"], s["ids"], s["tw"], s["emap"], setup.w13_bf16, setup.w2_bf16,
                                         shape.swiglu_limit)
            baseline[b] = self.timer([functools.partial(base, s) for s in sets]) + (base,)
        row["torch_us"], row["torch_timing"], base = baseline[b]
        row["torch_bytes"] = traffic.moe(slots, touched, shape.hidden, shape.moe_inter, "bf16").bytes
        ref = base(sets[0]).float()
        call(sets[0], out=outs[0])
        row["rel_diff"] = num(((outs[0].float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item())
        return row
