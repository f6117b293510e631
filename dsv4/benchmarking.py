"""Timing helpers shared by the benchmark scripts (CUDA only).

Conventions (docs/perf.md): median over >= 30 timed iterations after warm-up,
CUDA events around each call, inputs rotated so the 60 MB L2 does not flatter,
ceilings measured in the same process as the kernels they judge.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_us(fn: Callable[[int], object], *, n_inputs: int = 1, warmup: int = 5, iters: int = 50) -> float:
    """Median time of ``fn(i % n_inputs)`` in microseconds, one event pair per call."""
    return interleaved_median_us({0: fn}, n_inputs=n_inputs, warmup=warmup, iters=iters)[0]


def interleaved_median_us(fns: dict, *, n_inputs: int = 1, warmup: int = 3, iters: int = 50) -> dict:
    """Median times (us) of several variants of one call, taken round-robin (a, b, c, a, b,
    c, ...) so that clock and temperature drift during the run hit every variant alike;
    timed one after the other, the first variant measured several percent faster."""
    for i in range(warmup):
        for fn in fns.values():
            fn(i % n_inputs)
    events = {k: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
              for k in fns}
    for i in range(iters):
        for k, fn in fns.items():
            events[k][i][0].record()
            fn(i % n_inputs)
            events[k][i][1].record()
    torch.cuda.synchronize()
    return {k: statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3 for k, ev in events.items()}


def graph_median_us(fn: Callable[[int], object], *, n_inputs: int = 1, iters: int = 50) -> float:
    """Like median_us, but each input set's call is captured once in a CUDA graph and the
    graphs are replayed: no host or dispatcher overhead, as vLLM runs decode."""
    for i in range(n_inputs):  # warm-up outside capture: lazy init, workspaces
        fn(i)
    torch.cuda.synchronize()
    graphs = []
    for i in range(n_inputs):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(i)
        graphs.append(graph)
    return median_us(lambda i: graphs[i].replay(), n_inputs=n_inputs, iters=iters)


def copy_bandwidth_tbps(nbytes: int = 1 << 31) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = median_us(lambda i: dst.copy_(src), iters=30)
    return 2 * nbytes / (us * 1e-6) / 1e12


def bf16_gemm_tflops(n: int = 8192) -> float:
    """Dense bf16 GEMM rate (cuBLAS through torch.matmul) on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = median_us(lambda i: torch.matmul(a, b), iters=30)
    return 2 * n**3 / (us * 1e-6) / 1e12
