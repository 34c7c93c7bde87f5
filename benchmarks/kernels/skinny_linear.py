"""Microbenchmark: ``lfmspark::skinny_linear`` against cuBLAS (``F.linear``) at the weight shapes of
LFM2.5-1.2B and its DSpark draft (bf16), for M = 1 (decode), 10 (verify) and 40 (verify, batch 4).

Bytes: the weight read once, plus ``x`` read and the output written. Each timed call runs the
product over as many copies of the weight as make ``_STREAM_BYTES`` (as a model's layers do), so
no call finds its weight in L2; the reported time is per product.

    python benchmarks/kernels/skinny_linear.py            # the report table
    python benchmarks/kernels/skinny_linear.py --sweep    # time candidate launch configs (tuning aid)
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time

import torch
import torch.nn.functional as F

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.skinny_linear import SkinnyConfig, skinny_config, skinny_linear_triton

try:
    from .common import copy_bandwidth_gbps, row, time_ms
except ImportError:  # run as a script
    from common import copy_bandwidth_gbps, row, time_ms

DTYPE = torch.bfloat16
# (N, K): target in_proj (conv), out_proj, w1|w3, w2, qkv, LM head; draft fc, o_proj, w1|w3
SHAPES = [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (3072, 2048), (65536, 2048),
          (2048, 4096), (4096, 2048), (12288, 2048)]
ROWS = [1, 10, 40]
_STREAM_BYTES = 512 * 2**20  # weight bytes per timed call: far past the H200's 60 MB L2


def _weights(N: int, K: int) -> list[torch.Tensor]:
    n_copies = max(1, _STREAM_BYTES // (N * K * DTYPE.itemsize))
    gen = torch.Generator(device="cuda").manual_seed(N + K)
    return [(torch.randn(N, K, generator=gen, device="cuda") / K ** 0.5).to(DTYPE) for _ in range(n_copies)]


def _cases(rows_m=tuple(ROWS), shapes=tuple(SHAPES)):
    """``(N, K, M, weights, x)`` for every shape and row count (one weight set per shape)."""
    for N, K in shapes:
        weights = _weights(N, K)
        for M in rows_m:
            yield N, K, M, weights, torch.randn(M, K, device="cuda").to(DTYPE)
        del weights


def _per_product_ms(fn, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    def step():
        for w in weights:
            fn(x, w)
    return time_ms(step) / len(weights)


def _bytes(M: int, N: int, K: int) -> int:
    return (N * K + M * K + M * N) * DTYPE.itemsize


def run(copy_gbps: float) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for N, K, M, weights, x in _cases():
        shape = f"M={M} N={N} K={K} bf16"
        cfg = skinny_config(M, N, K, DTYPE.itemsize, sms)
        ms = _per_product_ms(torch.ops.lfmspark.skinny_linear, x, weights)
        rows.append(row("skinny_linear", shape, ms, _bytes(M, N, K), copy_gbps,
                        block_n=cfg.block_n, block_k=cfg.block_k, split_k=cfg.split_k))
        ms = _per_product_ms(F.linear, x, weights)
        rows.append(row("F.linear (cuBLAS)", shape, ms, _bytes(M, N, K), copy_gbps))
    return rows


# ---------------------------------------------------------------------------------------------
# tuning aid

def _candidates(M: int) -> list[SkinnyConfig]:
    if M == 1:  # the tl.dot-free kernel
        return [SkinnyConfig(block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=2, gemv=True)
                for bn, bk, sk, nw in itertools.product((4, 8, 16), (512, 1024, 2048), (1, 2, 4), (4, 8))]
    widths = (16, 32, 64, 128) if M <= 16 else (32, 64, 128)
    configs = [SkinnyConfig(block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=ns)
               for bn, bk, sk, nw, ns in itertools.product(widths, (64, 128, 256), (1, 2, 4, 8), (4, 8), (3, 4))]
    random.Random(0).shuffle(configs)  # a time budget then samples the whole space, not one corner
    return configs


def sweep(copy_gbps: float, budget_s: float = 480.0, rows_m: tuple[int, ...] = tuple(ROWS),
          shapes: tuple[tuple[int, int], ...] = tuple(SHAPES)) -> list[dict]:
    """Time cuBLAS, the heuristic's config and the candidates at each shape and M, for
    ``budget_s / (shapes x rows)`` seconds each at most (compiles included); returns all rows."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for N, K, M, weights, x in _cases(rows_m, shapes):
        ms = _per_product_ms(F.linear, x, weights)
        r = row("F.linear", f"M={M} N={N} K={K}", ms, _bytes(M, N, K), copy_gbps)
        rows.append({"M": M, "N": N, "K": K, "config": "cuBLAS", "default": True,
                     "us": r["us"], "GB/s": r["GB/s"], "frac_of_copy": r["frac_of_copy"]})
        default = skinny_config(M, N, K, DTYPE.itemsize, sms)
        t0 = time.time()
        for cfg in [default] + _candidates(M):
            if time.time() - t0 > budget_s / (len(shapes) * len(rows_m)):
                break
            op = lambda x, w, cfg=cfg: skinny_linear_triton(x, w, cfg)  # noqa: E731
            try:
                ms = _per_product_ms(op, x, weights)
            except Exception as exc:  # e.g. out of shared memory for a large tile
                rows.append({"M": M, "N": N, "K": K, "config": str(cfg), "error": type(exc).__name__})
                continue
            r = row("skinny_linear", f"M={M} N={N} K={K}", ms, _bytes(M, N, K), copy_gbps)
            rows.append({"M": M, "N": N, "K": K, "config": str(cfg), "default": cfg is default,
                         "us": r["us"], "GB/s": r["GB/s"], "frac_of_copy": r["frac_of_copy"]})
    return rows


if __name__ == "__main__":
    from tabulate import tabulate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time candidate launch configs instead")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds the sweep may take")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M to sweep, e.g. 1,10")
    parser.add_argument("--target-shapes", action="store_true", help="sweep only the target's six shapes")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    copy_gbps = copy_bandwidth_gbps()
    rows_m = tuple(int(m) for m in args.rows.split(","))
    shapes = tuple(SHAPES[:6]) if args.target_shapes else tuple(SHAPES)
    rows = sweep(copy_gbps, args.budget, rows_m, shapes) if args.sweep else run(copy_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "rows": rows}, f, indent=1)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s")
    if args.sweep:
        for (N, K), M in itertools.product(shapes, rows_m):
            ok = sorted((r for r in rows if (r["M"], r["N"], r["K"]) == (M, N, K) and "us" in r), key=lambda r: r["us"])
            print(tabulate(ok[:4] + [r for r in ok[4:] if r["default"]], headers="keys"))
    else:
        print(tabulate(rows, headers="keys"))
