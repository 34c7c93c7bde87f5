"""Microbenchmark: ``lfmspark::argmax_rows`` against ``torch.argmax``, and the fused greedy Markov
walk ``lfmspark::markov_greedy_walk`` against the loop it replaces (``markov_greedy_walk_reference``:
embedding, cuBLAS GEMV, add, argmax per slot, compiled with Inductor as the draft's tail is), at the
LFM2.5-1.2B draft's shape: V = 65536, Markov rank 256 (bf16), block G = 9.

Bytes: argmax reads the logits once; the walk reads ``base`` once and ``w2`` once per slot (33.5 MB
each, from L2 after the first; GB/s above the HBM copy rate means L2 hits).

    python benchmarks/kernels/argmax_walk.py
    python benchmarks/kernels/argmax_walk.py --sweep     # the step kernels' launch configs (WalkConfig)
    python benchmarks/kernels/argmax_walk.py --persistent-sweep   # the persistent walk's (PersistentWalkConfig)
    python benchmarks/kernels/argmax_walk.py --jacobi    # the Jacobi walk against the sequential kernels
"""

from __future__ import annotations

import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.markov_walk.op import WalkConfig, markov_greedy_walk_reference, markov_greedy_walk_triton, walk_config
from lfmspark.ops.markov_walk.jacobi import jacobi_pass_counts, jacobi_walk_config, markov_greedy_walk_jacobi
from lfmspark.ops.markov_walk.persistent import PersistentWalkConfig, markov_greedy_walk_persistent

try:
    from .common import copy_bandwidth_gbps, row, time_ms
except ImportError:  # run as a script
    from common import copy_bandwidth_gbps, row, time_ms

V, RANK, G = 65536, 256, 9


def run(copy_gbps: float) -> list[dict]:
    dev, rows = "cuda", []
    for R in (1, 4, 10, 40):
        x = torch.randn(R, V, device=dev)
        for name, fn in (("argmax_rows", lambda: torch.ops.lfmspark.argmax_rows(x)),
                         ("torch.argmax", lambda: x.argmax(dim=-1))):
            rows.append(row(name, f"R={R} V={V}", time_ms(fn), x.numel() * 4, copy_gbps))
    w1 = (torch.randn(V, RANK, device=dev) * 0.05).bfloat16()
    w2 = (torch.randn(V, RANK, device=dev) * 0.05).bfloat16()
    compiled_loop = torch.compile(markov_greedy_walk_reference, fullgraph=True, dynamic=False)
    for B in (1, 4):
        base = torch.randn(B, G, V, device=dev)
        anchor = torch.randint(0, V, (B,), device=dev)
        if not torch.equal(torch.ops.lfmspark.markov_greedy_walk(base, anchor, w1, w2),
                           markov_greedy_walk_reference(base, anchor, w1, w2)):
            print(f"note: B={B}: the walks disagree (a near-tie under another summation order?)")
        n_bytes = base.numel() * 4 + G * w2.numel() * 2
        for name, fn in (("markov_greedy_walk", lambda: torch.ops.lfmspark.markov_greedy_walk(base, anchor, w1, w2)),
                         ("walk loop (compiled)", lambda: compiled_loop(base, anchor, w1, w2))):
            for graph in (True, False):
                rows.append(row(name, f"B={B} G={G} V={V} r={RANK}", time_ms(fn, use_graph=graph), n_bytes,
                                copy_gbps, graph=graph))
    return rows


def sweep(batches: list[int]) -> list[dict]:
    """Every ``WalkConfig`` of a small grid at the draft's shape, timed in a CUDA graph (one walk of
    G steps per replay, as in the round), each checked against the default config's tokens."""
    dev, rows = "cuda", []
    w1 = (torch.randn(V, RANK, device=dev) * 0.05).bfloat16()
    w2 = (torch.randn(V, RANK, device=dev) * 0.05).bfloat16()
    for B in batches:
        base = torch.randn(B, G, V, device=dev).bfloat16()          # the LM head's own output dtype
        anchor = torch.randint(0, V, (B,), device=dev)
        default = walk_config(B, V, RANK)
        want = markov_greedy_walk_triton(base, anchor, w1, w2, config=default)
        for block_v in (64, 128, 256):
            for block_r in (64, 128, 256):
                for num_warps in (4, 8):
                    cfg = WalkConfig(block_v=block_v, block_r=block_r, num_warps=num_warps)
                    try:
                        same = torch.equal(markov_greedy_walk_triton(base, anchor, w1, w2, config=cfg), want)
                        us = time_ms(lambda: markov_greedy_walk_triton(base, anchor, w1, w2, config=cfg)) * 1e3
                    except Exception as exc:  # e.g. out of registers / shared memory: report, go on
                        rows.append({"B": B, "config": str(cfg), "error": type(exc).__name__})
                        continue
                    rows.append({"B": B, "block_v": block_v, "block_r": block_r, "warps": num_warps,
                                 "us_per_walk": round(us, 2), "us_per_step": round(us / G, 2),
                                 "default": cfg == default, "same_tokens": same})
    return sorted(rows, key=lambda r: (r["B"], r.get("us_per_walk", 1e9)))


def _cold_l2_us(fn, flush_src: torch.Tensor, flush_dst: torch.Tensor) -> float:
    """Microseconds of ``fn`` after a copy that evicts L2 (as the LM head's 268 MB read does before
    the walk in the round): a graph of copy + ``fn`` minus a graph of the copy alone."""
    def both():
        flush_dst.copy_(flush_src)
        fn()
    return (time_ms(both) - time_ms(lambda: flush_dst.copy_(flush_src))) * 1e3


def persistent_sweep(batches: list[int]) -> list[dict]:
    """The persistent walk's configs against the step kernels' default, each timed after an L2
    flush and checked against the reference on order-independent inputs (weights multiples of 1/8)."""
    dev, rows = "cuda", []
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randint(-16, 17, (V, RANK), generator=g) / 8).to(dev, torch.bfloat16)
    w2 = (torch.randint(-16, 17, (V, RANK), generator=g) / 8).to(dev, torch.bfloat16)
    flush_src = torch.empty(64 * 2 ** 20, device=dev, dtype=torch.float32)
    flush_dst = torch.empty_like(flush_src)
    configs = [PersistentWalkConfig(block_v=bv, resident=res, num_warps=nw, num_stages=ns)
               for bv, res, nw, ns in [(256, 1, 8, 2), (256, 1, 4, 2), (256, 1, 8, 1), (256, 0, 8, 2),
                                       (128, 2, 8, 2), (128, 2, 16, 2), (128, 1, 8, 2), (64, 2, 8, 2)]]
    for B in batches:
        base = (torch.randint(-40, 41, (B, G, V), generator=g) / 4).to(dev, torch.bfloat16)
        anchor = torch.randint(0, V, (B,), generator=g).to(dev)
        want = markov_greedy_walk_reference(base.cpu().float(), anchor.cpu(), w1.cpu(), w2.cpu())
        steps = walk_config(B, V, RANK)
        us = _cold_l2_us(lambda: markov_greedy_walk_triton(base, anchor, w1, w2, config=steps), flush_src, flush_dst)
        rows.append({"B": B, "kernel": "steps", "config": str(steps), "us_per_walk": round(us, 2),
                     "same_tokens": torch.equal(markov_greedy_walk_triton(base, anchor, w1, w2, config=steps).cpu(), want)})
        for cfg in configs:
            try:
                same = torch.equal(markov_greedy_walk_persistent(base, anchor, w1, w2, cfg).cpu(), want)
                us = _cold_l2_us(lambda: markov_greedy_walk_persistent(base, anchor, w1, w2, cfg), flush_src, flush_dst)
            except Exception as exc:  # e.g. out of registers / shared memory: report, go on
                rows.append({"B": B, "kernel": "persistent", "config": str(cfg), "error": f"{type(exc).__name__}: "
                             f"{str(exc)[:80]}"})
                continue
            rows.append({"B": B, "kernel": "persistent", "config": str(cfg), "us_per_walk": round(us, 2),
                         "same_tokens": same})
    return sorted(rows, key=lambda r: (r["B"], r.get("us_per_walk", 1e9)))


def jacobi_compare() -> list[dict]:
    """One row (B = 1): the step kernels, the sequential persistent walk and the Jacobi walk in a few
    configs, each after an L2 flush, on two kinds of weights: the benchmark presets' random init
    (``N(0, 0.02)`` Markov weights, base logits of an ``N(0, 0.02)`` LM head on a unit-RMS hidden
    state: biases ~0.006 against logits ~0.9, so the bias rarely moves an argmax) and the
    order-independent test weights (biases as large as the logits: many passes). Tokens are
    compared with the persistent walk's, whose per-slot numerics the Jacobi walk shares. The Jacobi
    rows run its default config, then others."""
    dev, rows = "cuda", []
    g = torch.Generator().manual_seed(0)
    flush_src = torch.empty(64 * 2 ** 20, device=dev, dtype=torch.float32)
    flush_dst = torch.empty_like(flush_src)
    anchor = torch.randint(0, V, (1,), generator=g).to(dev)
    kinds = {
        "preset_init": ((torch.randn(V, RANK, generator=g) * 0.02), (torch.randn(V, RANK, generator=g) * 0.02),
                        torch.randn(1, G, V, generator=g) * 0.9),
        "large_bias": ((torch.randint(-16, 17, (V, RANK), generator=g) / 8), (torch.randint(-16, 17, (V, RANK), generator=g) / 8),
                       torch.randint(-40, 41, (1, G, V), generator=g) / 4),
    }
    default = jacobi_walk_config()
    variants = [default] + [PersistentWalkConfig(block_v=bv, resident=res, num_warps=nw)
                            for bv, res, nw in [(256, 1, 8), (128, 2, 16), (128, 1, 8)]]
    persistent = PersistentWalkConfig(block_v=256, resident=1, num_warps=8)
    for kind, (w1, w2, base) in kinds.items():
        w1, w2, base = w1.to(dev, torch.bfloat16), w2.to(dev, torch.bfloat16), base.to(dev, torch.bfloat16)
        want = markov_greedy_walk_persistent(base, anchor, w1, w2, persistent)
        steps = walk_config(1, V, RANK)
        us = _cold_l2_us(lambda: markov_greedy_walk_triton(base, anchor, w1, w2, config=steps), flush_src, flush_dst)
        rows.append({"weights": kind, "kernel": "steps", "config": str(steps), "us_per_walk": round(us, 2)})
        us = _cold_l2_us(lambda: markov_greedy_walk_persistent(base, anchor, w1, w2, persistent), flush_src, flush_dst)
        rows.append({"weights": kind, "kernel": "persistent", "config": str(persistent), "us_per_walk": round(us, 2)})
        for cfg in variants:
            def walk():
                return markov_greedy_walk_jacobi(base, anchor, w1, w2, cfg, count_passes=True)
            label = {"weights": kind, "kernel": "jacobi", "config": str(cfg)}
            try:
                before = jacobi_pass_counts()
                same = torch.equal(walk(), want)
                passes = jacobi_pass_counts()[0] - before[0]
                us = _cold_l2_us(walk, flush_src, flush_dst)
            except Exception as exc:  # e.g. out of registers / shared memory: report, go on
                rows.append({**label, "error": f"{type(exc).__name__}: {str(exc)[:80]}"})
                continue
            rows.append({**label, "us_per_walk": round(us, 2), "passes": passes, "same_tokens": same})
    return rows


if __name__ == "__main__":
    import argparse
    import json

    from tabulate import tabulate

    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="sweep the step kernels' launch configs instead")
    ap.add_argument("--persistent-sweep", action="store_true", help="sweep the persistent walk's configs instead")
    ap.add_argument("--jacobi", action="store_true", help="the Jacobi walk against the sequential kernels (B = 1)")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.jacobi:
        result = jacobi_compare()
    elif args.persistent_sweep:
        result = persistent_sweep(batches)
    else:
        result = sweep(batches) if args.sweep else run(copy_bandwidth_gbps())
    print(tabulate(result, headers="keys"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
