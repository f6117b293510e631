"""Benchmark dsv4.sparse_mqa_decode / dsv4.sparse_mqa_prefill on the GPU.

Shapes (issue 3): V4-Flash decode (H=64, 512 compressed + 128 window keys, fp8 cache),
V4-Pro decode (H=128, 1024 + 128), batch 1..256; prefill H=128 with 1152 indices per
token at T = 4096 and 16384 (bf16 gathered kv).

Method: each input set's call is captured in a CUDA graph (as vLLM runs decode); median
of >= 30 CUDA-event-timed graph replays after warm-up, L2 evicted before each (dsv4.bench.timing), rotating through several input sets (different q / indices over caches much larger than L2) so caches do
not flatter. Useful FLOPs = 2 * H * (512 + 512) per valid key per token. Bytes = q + out
+ lse + each token's gathered KV rows once (fp8: 576 data + 8 scale bytes per key; bf16:
1024). Ceilings measured in the same run: bf16 torch.matmul 8192^3 and a device copy
(read + write bytes).

dsv4.dense_fmha rows (issue 7): 4 sequences x 4096 queries over [1024 compressed | 4096 window]
rows, causal, window 128, ratio 4; D=512 H=128 MQA (sparse prefill kernel) and the dense
kernel at D=128 (32/8 heads) and D=256 (16/2 heads). Useful FLOPs = 4 * D * Hq per
visible key per query.

Usage: python scripts/bench_attention.py [--quick] [--json PATH] [--only-fmha | --skip-fmha]
           [--skip-decode] [--skip-prefill] [--prefill-rows N] [--fmha-dims 512,128,256]
(--prefill-rows 8192 puts the prefill kv in L2: the kernel's rate without DRAM misses.)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


from dsv4 import formats
from dsv4.attention import sparse_mqa_decode, sparse_mqa_prefill
from dsv4.fmha import dense_fmha, dense_fmha_kernel, visible_rows
from dsv4.bench.timing import bf16_gemm_tflops, copy_bandwidth_tbps
from dsv4.bench.timing import time_us as _time_us

SCALE = 512**-0.5
EAGER = False  # --eager: time eager calls (host overhead included) instead of CUDA-graph replays


def time_us(run, *, n_inputs, iters):
    """The one timer (dsv4.bench.timing): cold L2, rotating input sets."""
    return _time_us({"dsv4": [lambda k=k: run(k) for k in range(n_inputs)]}, iters=iters,
                    cuda_graph=not EAGER)["dsv4"].us


def random_fp8_cache(num_blocks, block_size, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = formats.new_fp8_ds_mla_cache(num_blocks, block_size, device="cuda")
    n = num_blocks * block_size
    chunk = 1 << 16
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        rows = torch.randn(e - s, 512, device="cuda", generator=g)
        formats.write_fp8_ds_mla(cache, torch.arange(s, e, device="cuda"), rows)
    return cache


def bench_decode(name, h, topk, window, batches, iters, caches, n_inputs=4):
    comp_cache, swa_cache = caches
    n_comp = comp_cache.shape[0] * comp_cache.shape[1]
    n_swa = swa_cache.shape[0] * swa_cache.shape[1]
    rows = []
    for b in batches:
        g = torch.Generator(device="cuda").manual_seed(b)
        inputs = []
        for _ in range(n_inputs):
            q = torch.randn(b, 1, h, 512, device="cuda", generator=g).bfloat16()
            idx = torch.randint(0, n_comp, (b, 1, topk), device="cuda", generator=g, dtype=torch.int32)
            swa = torch.randint(0, n_swa, (b, 1, window), device="cuda", generator=g, dtype=torch.int32)
            inputs.append((q, idx, swa))
        sink = torch.randn(h, device="cuda")
        out = torch.empty(b, 1, h, 512, device="cuda", dtype=torch.bfloat16)
        lens_c = torch.full((b,), topk, device="cuda", dtype=torch.int32)
        lens_w = torch.full((b,), window, device="cuda", dtype=torch.int32)

        def run(k):
            q, idx, swa = inputs[k]
            sparse_mqa_decode(q, swa_cache.unsqueeze(2), swa, lens_w, sink, SCALE,
                              comp_cache.unsqueeze(2), idx, lens_c, out=out)

        t = time_us(run, n_inputs=n_inputs, iters=iters) * 1e-6
        keys = topk + window
        flops = 2.0 * h * 1024 * keys * b
        nbytes = b * (2 * h * 512 * 2 + h * 4 + keys * (576 + 8 + 4))
        rows.append(dict(name=f"{name} decode B={b}", us=t * 1e6, tflops=flops / t / 1e12, gb=nbytes / 1e9,
                         tbs=nbytes / t / 1e12))
    return rows


def bench_prefill(ts, iters, n_rows=1 << 16, topk=1152, h=128, n_inputs=2):
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(n_rows, 512, device="cuda", generator=g).bfloat16()
    sink = torch.randn(h, device="cuda")
    for t_ in ts:
        inputs = []
        for _ in range(n_inputs):
            q = torch.randn(t_, h, 512, device="cuda", generator=g).bfloat16()
            idx = torch.randint(0, n_rows, (t_, topk), device="cuda", generator=g, dtype=torch.int32)
            inputs.append((q, idx))
        out = torch.empty(t_, h, 512, device="cuda", dtype=torch.bfloat16)

        def run(k):
            q, idx = inputs[k]
            sparse_mqa_prefill(q, kv, idx, None, sink, SCALE, out=out)

        t = time_us(run, n_inputs=n_inputs, iters=iters) * 1e-6
        flops = 2.0 * h * 1024 * topk * t_
        nbytes = t_ * (2 * h * 512 * 2 + h * 4 + topk * (1024 + 4))
        kv_note = "" if n_rows == 1 << 16 else f" kv={n_rows}"
        rows.append(dict(name=f"prefill H={h} T={t_} topk={topk}{kv_note}", us=t * 1e6, tflops=flops / t / 1e12,
                         gb=nbytes / 1e9, tbs=nbytes / t / 1e12))
    return rows


def bench_fmha(iters, dims=(512, 128, 256), seqs=4, seqlen=4096, n_comp=1024, ratio=4, window=128):
    """dsv4.dense_fmha over [n_comp compressed | seqlen window] rows per sequence, causal: D=512
    H=128 MQA (the issue-7 acceptance shape, through the sparse prefill kernel) and two
    dense-kernel shapes (GQA). Timed as the whole op (index construction included)."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(7)
    rows_per = n_comp + seqlen
    t_ = seqs * seqlen
    cu_q = torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * seqlen
    cu_kv = torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * rows_per
    nc = torch.full((seqs,), n_comp, device="cuda", dtype=torch.int32)
    _, lengths = visible_rows(t_, cu_q, cu_kv, nc, width=rows_per, window=window, causal=True, ratio=ratio)
    keys = int(lengths.sum())
    for d, hq, hkv in ((512, 128, 1), (128, 32, 8), (256, 16, 2)):
        if d not in dims:
            continue
        q = torch.randn(t_, hq, d, device="cuda", generator=g).bfloat16()
        k = torch.randn(seqs * rows_per, hkv, d, device="cuda", generator=g).bfloat16()
        kv = k if d == 512 else (k, torch.randn_like(k))
        sink = torch.randn(hq, device="cuda")
        out = torch.empty_like(q)

        def run(_):
            dense_fmha(q, kv, cu_q, cu_kv, nc, max_seqlen_kv=rows_per, window=window, causal=True, ratio=ratio,
                       attn_sink=sink, softmax_scale=d**-0.5, out=out, max_seqlen_q=seqlen)

        t = time_us(run, n_inputs=1, iters=iters) * 1e-6
        flops = 4.0 * d * hq * keys
        nbytes = 2 * q.numel() * 2 + t_ * hq * 4 + k.numel() * 2 * (1 if d == 512 else 2)
        kernel = dense_fmha_kernel(q, *((kv, kv) if d == 512 else kv))
        rows.append(dict(name=f"dense_fmha D={d} H={hq}/{hkv} {seqs}x{seqlen} c={n_comp} ({kernel})", us=t * 1e6,
                         tflops=flops / t / 1e12, gb=nbytes / 1e9, tbs=nbytes / t / 1e12))
        del q, k, kv, out
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--comp-blocks", type=int, default=16384,
                    help="compressed fp8 cache blocks of 64 slots (default 16384 = 600 MB)")
    ap.add_argument("--swa-blocks", type=int, default=4096, help="window fp8 cache blocks of 64 slots")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--prefill-rows", type=int, default=1 << 16,
                    help="rows of the prefill kv (64 MB at the default: more than L2 holds)")
    ap.add_argument("--skip-fmha", action="store_true")
    ap.add_argument("--only-fmha", action="store_true", help="just the dsv4.dense_fmha rows")
    ap.add_argument("--fmha-dims", type=str, default="512,128,256", help="head dims of the dsv4.dense_fmha rows")
    ap.add_argument("--eager", action="store_true",
                    help="time eager calls (includes host/dispatcher overhead) instead of CUDA-graph replays")
    ap.add_argument("--vs", choices=["vllm"], default=None,
                    help="side by side with FlashMLA's SM90 kernels (python -m dsv4.bench.compare; "
                         "--anchors / DSV4_ANCHORS find them)")
    ap.add_argument("--anchors", default=None, help="with --vs vllm: anchor folders (see scripts/fetch_anchors.py)")
    args = ap.parse_args()
    if args.vs:
        from dsv4.bench import compare

        only = [k for k, skip in (("decode", args.skip_decode), ("prefill", args.skip_prefill)) if not skip]
        argv = ["--only", ",".join(only), "--iters", str(args.iters)] + (["--json", args.json] if args.json else [])
        argv += ["--batch", "1,32,128"] if args.quick else []
        return compare.main(argv + (["--anchors", args.anchors] if args.anchors else []))
    iters = max(30, args.iters)
    global EAGER
    EAGER = args.eager
    torch.backends.cuda.matmul.allow_tf32 = False

    gemm = bf16_gemm_tflops()
    copy = copy_bandwidth_tbps()
    print(f"ceilings: bf16 matmul 8192^3 {gemm:.0f} TFLOP/s, device copy {copy:.2f} TB/s", flush=True)

    batches = [1, 32, 128] if args.quick else [1, 8, 32, 64, 128, 256]
    rows = []
    if not args.only_fmha:
        if not args.skip_decode:
            # Caches much larger than L2 (50 MB): 1M compressed slots (~600 MB), 256K window slots.
            comp = random_fp8_cache(args.comp_blocks, 64, 1)
            swa = random_fp8_cache(args.swa_blocks, 64, 2)
            part = bench_decode("V4-Flash H=64 512+128", 64, 512, 128, batches, iters, (comp, swa))
            part += bench_decode("V4-Pro H=128 1024+128", 128, 1024, 128, batches, iters, (comp, swa))
            print("\n".join(f"  {r['name']}: {r['us']:.1f} us" for r in part), flush=True)
            rows += part
            del comp, swa
            torch.cuda.empty_cache()
        if not args.skip_prefill:
            part = bench_prefill([4096, 16384], iters, n_rows=args.prefill_rows)
            print("\n".join(f"  {r['name']}: {r['us']:.1f} us" for r in part), flush=True)
            rows += part
    if not args.skip_fmha:
        part = bench_fmha(iters, dims=tuple(int(d) for d in args.fmha_dims.split(",")))
        print("\n".join(f"  {r['name']}: {r['us']:.1f} us" for r in part), flush=True)
        rows += part

    for r in rows:
        r["pct_gemm"] = 100 * r["tflops"] / gemm
        r["pct_copy"] = 100 * r["tbs"] / copy
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gemm_tflops=gemm, copy_tbs=copy, rows=rows), f, indent=1)
    print(f"\nceilings: bf16 matmul {gemm:.0f} TFLOP/s | copy {copy:.2f} TB/s")
    print(f"{'case':48s} {'us':>9s} {'TFLOP/s':>8s} {'%gemm':>6s} {'GB':>7s} {'TB/s':>6s} {'%copy':>6s}")
    for r in rows:
        print(f"{r['name']:48s} {r['us']:9.1f} {r['tflops']:8.1f} {r['pct_gemm']:6.1f} {r['gb']:7.3f} "
              f"{r['tbs']:6.2f} {r['pct_copy']:6.1f}")


if __name__ == "__main__":
    sys.exit(main())
