"""Microbenchmark: ``lfmspark::skinny_linear`` against cuBLAS (``F.linear``) at the weight shapes of
LFM2.5-1.2B and its DSpark draft (bf16), for M = 1 (decode), 10 (verify) and 40 (verify, batch 4).

Bytes: the weight read once, plus ``x`` read and the output written. Each timed call runs the
product over as many copies of the weight as make ``_STREAM_BYTES`` (as a model's layers do), so
no call finds its weight in L2; the reported time is per product.

    python benchmarks/kernels/skinny_linear.py            # the report table
    python benchmarks/kernels/skinny_linear.py --sweep    # time candidate launch configs (tuning aid)

The sweep times, at each shape and M: cuBLAS, the default config (``skinny_config``), the swap-AB
heuristic (``swap_ab_config``, M > 1), then candidate configs until ``--budget`` runs out: a grid
over the swap-AB ``tl.dot`` kernel for M > 1 (the GEMV kernel for M = 1).
It goes config by config over all the cases (every case holds its weights), so a compiled kernel is
timed at every shape and split count before the next one is compiled: the budget buys compiles, and
the sampled configs are measured everywhere. ``--json`` records every timing with its full config
and a per-case summary (cuBLAS, default, best GEMV, best swap-AB, swap-AB heuristic).

    python benchmarks/kernels/skinny_linear.py --sweep --rows 10 --target-shapes --budget 75 --json sweep.json

``--swiglu`` times ``lfmspark::skinny_swiglu`` (gate/up product with the activation in its epilogue)
against the unfused pair it replaces, ``skinny_linear(x, w13)`` then ``silu(gate) * up`` (one
Inductor kernel, compiled as the served model compiles it), and cuBLAS + the same activation, at the
served ``w13`` shapes (LFM2.5-1.2B and its draft ``[16384, 2048]``, LFM2-8B-A1B dense layers
``[14336, 2048]``) for M = 9 (draft) and 10 (verify); with ``--sweep`` it also times the swap-AB
grid on the fused op (configs whose two weight tiles fit in shared memory) within ``--budget``:

    python benchmarks/kernels/skinny_linear.py --swiglu --json swiglu.json
    python benchmarks/kernels/skinny_linear.py --swiglu --sweep --budget 120 --json swiglu_sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import random
import time

import torch
import torch.nn.functional as F

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.linear.skinny_linear import (SkinnyConfig, skinny_config, skinny_linear_triton, skinny_swiglu_triton,
                                        split_k_plan, swap_ab_config, swiglu_config)

try:
    from .common import copy_bandwidth_gbps, row, time_ms
except ImportError:  # run as a script
    from common import copy_bandwidth_gbps, row, time_ms

DTYPE = torch.bfloat16
# (N, K): target in_proj (conv), out_proj, w1|w3, w2, qkv, LM head; draft fc, o_proj, w1|w3
SHAPES = [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (3072, 2048), (65536, 2048),
          (2048, 4096), (4096, 2048), (12288, 2048)]
ROWS = [1, 10, 40]
_STREAM_BYTES = 512 * 2**20  # weight bytes per timed call: far past the GPU's L2 (tens of MB)


def _weights(N: int, K: int) -> list[torch.Tensor]:
    n_copies = max(1, _STREAM_BYTES // (N * K * DTYPE.itemsize))
    gen = torch.Generator(device="cuda").manual_seed(N + K)
    return [(torch.randn(N, K, generator=gen, device="cuda") / K ** 0.5).to(DTYPE) for _ in range(n_copies)]


def _x(M: int, K: int) -> torch.Tensor:
    return torch.randn(M, K, device="cuda").to(DTYPE)


def _cases(rows_m=tuple(ROWS), shapes=tuple(SHAPES)):
    """``(N, K, M, weights, x)`` for every shape and row count (one weight set per shape)."""
    for N, K in shapes:
        weights = _weights(N, K)
        for M in rows_m:
            yield N, K, M, weights, _x(M, K)
        del weights


def _per_product_ms(fn, x: torch.Tensor, weights: list[torch.Tensor], iters: int = 50) -> float:
    def step():
        for w in weights:
            fn(x, w)
    return time_ms(step, iters=iters) / len(weights)


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

SPLITS = (1, 2, 4, 8)
_SMEM_LIMIT = 227 * 1024  # sm_90's shared memory per block: larger pipelines cannot launch


def _gemv_candidates() -> list[SkinnyConfig]:
    """The GEMV kernel's grid (M = 1)."""
    return [SkinnyConfig(block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=2, gemv=True)
            for bn, bk, sk, nw in itertools.product((4, 8, 16), (512, 1024, 2048), (1, 2, 4), (4, 8))]


def _swap_candidates() -> list[SkinnyConfig]:
    """The swap-AB kernel's grid (M > 1): 64/128-wide weight tiles (wgmma's A operand)."""
    return [SkinnyConfig(block_n=bn, block_k=bk, split_k=sk, num_warps=nw, num_stages=ns)
            for bn, bk, sk, ns, nw in itertools.product((64, 128), (64, 128, 256), SPLITS, (3, 4, 5), (4, 8))]


def _block_m(M: int) -> int:
    return max(16, 1 << (M - 1).bit_length())


def _smem_bytes(cfg: SkinnyConfig, M: int, elem_size: int = DTYPE.itemsize) -> int:
    """Pipeline buffers of a tl.dot kernel: ``num_stages`` weight and x tiles."""
    return cfg.num_stages * (cfg.block_n + _block_m(M)) * cfg.block_k * elem_size


def _kernel_key(cfg: SkinnyConfig) -> SkinnyConfig:
    """Configs with the same key differ only in the split count, a runtime argument except for
    whether K is split at all (the kernels' ``SPLIT`` constexpr): a group compiles two kernels."""
    return dataclasses.replace(cfg, split_k=1)


def _groups(configs: list[SkinnyConfig], seed: int = 0) -> list[list[SkinnyConfig]]:
    """``configs`` grouped by compiled kernel (splits ascending), the groups in a seeded random
    order: a time budget then samples the whole space, not one corner."""
    by_key: dict[SkinnyConfig, list[SkinnyConfig]] = {}
    for cfg in configs:
        by_key.setdefault(_kernel_key(cfg), []).append(cfg)
    groups = [sorted(g, key=lambda c: c.split_k) for g in by_key.values()]
    random.Random(seed).shuffle(groups)
    return groups


def _schedule(rows_m: tuple[int, ...]) -> list[tuple[str, list[SkinnyConfig]]]:
    """``(variant, group)`` in sweep order: the kernels' groups interleaved, two swap-AB groups per
    GEMV group. Each config appears once; it is timed at every case it applies to (``_applies``)."""
    queues: dict[str, list[list[SkinnyConfig]]] = {}
    if 1 in rows_m:
        queues["gemv"] = _groups(_gemv_candidates())
    if any(m > 1 for m in rows_m):
        queues["swap_ab"] = _groups(_swap_candidates())
    weight = {"swap_ab": 2, "gemv": 1}
    order = []
    while any(queues.values()):
        for variant, queue in queues.items():
            for _ in range(weight[variant]):
                if queue:
                    order.append((variant, queue.pop(0)))
    return order


def _variant(cfg: SkinnyConfig, M: int) -> str:
    return "gemv" if M == 1 and cfg.gemv else "swap_ab"


def _applies(cfg: SkinnyConfig, M: int, N: int, K: int, sms: int) -> bool:
    """Whether a grid config is worth timing at this case: the kernel family that M uses (GEMV for
    M = 1, the tl.dot kernel for M > 1), a tl.dot pipeline that fits in shared memory, a split
    count the launcher keeps as asked (otherwise it duplicates a smaller one), and no split when the column tiles alone give two
    programs per SM."""
    if (M == 1) != cfg.gemv:
        return False
    if not cfg.gemv and _smem_bytes(cfg, M) > _SMEM_LIMIT:
        return False
    if cfg.split_k > 1 and (split_k_plan(K, cfg.block_k, cfg.split_k)[1] != cfg.split_k
                            or -(-N // cfg.block_n) >= 2 * sms):
        return False
    return True


def _describe(r: dict) -> str:
    """A timing row's config, short: kernel, block_n, block_k, split_k, num_warps, num_stages."""
    if r["variant"] == "cuBLAS":
        return ""
    kind = "gemv" if r["gemv"] else "swap"
    return f"{kind} bn{r['block_n']} bk{r['block_k']} sk{r['split_k']} w{r['num_warps']} s{r['num_stages']}"


def _summary(rows: list[dict], cases: list[tuple[int, int, int]]) -> list[dict]:
    """Per case: cuBLAS, the default config, the best GEMV and swap-AB configs, the swap-AB heuristic."""
    out = []
    for M, N, K in cases:
        mine = [r for r in rows if (r["M"], r["N"], r["K"]) == (M, N, K) and "us" in r]
        s = {"M": M, "N": N, "K": K}
        for name, pick in [("cuBLAS", lambda r: r["variant"] == "cuBLAS"),
                           ("default", lambda r: r["role"] == "default"),
                           ("best_gemv", lambda r: r["variant"] == "gemv"),
                           ("best_swap_ab", lambda r: r["variant"] == "swap_ab"),
                           ("swap_heuristic", lambda r: r["role"] == "swap_heuristic")]:
            best = min((r for r in mine if pick(r)), key=lambda r: r["us"], default=None)
            s[f"{name}_us"] = best and best["us"]
            if name != "cuBLAS":  # the full repr (SkinnyConfig(block_n=..., ...)) and the short form
                s[f"{name}_config"] = best and best["config"]
                s[f"{name}_short"] = best and _describe(best)
        s["timed_gemv"] = sum(r["variant"] == "gemv" for r in mine)
        s["timed_swap_ab"] = sum(r["variant"] == "swap_ab" for r in mine)
        out.append(s)
    return out


def sweep(copy_gbps: float, budget_s: float = 480.0, rows_m: tuple[int, ...] = tuple(ROWS),
          shapes: tuple[tuple[int, int], ...] = tuple(SHAPES),
          iters: int = 25) -> tuple[list[dict], list[dict]]:
    """Time cuBLAS, the default config and the swap-AB heuristic at every case, then the grid
    (``_schedule``) until ``budget_s`` seconds have gone on it (compiles included); returns every
    timing (with its full config) and the per-case summary."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = {(N, K): _weights(N, K) for N, K in shapes}  # all resident: 512 MB a shape
    cases = [(M, N, K) for N, K in shapes for M in rows_m]
    xs = {(M, N, K): _x(M, K) for M, N, K in cases}
    rows = []

    def record(fn, M, N, K, variant, role, cfg=None):
        r = {"M": M, "N": N, "K": K, "variant": variant, "role": role, "config": str(cfg) if cfg else "cuBLAS"}
        if cfg is not None:
            splits = split_k_plan(K, cfg.block_k, cfg.split_k)[1]
            r.update(dataclasses.asdict(cfg), splits=splits, programs=-(-N // cfg.block_n) * splits)
        try:
            ms = _per_product_ms(fn, xs[M, N, K], weights[N, K], iters)
        except Exception as exc:  # e.g. out of shared memory for a large tile
            rows.append({**r, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"})
            return
        t = row(variant, f"M={M} N={N} K={K}", ms, _bytes(M, N, K), copy_gbps)
        rows.append({**r, "us": t["us"], "GB/s": t["GB/s"], "frac_of_copy": t["frac_of_copy"]})

    def skinny(cfg):
        return functools.partial(skinny_linear_triton, config=cfg)

    for M, N, K in cases:
        record(F.linear, M, N, K, "cuBLAS", "cuBLAS")
        cfg = skinny_config(M, N, K, DTYPE.itemsize, sms)
        record(skinny(cfg), M, N, K, _variant(cfg, M), "default", cfg)
        if M > 1:
            cfg = swap_ab_config(M, N, K, DTYPE.itemsize, sms)
            record(skinny(cfg), M, N, K, "swap_ab", "swap_heuristic", cfg)
    t0 = time.time()
    for variant, group in _schedule(rows_m):
        if time.time() - t0 > budget_s:
            break
        for (M, N, K), cfg in itertools.product(cases, group):
            if _applies(cfg, M, N, K, sms):
                record(skinny(cfg), M, N, K, variant, "candidate", cfg)
    print(f"sweep: {time.time() - t0:.0f} s on the grid, {len(rows)} timings")
    return rows, _summary(rows, cases)


def print_sweep(rows: list[dict], summary: list[dict]) -> None:
    """Per case the three fastest configs of each kernel family and the fixed rows (cuBLAS, default,
    swap-AB heuristic); then the failures; then the summary (short config names)."""
    from tabulate import tabulate

    keep = ("M", "N", "K", "variant", "role", "us", "frac_of_copy", "programs")
    for s in summary:
        ok = sorted((r for r in rows if (r["M"], r["N"], r["K"]) == (s["M"], s["N"], s["K"]) and "us" in r),
                    key=lambda r: r["us"])
        top = [r for v in ("gemv", "swap_ab") for r in [x for x in ok if x["variant"] == v][:3]]
        fixed = [r for r in ok if r["role"] != "candidate" and r not in top]
        print(tabulate([{**{k: r.get(k) for k in keep}, "config": _describe(r)}
                        for r in sorted(top + fixed, key=lambda r: r["us"])], headers="keys"))
    errors = [r for r in rows if "error" in r]
    if errors:
        print(f"{len(errors)} configs failed, e.g. {errors[0]['config']}: {errors[0]['error']}")
    print(tabulate([{k: v for k, v in s.items() if not k.endswith("_config")} for s in summary], headers="keys"))


# ---------------------------------------------------------------------------------------------
# SwiGLU: the fused gate/up product + activation against the unfused pair

# w13 [2F, H]: LFM2.5-1.2B (the target; its draft has the same shape), LFM2-8B-A1B's dense layers
SWIGLU_SHAPES = [(16384, 2048), (14336, 2048)]
SWIGLU_ROWS = [9, 10]


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    """The unfused activation after the gate/up product (models/layers.py ``SwiGLU``)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _swiglu_applies(cfg: SkinnyConfig, M: int, F_: int, K: int, sms: int) -> bool:
    """Whether a swap-AB grid config is worth timing on the fused op: both weight tiles' pipeline
    fits in shared memory, and a split count the launcher keeps, only when the ``F / BLOCK_N``
    programs alone give less than two per SM (as ``_applies``)."""
    if cfg.num_stages * (2 * cfg.block_n + _block_m(M)) * cfg.block_k * DTYPE.itemsize > _SMEM_LIMIT:
        return False
    if cfg.split_k > 1 and (split_k_plan(K, cfg.block_k, cfg.split_k)[1] != cfg.split_k
                            or -(-F_ // cfg.block_n) >= 2 * sms):
        return False
    return True


def swiglu_bench(copy_gbps: float, act, budget_s: float = 0.0, rows_m: tuple[int, ...] = tuple(SWIGLU_ROWS),
                 shapes: tuple[tuple[int, int], ...] = tuple(SWIGLU_SHAPES), iters: int = 25
                 ) -> tuple[list[dict], list[dict]]:
    """Per ``(w13 [2F, K], M)``: the fused op with its default config (``swiglu_config``), then
    ``skinny_linear`` + ``act`` and cuBLAS + ``act`` (``act``: the activation, compiled by the
    caller); with ``budget_s > 0`` the swap-AB grid on the fused op until the budget runs out.
    Bytes (for GB/s) are the fused op's: ``w13`` and ``x`` read once, ``[M, F]`` written. Returns
    every timing (with its config) and the per-case summary."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = {(N2, K): _weights(N2, K) for N2, K in shapes}
    cases = [(M, N2 // 2, K) for N2, K in shapes for M in rows_m]
    xs = {(M, F_, K): _x(M, K) for M, F_, K in cases}
    rows = []

    def record(fn, M, F_, K, variant, role, cfg=None):
        r = {"M": M, "F": F_, "K": K, "variant": variant, "role": role, "config": str(cfg) if cfg else variant}
        if cfg is not None:
            splits = split_k_plan(K, cfg.block_k, cfg.split_k)[1]
            r.update(dataclasses.asdict(cfg), splits=splits, programs=-(-F_ // cfg.block_n) * splits)
        try:
            ms = _per_product_ms(fn, xs[M, F_, K], weights[2 * F_, K], iters)
        except Exception as exc:  # e.g. out of shared memory
            rows.append({**r, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"})
            return
        n_bytes = (2 * F_ * K + M * K + M * F_) * DTYPE.itemsize
        t = row(variant, f"M={M} w13=[{2 * F_}, {K}]", ms, n_bytes, copy_gbps)
        rows.append({**r, "us": t["us"], "GB/s": t["GB/s"], "frac_of_copy": t["frac_of_copy"]})

    def fused(cfg):
        return functools.partial(skinny_swiglu_triton, config=cfg)

    def unfused(product):
        return lambda x, w: act(product(x, w))

    for M, F_, K in cases:
        cfg = swiglu_config(M, F_, K, DTYPE.itemsize, sms)
        record(fused(cfg), M, F_, K, "fused", "default", cfg)
        record(unfused(torch.ops.lfmspark.skinny_linear), M, F_, K, "skinny_linear+act", "unfused")
        record(unfused(F.linear), M, F_, K, "cuBLAS+act", "unfused")
    t0 = time.time()
    for group in (_groups(_swap_candidates()) if budget_s > 0 else []):
        if time.time() - t0 > budget_s:
            break
        for (M, F_, K), cfg in itertools.product(cases, group):
            if _swiglu_applies(cfg, M, F_, K, sms):
                record(fused(cfg), M, F_, K, "fused", "candidate", cfg)
    summary = []
    for M, F_, K in cases:
        mine = [r for r in rows if (r["M"], r["F"], r["K"]) == (M, F_, K) and "us" in r]
        s = {"M": M, "w13": f"[{2 * F_}, {K}]"}
        for name, pick in [("fused_default", lambda r: r["role"] == "default"),
                           ("best_fused", lambda r: r["variant"] == "fused"),
                           ("skinny_linear+act", lambda r: r["variant"] == "skinny_linear+act"),
                           ("cuBLAS+act", lambda r: r["variant"] == "cuBLAS+act")]:
            best = min((r for r in mine if pick(r)), key=lambda r: r["us"], default=None)
            s[f"{name}_us"] = best and best["us"]
            if name in ("fused_default", "best_fused"):
                s[f"{name}_config"] = best and best["config"]
                s[f"{name}_short"] = best and _describe(best)
        s["timed_fused"] = sum(r["variant"] == "fused" for r in mine)
        summary.append(s)
    return rows, summary


def print_swiglu(rows: list[dict], summary: list[dict]) -> None:
    """Per case the fixed rows and the three fastest grid configs; the failures; the summary."""
    from tabulate import tabulate

    keep = ("M", "F", "K", "variant", "role", "us", "frac_of_copy", "programs")
    for s in summary:
        ok = sorted((r for r in rows if (r["M"], f"[{2 * r['F']}, {r['K']}]") == (s["M"], s["w13"]) and "us" in r),
                    key=lambda r: r["us"])
        shown = [r for r in ok if r["role"] != "candidate"] + [r for r in ok if r["role"] == "candidate"][:3]
        print(tabulate([{**{k: r.get(k) for k in keep}, "config": _describe(r) if "block_n" in r else ""}
                        for r in sorted(shown, key=lambda r: r["us"])], headers="keys"))
    errors = [r for r in rows if "error" in r]
    if errors:
        print(f"{len(errors)} configs failed, e.g. {errors[0]['config']}: {errors[0]['error']}")
    print(tabulate([{k: v for k, v in s.items() if not k.endswith("_config")} for s in summary], headers="keys"))


if __name__ == "__main__":
    from tabulate import tabulate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time candidate launch configs instead")
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds the sweep's grid may take (the fixed rows, setup and first compiles come on top)")
    parser.add_argument("--rows", help=f"row counts M, e.g. 1,10 (default {','.join(map(str, ROWS))}; "
                                       f"with --swiglu {','.join(map(str, SWIGLU_ROWS))})")
    parser.add_argument("--swiglu", action="store_true",
                        help="the fused skinny_swiglu against skinny_linear + activation at the served w13 shapes "
                             "(with --sweep: also its config grid)")
    parser.add_argument("--target-shapes", action="store_true", help="sweep only the target's six shapes")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    copy_gbps = copy_bandwidth_gbps()
    rows_m = tuple(int(m) for m in args.rows.split(",")) if args.rows else tuple(SWIGLU_ROWS if args.swiglu else ROWS)
    shapes = tuple(SHAPES[:6]) if args.target_shapes else tuple(SHAPES)
    summary = None
    if args.swiglu:
        from lfmspark.graphs.compile import configure_compile

        configure_compile(n_variants=len(rows_m) * len(SWIGLU_SHAPES))  # Inductor (and its PDL) as served
        act = torch.compile(_silu_mul, fullgraph=True, dynamic=False)
        rows, summary = swiglu_bench(copy_gbps, act, args.budget if args.sweep else 0.0, rows_m)
    elif args.sweep:
        rows, summary = sweep(copy_gbps, args.budget, rows_m, shapes)
    else:
        rows = run(copy_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy_gbps, "sms": torch.cuda.get_device_properties(0).multi_processor_count,
                       "budget_s": args.budget, "summary": summary, "rows": rows}, f, indent=1)
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s")
    if args.swiglu:
        print_swiglu(rows, summary)
    elif args.sweep:
        print_sweep(rows, summary)
    else:
        print(tabulate(rows, headers="keys"))
