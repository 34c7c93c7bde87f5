"""Skinny linear: ``x [M, K] @ weight[N, K]^T`` for a handful of rows (``M <= 64``), fp32 accumulation;
and skinny SwiGLU: ``silu(x @ w1^T) * (x @ w3^T)`` from the fused ``w13 = [w1; w3]`` for ``M <= 16``.

Why: a decode step at batch 1 multiplies one row by every weight matrix, and a speculative verify
``M = 10`` rows (the draft ``M = 9``); such products are bound by reading the weight once. For
``M = 1`` a ``tl.dot``-free GEMV kernel streams the served LFM2.5-1.2B shapes 3-31% faster than
cuBLAS (up to 0.998 of copy bandwidth on the LM head), so one-row products use it. For several
rows (the batch-1 verify and draft) the swap-AB ``tl.dot`` kernel below beats cuBLAS at every
served shape at ``M = 10`` (2048 x 2048: 4.76 vs 6.06 us; the down projection 10.71 vs 13.83 us;
docs/decisions.md), so products of up to 16 rows use it (ops/routing.py).

Design (``M > 1``): each program owns ``BLOCK_N`` output columns for all ``M`` rows (padded to ``BLOCK_M``, a
power of two >= 16, ``tl.dot``'s minimum) and streams its ``[BLOCK_N, K]`` slice of the weight
exactly once; ``x`` is tiny and is re-read from L2 by every program. When ``N`` is too small to
give every SM a couple of programs (e.g. ``N = 2048, K = 8192``), the K range is split as well.

Split-K without a second kernel ("serial split-K fix-up"): program ``(n block, k split)`` writes its
fp32 partial tile to a ``[splits, M, N]`` workspace, then increments the tile's arrival counter
(one int32 per column tile, ``tl.atomic_add`` with acq_rel semantics at GPU scope). The program that
finds ``splits - 1`` there arrived last: every other split's partial is already visible to it, so it
sums all of them, its own included, applies the epilogue (the rounding to ``x``'s dtype, or the
SwiGLU activation), writes the output and puts the counter back to 0. A split-K product is thus one
launch (a separate reduce kernel would run 59 times per batch-1 speculative round; with PDL a small
kernel costs ~0.5 us there, measured as the round's gain per removed kernel: docs/decisions.md).

Determinism: which program arrives last varies from run to run, but not what it computes: the
partials are the same (each split's sum over its K range, in a fixed order), and the last program
sums them in split order ``0, 1, ..., splits - 1`` from the workspace, whatever its own index. The
result is therefore the same run to run, and bit-identical to a two-kernel split-K whose reduce
kernel sums the same workspace in the same order.

Synchronization: each program's threads store their part of the partial tile; a CTA barrier
(``tl.debug_barrier``) orders all those stores before the increment, which one thread issues (Triton
runs scalar atomics on one thread) with release semantics at GPU scope, cumulative over the stores
the barrier ordered before it. The last program's increment acquires every earlier increment
(release sequence of the counter's atomic read-modify-writes); Triton broadcasts the atomic's result
to the CTA through shared memory behind a barrier, so all of the last program's workspace loads come
after the acquire (they also bypass L1, ``.cg``). This is the protocol of CUTLASS's split-K
semaphore (barrier, one-thread release; one-thread acquire, barrier).

The counters (:func:`_split_counters`) are one persistent, zero-initialised int32 buffer per device,
shared by every split-K launch of both kernels and left all-zero by each launch, which is why the
ops need no extra argument and declare no mutation: between launches the buffer is always zero,
so the op is a pure function of its inputs for ``torch.library``, functionalization and
``torch.compile``, and a CUDA graph replays it as often as wanted. The price is an ordering
constraint: two launches that may run at the same time must not share counters, so split-K
launches on one device must be ordered (one stream, as lfmspark runs its steps, or streams joined
by events). With PDL a launch may start before its predecessor ends, but its counter and workspace
accesses come after ``gdc_wait``, which returns once the predecessor grid has completed (and with
it, by the PDL chain condition of ops/_dispatch.py, every earlier grid), so consecutive kernels
never use the counters at the same time. Launches on a second stream that may run beside the
first (the speculative round's context injection, runtime/steps.py) pass ``side_stream=True`` and
take another buffer, and are ordered among themselves the same way. Each buffer is created on first use,
which therefore must not be inside a CUDA-graph capture (it raises there; the warm-up runs before
capture anyway).

Swap-AB (every ``tl.dot`` launch, with ``swap_ab_config`` fitted to a sweep): each program
computes the transposed tile ``out^T [BLOCK_N, BLOCK_M] = weight tile [BLOCK_N, BLOCK_K] @ x tile^T
[BLOCK_K, BLOCK_M]``, so the wide weight tile is ``tl.dot``'s A operand and the few rows its N
dimension. With x as A the A operand would have ``BLOCK_M`` rows, fewer than wgmma's 64 for ``M <=
32``, which keeps Hopper on the older mma.sync path (slower at every served shape); with 64- or
128-row weight tiles as A, Triton issues wgmma with ``BLOCK_M`` (16 for ``M <= 16``) as its N.

SwiGLU (``lfmspark::skinny_swiglu``, the batch-1 verify and draft feed-forwards): the same kernel
with ``SWIGLU``: each program owns ``BLOCK_N`` gate columns ``j`` and the same up columns (rows
``j`` and ``F + j`` of ``w13``), streams both weight tiles per K step into two accumulators and
applies ``silu(gate) * up`` in the epilogue (with split-K, in the last program's fix-up, on the
summed fp32 partials), so the ``[M, 2F]`` gate/up product is never written and the activation is
no separate kernel. Numerics: those of the unfused module in ``x``'s dtype: gate and up are each an fp32 sum rounded once to the dtype (as
``F.linear`` rounds its output), ``silu(gate)`` is rounded, and so is the product.

Pair (``lfmspark::skinny_linear_pair``, the DSpark draft's block q and K/V projections): ``x @ [w_a;
w_b]^T`` from two separate weights, as if stacked along N, in one launch. Why: the draft's K/V
weights stay stacked across layers (``DSparkDraft.kv_proj [L, 2 KV, H]``, so the context injection
projects every layer in one product) and its q weights per layer: a stacked ``[q; k; v]`` weight,
as the target has, would either copy the K/V weights (4 MB a layer in bf16) or change the parameter
layout the checkpoint loader and the context injection rely on, and two products cost a launch (~3
us in the batch-1 round) more than one. The kernel with ``TWO_WEIGHTS``: output columns ``[0,
N_A)`` are rows of ``w_a``, ``[N_A, N)`` rows ``c - N_A`` of ``w_b``; a column tile never straddles
the two (``N_A % BLOCK_N == 0``, ``N_A`` a multiple of 16 by contract, :func:`pair_config` narrows the
tiles when needed), so each program picks its weight's base pointer and rows once, before the K
loop, which is the one-weight loop unchanged (same loads, same sums: each half of the output is
bit-identical to the one-weight kernel on that weight with the same launch parameters). Both
weights must share K, dtype and row stride (one ``stride_wn``); split-K, its counters and the PDL
contract are the plain product's. No GEMV variant: one row also runs on the tile kernel.

Norm epilogues (models/layers.py ``project_norm_feed_forward``, ``NormedCarry``): with
``ADD_NORM`` (``lfmspark::skinny_linear_add_norm``) the epilogue adds a residual and writes the sum
``s``, ``s * g`` for the next RMSNorm's weight ``g`` and each column tile's row sums of ``s^2``; with
``ROW_NORM`` (the ``row_ssq`` of ``skinny_linear``, ``skinny_swiglu`` and ``skinny_linear_pair``) a
product of that ``s * g`` scales each row's fp32 sums by ``rsqrt(mean square + eps)`` before its one
rounding: together, the product of ``RMSNorm(s)`` with no norm kernel between the two launches.

FP8 weights (``W_SCALE``, ``lfmspark::skinny_linear_fp8`` in ops/linear/skinny_linear_fp8.py): the
weight holds float8 e4m3fn values, half the bytes of a bf16 weight to stream. The ``tl.dot`` kernel
upcasts each weight tile to ``x``'s dtype in registers (exact: every e4m3fn value is a bf16 value),
the GEMV kernel to fp32 as it does every weight, and each output column's fp32 sum is multiplied by
its per-channel scale once, after the K loop (a split's partial too: the scaling is linear). Plain
and row-scaled products only; the tiles are the bf16 heuristics' (not tuned for fp8).

Numerics: ``torch.nn.functional.linear`` (the reference), i.e. fp32 accumulation and one rounding
to ``x``'s dtype; the summation order differs, so bf16 results may differ by an ulp. Static grids,
no host sync: the launchers are CUDA-graph safe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._dispatch import pdl_kwargs, use_triton
from ..tuning import tuned

MAX_M = 64  # rows the kernel handles (BLOCK_M up to 64); larger M is compute-bound: use cuBLAS
SWIGLU_MAX_M = 16  # rows of skinny_swiglu: BLOCK_M = 16, the batch-1 verify (10) and draft (9)
PAIR_ROWS_ALIGN = 16  # skinny_linear_pair's first weight: whole column tiles of the narrowest (16)


# ---------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, wb_ptr, out_ptr, ws_ptr, cnt_ptr,
    res_ptr, g_ptr, sg_ptr, ssq_out_ptr, ssq_in_ptr, n_ssq_in, inv_k, eps, w_scale_ptr,
    M, N, N_A, K, k_split,
    stride_xm, stride_wn, stride_om, stride_ws, stride_wsm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr, SWIGLU: tl.constexpr, TWO_WEIGHTS: tl.constexpr,
    ADD_NORM: tl.constexpr, ROW_NORM: tl.constexpr, SSQ_TILES: tl.constexpr, W_SCALE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    # program (n block, k split): BLOCK_N output columns of all rows, summed over the K range
    # [k0, k0 + k_split). Swap-AB: the weight tile is the MMA's A operand, out^T [BLOCK_N, BLOCK_M]
    # = w @ x^T, stored transposed (see the module doc). SWIGLU: N = F,
    # output column j = silu(x . w[j]) * (x . w[F + j]), two accumulators. SPLIT (more than one
    # split): partials to the fp32 workspace ws [splits, M, N] ([splits, M, 2F] for SWIGLU, the up
    # partials from column F on), the tile's last program sums them (see the module doc).
    # TWO_WEIGHTS: columns [0, N_A) are rows of w, columns [N_A, N) rows c - N_A of wb (same K and
    # row stride), as if the two were stacked (lfmspark::skinny_linear_pair; not with SWIGLU).
    # ADD_NORM (plain product): the epilogue adds the residual res [M, N] to the rounded product and
    # stores the sum s, s * g (g [N], the next RMSNorm's weight) to sg, and the tile's per-row sums
    # of s^2 to ssq_out [column tiles, M] (lfmspark::skinny_linear_add_norm). ROW_NORM: every row of
    # the product is scaled by rsqrt(mean square + eps), the mean square from the n_ssq_in partial
    # sums at ssq_in (inv_k = 1 / the norm's width): with x = s * g, the product of RMSNorm(s).
    # W_SCALE (plain product, lfmspark::skinny_linear_fp8): w holds fp8 values, upcast in registers
    # (_dot_block), and each column's fp32 sum is multiplied by its scale w_scale [N] after the K loop.
    tl.static_assert(not (TWO_WEIGHTS and SWIGLU), "skinny_linear_pair has no SwiGLU epilogue")
    tl.static_assert(not (ADD_NORM and (SWIGLU or TWO_WEIGHTS)), "ADD_NORM is the plain product's epilogue")
    tl.static_assert(not (W_SCALE and (SWIGLU or TWO_WEIGHTS or ADD_NORM)),
                     "W_SCALE is the plain (or row-scaled) product's")
    if PDL == 1:  # the next kernel's programs may launch now (ops/_dispatch.py)
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    k0 = split * k_split
    k_end = tl.minimum(k0 + k_split, K)
    ks = k0 + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    # columns past N read row `c % N` instead of being masked, so the weight loads of the fast path
    # carry no mask at all (full-width vector loads); those columns are never stored
    if TWO_WEIGHTS:
        # a program's BLOCK_N columns lie in one weight (N_A % BLOCK_N == 0): its base pointer and
        # rows are chosen once, here, and the K loop below is the one-weight loop unchanged
        in_b = pid_n * BLOCK_N >= N_A
        w_rows = (cols - tl.where(in_b, N_A, 0)) % tl.where(in_b, N - N_A, N_A)
        w_ptrs = tl.where(in_b, wb_ptr, w_ptr) + w_rows.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    else:
        w_ptrs = w_ptr + (cols % N).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    # the first K block is peeled: its weights depend on no earlier kernel, so they are requested
    # before waiting for the predecessor (PDL); x is its output and is read after the wait
    w = _load_w_block(w_ptrs, k0, k_end, BLOCK_K, EVEN_K)
    if SWIGLU:  # the up rows F + j
        u_ptrs = w_ptr + (cols % N + N).to(tl.int64)[:, None] * stride_wn + ks[None, :]
        wu = _load_w_block(u_ptrs, k0, k_end, BLOCK_K, EVEN_K)
    out_offs, out_mask = _tile_offsets(rows, cols, row_ok, N, stride_om)
    if W_SCALE:  # a parameter too: requested before the wait
        w_scale = tl.load(w_scale_ptr + cols % N)
    if ADD_NORM:  # the norm weight is a parameter: requested before the wait, as the weights are
        g = tl.load(g_ptr + cols, mask=cols < N, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if ROW_NORM:  # requested before the K loop and reduced after it: its latency hides behind the weight
        # stream, and the x loads below are not held up behind the reduction
        ssq_part = _load_row_ssq(ssq_in_ptr, n_ssq_in, rows, row_ok, M, SSQ_TILES)
    a = _load_x_block(x_ptrs, row_ok, k0, k_end, BLOCK_K, EVEN_K)
    if ADD_NORM:  # requested now, not in the epilogue, so that the split-K fix-up waits for its partials alone
        res = tl.load(res_ptr + out_offs, mask=out_mask, other=0.0)
    acc = _dot_block(a, w, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), DOT_PRECISION, UPCAST)
    if SWIGLU:
        acc_u = _dot_block(a, wu, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), DOT_PRECISION, UPCAST)
    for k in range(k0 + BLOCK_K, k_end, BLOCK_K):
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        w = _load_w_block(w_ptrs, k, k_end, BLOCK_K, EVEN_K)
        if SWIGLU:
            u_ptrs += BLOCK_K
            wu = _load_w_block(u_ptrs, k, k_end, BLOCK_K, EVEN_K)
        a = _load_x_block(x_ptrs, row_ok, k, k_end, BLOCK_K, EVEN_K)
        acc = _dot_block(a, w, acc, DOT_PRECISION, UPCAST)
        if SWIGLU:
            acc_u = _dot_block(a, wu, acc_u, DOT_PRECISION, UPCAST)
    if PDL == 2:  # the late trigger (ops/_dispatch.py): this program's weights are read
        tl.extra.cuda.gdc_launch_dependents()
    if W_SCALE:  # the fp32 sums (or a split's partials: the scaling is linear)
        acc = acc * w_scale[:, None]
    if ROW_NORM:  # the fp32 sums (or a split's partials: the scaling is linear)
        rstd = _row_rstd(ssq_part, row_ok, inv_k, eps)
        acc = acc * rstd[None, :]
        if SWIGLU:
            acc_u = acc_u * rstd[None, :]
    if SPLIT:
        ws_offs, ws_mask = _tile_offsets(rows, cols, row_ok, N, stride_wsm)
        tl.store(ws_ptr + split * stride_ws + ws_offs, acc, mask=ws_mask)
        if SWIGLU:
            tl.store(ws_ptr + split * stride_ws + N + ws_offs, acc_u, mask=ws_mask)
        if _arrives_last(cnt_ptr + pid_n, tl.num_programs(1)):
            total = _sum_partials(ws_ptr + ws_offs, ws_mask, stride_ws, tl.num_programs(1))
            if SWIGLU:
                total_u = _sum_partials(ws_ptr + N + ws_offs, ws_mask, stride_ws, tl.num_programs(1))
            else:
                total_u = total  # not read by the plain epilogue
            if ADD_NORM:
                _store_add_norm(out_ptr, res, g, sg_ptr, ssq_out_ptr, out_offs, out_mask, total, rows, row_ok, M,
                                pid_n)
            else:
                _store_out(out_ptr + out_offs, out_mask, total, total_u, SWIGLU)
            tl.store(cnt_ptr + pid_n, 0)  # reusable by the next launch
    elif ADD_NORM:
        _store_add_norm(out_ptr, res, g, sg_ptr, ssq_out_ptr, out_offs, out_mask, acc, rows, row_ok, M, pid_n)
    else:
        _store_out(out_ptr + out_offs, out_mask, acc, acc_u if SWIGLU else acc, SWIGLU)


@triton.jit
def _load_w_block(w_ptrs, k, k_end, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=((k + tl.arange(0, BLOCK_K)) < k_end)[None, :], other=0.0)


@triton.jit
def _load_x_block(x_ptrs, row_ok, k, k_end, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # padding rows of x are masked, not clamped: a masked load costs no L2 traffic
    if EVEN_K:
        return tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
    k_ok = (k + tl.arange(0, BLOCK_K)) < k_end
    return tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _dot_block(a, w, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # out^T += w @ x^T: the weight tile is the MMA's A operand (swap-AB, module doc)
    if UPCAST:  # the Triton 3.9 interpreter multiplies bf16 dot operands as raw integers
        a, w = a.to(tl.float32), w.to(tl.float32)
    else:  # fp8 weights (W_SCALE) upcast to x's dtype in registers, exactly; a no-op otherwise
        w = w.to(a.dtype)
    return tl.dot(w, tl.trans(a), acc, input_precision=DOT_PRECISION)


@triton.jit
def _tile_offsets(rows, cols, row_ok, N, stride_m):
    # element offsets and mask of the accumulator tile out^T [BLOCK_N, BLOCK_M] in a row-major [M, *]
    # matrix of row stride stride_m (the output or the workspace)
    offs = rows[None, :] * stride_m + cols[:, None]
    mask = (cols < N)[:, None] & row_ok[None, :]
    return offs, mask


@triton.jit
def _arrives_last(counter_ptr, n_splits):
    # Split-K arrival, after the program stored its partial: true in the tile's last of n_splits programs. The
    # barrier orders all threads' partial stores before the increment, which one thread issues:
    # its release (gpu scope) publishes them, its acquire makes every earlier program's partial
    # visible here; Triton broadcasts the scalar result behind a barrier, so the caller's loads of
    # the partials come after the acquire in every thread (module doc, "Synchronization")
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == n_splits - 1


@triton.jit
def _sum_partials(ptrs, mask, stride_ws, splits):
    # the sum of a tile's partials over all splits (ptrs + s * stride_ws, s < splits) in split order
    # 0, 1, ..., whichever program runs it: deterministic. Four slices per step are loaded at once
    # (indices past the last split reload the last one and are not added); .cg: from L2, never a
    # stale L1 line
    total = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for s0 in range(1, splits, 4):
        for i in tl.static_range(4):
            part = tl.load(ptrs + tl.minimum(s0 + i, splits - 1).to(tl.int64) * stride_ws, mask=mask, other=0.0,
                           cache_modifier=".cg")
            total = tl.where(s0 + i < splits, total + part, total)
    return total


@triton.jit
def _store_out(ptrs, mask, gate, up, SWIGLU: tl.constexpr):
    # the epilogue on fp32 sums: plain, one rounding to the output dtype; SWIGLU, the unfused
    # module's roundings (gate and up each rounded once, silu(gate) rounded, the product rounded)
    dtype = ptrs.dtype.element_ty
    if SWIGLU:
        g = gate.to(dtype).to(tl.float32)
        u = up.to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        val = act * u
    else:
        val = gate
    tl.store(ptrs, val.to(dtype), mask=mask)


@triton.jit
def _store_add_norm(out_ptr, res, g, sg_ptr, ssq_ptr, offs, mask, total, rows, row_ok, M, pid_n):
    # the ADD_NORM epilogue on the tile's fp32 sums, with the tile's residual res and the norm weight's
    # columns g already loaded: the module's roundings for the product (rounded once, as F.linear)
    # and the residual add (bf16 + bf16, rounded), then s * g rounded once, and the per-row sums of
    # s^2 over the tile's columns (in fp32 from the rounded s, as RMSNorm's statistics are), one
    # partial per column tile: the consumer adds them in a fixed order
    dtype = out_ptr.dtype.element_ty
    delta = total.to(dtype).to(tl.float32)
    s = (res.to(tl.float32) + delta).to(dtype)
    tl.store(out_ptr + offs, s, mask=mask)
    s32 = tl.where(mask, s.to(tl.float32), 0.0)
    g = g.to(tl.float32)
    sg = s32 * g[:, None]           # tile [BLOCK_N columns, BLOCK_M rows]
    ssq = tl.sum(s32 * s32, axis=0)
    tl.store(sg_ptr + offs, sg.to(dtype), mask=mask)
    tl.store(ssq_ptr + pid_n * M + rows, ssq, mask=row_ok)


@triton.jit
def _load_row_ssq(ssq_ptr, n_tiles, rows, row_ok, M, SSQ_TILES: tl.constexpr):
    # the producer's n_tiles partial sums of squares ssq [n_tiles, M] of the tile's rows, [SSQ_TILES,
    # BLOCK_M] (.cg: written by the previous kernel, read from L2; 0 past n_tiles and for padding rows)
    t = tl.arange(0, SSQ_TILES)
    return tl.load(ssq_ptr + t[:, None] * M + rows[None, :], mask=(t < n_tiles)[:, None] & row_ok[None, :],
                   other=0.0, cache_modifier=".cg")


@triton.jit
def _row_rstd(part, row_ok, inv_k, eps):
    # rsqrt(mean square + eps) per row from its partial sums (_load_row_ssq); 0 for padding rows
    return tl.where(row_ok, tl.rsqrt(tl.sum(part, axis=0) * inv_k + eps), 0.0)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, w_scale_ptr,
    N, K, k_split,
    stride_wn, stride_ws,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    W_SCALE: tl.constexpr, PDL: tl.constexpr,
):
    # the M = 1 case without tl.dot (whose 16-row minimum wastes 15/16 of its registers on padding):
    # program (n block, k split) keeps a [BLOCK_N, BLOCK_K] fp32 elementwise accumulator and reduces
    # it once at the end, so each K step is one wide weight load and a multiply-add. SPLIT: partials
    # to the workspace ws [splits, N], summed by the tile's last program, as in _skinny_linear_kernel.
    # W_SCALE: fp8 weights (upcast as they are loaded), each column's sum times its scale w_scale [N]
    if PDL == 1:  # the next kernel's programs may launch now (ops/_dispatch.py)
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = split * k_split
    k_end = tl.minimum(k0 + k_split, K)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (cols % N).to(tl.int64)[:, None] * stride_wn + (k0 + ks)[None, :]
    # first K block peeled: weights requested before the PDL wait, x (the predecessor's output) after
    w = _load_w_block(w_ptrs, k0, k_end, BLOCK_K, EVEN_K)
    if W_SCALE:  # a parameter too: requested before the wait
        w_scale = tl.load(w_scale_ptr + cols % N)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = w.to(tl.float32) * _load_x_vector(x_ptr, k0, k_end, BLOCK_K, EVEN_K)[None, :]
    for k in range(k0 + BLOCK_K, k_end, BLOCK_K):
        w_ptrs += BLOCK_K
        w = _load_w_block(w_ptrs, k, k_end, BLOCK_K, EVEN_K)
        acc += w.to(tl.float32) * _load_x_vector(x_ptr, k, k_end, BLOCK_K, EVEN_K)[None, :]
    if PDL == 2:  # the late trigger (ops/_dispatch.py): this program's weights are read
        tl.extra.cuda.gdc_launch_dependents()
    out = tl.sum(acc, axis=1)
    if W_SCALE:
        out = out * w_scale
    col_ok = cols < N
    if SPLIT:
        tl.store(ws_ptr + split * stride_ws + cols, out, mask=col_ok)
        if _arrives_last(cnt_ptr + pid_n, tl.num_programs(1)):
            total = _sum_partials(ws_ptr + cols, col_ok, stride_ws, tl.num_programs(1))
            _store_out(out_ptr + cols, col_ok, total, total, False)
            tl.store(cnt_ptr + pid_n, 0)  # reusable by the next launch
    else:
        _store_out(out_ptr + cols, col_ok, out, out, False)


@triton.jit
def _load_x_vector(x_ptr, k, k_end, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    ks = k + tl.arange(0, BLOCK_K)
    if EVEN_K:
        return tl.load(x_ptr + ks).to(tl.float32)
    return tl.load(x_ptr + ks, mask=ks < k_end, other=0.0).to(tl.float32)


# ---------------------------------------------------------------------------------------------
# launcher

@dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters (``BLOCK_M`` always follows ``M``)."""
    block_n: int
    block_k: int
    split_k: int = 1  # upper bound: the launcher drops splits that would be empty
    num_warps: int = 4
    num_stages: int = 4
    gemv: bool = False  # M = 1 plain products only: the tl.dot-free kernel (_gemv_kernel); else swap-AB


_PROGRAMS_PER_SM = 2          # split-K target: about this many programs per SM
_MIN_PROGRAMS_PER_SM = 1.5    # a column tiling with fewer programs than this needs splitting
_MIN_SPLIT_ITERS = 4          # K blocks per split at least: shorter loops cannot fill the pipeline
_STAGE_BYTES = 24 * 1024      # shared memory per K step (weight and x tiles) a program aims for
_SMEM_BYTES = 96 * 1024       # pipeline buffers per program: two programs fit in an SM's 228 KB


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: only sizes the heuristic


def _block_m(M: int) -> int:
    return max(16, triton.next_power_of_2(M))


def skinny_config(M: int, N: int, K: int, elem_size: int, sms: int, side_stream: bool = False) -> SkinnyConfig:
    """Default launch parameters for ``[M, K] x [N, K]^T`` with ``sms`` SMs: the GEMV kernel for one
    row, the swap-AB kernel (:func:`swap_ab_config`) for several."""
    if M == 1:
        # the tl.dot-free kernel, 4 columns x 2048-wide K steps per program. Timed alone
        # (benchmarks/kernels/skinny_linear.py --sweep) 1024-wide steps are the best or within 3% of
        # the best at every served shape; inside the decode step's PDL chain 2048 takes the LFM2.5-1.2B
        # TPOT from 0.772 to 0.734 ms (4096: 0.751 ms; docs/decisions.md). Likely why: a
        # K = 2048 program (out_proj) requests its whole weight tile before it waits for its
        # predecessor (the first K step is peeled), and w2 (K = 8192) takes 4 steps instead of 8; which
        # of the two matters is not measured. No split: N / 4 programs already oversubscribe the SMs at N >= 2048
        shape = (N, K)
        return SkinnyConfig(block_n=tuned("gemv", "block_n", 4, shape),
                            block_k=min(tuned("gemv", "block_k", 2048, shape), max(16, triton.next_power_of_2(K))),
                            split_k=1, num_warps=tuned("gemv", "num_warps", 4, shape),
                            num_stages=tuned("gemv", "num_stages", 2, shape), gemv=True)
    return swap_ab_config(M, N, K, elem_size, sms, side_stream=side_stream)


_SWAP_SMEM_BYTES = 200 * 1024  # swap-AB pipeline buffers: one program per SM (227 KB a block on sm_90)


def swap_ab_config(M: int, N: int, K: int, elem_size: int, sms: int, kind: str = "tile",
                   side_stream: bool = False) -> SkinnyConfig:
    """Launch parameters of the swap-AB kernel (``M > 1``), fitted to a sweep at ``M = 10``
    (``benchmarks/kernels/skinny_linear.py --sweep --rows 10 --target-shapes``),
    whose winners it reproduces at every served LFM2.5-1.2B shape:

    - 64-row weight tiles (wgmma's A height) with 128-wide K steps; 128-row tiles with 64-wide steps
      when ``N / 128`` alone gives two programs per SM (the LM head: 512 programs);
    - K split only up to one wave of programs (``n_blocks * split <= sms``, at least 4 K steps per
      split): the winners run 96-128 programs on 132 SMs (2048 x 2048: 32 tiles x 4 splits), and
      splitting further loses to the extra partial traffic and reduction (measured with a separate
      reduce kernel summing the splits, not the serial fix-up);
    - 5 pipeline stages when split (short loops) or when the column tiles are fewer than the SMs
      (up to the budget; 4-5 for the fused SwiGLU), 3-4 otherwise; 4 warps (one warpgroup). The sweep
      timed alone favours 3 stages for the unsplit under-filled launches, but inside the
      speculative round the 96-program in_proj ``[6144, 2048]`` goes
      from 10.77 to 8.96 us per launch at 5 stages and the draft's 96-program SwiGLU ``[2 x 6144,
      2048]`` from 16.62 to 16.09 us (round 1.375 -> 1.345 ms for the in_proj alone), with no
      other launch slower (docs/decisions.md).

    - on the side stream (``side_stream``), at most ``SIDE_STREAM_STAGES``.

    ``LFMSPARK_TUNE`` (ops/tuning.py, ``kind`` ``tile``, also per ``(N, K)``) may replace each choice; the later
    ones follow.
    """
    block_m = _block_m(M)
    shape = (N, K)
    block_n = tuned(kind, "block_n", 128 if triton.cdiv(N, 128) >= 2 * sms else 64, shape)
    block_k = 64 if block_n >= 128 else 128
    if K % 64 == 0:
        while K % block_k:
            block_k //= 2
    block_k = min(tuned(kind, "block_k", block_k, shape), max(16, triton.next_power_of_2(K)))
    n_blocks = triton.cdiv(N, block_n)
    split_k = 1
    if n_blocks < sms:
        split_k = min(max(1, sms // n_blocks), max(1, triton.cdiv(K, block_k) // _MIN_SPLIT_ITERS))
    split_k = split_k_plan(K, block_k, tuned(kind, "split_k", split_k, shape))[1]
    # 5 stages (as many as the budget holds) also when the programs leave SMs idle: fewer SMs must
    # each keep more bytes in flight (measured inside the round; the sweep timed alone favours 3)
    num_stages = 5 if split_k > 1 or n_blocks < sms else (4 if block_n >= 128 else 3)
    if side_stream:  # launches beside the main stream's (SIDE_STREAM_STAGES)
        num_stages = min(num_stages, SIDE_STREAM_STAGES)
    while num_stages > 2 and num_stages * (block_n + block_m) * block_k * elem_size > _SWAP_SMEM_BYTES:
        num_stages -= 1  # wide rows (M > 16) or fp32
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k,
                        num_warps=tuned(kind, "num_warps", 4, shape),
                        num_stages=tuned(kind, "num_stages", num_stages, shape))


def swiglu_config(M: int, F: int, K: int, elem_size: int, sms: int) -> SkinnyConfig:
    """Launch parameters of ``skinny_swiglu`` (``F`` gate columns): :func:`swap_ab_config` for ``N = F``
    columns, with as many pipeline stages as fit two weight tiles per K step.

    Why: the fused kernel is the plain product over the ``2F`` rows of ``w13`` with the gate and up
    tiles of a column block paired in one program, so it launches ``cdiv(F, BLOCK_N)`` programs; the
    swap-AB heuristic sizes its column tiles and its K split by the programs launched (at most one
    wave, which the sweep favours), so it is applied to ``F``. Each program then streams twice
    the weight bytes per K step, more bytes in flight per program for the same pipeline depth, which
    a bandwidth-bound kernel wants; halving the tiles instead (32 gate + 32 up rows) would drop below
    wgmma's 64-row A operand. The cost is shared memory: a stage holds ``(2 * BLOCK_N + BLOCK_M) *
    BLOCK_K`` elements, so stages are dropped (down to 2) to stay within the swap-AB budget. At the
    served shapes (bf16, M = 9/10): LFM2.5-1.2B ``w13 [16384, 2048]``: 128 programs of 64 + 64 rows,
    K steps of 128, no split, 5 stages (fewer programs than SMs; 180 KB); LFM2-8B-A1B dense
    ``[14336, 2048]``: 112 programs, otherwise the same. Untuned:
    ``benchmarks/kernels/skinny_linear.py --swiglu --sweep`` times the alternatives on the GPU.
    """
    cfg = swap_ab_config(M, F, K, elem_size, sms, kind="tile_swiglu")
    stages = cfg.num_stages
    while stages > 2 and stages * (2 * cfg.block_n + _block_m(M)) * cfg.block_k * elem_size > _SWAP_SMEM_BYTES:
        stages -= 1
    return replace(cfg, num_stages=tuned("tile_swiglu", "num_stages", stages, (F, K)))


def split_k_plan(K: int, block_k: int, split_k: int) -> tuple[int, int]:
    """``(k_split, splits)``: the K range each split covers (whole K blocks) and the number of
    non-empty splits the launcher runs for a requested ``split_k``."""
    k_split = triton.cdiv(triton.cdiv(K, max(1, split_k)), block_k) * block_k
    return k_split, triton.cdiv(K, k_split)


MAX_SPLIT_TILES = 1 << 16  # column tiles a split-K launch may have: one arrival counter each (256 KB)


# the side stream's launches (side_stream=True): their own split-K counter set, and at most this many
# pipeline stages, so that their programs fit in an SM's shared memory beside the main stream's: a
# program of the 64-column tiles holds (stages + 1) x 20 KB at M <= 16 (bf16, 128-wide K steps); at
# the default 5 stages (120 KB) it cannot share an SM with a 120 KB program of the main stream, at 3
# (80 KB) it can (228 KB per SM on sm_90). The speculative round's context injection runs there
# (runtime/steps.py ``Steps.fork_injection``).
SIDE_STREAM_STAGES = 3


def _split_counters(device: torch.device, side_stream: bool) -> torch.Tensor:
    """The split-K arrival counters of ``device`` for the main stream's launches (set 0) or the side
    stream's (set 1; see the module doc)."""
    return _counter_buffer(device, 1 if side_stream else 0)


@functools.lru_cache(maxsize=None)
def _counter_buffer(device: torch.device, index: int) -> torch.Tensor:
    """Split-K arrival counters ``index`` of ``device``: ``MAX_SPLIT_TILES`` int32, zeroed once,
    shared by every split-K launch there with that index and left all-zero by each (module doc: the
    last program of a tile resets its counter). Indices 0 and 1: this module's main and side stream
    sets; 2: exact mode's products (exact_linear.py). Launches using one buffer must be ordered on the
    device (one stream), which the PDL contract keeps for consecutive kernels (their counter
    accesses follow ``gdc_wait``)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("lfmspark split-K: the per-device arrival counters are created (zeroed) on first use, "
                           "which cannot be captured in a CUDA graph; run a split-K product on this device once "
                           "before capturing (a warm-up run does)")
    counters = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # zero before any stream uses them
    return counters


@dataclass
class AddNorm:
    """The ``ADD_NORM`` epilogue's tensors (:func:`skinny_linear_add_norm`): the residual ``[M, N]``
    added to the product, the next RMSNorm's weight ``[N]``, and the outputs ``s * g`` ``[M, N]`` and
    the per-row partial sums of squares ``[column tiles, M]`` (fp32)."""
    residual: torch.Tensor
    norm_weight: torch.Tensor
    scaled: torch.Tensor
    ssq: torch.Tensor


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: SkinnyConfig, swiglu: bool,
            weight_b: torch.Tensor | None = None, add_norm: AddNorm | None = None,
            row_ssq: torch.Tensor | None = None, eps: float = 0.0, side_stream: bool = False,
            weight_scale: torch.Tensor | None = None) -> None:
    """One launch of the GEMV kernel (one row, ``cfg.gemv``, plain product) or of the ``tl.dot``
    kernel computing ``out [M, N]`` (``N = F`` for SwiGLU, whose ``weight`` is ``w13 [2F, K]``; with
    ``weight_b``, the pair ``[weight; weight_b]``, always on the ``tl.dot`` kernel); with split-K,
    the fp32 workspace and the device's arrival counters. ``add_norm``: the ``ADD_NORM`` epilogue;
    ``row_ssq`` ``[tiles, M]``: every row scaled by ``rsqrt(row_ssq.sum(0) / K + eps)`` (``ROW_NORM``);
    both on the ``tl.dot`` kernel. ``side_stream``: the launch may run beside the main stream's, so
    it takes the side stream's split-K counters (module doc). ``weight_scale`` ``[N]`` (fp32): ``weight``
    holds fp8 values, each output column scaled by its entry (``W_SCALE``; plain products only)."""
    (M, K), N = x.shape, out.shape[1]
    n_a = N
    if weight_b is not None:
        n_a = weight.shape[0]
        if n_a % cfg.block_n:  # the kernel picks one weight per column tile
            raise ValueError(f"skinny_linear_pair: the first weight's {n_a} rows must be whole column tiles "
                             f"(block_n = {cfg.block_n})")
    k_split, splits = split_k_plan(K, cfg.block_k, cfg.split_k)  # recounting the splits drops empty ones
    n_tiles = triton.cdiv(N, cfg.block_n)
    if splits > 1:
        if n_tiles > MAX_SPLIT_TILES:
            raise ValueError(f"split-K over {n_tiles} column tiles: at most {MAX_SPLIT_TILES} (one arrival counter "
                             f"each); use wider tiles (block_n) or no split")
        ws = torch.empty((splits, M, 2 * N if swiglu else N), dtype=torch.float32, device=x.device)
        counters, stride_ws, stride_wsm = _split_counters(x.device, side_stream), ws.stride(0), ws.stride(1)
    else:  # not read: the kernels' split-K code is compiled out
        ws, counters, stride_ws, stride_wsm = out, out, 0, 0
    grid = (n_tiles, splits)
    w_scale = out if weight_scale is None else weight_scale   # not read without W_SCALE
    if M == 1 and cfg.gemv and not swiglu and weight_b is None and add_norm is None and row_ssq is None:
        _gemv_kernel[grid](
            x, weight, out, ws, counters, w_scale, N, K, k_split, weight.stride(0), stride_ws,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0, SPLIT=splits > 1,
            W_SCALE=weight_scale is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(x, one_row_product=True),
        )
    else:
        norm = add_norm or AddNorm(out, out, out, out)  # not read without ADD_NORM
        ssq_in = out if row_ssq is None else row_ssq     # not read without ROW_NORM
        _skinny_linear_kernel[grid](
            x, weight, weight if weight_b is None else weight_b, out, ws, counters,
            norm.residual, norm.norm_weight, norm.scaled, norm.ssq, ssq_in,
            0 if row_ssq is None else row_ssq.shape[0],
            1.0 / K, eps, w_scale,
            M, N, n_a, K, k_split,
            x.stride(0), weight.stride(0), out.stride(0), stride_ws, stride_wsm,
            BLOCK_M=_block_m(M), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0,
            SPLIT=splits > 1, SWIGLU=swiglu, TWO_WEIGHTS=weight_b is not None,
            ADD_NORM=add_norm is not None, ROW_NORM=row_ssq is not None,
            SSQ_TILES=2 if row_ssq is None else max(2, triton.next_power_of_2(row_ssq.shape[0])),
            W_SCALE=weight_scale is not None,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding
            UPCAST=x.device.type != "cuda" and x.dtype == torch.bfloat16,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(x),
        )


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] > MAX_M:
        raise ValueError(f"skinny_linear supports at most {MAX_M} rows, got M = {x.shape[0]}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("weight must be row-major (stride(1) == 1)")


def _default_config(x: torch.Tensor, weight: torch.Tensor, n_out: int, swiglu: bool,
                    weight_b: torch.Tensor | None, row_ssq: torch.Tensor | None, side_stream: bool) -> SkinnyConfig:
    """The launch parameters the ops use: :func:`skinny_config` for a plain product (the GEMV kernel
    at one row), else the swap-AB kernel's (:func:`swiglu_config`, :func:`pair_config`, or
    :func:`swap_ab_config` for a row-scaled product, whose epilogue only that kernel has)."""
    (M, K), elem, sms = x.shape, x.element_size(), _sm_count(x.device)
    if weight_b is not None:
        return pair_config(M, weight.shape[0], weight_b.shape[0], K, elem, sms)
    if swiglu:
        return swiglu_config(M, n_out, K, elem, sms)
    if row_ssq is not None:
        return swap_ab_config(M, n_out, K, elem, sms, side_stream=side_stream)
    return skinny_config(M, n_out, K, elem, sms, side_stream)


def _product(x: torch.Tensor, weight: torch.Tensor, n_out: int, config: SkinnyConfig | None, swiglu: bool,
             weight_b: torch.Tensor | None = None, row_ssq: torch.Tensor | None = None,
             eps: float = 0.0, side_stream: bool = False, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``out [M, n_out]`` of the ops on checked inputs: empty shapes and ``K = 0`` (a zero product;
    for SwiGLU ``silu(0) * 0``) handled on the host, else one :func:`_launch` with ``config`` or the
    default configuration (:func:`_default_config`)."""
    M, K = x.shape
    out = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    config = config or _default_config(x, weight, n_out, swiglu, weight_b, row_ssq, side_stream)
    _launch(x, weight, out, config, swiglu=swiglu, weight_b=weight_b, row_ssq=row_ssq, eps=eps,
            side_stream=side_stream, weight_scale=weight_scale)
    return out


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None,
                         row_ssq: torch.Tensor | None = None, eps: float = 0.0, side_stream: bool = False
                         ) -> torch.Tensor:
    """The op on the Triton kernels (``config``: launch override, for tests and tuning; with ``row_ssq``
    one row also runs on the ``tl.dot`` kernel, whose epilogue has the row scale)."""
    _check(x, weight)
    _check_row_ssq(x, row_ssq)
    return _product(x, weight, weight.shape[0], config, swiglu=False, row_ssq=row_ssq, eps=eps,
                    side_stream=side_stream)


def _check_swiglu(x: torch.Tensor, w13: torch.Tensor) -> None:
    if x.dim() != 2 or w13.dim() != 2 or x.shape[1] != w13.shape[1]:
        raise ValueError(f"expected x [M, H] and w13 [2F, H], got {tuple(x.shape)} and {tuple(w13.shape)}")
    if w13.shape[0] % 2:
        raise ValueError(f"w13 must stack gate and up rows ([2F, H]), got {w13.shape[0]} rows")
    if x.shape[0] > SWIGLU_MAX_M:
        raise ValueError(f"skinny_swiglu supports at most {SWIGLU_MAX_M} rows, got M = {x.shape[0]}")
    if x.dtype != w13.dtype:
        raise ValueError(f"x and w13 must share a dtype, got {x.dtype} and {w13.dtype}")
    if w13.stride(1) != 1:
        raise ValueError("w13 must be row-major (stride(1) == 1)")


def _check_row_ssq(x: torch.Tensor, row_ssq: torch.Tensor | None) -> None:
    if row_ssq is None:
        return
    if row_ssq.dim() != 2 or row_ssq.shape[1] != x.shape[0] or row_ssq.shape[0] < 1:
        raise ValueError(f"row_ssq must be [tiles, M] partial sums of squares for x's M = {x.shape[0]} rows, "
                         f"got {tuple(row_ssq.shape)}")
    if row_ssq.dtype != torch.float32 or not row_ssq.is_contiguous():
        raise ValueError(f"row_ssq must be contiguous fp32 (skinny_linear_add_norm's ssq), got {row_ssq.dtype}")
    if row_ssq.device != x.device:
        raise ValueError(f"row_ssq must be on x's device {x.device}, got {row_ssq.device}")


def skinny_swiglu_triton(x: torch.Tensor, w13: torch.Tensor, config: SkinnyConfig | None = None,
                         row_ssq: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """``skinny_swiglu`` on the ``tl.dot`` kernel (``config``: launch override; ``gemv`` is ignored)."""
    _check_swiglu(x, w13)
    _check_row_ssq(x, row_ssq)
    return _product(x, w13, w13.shape[0] // 2, config, swiglu=True, row_ssq=row_ssq, eps=eps)


def _check_add_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor) -> None:
    _check(x, weight)
    M, N = x.shape[0], weight.shape[0]
    if residual.shape != (M, N) or residual.dtype != x.dtype:
        raise ValueError(f"residual must be [M, N] = {(M, N)} in {x.dtype}, got {tuple(residual.shape)} in "
                         f"{residual.dtype}")
    if norm_weight.shape != (N,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_weight must be [N] = [{N}] in {x.dtype}, got {tuple(norm_weight.shape)} in "
                         f"{norm_weight.dtype}")
    if not x.device == weight.device == residual.device == norm_weight.device:
        raise ValueError(f"x, weight, residual and norm_weight must be on one device, got {x.device}, {weight.device}, "
                         f"{residual.device} and {norm_weight.device}")


def add_norm_config(x: torch.Tensor, weight: torch.Tensor) -> SkinnyConfig:
    """Launch parameters of ``skinny_linear_add_norm``: the plain product's swap-AB tiles (for one
    row too: the epilogue is the ``tl.dot`` kernel's); their ``block_n`` sets the ssq partials."""
    (M, K), N = x.shape, weight.shape[0]
    return swap_ab_config(M, N, K, x.element_size(), _sm_count(x.device))


def skinny_linear_add_norm_triton(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                                  norm_weight: torch.Tensor, config: SkinnyConfig | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``skinny_linear_add_norm`` on the ``tl.dot`` kernel (``config``: launch override)."""
    _check_add_norm(x, weight, residual, norm_weight)
    config = config or add_norm_config(x, weight)
    (M, K), N = x.shape, weight.shape[0]
    if M == 0 or N == 0 or K == 0:
        return skinny_linear_add_norm_reference(x, weight, residual, norm_weight, config.block_n)
    # row-major [M, N] outputs: the kernel addresses them, and the residual, with one row stride
    s, scaled = (torch.empty((M, N), dtype=x.dtype, device=x.device) for _ in range(2))
    ssq = torch.empty((triton.cdiv(N, config.block_n), M), dtype=torch.float32, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    _launch(x, weight, s, config, swiglu=False,
            add_norm=AddNorm(residual.contiguous(), norm_weight.contiguous(), scaled, ssq))
    return s, scaled, ssq


def pair_problem(x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor) -> str | None:
    """Why ``skinny_linear_pair`` cannot take these inputs (``x [M, K]``), or None if it can; the
    op raises it, models/layers.py ``linear_pair`` falls back to two products on it."""
    if x.dim() != 2 or w_a.dim() != 2 or w_b.dim() != 2 or not x.shape[1] == w_a.shape[1] == w_b.shape[1]:
        return (f"expected x [M, K], w_a [N_A, K] and w_b [N_B, K], got {tuple(x.shape)}, {tuple(w_a.shape)} and "
                f"{tuple(w_b.shape)}")
    if x.shape[0] > MAX_M:
        return f"skinny_linear_pair supports at most {MAX_M} rows, got M = {x.shape[0]}"
    if not x.dtype == w_a.dtype == w_b.dtype:
        return f"x, w_a and w_b must share a dtype, got {x.dtype}, {w_a.dtype} and {w_b.dtype}"
    if w_a.stride(1) != 1 or w_b.stride(1) != 1:
        return "w_a and w_b must be row-major (stride(1) == 1)"
    if w_a.stride(0) != w_b.stride(0):
        return f"w_a and w_b must share a row stride (one stride_wn), got {w_a.stride(0)} and {w_b.stride(0)}"
    if w_a.shape[0] % PAIR_ROWS_ALIGN:
        return f"w_a's rows must be a multiple of {PAIR_ROWS_ALIGN} (whole column tiles), got {w_a.shape[0]}"
    return None


def _check_pair(x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor) -> None:
    if (problem := pair_problem(x, w_a, w_b)) is not None:
        raise ValueError(problem)


def pair_config(M: int, N_A: int, N_B: int, K: int, elem_size: int, sms: int) -> SkinnyConfig:
    """Launch parameters of ``skinny_linear_pair``: :func:`swap_ab_config` for the ``N_A + N_B``
    columns (so ``LFMSPARK_TUNE``'s ``tile@NxK`` keys name the total), with column tiles halved
    until ``N_A`` is a whole number of them (no change at the served draft shape, ``N_A = 2048``)."""
    cfg = swap_ab_config(M, N_A + N_B, K, elem_size, sms)
    block_n = cfg.block_n
    while N_A % block_n:
        block_n //= 2
    return replace(cfg, block_n=block_n)


def skinny_linear_pair_triton(x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor,
                              config: SkinnyConfig | None = None, row_ssq: torch.Tensor | None = None,
                              eps: float = 0.0) -> torch.Tensor:
    """``skinny_linear_pair`` on the ``tl.dot`` kernel (``config``: launch override, its ``block_n``
    dividing ``N_A``; ``gemv`` is ignored)."""
    _check_pair(x, w_a, w_b)
    _check_row_ssq(x, row_ssq)
    return _product(x, w_a, w_a.shape[0] + w_b.shape[0], config, swiglu=False, weight_b=w_b, row_ssq=row_ssq,
                    eps=eps)


# ---------------------------------------------------------------------------------------------
# references

def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, row_ssq: torch.Tensor | None = None,
                            eps: float = 0.0) -> torch.Tensor:
    """``F.linear``; with ``row_ssq``, the fp32 product scaled by each row's ``rsqrt(mean square + eps)``
    (the mean over ``x``'s width), then rounded once (``ROW_NORM``)."""
    if row_ssq is None:
        return F.linear(x, weight)
    return (F.linear(x.float(), weight.float()) * row_rstd_reference(row_ssq, x.shape[1], eps)).to(x.dtype)


def skinny_linear_pair_reference(x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor,
                                 row_ssq: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    return torch.cat([skinny_linear_reference(x, w_a, row_ssq, eps), skinny_linear_reference(x, w_b, row_ssq, eps)],
                     dim=-1)


def row_rstd_reference(row_ssq: torch.Tensor, width: int, eps: float) -> torch.Tensor:
    """``[M, 1]`` fp32 ``rsqrt(mean square + eps)`` from the partial sums of squares ``[tiles, M]``."""
    return torch.rsqrt(row_ssq.sum(0) / width + eps)[:, None]


def skinny_swiglu_reference(x: torch.Tensor, w13: torch.Tensor, row_ssq: torch.Tensor | None = None,
                            eps: float = 0.0) -> torch.Tensor:
    """The unfused module: ``F.linear`` (gate and up each rounded once to ``x``'s dtype), then
    ``F.silu`` (rounded) times up (rounded). With ``row_ssq``, gate and up are the fp32 products
    scaled by each row's ``rsqrt(mean square + eps)`` before that rounding (``ROW_NORM``)."""
    if row_ssq is None:
        gate_up = F.linear(x, w13)
    else:
        gate_up = (F.linear(x.float(), w13.float()) * row_rstd_reference(row_ssq, x.shape[1], eps)).to(x.dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def skinny_linear_add_norm_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                                     norm_weight: torch.Tensor, block_n: int
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s, s * g, ssq)``: ``s = residual + x @ weight^T`` (the product rounded, then the add rounded,
    as the modules do), ``s * norm_weight`` rounded once, and the fp32 sums of ``s^2`` per row over
    each ``block_n``-column tile, ``[tiles, M]`` (the kernel's partials: their sum is the row's)."""
    s = residual + F.linear(x, weight)
    s32 = s.float()
    M, N = s.shape
    tiles = triton.cdiv(N, block_n)
    sq = F.pad(s32 * s32, (0, tiles * block_n - N)).view(M, tiles, block_n)
    return s, (s32 * norm_weight.float()).to(s.dtype), sq.sum(-1).T.contiguous()


# ---------------------------------------------------------------------------------------------
# ops
#
# No mutated arguments, although split-K launches update the device's arrival counters
# (_split_counters): every launch leaves them all-zero, as it found them, so both ops are pure
# functions of their inputs. Declaring the counters as a mutated argument would make the callers
# pass them around and functionalization copy them back after every call for nothing; keeping
# them internal keeps the ops' signatures (and the compiled graphs that call them) unchanged, and a
# CUDA graph replays a launch any number of times.

@torch.library.custom_op("lfmspark::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, row_ssq: torch.Tensor | None = None,
                  eps: float = 0.0, side_stream: bool = False) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T`` -> ``[M, N]`` in ``x``'s dtype, for ``M <= 64``. With ``row_ssq`` (the
    ``ssq`` of :func:`skinny_linear_add_norm`, ``x`` its ``s * g``), each row is scaled by
    ``rsqrt(row_ssq.sum(0) / K + eps)`` before the one rounding: the product of ``RMSNorm(s)``.
    ``side_stream``: the call runs on a stream beside the main one (the round's context injection):
    its own split-K counters and fewer pipeline stages (``SIDE_STREAM_STAGES``); the same values."""
    if use_triton(x):
        return skinny_linear_triton(x, weight, row_ssq=row_ssq, eps=eps, side_stream=side_stream)
    _check(x, weight)  # the same limits on every device
    _check_row_ssq(x, row_ssq)
    return skinny_linear_reference(x, weight, row_ssq, eps)


@skinny_linear.register_kernel("cuda")
def _skinny_linear_cuda(x, weight, row_ssq=None, eps=0.0, side_stream=False):
    return skinny_linear_triton(x, weight, row_ssq=row_ssq, eps=eps, side_stream=side_stream)


@skinny_linear.register_fake
def _skinny_linear_fake(x, weight, row_ssq=None, eps=0.0, side_stream=False):
    _check(x, weight)
    _check_row_ssq(x, row_ssq)
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("lfmspark::skinny_swiglu", mutates_args=())
def skinny_swiglu(x: torch.Tensor, w13: torch.Tensor, row_ssq: torch.Tensor | None = None,
                  eps: float = 0.0) -> torch.Tensor:
    """``silu(gate) * up`` with ``[gate | up] = x [M, H] @ w13[2F, H]^T`` -> ``[M, F]``, for ``M <= 16``
    (the batch-1 verify and draft, and one-row products outside the decode step's fused GEMV). With ``row_ssq`` (the
    ``ssq`` of :func:`skinny_linear_add_norm`, ``x`` its ``s * g``), gate and up are scaled per row
    by ``rsqrt(row_ssq.sum(0) / H + eps)``: the feed-forward of ``RMSNorm(s)``."""
    if use_triton(x):
        return skinny_swiglu_triton(x, w13, row_ssq=row_ssq, eps=eps)
    _check_swiglu(x, w13)
    _check_row_ssq(x, row_ssq)
    return skinny_swiglu_reference(x, w13, row_ssq, eps)


@skinny_swiglu.register_kernel("cuda")
def _skinny_swiglu_cuda(x, w13, row_ssq=None, eps=0.0):
    return skinny_swiglu_triton(x, w13, row_ssq=row_ssq, eps=eps)


@skinny_swiglu.register_fake
def _skinny_swiglu_fake(x, w13, row_ssq=None, eps=0.0):
    _check_swiglu(x, w13)
    _check_row_ssq(x, row_ssq)
    return x.new_empty((x.shape[0], w13.shape[0] // 2))


@torch.library.custom_op("lfmspark::skinny_linear_add_norm", mutates_args=())
def skinny_linear_add_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                           norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s, s * norm_weight, ssq)`` with ``s = residual + x [M, K] @ weight[N, K]^T`` (``[M, N]``, the
    modules' roundings) and ``ssq`` ``[tiles, M]`` fp32 partial sums of ``s^2`` per row: what the next
    RMSNorm's consumer takes (``skinny_swiglu``'s ``row_ssq``), so that no norm kernel runs between
    the two products. Why: the several-row add + RMSNorm kernels between the round's products cost
    ~97 us per batch-1 round (all removed: docs/decisions.md)."""
    if use_triton(x):
        return skinny_linear_add_norm_triton(x, weight, residual, norm_weight)
    _check_add_norm(x, weight, residual, norm_weight)
    return skinny_linear_add_norm_reference(x, weight, residual, norm_weight, add_norm_config(x, weight).block_n)


@skinny_linear_add_norm.register_kernel("cuda")
def _skinny_linear_add_norm_cuda(x, weight, residual, norm_weight):
    return skinny_linear_add_norm_triton(x, weight, residual, norm_weight)


@skinny_linear_add_norm.register_fake
def _skinny_linear_add_norm_fake(x, weight, residual, norm_weight):
    _check_add_norm(x, weight, residual, norm_weight)
    tiles = triton.cdiv(weight.shape[0], add_norm_config(x, weight).block_n)
    return (residual.new_empty(residual.shape), residual.new_empty(residual.shape),
            x.new_empty((tiles, x.shape[0]), dtype=torch.float32))


@torch.library.custom_op("lfmspark::skinny_linear_pair", mutates_args=())
def skinny_linear_pair(x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor, row_ssq: torch.Tensor | None = None,
                       eps: float = 0.0) -> torch.Tensor:
    """``x [M, K] @ [w_a; w_b]^T`` -> ``[M, N_A + N_B]`` in ``x``'s dtype, for ``M <= 64``, in one
    launch and without stacking the weights (``N_A`` a multiple of 16, one row stride). ``row_ssq``,
    ``eps``: the row scale of ``skinny_linear``."""
    if use_triton(x):
        return skinny_linear_pair_triton(x, w_a, w_b, row_ssq=row_ssq, eps=eps)
    _check_pair(x, w_a, w_b)
    _check_row_ssq(x, row_ssq)
    return skinny_linear_pair_reference(x, w_a, w_b, row_ssq, eps)


@skinny_linear_pair.register_kernel("cuda")
def _skinny_linear_pair_cuda(x, w_a, w_b, row_ssq=None, eps=0.0):
    return skinny_linear_pair_triton(x, w_a, w_b, row_ssq=row_ssq, eps=eps)


@skinny_linear_pair.register_fake
def _skinny_linear_pair_fake(x, w_a, w_b, row_ssq=None, eps=0.0):
    _check_pair(x, w_a, w_b)
    _check_row_ssq(x, row_ssq)
    return x.new_empty((x.shape[0], w_a.shape[0] + w_b.shape[0]))
