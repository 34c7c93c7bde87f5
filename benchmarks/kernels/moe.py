"""Microbenchmark: ``lfmspark::moe_experts`` at LFM2-8B-A1B shapes (bf16, H 2048, I 1792, E 32, k 4).

Decode and verify sizes are bound by reading the selected experts' weights, so the bytes counted
are the distinct experts actually selected times their three matrices (``w1``, ``w3``, ``w2``:
``3 * H * I`` elements each), plus the activations (``x`` and the routing read, the output written).

Each timed call runs the op over ``LAYERS`` different copies of the expert weights in turn (as a
model's MoE layers do), so no layer finds its experts in L2; the reported time is per layer.

    python benchmarks/kernels/moe.py            # the report table
    python benchmarks/kernels/moe.py --sweep    # time candidate tile configs per N (tuning aid)
    python benchmarks/kernels/moe.py --profile  # device time of each of the op's kernels

For scale (triton 3.6, graph replay, per layer; measured results: docs/benchmarks.md): N=1 34 us
(88 MB, 2.6 TB/s), N=10 151 us (573 MB, 3.8 TB/s), N=40 184 us, N=160 196 us (706 MB, 3.6 TB/s),
N=10 on 4 experts 39 us; the eager per-expert reference 5 ms at N=10.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable

import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.moe import MoeConfig, default_config, moe_config, moe_experts_reference, moe_experts_triton

try:
    from .common import copy_bandwidth_gbps, row, time_ms
except ImportError:  # run as a script
    from common import copy_bandwidth_gbps, row, time_ms

H, I, E, K = 2048, 1792, 32, 4
DTYPE = torch.bfloat16
LAYERS = 6  # weight copies cycled through per timed call (6 x 704 MB, far past the 60 MB L2)


def _weights(n_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [((torch.randn(E, 2 * I, H, generator=gen, device="cuda") / H ** 0.5).to(DTYPE),
             (torch.randn(E, H, I, generator=gen, device="cuda") / I ** 0.5).to(DTYPE))
            for _ in range(n_layers)]


def _tokens(N: int, routing: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x``, ``topk_ids`` and ``topk_weights`` for ``N`` tokens: ``random`` routing (k distinct
    experts per token) or ``same4`` (every token on the same 4 experts)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, H, generator=gen, device="cuda").to(DTYPE)
    if routing == "same4":
        ids = torch.randperm(E, generator=gen, device="cuda")[:K].repeat(N, 1)
    else:
        ids = torch.rand(N, E, generator=gen, device="cuda").argsort(dim=1)[:, :K]
    w = (torch.rand(N, K, generator=gen, device="cuda") + 0.1).to(DTYPE)
    return x, ids, w


def _bytes(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    """(bytes one layer must move, distinct experts selected)."""
    distinct = ids.unique().numel()  # host sync: fine here, outside the timed region
    weights = distinct * 3 * H * I * DTYPE.itemsize
    acts = 2 * x.numel() * x.element_size() + ids.numel() * ids.element_size() + w.numel() * w.element_size()
    return weights + acts, distinct


def _per_layer_ms(op: Callable, layers: list, x, ids, w, use_graph: bool = True) -> float:
    def step():
        for w13, w2 in layers:
            op(x, ids, w, w13, w2)
    return time_ms(step, use_graph=use_graph) / len(layers)


def run(copy_gbps: float) -> list[dict]:
    layers = _weights(LAYERS)
    op = torch.ops.lfmspark.moe_experts
    rows = []
    for N, routing in [(1, "random"), (10, "random"), (40, "random"), (160, "random"), (10, "same4")]:
        x, ids, w = _tokens(N, routing, seed=N)
        n_bytes, distinct = _bytes(x, ids, w)
        shape = f"N={N} {routing} E={E} k={K} H={H} I={I} bf16"
        ms = _per_layer_ms(op, layers, x, ids, w)
        rows.append(row("moe_experts", shape, ms, n_bytes, copy_gbps, experts=distinct, graph=True))
        if N == 10 and routing == "random":
            # launch-bound view (no graph), and the per-expert eager reference for comparison
            ms = _per_layer_ms(op, layers, x, ids, w, use_graph=False)
            rows.append(row("moe_experts", shape, ms, n_bytes, copy_gbps, experts=distinct, graph=False))
            ms = _per_layer_ms(moe_experts_reference, layers, x, ids, w, use_graph=False)
            rows.append(row("moe_experts_reference", shape, ms, n_bytes, copy_gbps, experts=distinct, graph=False))
    return rows


# ---------------------------------------------------------------------------------------------
# tuning aid

def _candidates(N: int) -> list[MoeConfig]:
    if N * K / E <= 4:  # decode: weight-bandwidth bound, a few pairs per expert
        grid = itertools.product([16], [16, 32, 64], [128, 256], [4], [3, 4])
    elif N * K / E <= 96:  # verify
        grid = itertools.product([16, 32, 64], [32, 64], [64, 128], [4], [4])
    else:  # prefill: matrix-unit bound
        grid = itertools.product([64, 128], [64, 128], [64], [4, 8], [3, 4])
    return [MoeConfig(block_m=bm, block_n1=bn, block_k1=bk, block_n2=bn, block_k2=bk, num_warps=nw, num_stages=ns)
            for bm, bn, bk, nw, ns in grid]


def sweep(copy_gbps: float, sizes: list[int], budget_s: float = 420.0) -> list[dict]:
    """Time the candidate configs at each ``N`` (random routing), ``budget_s / len(sizes)`` seconds
    per size at most; returns all rows."""
    layers = _weights(3)
    rows = []
    for N in sizes:
        x, ids, w = _tokens(N, "random", seed=N)
        n_bytes, distinct = _bytes(x, ids, w)
        t0 = time.time()
        for cfg in [moe_config(N * K, E)] + _candidates(N):
            if time.time() - t0 > budget_s / len(sizes):
                break
            op = lambda *a, cfg=cfg: moe_experts_triton(*a, config=cfg)  # noqa: E731
            try:
                ms = _per_layer_ms(op, layers, x, ids, w)
            except Exception as exc:  # e.g. out of shared memory for a large tile
                rows.append({"N": N, "config": str(cfg), "error": type(exc).__name__})
                continue
            r = row("moe_experts", f"N={N}", ms, n_bytes, copy_gbps, experts=distinct)
            rows.append({"N": N, "config": str(cfg), "us": r["us"], "GB/s": r["GB/s"],
                         "frac_of_copy": r["frac_of_copy"], "TFLOP/s": round(6 * N * K * H * I / (ms * 1e9), 1)})
    return rows


def profile(sizes: list[int]) -> list[dict]:
    """Average device time of each kernel the op launches (eager calls under the profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    layers = _weights(3)
    rows = []
    for N in sizes:
        x, ids, w = _tokens(N, "random", seed=N)
        for w13, w2 in layers:
            moe_experts_triton(x, ids, w, w13, w2)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                for w13, w2 in layers:
                    moe_experts_triton(x, ids, w, w13, w2)
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            us = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0.0)
            if us > 0:
                rows.append({"N": N, "kernel": ev.key[:48], "calls": ev.count, "us": round(us, 2)})
    return rows


if __name__ == "__main__":
    from tabulate import tabulate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time candidate tile configs instead")
    parser.add_argument("--profile", action="store_true", help="device time of each kernel instead")
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 10, 40, 160, 2048, 8192])
    parser.add_argument("--budget", type=float, default=420.0, help="seconds the sweep may take")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.profile:
        print(tabulate(profile(args.sizes), headers="keys"))
        raise SystemExit
    copy_gbps = copy_bandwidth_gbps()
    rows = sweep(copy_gbps, args.sizes, args.budget) if args.sweep else run(copy_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "rows": rows}, f, indent=1)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s")
    if args.sweep:
        for N in args.sizes:
            ok = sorted((r for r in rows if r["N"] == N and "us" in r), key=lambda r: r["us"])
            print(tabulate(ok[:5], headers="keys"))
    else:
        print(tabulate(rows, headers="keys"))
