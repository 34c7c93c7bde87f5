"""Probe: the batch-1 feed-forward (SwiGLU gate/up product, then the down projection) in ONE launch.

Why: at batch 1 the speculative round runs each feed-forward of ~10 rows as two launches,
``lfmspark::skinny_swiglu`` then ``lfmspark::skinny_linear``; on the H200 each costs ~6 us more than
reading its weights at copy bandwidth, mostly launch hand-off. This script measures whether one
launch per feed-forward gets closer to that floor. It is a probe, not a library op (ops/ is untouched).

Kernel (``_ffn_fused_kernel``): P = F / BLOCK_F programs; program p owns the intermediate columns
[p * BLOCK_F, (p + 1) * BLOCK_F). It streams its gate and up rows of ``w13 [2F, H]`` (swap-AB ``tl.dot``:
the weight tile is the MMA's A operand, x's rows padded to BLOCK_M >= 16 its B), applies the SwiGLU
epilogue with skinny_swiglu's roundings (gate, up, silu(gate) and the product each rounded to bf16), so
its ``h [M, BLOCK_F]`` slice is bit-identical to the two-launch path's, and keeps h in registers. Then for
every column tile c (BLOCK_N columns of H) it multiplies ``w2[c tile, its slice] @ h^T`` and stores
the fp32 partial to the workspace ``ws [P, M, H]``. The down projection is thus split-K over the P slices
and reduced as in ops/skinny_linear.py ("serial split-K fix-up"): after storing a group of GROUP tiles
the program bumps their arrival counters (one acq_rel atomic per tile, issued together), and the program
arriving last at tile c sums its P partials in slice order 0..P-1 (deterministic whatever the arrival
order), stores ``out[:, c tile]`` in bf16 and resets the counter (a CUDA graph replays it with no memset).
Program p visits the tiles in the rotated order c = (p + i) % n_tiles so that the last arrivals, and with
them the reductions, are spread over the programs. No grid barrier: it also runs under TRITON_INTERPRET=1.

    TRITON_INTERPRET=1 python benchmarks/kernels/ffn_fused_probe.py --check    # CPU, small shapes
    python benchmarks/kernels/ffn_fused_probe.py --check --time --json ffn_fused.json   # H200
    python benchmarks/kernels/ffn_fused_probe.py --check --time --group 1,2,4 --block-n 32,64 --prefetch 0,1 \
        --num-warps 4,8 --json ffn_fused_sweep.json   # H200, the knobs

``--time`` (CUDA): a chain of L = 16 feed-forwards with distinct weights (nothing stays in L2), each
layer's output the next one's input, captured in a CUDA graph (a) as the two real ops and (b) as the
fused kernel; per-layer microseconds against the floor (w13 + w2 bytes / measured copy bandwidth).
``--block-f``, ``--block-n``, ``--block-k``, ``--group``, ``--prefetch``, ``--num-warps``, ``--num-stages``
take comma-separated lists: every combination is timed.

Measured (H200, docs/benchmarks.md session 19): 70-165 us per layer across 24 configurations against
24-29 us for the two launches (floors 18-24 us): the one-launch form without a grid barrier lost at
every setting, so it stays a probe.

Performance notes (from the sm90 compile, before the measurement): Triton software-pipelines the gate/up K loop
(cp.async, num_stages deep) but not the down loop, whose body holds the barrier, the atomics and the
conditional reductions; so the w2 loads there are plain loads, and PREFETCH=1 issues the next group's block
before the current group's store and arrival round trip to hide part of that latency. A group is loaded
as one ``[GROUP * BLOCK_N, BLOCK_F]`` block and multiplied by one ``tl.dot``; larger groups mean fewer
arrival round trips per program (n_tiles / GROUP) but reductions concentrated on fewer programs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lfmspark.ops._dispatch import pdl_kwargs  # noqa: E402  (importing lfmspark.ops registers its ops)
from lfmspark.ops.skinny_linear import _sum_partials, skinny_linear_reference, skinny_swiglu_reference  # noqa: E402


DTYPE = torch.bfloat16
SERVED = {"verify": (10, 2048, 8192), "draft": (10, 2048, 6144)}  # (M, H, F): LFM2.5-1.2B and its draft


@dataclass(frozen=True)
class FusedConfig:
    block_f: int = 64    # intermediate columns per program: P = F / block_f programs
    block_n: int = 64    # output columns per tile of the down projection (one arrival counter each)
    block_k: int = 128   # K step of the gate/up product
    group: int = 1       # tiles stored between two counter bumps (one atomic round trip, one tl.dot per group)
    prefetch: int = 1    # 1: the next group's w2 block is loaded before this group's store/arrival/reductions
    num_warps: int = 4
    num_stages: int = 3


# ---------------------------------------------------------------------------------------------
# kernel

@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    # acc += a @ b. UPCAST: the Triton 3.9 interpreter multiplies bf16 dot operands as raw integers
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def _swiglu_rounded(gate, up, dtype: tl.constexpr):
    # skinny_swiglu's roundings on fp32 sums: gate and up each rounded once (as F.linear), silu(gate)
    # rounded, the product rounded: h is bit-identical to the two-launch path's
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (act * u).to(dtype)


@triton.jit
def _ffn_fused_kernel(
    x_ptr, w13_ptr, w2_ptr, out_ptr, ws_ptr, cnt_ptr, h_ptr,
    M, H, F, n_tiles,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, PREFETCH: tl.constexpr, STORE_H: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    # x [M, H], w13 [2F, H], w2 [H, F], out [M, H] row-major; ws [P, M, H] fp32; cnt [n_tiles] int32,
    # all zero between launches; STORE_H: also write h [M, F] (the check's bit-exact comparison).
    # Host contract: F % BLOCK_F == 0, H % BLOCK_K == 0, H % BLOCK_N == 0, n_tiles % GROUP == 0
    if PDL == 1:  # the next kernel's programs may launch now (ops/_dispatch.py)
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    n_slices = tl.num_programs(0)
    dtype = out_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    fs = pid * BLOCK_F + tl.arange(0, BLOCK_F)
    ks = tl.arange(0, BLOCK_K)

    # gate/up: g^T, u^T [BLOCK_F, BLOCK_M] = w13 slice [BLOCK_F, H] @ x^T, fp32. The first K block is
    # peeled: weights depend on no earlier kernel and are requested before the PDL wait, x after it
    g_ptrs = w13_ptr + fs.to(tl.int64)[:, None] * H + ks[None, :]
    u_ptrs = w13_ptr + (fs + F).to(tl.int64)[:, None] * H + ks[None, :]
    x_ptrs = x_ptr + rows[:, None] * H + ks[None, :]
    wg = tl.load(g_ptrs)
    wu = tl.load(u_ptrs)
    if PDL:
        tl.extra.cuda.gdc_wait()
    xt = tl.trans(tl.load(x_ptrs, mask=row_ok[:, None], other=0.0))
    acc_g = _mma(wg, xt, tl.zeros((BLOCK_F, BLOCK_M), dtype=tl.float32), UPCAST)
    acc_u = _mma(wu, xt, tl.zeros((BLOCK_F, BLOCK_M), dtype=tl.float32), UPCAST)
    for _ in range(BLOCK_K, H, BLOCK_K):
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        wg = tl.load(g_ptrs)
        wu = tl.load(u_ptrs)
        xt = tl.trans(tl.load(x_ptrs, mask=row_ok[:, None], other=0.0))
        acc_g = _mma(wg, xt, acc_g, UPCAST)
        acc_u = _mma(wu, xt, acc_u, UPCAST)
    h = _swiglu_rounded(acc_g, acc_u, dtype)  # h^T [BLOCK_F, BLOCK_M]: the down product's B operand as is
    if STORE_H:
        tl.store(h_ptr + rows[None, :] * F + fs[:, None], h, mask=row_ok[None, :])
    if PDL == 2:  # late trigger: the gate/up weights are read
        tl.extra.cuda.gdc_launch_dependents()

    # down: per group of GROUP consecutive tiles (rotated: tiles (pid + i0 + t) % n_tiles), one block
    # w2[group rows, slice] [GROUP * BLOCK_N, BLOCK_F] @ h^T -> partial^T, stored to ws[pid, :, group columns]
    rs = tl.arange(0, GROUP * BLOCK_N)
    gs = tl.arange(0, GROUP)
    part_mask = (rs < GROUP * BLOCK_N)[:, None] & row_ok[None, :]
    stride_p = M * H
    w2 = _load_w2_group(w2_ptr, fs, pid, 0, n_tiles, F, BLOCK_N, GROUP)
    for i0 in range(0, n_tiles, GROUP):
        if PREFETCH:  # the next group's block is requested before this group's store, arrival and reductions
            w2_next = _load_w2_group(w2_ptr, fs, pid, i0 + GROUP, n_tiles, F, BLOCK_N, GROUP)
        part = _mma(w2, h, tl.zeros((GROUP * BLOCK_N, BLOCK_M), dtype=tl.float32), UPCAST)
        cols = _group_cols(pid, i0, n_tiles, BLOCK_N, GROUP)
        tl.store(ws_ptr + pid * stride_p + rows[None, :] * H + cols[:, None], part, mask=part_mask)
        # arrival (ops/skinny_linear.py, "Synchronization"): the barrier orders every thread's partial
        # stores before the increments, whose release (gpu scope) publishes them; their acquire makes the
        # other programs' partials visible. The GROUP increments go out together: one round trip
        tl.debug_barrier()
        cs = (pid + i0 + gs) % n_tiles
        arrived = tl.atomic_add(cnt_ptr + cs, tl.full((GROUP,), 1, tl.int32), sem="acq_rel", scope="gpu")
        last = (arrived == n_slices - 1).to(tl.int32)
        tl.debug_barrier()  # every thread's partial loads below come after the acquiring thread's atomic
        for j in tl.static_range(GROUP):
            # tl.sum broadcasts the flag to the whole CTA (through shared memory): a uniform branch
            if tl.sum(tl.where(gs == j, last, 0)) > 0:
                c = (pid + i0 + j) % n_tiles
                tile_offs = rows[None, :] * H + c * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
                tile_mask = (tl.arange(0, BLOCK_N) < BLOCK_N)[:, None] & row_ok[None, :]
                total = _sum_partials(ws_ptr + tile_offs, tile_mask, stride_p, n_slices)  # in slice order
                tl.store(out_ptr + tile_offs, total.to(dtype), mask=tile_mask)
                tl.store(cnt_ptr + c, 0)  # reusable by the next launch
        if PREFETCH:
            w2 = w2_next
        else:
            w2 = _load_w2_group(w2_ptr, fs, pid, i0 + GROUP, n_tiles, F, BLOCK_N, GROUP)


@triton.jit
def _group_cols(pid, i0, n_tiles, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    # output columns of the group starting at rotated step i0: tiles (pid + i0 + t) % n_tiles, t < GROUP
    rs = tl.arange(0, GROUP * BLOCK_N)
    return ((pid + i0 + rs // BLOCK_N) % n_tiles) * BLOCK_N + rs % BLOCK_N


@triton.jit
def _load_w2_group(w2_ptr, fs, pid, i0, n_tiles, F, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    # w2[group columns, slice] [GROUP * BLOCK_N, BLOCK_F]; past the last group (i0 >= n_tiles): masked, no traffic
    cols = _group_cols(pid, i0, n_tiles, BLOCK_N, GROUP)
    ok = (i0 + tl.zeros_like(cols)) < n_tiles  # a tensor mask: the interpreter takes no scalar one
    return tl.load(w2_ptr + cols.to(tl.int64)[:, None] * F + fs[None, :], mask=ok[:, None], other=0.0)


# ---------------------------------------------------------------------------------------------
# launcher and reference

@dataclass
class Buffers:
    """The fused kernel's fp32 workspace ``[P, M, H]`` and zeroed arrival counters ``[n_tiles]``;
    reusable by consecutive launches on one stream (the PDL wait orders their accesses)."""
    ws: torch.Tensor
    counters: torch.Tensor


def block_m(M: int) -> int:
    return max(16, triton.next_power_of_2(M))  # tl.dot's minimum


def check_shapes(M: int, H: int, F: int, cfg: FusedConfig) -> None:
    if M > 64:
        raise ValueError(f"at most 64 rows, got {M}")
    if F % cfg.block_f or H % cfg.block_k or H % cfg.block_n or (H // cfg.block_n) % cfg.group:
        raise ValueError(f"shape H={H}, F={F} does not tile by {cfg}")


def make_buffers(M: int, H: int, F: int, cfg: FusedConfig, device: torch.device | str) -> Buffers:
    check_shapes(M, H, F, cfg)
    ws = torch.empty((F // cfg.block_f, M, H), dtype=torch.float32, device=device)
    return Buffers(ws, torch.zeros(H // cfg.block_n, dtype=torch.int32, device=device))


def ffn_fused(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, cfg: FusedConfig, buf: Buffers,
              h_out: torch.Tensor | None = None) -> torch.Tensor:
    """``skinny_linear(skinny_swiglu(x, w13), w2)`` in one launch (``h_out``: also store h ``[M, F]``)."""
    (M, H), F = x.shape, w2.shape[1]
    check_shapes(M, H, F, cfg)
    assert w13.shape == (2 * F, H) and w2.shape == (H, F) and x.is_contiguous()
    assert w13.is_contiguous() and w2.is_contiguous() and x.dtype == w13.dtype == w2.dtype
    assert buf.ws.shape == (F // cfg.block_f, M, H) and buf.counters.numel() == H // cfg.block_n
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    _ffn_fused_kernel[(F // cfg.block_f,)](
        x, w13, w2, out, buf.ws, buf.counters, out if h_out is None else h_out,
        M, H, F, H // cfg.block_n,
        BLOCK_M=block_m(M), BLOCK_F=cfg.block_f, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n,
        GROUP=cfg.group, PREFETCH=cfg.prefetch,
        STORE_H=h_out is not None, UPCAST=x.device.type != "cuda",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(x),
    )
    return out


def ffn_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, out)`` of the two-launch path's plain-PyTorch references."""
    h = skinny_swiglu_reference(x, w13)
    return h, skinny_linear_reference(h, w2)


def random_layer(H: int, F: int, device: torch.device | str, gen: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    # scaled so that gate/up and the output stay O(1): a chain of layers neither explodes nor vanishes
    w13 = torch.randn((2 * F, H), device=device, generator=gen) * H ** -0.5
    w2 = torch.randn((H, F), device=device, generator=gen) * (2.0 / F) ** 0.5
    return w13.to(DTYPE), w2.to(DTYPE)


# ---------------------------------------------------------------------------------------------
# --check

def grid_layer(M: int, H: int, F: int, device: torch.device | str, gen: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, w13, w2)`` on coarse binary grids: every gate/up product and partial sum is exact in fp32,
    so gate and up do not depend on the summation order and h must be bit-identical to the reference's
    (with random data the fp32 sums, hence the bf16 roundings, differ by an ulp now and then)."""
    def grid(shape, lo, hi, scale):
        return (torch.randint(lo, hi, shape, device=device, generator=gen) * scale).to(DTYPE)
    return grid((M, H), -2, 3, 0.25), grid((2 * F, H), -3, 4, 2.0 ** -5), grid((H, F), -3, 4, 2.0 ** -2)


def check(device: str, shapes: list[tuple[int, int, int]], cfg: FusedConfig, log=print) -> list[dict]:
    """Fused vs reference at each (M, H, F) on grid data (h bit-exact, out to bf16 tolerance), twice in a
    row on the same buffers (identical results, counters back at zero); raises AssertionError on a mismatch."""
    # the Triton 3.9 interpreter casts fp32 to bf16 by truncation (runtime/interpreter.py, cast_impl), not
    # round-to-nearest-even as the GPU and PyTorch do: off the GPU h can only match to an ulp
    exact_h = device == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for M, H, F in shapes:
        x, w13, w2 = grid_layer(M, H, F, device, gen)
        h_ref, out_ref = ffn_reference(x, w13, w2)
        buf = make_buffers(M, H, F, cfg, device)
        outs = []
        for _ in range(2):
            h = torch.full((M, F), float("nan"), dtype=DTYPE, device=device)
            outs.append(ffn_fused(x, w13, w2, cfg, buf, h_out=h))
            if exact_h:
                assert torch.equal(h, h_ref), f"h differs at {M, H, F}: {(h.float() - h_ref.float()).abs().max()}"
            else:
                torch.testing.assert_close(h, h_ref, rtol=1e-2, atol=1e-2)
            assert int(buf.counters.abs().sum()) == 0, "counters not reset"
        diff = (outs[0].float() - out_ref.float()).abs().max().item()
        torch.testing.assert_close(outs[0], out_ref, rtol=2e-2, atol=2e-2)
        assert torch.equal(outs[0], outs[1]), "second launch differs (deterministic reduction expected)"
        h_same = (h == h_ref).float().mean().item()
        rows.append({"M": M, "H": H, "F": F, "max_abs_diff": diff, "max_abs_ref": out_ref.abs().max().item(),
                     "h_identical_fraction": h_same, "h_exact_required": exact_h})
        log(f"check M={M:2d} H={H} F={F} {cfg}: h identical {h_same:.1%} (exact required: {exact_h}), "
            f"out max |diff| {diff:.3g} "
            f"(max |ref| {rows[-1]['max_abs_ref']:.3g}), rerun identical, counters reset")
    return rows


# ---------------------------------------------------------------------------------------------
# --time

def _chain_ms(fn, warmup: int, iters: int) -> float:
    """Median ms of one CUDA-graph replay of ``fn`` (benchmarks/kernels/common.py's time_ms)."""
    try:
        from .common import time_ms
    except ImportError:  # run as a script
        from common import time_ms
    return time_ms(fn, warmup=warmup, iters=iters, use_graph=True)


def time_shape(name: str, M: int, H: int, F: int, configs: list[FusedConfig], layers: int, iters: int,
               copy_gbps: float, log=print) -> list[dict]:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(1)
    weights = [random_layer(H, F, device, gen) for _ in range(layers)]
    x0 = torch.randn((M, H), device=device, generator=gen).to(DTYPE)
    layer_bytes = (3 * F * H) * DTYPE.itemsize
    floor_us = layer_bytes / (copy_gbps * 1e9) * 1e6

    def two_launch():
        x = x0
        for w13, w2 in weights:
            x = torch.ops.lfmspark.skinny_linear(torch.ops.lfmspark.skinny_swiglu(x, w13), w2)
        return x

    base_out = two_launch()
    base_us = _chain_ms(two_launch, 3, iters) * 1e3 / layers
    log(f"{name} M={M} H={H} F={F}: floor {floor_us:.2f} us/layer ({layer_bytes / 2**20:.0f} MiB at "
        f"{copy_gbps:.0f} GB/s); two launches {base_us:.2f} us/layer ({base_us / floor_us:.3f} x floor)")
    rows = []
    for cfg in configs:
        try:
            buf = make_buffers(M, H, F, cfg, device)
        except ValueError as e:
            log(f"  skip {cfg}: {e}")
            continue

        def fused(cfg=cfg, buf=buf):
            x = x0
            for w13, w2 in weights:
                x = ffn_fused(x, w13, w2, cfg, buf)
            return x

        try:
            out = fused()
            torch.cuda.synchronize()
        except Exception as e:  # e.g. out of shared memory at this config
            log(f"  fail {cfg}: {type(e).__name__}: {str(e)[:200]}")
            continue
        # one layer against the real ops (a chain amplifies the summation-order ulps, so compare layer 1)
        one = ffn_fused(x0, *weights[0], cfg, buf)
        ref1 = torch.ops.lfmspark.skinny_linear(torch.ops.lfmspark.skinny_swiglu(x0, weights[0][0]), weights[0][1])
        diff1 = (one.float() - ref1.float()).abs().max().item()
        ok1 = diff1 <= 2e-2 * max(1.0, ref1.abs().max().item())
        chain_diff = (out.float() - base_out.float()).abs().max().item()
        us = _chain_ms(fused, 3, iters) * 1e3 / layers
        row = {"shape": name, "M": M, "H": H, "F": F, **asdict(cfg), "programs": F // cfg.block_f,
               "fused_us": round(us, 3), "two_launch_us": round(base_us, 3), "floor_us": round(floor_us, 3),
               "fused_over_floor": round(us / floor_us, 4), "two_launch_over_floor": round(base_us / floor_us, 4),
               "fused_over_two_launch": round(us / base_us, 4), "layer1_max_abs_diff": diff1, "layer1_ok": ok1,
               "chain_max_abs_diff": chain_diff, "copy_gbps": round(copy_gbps, 1), "layers": layers}
        rows.append(row)
        log(f"  fused {cfg}: {us:.2f} us/layer ({us / floor_us:.3f} x floor, {us / base_us:.3f} x two launches); "
            f"layer-1 max |diff| vs real ops {diff1:.3g}{'' if ok1 else ' MISMATCH'}, after {layers} layers "
            f"{chain_diff:.3g}")
    return rows


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="fused vs reference on small shapes (CPU interpreter or CUDA)")
    p.add_argument("--time", action="store_true", help="time the served shapes' chains (CUDA)")
    p.add_argument("--block-f", default="64")
    p.add_argument("--block-n", default="64")
    p.add_argument("--block-k", default="128")
    p.add_argument("--group", default="1", help="tiles per counter bump (divides H / block_n)")
    p.add_argument("--prefetch", default="1", help="1: load the next group's w2 block early; 0: not")
    p.add_argument("--num-warps", default="4")
    p.add_argument("--num-stages", default="3")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--shapes", default="verify,draft", help=f"of {','.join(SERVED)}")
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args(argv)
    if not (args.check or args.time):
        p.error("give --check and/or --time")
    configs = [FusedConfig(*c) for c in itertools.product(
        _ints(args.block_f), _ints(args.block_n), _ints(args.block_k), _ints(args.group), _ints(args.prefetch),
        _ints(args.num_warps), _ints(args.num_stages))]
    report: dict = {"configs": [asdict(c) for c in configs]}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.check:
        small = FusedConfig(block_f=64, block_n=64, block_k=64, group=1)
        shapes = [(M, 128, 256) for M in (1, 4, 10, 16)]
        try:
            report["check"] = check(device, shapes, small)
            # grouped bumps; fewer programs than tiles, P = 3 (not a power of two, as the draft's 96)
            report["check"] += check(device, [(10, 256, 256)], FusedConfig(64, 32, 64, 4))
            report["check"] += check(device, [(9, 256, 192)], FusedConfig(64, 32, 64, 2, prefetch=0))
        except AssertionError as e:
            print(f"CHECK FAILED: {e}")
            return 1
    if args.time:
        if device != "cuda":
            p.error("--time needs CUDA")
        try:
            from .common import copy_bandwidth_gbps
        except ImportError:  # run as a script
            from common import copy_bandwidth_gbps
        copy_gbps = copy_bandwidth_gbps()
        report["copy_gbps"] = copy_gbps
        report["device"] = torch.cuda.get_device_name()
        report["pdl"] = pdl_kwargs(torch.empty(1, device=device))
        report["time"] = []
        for name in args.shapes.split(","):
            report["time"] += time_shape(name, *SERVED[name], configs, args.layers, args.iters, copy_gbps)
            torch.cuda.empty_cache()  # the shape's weights (1.5 GiB at the verify shape) are gone
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
