"""Microbenchmark: ``lfmspark::add_rmsnorm_gemv`` (residual add + RMSNorm + one-row GEMV, or the
SwiGLU gate/up GEMV, in one kernel) against the unfused decode path it replaces: the add and
RMSNorm as one Inductor kernel (what the compiled layer runs: ``s = h + delta`` and the normalised
row) followed by ``lfmspark::skinny_linear`` / ``lfmspark::skinny_swiglu`` (bf16, batch 1).

Shapes: the one-row products that follow a norm in LFM2.5-1.2B (``in_proj``, ``qkv_proj``, the
gate/up GEMV, the LM head; K = 2048) and LFM2-350M (K = 1024), plus LFM2-2.6B's wider FFN.
Bytes: the weight read once, plus ``h``, ``delta`` and the norm weight read and ``s`` and ``y``
written (the fused kernel re-reads ``h``/``delta``/norm weight per program, from L2; not counted).
Each timed call runs the product over as many copies of the weight as make ``_STREAM_BYTES`` (as
a model's layers do), so no call finds its weight in L2; graph-replayed; the time is per product.

    python benchmarks/kernels/add_rmsnorm_gemv.py                      # fused vs unfused table
    python benchmarks/kernels/add_rmsnorm_gemv.py --sweep              # block_n x num_warps per shape
    python benchmarks/kernels/add_rmsnorm_gemv.py --sweep --block-n 2,4,8,16 --num-warps 4,8,16 --json out.json

What to sweep: ``block_n`` (output columns per program; gate columns, each with its up column,
for SwiGLU) 2/4/8/16 — wider tiles re-read the ``[K]`` input vectors (h, delta, norm weight: 3 x 4
KB at K = 2048) from L2 less often per weight byte — and ``num_warps`` 4/8/16. The defaults (8
plain, 4 SwiGLU, 8 warps: ``ops/add_rmsnorm_gemv.launch_params``) are the sweep's winners.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.linear.add_rmsnorm_gemv import add_rmsnorm_gemv_triton, launch_params, rmsnorm_reference

try:
    from .common import copy_bandwidth_gbps, row, time_ms
except ImportError:  # run as a script
    from common import copy_bandwidth_gbps, row, time_ms

DTYPE = torch.bfloat16
EPS = 1e-5
# (name, N, K, swiglu): N is the output width (F, the gate/up width, for SwiGLU: weight [2F, K])
SHAPES = [
    ("1.2B in_proj", 6144, 2048, False), ("1.2B qkv_proj", 3072, 2048, False),
    ("1.2B w13 swiglu", 8192, 2048, True), ("1.2B lm_head", 65536, 2048, False),
    ("350M in_proj", 3072, 1024, False), ("350M qkv_proj", 2048, 1024, False),
    ("350M w13 swiglu", 4608, 1024, True), ("350M lm_head", 65536, 1024, False),
    ("2.6B w13 swiglu", 10752, 2048, True),
]
_STREAM_BYTES = 512 * 2**20  # weight bytes per timed call: far past the GPU's L2 (tens of MB)


def _case(N: int, K: int, swiglu: bool):
    """``(h, delta, norm_weight, weights)``: one row and enough weight copies to stream from HBM."""
    rows = 2 * N if swiglu else N
    n_copies = max(1, _STREAM_BYTES // (rows * K * DTYPE.itemsize))
    gen = torch.Generator(device="cuda").manual_seed(N + K)
    h = torch.randn(1, K, generator=gen, device="cuda").to(DTYPE)
    delta = torch.randn(1, K, generator=gen, device="cuda").to(DTYPE)
    norm_weight = (1 + 0.2 * torch.randn(K, generator=gen, device="cuda")).to(DTYPE)
    weights = [(torch.randn(rows, K, generator=gen, device="cuda") / K ** 0.5).to(DTYPE) for _ in range(n_copies)]
    return h, delta, norm_weight, weights


def _bytes(N: int, K: int, swiglu: bool) -> int:
    return ((2 * N if swiglu else N) * K + 5 * K + N) * DTYPE.itemsize


@torch.compile(fullgraph=True, dynamic=False)
def _add_rmsnorm(h: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor):
    """The unfused path's first kernel: the compiled layer's residual add fused into its RMSNorm."""
    s = h + delta
    return s, rmsnorm_reference(s, norm_weight, EPS)


def _per_product_ms(step_one, weights: list[torch.Tensor]) -> float:
    def step():
        for w in weights:
            step_one(w)
    return time_ms(step) / len(weights)


def _fused(h, delta, norm_weight, swiglu, **launch):
    if launch:
        return lambda w: add_rmsnorm_gemv_triton(h, delta, norm_weight, EPS, w, swiglu, **launch)
    return lambda w: torch.ops.lfmspark.add_rmsnorm_gemv(h, delta, norm_weight, EPS, w, swiglu)


def _unfused(h, delta, norm_weight, swiglu):
    gemv = torch.ops.lfmspark.skinny_swiglu if swiglu else torch.ops.lfmspark.skinny_linear

    def one(w):
        _, x = _add_rmsnorm(h, delta, norm_weight)
        return gemv(x, w)
    return one


def _check(h, delta, norm_weight, weight, swiglu) -> float:
    """Relative error of the fused op against the unfused path (bf16 noise expected, ~1e-3)."""
    _, y = torch.ops.lfmspark.add_rmsnorm_gemv(h, delta, norm_weight, EPS, weight, swiglu)
    want = _unfused(h, delta, norm_weight, swiglu)(weight)
    return ((y.float() - want.float()).norm() / want.float().norm()).item()


def run(copy_gbps: float, shapes=tuple(SHAPES)) -> list[dict]:
    rows = []
    for name, N, K, swiglu in shapes:
        h, delta, norm_weight, weights = _case(N, K, swiglu)
        shape = f"{name}: N={N} K={K}" + (" (x2 gate/up)" if swiglu else "")
        n_bytes = _bytes(N, K, swiglu)
        block_n, _, num_warps = launch_params(K, swiglu)
        fused = _per_product_ms(_fused(h, delta, norm_weight, swiglu), weights)
        rows.append(row("add_rmsnorm_gemv", shape, fused, n_bytes, copy_gbps, block_n=block_n, num_warps=num_warps,
                        rel_err=round(_check(h, delta, norm_weight, weights[0], swiglu), 5)))
        unfused = _per_product_ms(_unfused(h, delta, norm_weight, swiglu), weights)
        gemv = "skinny_swiglu" if swiglu else "skinny_linear"
        rows.append(row(f"add+rmsnorm (Inductor) + {gemv}", shape, unfused, n_bytes, copy_gbps,
                        saved_us=round((unfused - fused) * 1e3, 2)))
        del weights
    return rows


def sweep(copy_gbps: float, block_ns: tuple[int, ...], warps: tuple[int, ...], shapes=tuple(SHAPES)) -> list[dict]:
    """Time every ``block_n x num_warps`` launch of the fused kernel at each shape (``num_warps`` 0 =
    the default rule), next to the default launch and the unfused path."""
    rows = []
    for name, N, K, swiglu in shapes:
        h, delta, norm_weight, weights = _case(N, K, swiglu)
        n_bytes = _bytes(N, K, swiglu)
        base = {"shape": name, "N": N, "K": K, "swiglu": swiglu}
        ms = _per_product_ms(_unfused(h, delta, norm_weight, swiglu), weights)
        r = row("unfused", name, ms, n_bytes, copy_gbps)
        rows.append({**base, "config": "unfused", "default": True, "us": r["us"], "GB/s": r["GB/s"],
                     "frac_of_copy": r["frac_of_copy"]})
        default = launch_params(K, swiglu)
        for bn, nw in itertools.product(block_ns, warps):
            bn, _, nw = launch_params(K, swiglu, bn, nw or None)
            config = f"block_n={bn} num_warps={nw}"
            if any(x["shape"] == name and x["config"] == config for x in rows):
                continue
            try:
                ms = _per_product_ms(_fused(h, delta, norm_weight, swiglu, block_n=bn, num_warps=nw), weights)
            except Exception as exc:  # e.g. out of registers / resources for a wide tile
                rows.append({**base, "config": config, "error": type(exc).__name__})
                continue
            r = row("add_rmsnorm_gemv", name, ms, n_bytes, copy_gbps)
            rows.append({**base, "config": config, "default": (bn, nw) == (default[0], default[2]),
                         "us": r["us"], "GB/s": r["GB/s"], "frac_of_copy": r["frac_of_copy"]})
        del weights
    return rows


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


if __name__ == "__main__":
    from tabulate import tabulate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time block_n x num_warps launches instead")
    parser.add_argument("--block-n", default="2,4,8,16", help="sweep: output columns per program")
    parser.add_argument("--num-warps", default="0,4,8,16", help="sweep: warps per program (0 = the default, NUM_WARPS)")
    parser.add_argument("--shapes", help="only the shapes whose name contains one of these, e.g. 1.2B,lm_head")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    shapes = tuple(SHAPES)
    if args.shapes:
        keys = args.shapes.split(",")
        shapes = tuple(s for s in SHAPES if any(k in s[0] for k in keys))
    copy_gbps = copy_bandwidth_gbps()
    if args.sweep:
        rows = sweep(copy_gbps, _ints(args.block_n), _ints(args.num_warps), shapes)
    else:
        rows = run(copy_gbps, shapes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "rows": rows}, f, indent=1)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s")
    if args.sweep:
        for name, *_ in shapes:
            ok = sorted((r for r in rows if r["shape"] == name and "us" in r), key=lambda r: r["us"])
            print(tabulate(ok[:5] + [r for r in ok[5:] if r["default"]], headers="keys"))
    else:
        print(tabulate(rows, headers="keys"))
