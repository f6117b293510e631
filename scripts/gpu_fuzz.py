"""Seeded GPU fuzz of every dsv4 op against independent float32 computations.

    python scripts/gpu_fuzz.py [--seed 0] [--attention 2000] [--moe 500] [--quantize 2000]
                               [--json PATH] [--show 10]

Each configuration is drawn from the seed (so a failure reproduces with its number):

* attention (sparse_mqa_decode): batch 0-64, s_q 1-2, heads 64/128, one or two fp8_ds_mla
  caches of block size 1, 2, 64 or 69 with the block stride padded by 0-3 extra 576-byte
  units, list lengths 0-2048, -1 and out-of-range ids, duplicates, ids past the list's
  length, sinks finite / -inf / +inf / none, and every slot no valid entry names filled
  with random bytes (NaN and inf patterns included). Checked against a float32 softmax
  over the dequantized rows of the valid entries only, with the test suite's criterion
  (tests/test_attention.py assert_close): relative L2 of the output <= 3e-3, no element
  off by more than 2e-2 + 2^-7 |ref| (the kernel rounds p to bf16 before p.v, an error of
  up to 2^-9 of the largest |v| ~ 4), lse within 2e-3, a token without visible keys
  exactly zero with lse -inf;
* moe (nvfp4_moe): M 0-300, 1-9 local experts of 8-64 global, K and N multiples of 64,
  routing uniform or skewed onto one expert, expert maps, swiglu_limit on/off, W4A16 and
  W4A4, against dsv4.reference.nvfp4_moe (float32): relative L2 <= 1e-2 (W4A16) / 3e-2
  (W4A4, where one e2m1 code flip at a rounding tie moves a token by a few %);
* quantize (quantize_nvfp4): shapes [M, K] with K a multiple of 16 (M 0-300), row strides
  padded, outliers, all-zero blocks, global scales over 2^-12..2^12, against
  dsv4.reference.quantize_nvfp4 byte for byte.

Prints per op: configurations tried, mismatches (goal 0) and the first ``--show`` of them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from dsv4 import formats, reference
from dsv4.attention import sparse_mqa_decode
from dsv4.moe import nvfp4_moe, prepare_nvfp4_moe_weights
from dsv4.quantize import quantize_nvfp4

DEV = os.environ.get("DSV4_FUZZ_DEVICE", "cuda")  # "cpu": a dry run of the harness against the CPU kernels


def _cache(n_slots: int, block: int, pad_units: int, rng: random.Random):
    """fp8_ds_mla cache of >= n_slots slots, random bytes everywhere, block stride padded."""
    nb = max(1, -(-n_slots // block))
    stride = formats.fp8_ds_mla_block_bytes(block) + 576 * pad_units
    flat = torch.randint(0, 256, (nb * stride,), dtype=torch.uint8, device=DEV,
                         generator=torch.Generator(device=DEV).manual_seed(rng.getrandbits(31)))
    return flat.as_strided((nb, block, 584), (stride, 584, 1))


def _attention_case(i: int, rng: random.Random) -> str | None:
    B = rng.choice([0, 1, 1, 2, 3, 7, 16, 33, 64])
    s_q = rng.choice([1, 1, 2])
    H = rng.choice([64, 128])
    lists = []
    for li in range(rng.choice([1, 2])):
        block = rng.choice([1, 2, 64, 69])
        width = rng.choice([1, 7, 64, 128, 129, 512, 1000, 2048])
        n_slots = rng.choice([1, 5, 200, 5000, 70000])
        cache = _cache(n_slots, block, rng.choice([0, 0, 1, 3]), rng)
        cap = cache.shape[0] * block
        g = torch.Generator(device=DEV).manual_seed(rng.getrandbits(31))
        idx = torch.randint(0, cap, (B, s_q, width), generator=g, device=DEV, dtype=torch.int32)
        r = torch.rand(B, s_q, width, generator=g, device=DEV)
        idx[r < 0.1] = -1
        idx[(r >= 0.1) & (r < 0.15)] = cap + torch.randint(0, 1000, (1,), generator=g, device=DEV).int()
        if rng.random() < 0.3:  # duplicates
            idx[..., 1::2] = idx[..., 0:1]
        lens = torch.randint(0, width + 1, (B,), generator=g, device=DEV, dtype=torch.int32) \
            if rng.random() < 0.8 else None
        # Write real rows into every slot a valid entry names; everything else keeps random bytes.
        e = torch.arange(width, device=DEV).view(1, 1, width)
        live = (idx >= 0) & (idx < cap)
        if lens is not None:
            live &= e < lens.view(B, 1, 1)
        slots = torch.unique(idx[live].long())
        if slots.numel():
            formats.write_fp8_ds_mla(cache, slots, torch.randn(slots.numel(), 512, generator=g, device=DEV))
        lists.append((cache, idx, lens, live))
    g = torch.Generator(device=DEV).manual_seed(rng.getrandbits(31))
    q = torch.randn(B, s_q, H, 512, generator=g, device=DEV).to(torch.bfloat16)
    sink_kind = rng.choice(["none", "finite", "-inf", "+inf"])
    sink = None if sink_kind == "none" else {
        "finite": torch.randn(H, generator=g, device=DEV) * 3, "-inf": torch.full((H,), -float("inf"), device=DEV),
        "+inf": torch.full((H,), float("inf"), device=DEV)}[sink_kind]
    scale = 512**-0.5 * rng.choice([0.5, 1.0, 2.0])
    out = torch.full_like(q, float("nan"))  # poisoned output: every element must be written
    (c1, i1, l1, _), extra = lists[0], (lists[1] if len(lists) > 1 else None)
    got, lse = sparse_mqa_decode(q, c1, i1, l1, sink, scale,
                                 extra_kv_cache=extra[0] if extra else None, extra_indices=extra[1] if extra else None,
                                 extra_topk_length=extra[2] if extra else None, out=out)
    # independent float32 reference over the valid entries only
    scores, rows = [], []
    for cache, idx, lens, live in lists:
        safe = torch.where(live, idx, 0).long()
        flat = safe.view(-1)
        v = formats.read_fp8_ds_mla(cache, flat).float().view(B, s_q, -1, 512) if flat.numel() else \
            torch.zeros(B, s_q, idx.shape[-1], 512, device=DEV)
        v = torch.where(live.unsqueeze(-1), v, 0.0)
        s = torch.einsum("bshd,bskd->bshk", q.float(), v) * scale
        scores.append(torch.where(live.unsqueeze(2), s, -float("inf")))
        rows.append(v)
    s = torch.cat(scores, -1)
    v = torch.cat(rows, 2)
    m = s.amax(-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink.view(1, 1, H, 1))
    m = torch.where(torch.isfinite(m), m, 0.0)
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True) + (torch.exp(sink.view(1, 1, H, 1) - m) if sink is not None else 0.0)
    ref = torch.einsum("bshk,bskd->bshd", p, v) / torch.where(den > 0, den, 1.0)
    ref = torch.where(torch.isinf(den), 0.0, ref)  # +inf sink: zero output
    ref_lse = torch.log(p.sum(-1)) + m.squeeze(-1)
    empty = ~torch.cat([x[3] for x in lists], -1).any(-1)  # [B, s_q]
    if DEV == "cuda":
        torch.cuda.synchronize()
    bad = []
    if torch.isnan(got).any():
        bad.append("NaN in output")
    err = (got.float() - ref).abs()
    rel = float((got.float() - ref).norm() / ref.norm()) if ref.norm() > 0 else float(err.max()) if err.numel() else 0.0
    if rel > 3e-3:
        bad.append(f"output relative L2 {rel:.3g}")
    if err.numel() and not bool((err <= 2e-2 + 2**-7 * ref.abs()).all()):
        bad.append(f"output max err {float(err.max()):.3g}")
    e2 = empty.unsqueeze(-1).expand_as(lse)
    if bool((got[empty] != 0).any()) or bool((lse[e2] != -float("inf")).any()):
        bad.append("a token without visible keys is not zero / lse not -inf")
    ok = ~e2
    if ok.any() and not bool(((lse[ok] - ref_lse[ok]).abs() <= 2e-3).all()):
        bad.append(f"lse max err {float((lse[ok] - ref_lse[ok]).abs().max()):.3g}")
    if bad:
        return f"B={B} s_q={s_q} H={H} lists={[(c.shape[1], x.shape[-1], l is not None) for c, x, l, _ in lists]} " \
               f"sink={sink_kind}: " + "; ".join(bad)
    return None


def _moe_case(i: int, rng: random.Random) -> str | None:
    E_local = rng.choice([1, 2, 3, 8, 9])
    E_global = rng.choice([E_local, 8, 64]) if E_local <= 8 else 64
    K = rng.choice([64, 128, 256, 512])
    N = rng.choice([64, 128, 192, 256])
    M = rng.choice([0, 1, 2, 7, 33, 64, 100, 300])
    k = rng.choice([1, 2, 6]) if E_global >= 6 else 1
    g = torch.Generator(device=DEV).manual_seed(rng.getrandbits(31))
    w = formats.random_nvfp4_moe_weights(E_local, N, K, generator=g, device=DEV)
    x = (torch.randn(M, K, generator=g, device=DEV) * rng.choice([0.1, 1.0, 4.0])).to(torch.bfloat16)
    scores = torch.rand(M, E_global, generator=g, device=DEV)
    if rng.random() < 0.3:
        scores[:, 0] += 10  # skew: every token picks expert 0
    tw, ids = scores.topk(k, dim=1)
    tw = (tw / tw.sum(1, keepdim=True)).float()
    ids = ids.to(torch.int32)
    emap = None
    if E_global != E_local or rng.random() < 0.5:
        perm = torch.randperm(E_global, generator=torch.Generator().manual_seed(rng.getrandbits(31)))[:E_local]
        emap = torch.full((E_global,), -1, dtype=torch.int32)
        emap[perm] = torch.arange(E_local, dtype=torch.int32)
        emap = emap.to(DEV)
    limit = rng.choice([None, 10.0, 1.5])
    act = rng.choice(["bf16", "nvfp4"])
    kw = dict(a13_scale=w["w13_input_scale"], a2_scale=w["w2_input_scale"]) if act == "nvfp4" else {}
    keys = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")
    prepared = prepare_nvfp4_moe_weights(*(w[k_] for k_ in keys))
    out = torch.full((M, K), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = nvfp4_moe(x, ids, tw, prepared, expert_map=emap, swiglu_limit=limit, activation=act, out=out, **kw)
    ref = reference.nvfp4_moe(x, ids, tw, *(w[k_] for k_ in keys), swiglu_limit=limit, activation=act,
                              expert_map=emap, **kw)
    if DEV == "cuda":
        torch.cuda.synchronize()
    if M == 0:
        return None
    if torch.isnan(got).any():
        return f"M={M} E={E_local}/{E_global} K={K} N={N} k={k} {act}: NaN in output"
    rel = float((got.float() - ref).norm() / ref.norm().clamp_min(1e-20))
    if ref.norm() == 0:
        rel = float(got.float().abs().max())
    lim = 1e-2 if act == "bf16" else 3e-2
    if rel > lim:
        return f"M={M} E={E_local}/{E_global} K={K} N={N} k={k} limit={limit} {act} map={emap is not None}: rel L2 {rel:.3g}"
    return None


def _quantize_case(i: int, rng: random.Random) -> str | None:
    M = rng.choice([0, 1, 2, 3, 17, 64, 128, 300])
    K = 16 * rng.choice([1, 2, 3, 8, 64, 129, 256])
    g = torch.Generator(device=DEV).manual_seed(rng.getrandbits(31))
    pad = rng.choice([0, 0, 16, 48])
    base = torch.randn(M, K + pad, generator=g, device=DEV) * rng.choice([1e-3, 1.0, 30.0])
    if rng.random() < 0.3:  # outliers
        base[torch.rand(base.shape, generator=g, device=DEV) < 0.01] *= 1000
    if rng.random() < 0.3 and K >= 32:  # whole zero blocks
        base[:, 16:32] = 0
    x = base.to(torch.bfloat16)[:, :K]  # row stride K + pad
    gs = torch.tensor([2.0 ** rng.uniform(-12, 12)], device=DEV)
    codes, scales = quantize_nvfp4(x, gs)
    rc, rs = reference.quantize_nvfp4(x.cpu(), gs.cpu())
    if DEV == "cuda":
        torch.cuda.synchronize()
    nc = int((codes.cpu() != rc).sum())
    ns = int((scales.cpu().view(torch.uint8) != rs.view(torch.uint8)).sum())
    if nc or ns:
        return f"M={M} K={K} pad={pad} g={float(gs):.3g}: {nc} code bytes, {ns} scales differ"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", type=int, default=2000)
    ap.add_argument("--moe", type=int, default=500)
    ap.add_argument("--quantize", type=int, default=2000)
    ap.add_argument("--show", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=None,
                    help="time limit per op: stop drawing configurations after it (the report says how many ran)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_fuzz: needs a CUDA device (DSV4_FUZZ_DEVICE=cpu fuzzes the CPU kernels)", file=sys.stderr)
        return 1
    report, failed = {}, 0
    for name, fn, n in (("quantize", _quantize_case, args.quantize), ("attention", _attention_case, args.attention),
                        ("moe", _moe_case, args.moe)):
        rng = random.Random(f"{args.seed}-{name}")
        bad, t0, tried = [], time.time(), 0
        for i in range(n):
            if args.seconds is not None and time.time() - t0 > args.seconds:
                break
            tried += 1
            try:
                msg = fn(i, rng)
            except Exception as e:  # an error is a finding, not a crash of the fuzz
                msg = f"raised {type(e).__name__}: {str(e)[:200]}"
            if msg:
                bad.append(f"#{i} {msg}")
        report[name] = dict(tried=tried, asked=n, mismatches=len(bad), first=bad[: args.show], seconds=time.time() - t0)
        failed += len(bad)
        cut = f" of {n} asked (time limit)" if tried < n else ""
        print(f"{name}: {tried} configurations{cut}, {len(bad)} mismatches ({time.time() - t0:.0f}s)", flush=True)
        for b in bad[: args.show]:
            print("   ", b, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(seed=args.seed, report=report), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
