"""Microbenchmark: ``lfmspark::exact_linear`` (exact mode's batch-invariant product) against the
default mode's product (``skinny_linear`` up to 16 rows, cuBLAS past) and cuBLAS, at the exact-mode
weight shapes of LFM2.5-1.2B and LFM2-8B-A1B (their attention, conv and dense products and the LM
head; bf16; on the stacked gate/up weights also ``exact_swiglu``, the product with its activation,
against the product followed by the activation), for M = 1 and 8 (target-only decode at batch 1
and 8) and 10 and 80 (a 10-token verify at batch 1 and 8).

Bytes and timing as benchmarks/kernels/skinny_linear.py (the weight streamed from DRAM each call).

    python benchmarks/kernels/exact_linear.py                      # the report table
    python benchmarks/kernels/exact_linear.py --sweep --budget 90  # candidate plans (tuning aid)
    python benchmarks/kernels/exact_linear.py --sweep --vary row_programs num_stages   # around the default

A plan must be one for every ``M`` (that is what makes the op batch-invariant), so the sweep times
candidate rules (``exact_config``'s constants) at every shape and ``M`` and ranks them by their
time summed over the ``M``s, per shape and per decoded token; it also prints each ``M``'s own best,
the price of one plan for all.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import time

import torch
import torch.nn.functional as F

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.linear.exact_linear import ExactConfig, _stages_that_fit, exact_config, exact_linear_triton
from lfmspark.ops.routing import FEW_ROWS

try:
    from .common import copy_bandwidth_gbps, row
    from .skinny_linear import _SMEM_LIMIT, DTYPE, _bytes, _per_product_ms, _weights, _x
except ImportError:  # run as a script
    from common import copy_bandwidth_gbps, row
    from skinny_linear import _SMEM_LIMIT, DTYPE, _bytes, _per_product_ms, _weights, _x

# (N, K): conv in_proj, out_proj, w1|w3 (1.2B), w2 (1.2B), qkv, LM head, w1|w3 and w2 of the 8B's dense layers
SHAPES = [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (3072, 2048), (65536, 2048),
          (14336, 2048), (2048, 7168)]
ROWS = [1, 8, 10, 80]
SWIGLU_SHAPES = {(16384, 2048), (14336, 2048)}   # the stacked gate/up weights: exact_swiglu timed on them too


def _exact_linear_then_swiglu(x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    # exact mode's SwiGLU before exact_swiglu: the stacked product, then the activation (eager here:
    # two kernels, where the model's compiled graph fuses them into one)
    gate, up = torch.ops.lfmspark.exact_linear(x, w13).chunk(2, dim=-1)
    return F.silu(gate) * up


def run(copy_gbps: float, rows_m=tuple(ROWS), shapes=tuple(SHAPES)) -> list[dict]:
    rows = []
    for N, K in shapes:
        weights = _weights(N, K)
        cfg = exact_config(N, K)
        for M in rows_m:
            x, shape = _x(M, K), f"M={M} N={N} K={K} bf16"
            products = [("exact_linear", torch.ops.lfmspark.exact_linear), ("default mode", _default_product(M)),
                        ("F.linear (cuBLAS)", F.linear)]
            if (N, K) in SWIGLU_SHAPES:
                products += [("exact_swiglu", torch.ops.lfmspark.exact_swiglu),
                             ("exact_linear + silu*up", _exact_linear_then_swiglu)]
            for name, fn in products:
                exact = name in ("exact_linear", "exact_swiglu")
                extra = dict(block_n=cfg.block_n, block_k=cfg.block_k, splits=cfg.splits) if exact else {}
                rows.append(row(name, shape, _per_product_ms(fn, x, weights), _bytes(M, N, K), copy_gbps, **extra))
        del weights
    return rows


# a rule's constants (exact_config's keywords): K step, column tile width, the column tiles from which
# a product is not split, the programs a split product aims for, the K steps a split sums at least,
# warps, stages, the programs a launch of several row tiles aims for
RULES = [dict(block_k=bk, block_n=bn, unsplit_tiles=ut, target_programs=tp, min_split_steps=ms, num_warps=nw,
              num_stages=ns, row_programs=rp)
         for bk, bn, ut, tp, ms, nw, ns, rp in itertools.product((128, 256), (32, 64, 128), (32, 48, 64, 96, 1 << 20),
                                                               (128, 256), (2, 4), (4, 8), (3, 4), (0, 132, 264))]
DEFAULT_RULE = {key: exact_config.__kwdefaults__[key] for key in RULES[0]}   # the rule the op uses
# products per decoded token of LFM2.5-1.2B (10 conv and 6 attention layers, 16 dense FFNs, one LM
# head) and of LFM2-8B-A1B's two dense FFNs: the weights of a rule's total
USES = {(6144, 2048): 10, (2048, 2048): 16, (16384, 2048): 16, (2048, 8192): 16, (3072, 2048): 6,
        (65536, 2048): 1, (14336, 2048): 2, (2048, 7168): 2}


def _default_product(M: int):
    """The default mode's product of ``M`` rows (ops/routing.py): skinny_linear up to ``FEW_ROWS``, cuBLAS past."""
    return torch.ops.lfmspark.skinny_linear if M <= FEW_ROWS else F.linear


def _fits(rule: dict) -> bool:
    # a rule whose one-row-tile launch gets its whole pipeline depth (the op would run it shallower:
    # ops/linear/exact_linear.py _stages_that_fit, which counts the buffers Triton keeps)
    cfg = ExactConfig(rule["block_n"], rule["block_k"], 1, 1, num_stages=rule["num_stages"])
    return _stages_that_fit(cfg, 1, DTYPE.itemsize, _SMEM_LIMIT) == rule["num_stages"]


def _short(rule: dict) -> str:
    return (f"bk{rule['block_k']} bn{rule['block_n']} ut{rule['unsplit_tiles']} "
            f"tp{rule['target_programs']} ms{rule['min_split_steps']} w{rule['num_warps']} s{rule['num_stages']} "
            f"rp{rule['row_programs']}")


def sweep(copy_gbps: float, budget_s: float, rows_m=tuple(ROWS), shapes=tuple(SHAPES), iters: int = 20,
          seed: int = 0, vary: tuple[str, ...] = ()) -> list[dict]:
    """The default rule, then rules in a seeded random order until ``budget_s`` is spent, each timed
    at every shape and ``M`` (one compile serves every shape). Returns one row per (rule, shape) with
    its plan's time per ``M``, plus the default mode's product per shape. ``vary``: only the rules
    that differ from the default in these constants (all rules when empty)."""
    weights = {(N, K): _weights(N, K) for N, K in shapes}  # all resident: 512 MB a shape
    xs = {(M, K): _x(M, K) for M in rows_m for _, K in shapes}
    default = DEFAULT_RULE
    rules = [r for r in RULES if _fits(r) and r != default
             and (not vary or all(r[key] == default[key] for key in r if key not in vary))]
    random.Random(seed).shuffle(rules)
    timed: dict[tuple, float] = {}   # (shape, plan, M) -> ms: rules that give a shape the same plan share it
    results = []
    for N, K in shapes:  # the price of exactness
        r = {"rule": "default mode", "N": N, "K": K}
        for M in rows_m:
            r[f"us_M{M}"] = round(_per_product_ms(_default_product(M), xs[M, K], weights[N, K]) * 1e3, 2)
        results.append(r)
    t0 = time.time()
    for i, rule in enumerate([default] + rules):
        if i and time.time() - t0 > budget_s:
            break
        for N, K in shapes:
            cfg = exact_config(N, K, **rule)
            r = {"rule": _short(rule), "default": rule == default, "N": N, "K": K, "splits": cfg.splits}
            try:
                for M in rows_m:
                    key = (N, K, cfg, M)
                    if key not in timed:
                        fn = functools.partial(exact_linear_triton, config=cfg)
                        timed[key] = _per_product_ms(fn, xs[M, K], weights[N, K], iters)
                    r[f"us_M{M}"] = round(timed[key] * 1e3, 2)
                    r[f"frac_M{M}"] = row("", "", timed[key], _bytes(M, N, K), copy_gbps)["frac_of_copy"]
            except Exception as exc:  # e.g. out of shared memory on this device
                r["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            results.append(r)
    print(f"sweep: {time.time() - t0:.0f} s, {len({r['rule'] for r in results})} rules")
    return results


def print_sweep(results: list[dict], rows_m=tuple(ROWS)) -> None:
    """Per shape the five fastest rules by summed time over the Ms (with the default rule and the
    default mode), each M's own best; then the rules ranked by the per-token total (``USES``)."""
    from tabulate import tabulate

    cols = [f"us_M{M}" for M in rows_m]
    complete = [r for r in results if all(c in r for c in cols)]
    for r in complete:
        r["us_sum"] = round(sum(r[c] for c in cols), 2)
    for N, K in dict.fromkeys((r["N"], r["K"]) for r in results):
        mine = [r for r in complete if (r["N"], r["K"]) == (N, K)]
        ranked = sorted((r for r in mine if not r["rule"].startswith("default mode")), key=lambda r: r["us_sum"])
        fixed = [r for r in mine if r.get("default") or r["rule"].startswith("default mode")]
        print(f"--- N={N} K={K}: {len(ranked)} rules timed")
        print(tabulate([{k: r.get(k) for k in ["rule", "splits"] + cols + ["us_sum"]}
                        for r in ranked[:5] + [r for r in fixed if r not in ranked[:5]]], headers="keys"))
        for c in cols:
            best = min(ranked, key=lambda r: r[c], default=None)
            if best:
                print(f"  best at M={c[4:]}: {best['rule']} {best[c]} us")
    totals = {}
    for r in complete:
        t = totals.setdefault(r["rule"], {"rule": r["rule"], "shapes": 0, **{c: 0.0 for c in cols}})
        t["shapes"] += 1
        for c in cols:
            t[c] = round(t[c] + USES.get((r["N"], r["K"]), 1) * r[c], 1)
    n_shapes = max(t["shapes"] for t in totals.values())
    ranked = sorted((t for t in totals.values() if t["shapes"] == n_shapes), key=lambda t: sum(t[c] for c in cols))
    print("--- per-token totals (us, products weighted by their uses a token)")
    print(tabulate(ranked[:10] + [t for t in ranked[10:] if t["rule"].startswith("default mode") or
                                  t["rule"] == _short(DEFAULT_RULE)],
                   headers="keys"))
    errors = [r for r in results if "error" in r]
    if errors:
        print(f"{len(errors)} plans failed, e.g. {errors[0]['rule']}: {errors[0]['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time candidate plans (tuning aid)")
    parser.add_argument("--budget", type=float, default=90.0, help="seconds of the sweep (compiles included)")
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS, help="M values")
    parser.add_argument("--vary", nargs="+", default=(), choices=sorted(DEFAULT_RULE), metavar="CONSTANT",
                        help="sweep only these constants of the rule, the others at their defaults")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    copy_gbps = copy_bandwidth_gbps()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s")
    if args.sweep:
        results = sweep(copy_gbps, args.budget, tuple(args.rows), vary=tuple(args.vary))
        print_sweep(results, tuple(args.rows))
    else:
        from tabulate import tabulate

        results = run(copy_gbps, tuple(args.rows))
        print(tabulate(results, headers="keys"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
