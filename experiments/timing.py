"""Timing for every benchmark: GPU time through CUDA graphs, and eager time with launches.

A kernel of tens of microseconds launched from Python is often bound by the host (argument
checks, autograd, Triton's launcher): ``do_bench`` then measures the host, not the kernel.
``time_ms(..., graph=True)`` captures many calls in one CUDA graph and times its replays, so the
number is what the GPU spends; ``graph=False`` is ``do_bench`` with its L2 flush, what an eager
Python loop sees. Benchmarks report both.

Repeated calls on one buffer that fits in L2 would measure the cache: ``input_sets`` says how
many copies of the inputs a benchmark should cycle through so they do not.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch


def input_sets(bytes_per_set: int, device: torch.device) -> int:
    """Number of input copies whose total is at least three times the L2 cache."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, math.ceil(3 * l2 / max(bytes_per_set, 1)))


def _quantiles(times: list[float]) -> tuple[float, float, float]:
    times = sorted(times)
    # inclusive: percentiles within the measured range (the default extrapolates from few runs)
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
    return statistics.median(times), q[1], q[7]  # median, 20th, 80th percentile


def time_ms(
    fn: Callable[[], object],
    *,
    graph: bool = True,
    grad_to_none: list[torch.Tensor] | None = None,
    rep_ms: int = 100,
) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile) milliseconds per call of ``fn``.

    CUDA: ``graph=True`` replays a CUDA graph of many calls (GPU time only);
    ``graph=False`` is ``triton.testing.do_bench``. CPU (the interpreter): a few wall-clock runs.
    """
    if not torch.cuda.is_available():
        fn()  # warm-up: compilation, caches
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e3)
        return _quantiles(runs)
    import triton.testing

    if graph:
        runs = triton.testing.do_bench_cudagraph(
            fn, rep=rep_ms, grad_to_none=grad_to_none, return_mode="all"
        )
        return _quantiles(runs)
    q = triton.testing.do_bench(
        fn, rep=rep_ms, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8]
    )
    return tuple(q)


def time_gpu_ms(
    fn: Callable[[], object],
    *,
    grad_to_none: list[torch.Tensor] | None = None,
    rep_ms: int = 100,
    graph_below_ms: float = 20.0,
) -> tuple[tuple[float, float, float], float, str]:
    """GPU time of ``fn`` for benchmarks whose calls range from microseconds to seconds.

    Returns ((median, 20th, 80th percentile) ms, the eager median ms, how): ``fn`` is timed
    eagerly first (``do_bench``); under ``graph_below_ms`` the host's launches may bound that
    time, so the returned quantiles come from a CUDA graph of many calls (how = "graph").
    Longer calls hide their launches and are not replayed (a graph would run them ~16 times
    where ``do_bench`` runs 7: seconds at long N): how = "eager". CPU: ``time_ms``'s wall
    clock, "cpu". A call the graph cannot capture raises: a failed capture may leave CUDA's
    random generator unusable (PyTorch 2.11: "Offset increment outside graph capture" at the
    next ``randn``), so no later case of the benchmark could be trusted to run.
    """
    eager = time_ms(fn, graph=False, grad_to_none=grad_to_none, rep_ms=rep_ms)
    if not torch.cuda.is_available():
        return eager, eager[0], "cpu"
    if eager[0] >= graph_below_ms:
        return eager, eager[0], "eager"
    return time_ms(fn, grad_to_none=grad_to_none, rep_ms=rep_ms), eager[0], "graph"


def peak_extra_mib(fn: Callable[[], object], device: torch.device, exclude_bytes: int = 0):
    """MiB allocated at the peak of one ``fn()`` beyond what was allocated before it, less
    ``exclude_bytes`` (outputs the caller does not count); None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before - exclude_bytes) / 2**20
