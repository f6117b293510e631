"""Rates of dsv4.sparse_mqa_decode, dsv4.sparse_mqa_prefill and dsv4.dense_fmha on the GPU,
against the ceilings measured in the same run (bf16 torch.matmul 8192^3, device copy).

Decode: the CSA shapes (dsv4.bench.models), V4-Flash H=64 with 512 compressed + 128 window
keys and V4-Pro H=128 with 1024 + 128, batch 1..256, fp8 caches in 64-entry blocks (a
1M-slot compressed pool, a 256K-slot window pool) and uniform random slot ids over them
(a gather stress case; the vLLM-shaped decode cases are the decode-step and compare
routines'). Prefill: V4-Pro H=128 with window + top-k = 1152 indices per token at T = 4096
and 16384 over 65536 gathered bf16 rows (--prefill-rows 8192 puts them in L2: the
kernel's rate without DRAM misses). dense_fmha: 4 sequences x 4096 queries over [1024
compressed | 4096 window] rows, causal, window 128, ratio 4; D=512 H=128 MQA (sparse
prefill kernel) and the dense kernel at D=128 (32/8 heads) and D=256 (16/2 heads).

Every case: the one timer (dsv4.bench.timing: CUDA-graph replays, L2 evicted before each,
over >= 30 calls on rotating input sets, the mean of each set's median); useful FLOPs and bytes from dsv4.bench.traffic.
--vs vllm runs the compare routine's decode and prefill sections instead.
"""

from __future__ import annotations

import argparse
import sys

import torch

from .. import traffic
from ..argtypes import int_list
from ..cases import random_fp8_pool
from ..models import HEAD_DIM, MODELS, RATIO, SOFTMAX_SCALE, WINDOW
from ..report import Table, dump_record, print_tables, to_markdown

SUMMARY = "sparse_mqa_decode / sparse_mqa_prefill / dense_fmha rates against the same-run ceilings"
BLOCK = 64  # entries per block of both pools


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _time(calls: list, iters: int, eager: bool) -> float:
    from ..timing import time_us

    return time_us({"dsv4": calls}, iters=iters, cuda_graph=not eager)["dsv4"].us


def _row(name: str, us: float, t: traffic.Traffic) -> dict:
    return dict(name=name, us=us, tflops=t.tflops(us), gb=t.bytes / 1e9, tbs=t.tbps(us))


def bench_decode(model, batches, iters, caches, eager, n_inputs=4) -> list[dict]:
    from ...attention import sparse_mqa_decode

    comp_cache, swa_cache = caches
    h, topk, window = model.heads, model.index_topk, model.window
    n_comp = comp_cache.shape[0] * comp_cache.shape[1]
    n_swa = swa_cache.shape[0] * swa_cache.shape[1]
    rows = []
    for b in batches:
        g = torch.Generator(device="cuda").manual_seed(b)
        inputs = []
        for _ in range(n_inputs):
            q = torch.randn(b, 1, h, HEAD_DIM, device="cuda", generator=g).bfloat16()
            idx = torch.randint(0, n_comp, (b, 1, topk), device="cuda", generator=g, dtype=torch.int32)
            swa = torch.randint(0, n_swa, (b, 1, window), device="cuda", generator=g, dtype=torch.int32)
            inputs.append((q, idx, swa))
        sink = torch.randn(h, device="cuda")
        out = torch.empty(b, 1, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        lens_c = torch.full((b,), topk, device="cuda", dtype=torch.int32)
        lens_w = torch.full((b,), window, device="cuda", dtype=torch.int32)

        def run(k):
            q, idx, swa = inputs[k]
            sparse_mqa_decode(q, swa_cache.unsqueeze(2), swa, lens_w, sink, SOFTMAX_SCALE,
                              comp_cache.unsqueeze(2), idx, lens_c, out=out)

        us = _time([lambda k=k: run(k) for k in range(n_inputs)], iters, eager)
        rows.append(_row(f"{model.name} H={h} {topk}+{window} decode B={b}", us,
                         traffic.decode_attention(b, h, topk + window)))
    return rows


def bench_prefill(model, ts, iters, eager, n_rows=1 << 16, n_inputs=2) -> list[dict]:
    from ...attention import sparse_mqa_prefill

    h, topk = model.heads, model.prefill_topk
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(n_rows, HEAD_DIM, device="cuda", generator=g).bfloat16()
    sink = torch.randn(h, device="cuda")
    for t_ in ts:
        inputs = []
        for _ in range(n_inputs):
            q = torch.randn(t_, h, HEAD_DIM, device="cuda", generator=g).bfloat16()
            idx = torch.randint(0, n_rows, (t_, topk), device="cuda", generator=g, dtype=torch.int32)
            inputs.append((q, idx))
        out = torch.empty(t_, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

        def run(k):
            q, idx = inputs[k]
            sparse_mqa_prefill(q, kv, idx, None, sink, SOFTMAX_SCALE, out=out)

        us = _time([lambda k=k: run(k) for k in range(n_inputs)], iters, eager)
        kv_note = "" if n_rows == 1 << 16 else f" kv={n_rows}"
        rows.append(_row(f"prefill H={h} T={t_} topk={topk}{kv_note}", us, traffic.prefill_attention(t_, h, topk)))
    return rows


def bench_fmha(iters, eager, dims=(512, 128, 256), seqs=4, seqlen=4096, n_comp=1024, ratio=RATIO["csa"],
               window=WINDOW):
    """dsv4.dense_fmha over [n_comp compressed | seqlen window] rows per sequence, causal: D=512
    H=128 MQA (through the sparse prefill kernel) and two dense-kernel shapes (GQA). Timed
    as the whole op (index construction included)."""
    from ...fmha import dense_fmha, dense_fmha_kernel, visible_rows

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

        def run():
            dense_fmha(q, kv, cu_q, cu_kv, nc, max_seqlen_kv=rows_per, window=window, causal=True, ratio=ratio,
                       attn_sink=sink, softmax_scale=d**-0.5, out=out, max_seqlen_q=seqlen)

        us = _time([run], iters, eager)
        kernel = dense_fmha_kernel(q, *((kv, kv) if d == 512 else kv))
        rows.append(_row(f"dense_fmha D={d} H={hq}/{hkv} {seqs}x{seqlen} c={n_comp} ({kernel})", us,
                         traffic.dense_fmha(t_, hq, d, keys, seqs * rows_per, hkv, shared_kv=d == 512)))
        del q, k, kv, out
    return rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes (1,32,128)")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per case (at least 30 are run; default 30)")
    ap.add_argument("--json", default=None, help="also write the rows and ceilings here")
    ap.add_argument("--markdown", default=None, help="also write the table as markdown here")
    ap.add_argument("--comp-blocks", type=int, default=16384,
                    help="compressed fp8 cache blocks of 64 slots (default 16384 = 600 MB)")
    ap.add_argument("--swa-blocks", type=int, default=4096, help="window fp8 cache blocks of 64 slots (default 4096)")
    ap.add_argument("--skip-decode", action="store_true", help="no sparse_mqa_decode rows")
    ap.add_argument("--skip-prefill", action="store_true", help="no sparse_mqa_prefill rows")
    ap.add_argument("--prefill-rows", type=int, default=1 << 16,
                    help="rows of the prefill kv (default 65536 = 64 MB: more than L2 holds)")
    ap.add_argument("--skip-fmha", action="store_true", help="no dense_fmha rows")
    ap.add_argument("--only-fmha", action="store_true", help="just the dense_fmha rows")
    ap.add_argument("--fmha-dims", type=int_list, default=[512, 128, 256],
                    help="head dims of the dense_fmha rows (default 512,128,256)")
    ap.add_argument("--eager", action="store_true",
                    help="time eager calls (includes host/dispatcher overhead) instead of CUDA-graph replays")
    ap.add_argument("--vs", choices=["vllm"], default=None,
                    help="side by side with FlashMLA's SM90 kernels instead: runs the compare routine's decode and "
                         "prefill sections (--anchors / DSV4_ANCHORS find them)")
    ap.add_argument("--anchors", default=None, help="with --vs vllm: anchor folders (see scripts/fetch_anchors.py)")


def run(args: argparse.Namespace) -> int:
    if args.vs:
        from ..cli import run_routine

        only = [k for k, skip in (("decode", args.skip_decode), ("prefill", args.skip_prefill)) if not skip]
        argv = ["--only", ",".join(only), "--iters", str(args.iters)] + (["--json", args.json] if args.json else [])
        argv += ["--batch", "1,32,128"] if args.quick else []
        return run_routine("compare", argv + (["--anchors", args.anchors] if args.anchors else []))
    if not torch.cuda.is_available():
        print("dsv4: attention: needs a CUDA GPU", file=sys.stderr)
        return 1
    from ..timing import bf16_gemm_tflops, copy_bandwidth_tbps

    iters = max(30, args.iters)
    torch.backends.cuda.matmul.allow_tf32 = False
    gemm, copy = bf16_gemm_tflops(), copy_bandwidth_tbps()
    print(f"ceilings: bf16 matmul 8192^3 {gemm:.0f} TFLOP/s, device copy {copy:.2f} TB/s", flush=True)
    batches = [1, 32, 128] if args.quick else [1, 8, 32, 64, 128, 256]
    rows = []

    def add(part):
        print("\n".join(f"  {r['name']}: {r['us']:.1f} us" for r in part), flush=True)
        rows.extend(part)

    if not args.only_fmha:
        if not args.skip_decode:
            # Caches much larger than L2 (50 MB): 1M compressed slots (~600 MB), 256K window slots.
            comp = random_fp8_pool(args.comp_blocks * BLOCK, BLOCK, "cuda", _gen(1))
            swa = random_fp8_pool(args.swa_blocks * BLOCK, BLOCK, "cuda", _gen(2))
            add([r for m in ("flash", "pro") for r in bench_decode(MODELS[m], batches, iters, (comp, swa),
                                                                   args.eager)])
            del comp, swa
            torch.cuda.empty_cache()
        if not args.skip_prefill:
            add(bench_prefill(MODELS["pro"], [4096, 16384], iters, args.eager, n_rows=args.prefill_rows))
    if not args.skip_fmha:
        add(bench_fmha(iters, args.eager, dims=tuple(args.fmha_dims)))
    for r in rows:
        r["pct_gemm"] = 100 * r["tflops"] / gemm
        r["pct_copy"] = 100 * r["tbs"] / copy
    if args.json:
        dump_record(dict(gemm_tflops=gemm, copy_tbs=copy, rows=rows), args.json)
    t = table(rows, gemm, copy)
    print_tables([t])
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(to_markdown([t]))
    return 0


def table(rows: list[dict], gemm: float, copy: float) -> Table:
    return Table(f"dsv4 attention kernels; ceilings in this process: bf16 matmul {gemm:.0f} TFLOP/s, copy "
                 f"{copy:.2f} TB/s (read + write)", ["case", "us", "TFLOP/s", "% gemm", "GB", "TB/s", "% copy"],
                 [[r["name"], f"{r['us']:.1f}", f"{r['tflops']:.1f}", f"{r['pct_gemm']:.1f}", f"{r['gb']:.3f}",
                   f"{r['tbs']:.2f}", f"{r['pct_copy']:.1f}"] for r in rows])
