"""Microbenchmark of ``lfmspark::cache_attention`` (Triton, CUDA) at LFM2.5-1.2B attention shapes:
32 query heads over 8 kv heads, head_dim 64, bf16, cache of 8192 + 64 positions.

Cases: decode (T = 1, causal), verify (T = 10, causal) and the DSpark draft block (T = 9,
non-causal), at batch 1, 4 and 16 and context 512 and 8192. Bytes counted: the K and V rows
actually read (each row's visible keys x n_kv x head_dim x 2 bytes, for K and for V) plus q and
the output. ``us`` (and GB/s) is one CUDA-graph replay as ``common.time_ms`` times it, which
includes a fixed launch cost of several µs; ``us_amortized`` is the kernels' own time with 20 calls
per graph; batch 1 is also timed without a graph (``us_no_graph``), since at short context the
kernel is launch-bound.
"""

from __future__ import annotations

import torch

try:
    from .common import copy_bandwidth_gbps, row, time_ms
except ImportError:  # run as a script: python benchmarks/kernels/cache_attention.py
    from common import copy_bandwidth_gbps, row, time_ms

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.attention.cache_attention import _sm_count, plan_launch

N_HEADS, N_KV, HEAD_DIM = 32, 8, 64
CACHE_LEN = 8192 + 64
DTYPE = torch.bfloat16
BATCHES = (1, 4, 16)
CONTEXTS = (512, 8192)
WINDOWS = ((1, True), (10, True), (9, False))  # (T, causal): decode, verify, draft


def _splits(B: int, T: int) -> int:
    """The split count the launcher's heuristic picks for this shape (reported, not forced)."""
    return plan_launch(B, T, N_HEADS, N_KV, HEAD_DIM, CACHE_LEN, DTYPE.itemsize, _sm_count(torch.device("cuda"))).num_splits


def _amortized_ms(fn, reps: int = 20) -> float:
    """Milliseconds per call with ``reps`` calls captured in one CUDA graph: the kernels' own time,
    without the per-replay launch and event overhead that ``time_ms`` includes."""
    return time_ms(lambda: [fn() for _ in range(reps)]) / reps


def run(copy_gbps: float) -> list[dict]:
    rows = []
    n_slots = max(BATCHES)
    gen = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(1, n_slots, CACHE_LEN, N_KV, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    v_cache = torch.randn(1, n_slots, CACHE_LEN, N_KV, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    scale = HEAD_DIM ** -0.5
    for B in BATCHES:
        slots = torch.arange(B, device="cuda", dtype=torch.int64)
        for ctx in CONTEXTS:
            start = torch.full((B,), ctx, device="cuda", dtype=torch.int64)
            for T, causal in WINDOWS:
                q = torch.randn(B, T, N_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)

                def call(q=q, start=start, causal=causal):
                    return torch.ops.lfmspark.cache_attention(q, k_cache, v_cache, 0, slots, start, causal, scale)

                keys = min(ctx + T, CACHE_LEN)  # the last query (every query when non-causal) sees these
                kv_bytes = B * keys * N_KV * HEAD_DIM * DTYPE.itemsize * 2
                n_bytes = kv_bytes + 2 * q.numel() * q.element_size()  # + q read + output written
                shape = f"B={B} T={T} ctx={ctx} {'causal' if causal else 'noncausal'}"
                extra = {"splits": _splits(B, T), "us_amortized": round(_amortized_ms(call) * 1e3, 2)}
                if B == 1:
                    extra["us_no_graph"] = round(time_ms(call, use_graph=False) * 1e3, 2)
                rows.append(row("cache_attention", shape, time_ms(call), n_bytes, copy_gbps, **extra))
    return rows


if __name__ == "__main__":
    from tabulate import tabulate

    gbps = copy_bandwidth_gbps()
    print(f"device copy bandwidth: {gbps:.0f} GB/s")
    print(tabulate(run(gbps), headers="keys"))
