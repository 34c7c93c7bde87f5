"""Shared helpers for the kernel microbenchmarks (run on a GPU, never in CI).

Each benchmark module exposes ``run(copy_gbps: float) -> list[dict]``; ``run_all.py`` measures
the device-to-device copy bandwidth once, runs every module and writes one JSON report.
"""

from __future__ import annotations

import torch

from lfmspark.tools.bench import copy_bandwidth_gbps as _measure_copy
from lfmspark.tools.bench import median_seconds


def copy_bandwidth_gbps() -> float:
    """Measured device-to-device copy bandwidth in GB/s (bytes read + written), the same
    measurement ``lfmspark bench`` reports: event-timed plain copies, median of 20. (A copy
    captured in a CUDA graph measures only about two thirds of that: ~2.8 against ~4.2 TB/s.)"""
    return _measure_copy(torch.device("cuda"))


def time_ms(fn, warmup: int = 5, iters: int = 50, use_graph: bool = True) -> float:
    """Median milliseconds per call of ``fn``, replayed from a CUDA graph when ``use_graph``
    (removes launch overhead so bandwidth-bound kernels are timed as kernels; launch-bound
    kernels should also be reported with ``use_graph=False``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    call = fn
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        call = graph.replay
    return median_seconds(call, runs=iters, warmup=0) * 1e3


def row(kernel: str, shape: str, ms: float, n_bytes: int, copy_gbps: float, **extra) -> dict:
    """One report row: time, achieved GB/s and its fraction of the measured copy bandwidth."""
    gbps = n_bytes / (ms * 1e-3) / 1e9
    return {"kernel": kernel, "shape": shape, "us": round(ms * 1e3, 2), "bytes": n_bytes,
            "GB/s": round(gbps, 1), "frac_of_copy": round(gbps / copy_gbps, 3), **extra}
