"""The one timer of every dsv4 benchmark (CUDA), and the CPU reference run's wall clock.

:func:`time_us` times several variants of one call (e.g. dsv4 and the incumbent) on the
same inputs, round-robin, so clock and temperature drift hit every variant alike:

* ``cuda_graph=True`` (default): each input set's call is captured once in a CUDA graph
  and replayed, as vLLM runs decode (no host or dispatcher time in the number);
  ``False`` times eager calls (host overhead included);
* ``cold_l2=True`` (default): L2 is evicted before every timed call by reading a buffer
  twice its size (a read leaves clean lines, so no write-back competes with the timed
  kernel): in a real step the rest of the model streams through L2 between two calls
  of one layer; ``False`` leaves L2 warm (the kernel's rate on data it just touched);
* inputs rotate over the given input sets (one callable per set).

``iters`` timed calls after ``warmup`` untimed ones, one CUDA event pair around each call
only; the time is the mean over the input sets of each set's median
(:func:`rotation_us`). Sets of one case can cost differently (a one-token MoE call has
0, 1 or 2 local experts in different sets): the median of all calls then sits on
whichever set's time the middle call falls, and moved by a third between two processes
with the same kernels (docs/perf-history/2026-12-06-timer-per-set-medians.md); the mean of
the per-set medians is the expected time of a call over the sets, and as stable as each
set's median.

:func:`cpu_median_us` is the wall clock of the decode-step routine's ``--cpu-reference``
run (float32 reference kernels on the CPU): it shows the report machinery, its times are
not performance numbers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

__all__ = ["Timing", "time_us", "rotation_us", "cpu_median_us", "copy_bandwidth_tbps", "bf16_gemm_tflops",
           "fp8_gemm_tflops", "l2_flush"]

_FLUSH: dict = {}


@dataclass(frozen=True)
class Timing:
    us: float  # microseconds of one call: the mean over input sets of each set's median (rotation_us)
    method: str  # "cuda-graph" or "eager" (a capture that failed falls back to eager and says so)


def l2_flush() -> None:
    """Evicts L2 by reading a buffer of twice its size."""
    buf = _FLUSH.get("buf")
    if buf is None:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or (64 << 20)
        buf = _FLUSH["buf"] = torch.ones(2 * l2 // 4, dtype=torch.int32, device="cuda")
        _FLUSH["sink"] = torch.empty((), dtype=torch.int32, device="cuda")
    torch.amax(buf, dim=0, out=_FLUSH["sink"])


def _capture(calls: Sequence[Callable[[], object]]) -> tuple[list, list, str]:
    graphs = []
    try:
        for f in calls:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                f()
            graphs.append(g)
        return graphs, [g.replay for g in graphs], "cuda-graph"
    except Exception:  # keep the number, say how it was taken
        torch.cuda.synchronize()
        return [], list(calls), "eager"


def rotation_us(times_us: Sequence[float], n_sets: int) -> float:
    """The time of a call over ``n_sets`` rotated input sets, from the timed calls in order
    (call i ran set i % n_sets): the mean over the sets of each set's median. Sets no call
    ran are left out."""
    if n_sets < 1 or not times_us:
        raise ValueError(f"dsv4: need timed calls and n_sets >= 1, got {len(times_us)} calls, n_sets={n_sets}")
    per_set = [times_us[j::n_sets] for j in range(n_sets)]
    return statistics.fmean(statistics.median(ts) for ts in per_set if ts)


def time_us(variants: Mapping[str, Sequence[Callable[[], object]]], *, iters: int = 50, warmup: int = 5,
            cuda_graph: bool = True, cold_l2: bool = True) -> dict[str, Timing]:
    """Time of one call of each variant: the mean over its input sets of each set's median
    (:func:`rotation_us`).

    Parameters
    ----------
    variants : mapping name -> sequence of zero-argument callables
        One callable per input set; the timed calls rotate over them. Every variant is
        called once outside capture first (lazy initialisation, workspaces, planners).
    iters, warmup : int
        Timed and untimed calls per variant.
    cuda_graph, cold_l2 : bool
        See the module docstring.

    Returns
    -------
    dict name -> :class:`Timing`
    """
    if iters < 1:
        raise ValueError(f"dsv4: iters must be >= 1, got {iters}")
    for calls in variants.values():
        for f in calls:
            f()
    torch.cuda.synchronize()
    runs, methods, keep = {}, {}, []
    for name, calls in variants.items():
        if cuda_graph:
            graphs, runs[name], methods[name] = _capture(calls)
            keep.append(graphs)
        else:
            runs[name], methods[name] = list(calls), "eager"
    for i in range(warmup):
        for r in runs.values():
            r[i % len(r)]()
    events = {k: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
              for k in runs}
    for i in range(iters):
        for name, r in runs.items():
            if cold_l2:
                l2_flush()
            start, end = events[name][i]
            start.record()
            r[i % len(r)]()
            end.record()
    torch.cuda.synchronize()
    out = {k: Timing(rotation_us([s.elapsed_time(e) * 1e3 for s, e in ev], len(runs[k])), methods[k])
           for k, ev in events.items()}
    del keep
    return out


def cpu_median_us(calls: Sequence[Callable[[], object]], *, iters: int = 3, warmup: int = 1) -> Timing:
    """Median wall time of one call on the CPU, rotating over ``calls`` (one per input
    set); method "cpu"."""
    n = len(calls)
    for i in range(warmup):
        calls[i % n]()
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        calls[i % n]()
        times.append(time.perf_counter() - t0)
    return Timing(statistics.median(times) * 1e6, "cpu")


def copy_bandwidth_tbps(nbytes: int = 1 << 31) -> float:
    """Device-to-device copy bandwidth (bytes read + bytes written), warm, eager."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = time_us({"copy": [lambda: dst.copy_(src)]}, iters=30, cuda_graph=False, cold_l2=False)["copy"].us
    return 2 * nbytes / (us * 1e-6) / 1e12


def bf16_gemm_tflops(n: int = 8192) -> float:
    """Dense bf16 GEMM rate (cuBLAS through torch.matmul) on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = time_us({"gemm": [lambda: torch.matmul(a, b)]}, iters=30, cuda_graph=False, cold_l2=False)["gemm"].us
    return 2 * n**3 / (us * 1e-6) / 1e12


def fp8_gemm_tflops(n: int = 8192) -> float:
    """Dense fp8 e4m3 GEMM rate (cuBLAS through torch._scaled_mm, bf16 out)."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    us = time_us({"gemm": [lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)]}, iters=30,
                 cuda_graph=False, cold_l2=False)["gemm"].us
    return 2 * n**3 / (us * 1e-6) / 1e12
