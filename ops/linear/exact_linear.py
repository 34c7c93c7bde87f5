"""Batch-invariant linear: ``x [M, K] @ weight[N, K]^T`` where every output row is computed with the
same arithmetic whatever ``M`` is and wherever the row sits in the launch (exact mode).

Why: the default products pick their kernel and its reduction by the number of rows (the one-row
GEMV, the swap-AB ``tl.dot`` kernel with a split-K that follows ``M``, cuBLAS past 16 rows:
ops/routing.py). A token's logits in a one-row decode step and in a ten-row verify window are then
summed in different orders, and a near-tied argmax can flip between target-only and speculative
decoding on the GPU. Exact mode routes every product through this op, which fixes the order.

Design: one tile shape for every ``M`` (:data:`BLOCK_M` rows, ``tl.dot``'s minimum; ``BLOCK_N`` x
``BLOCK_K`` from :func:`exact_config`), and the K range cut into a number of splits fixed by the
weight's shape ``(N, K)`` alone. Program ``(row group, column tile, split)`` loads each of its
split's weight tiles once and, for each of the group's row tiles (up to :data:`MAX_ROW_TILES`, as
many as the launch's rows allow: :func:`row_tiles_per_program`), adds that tile's 16-row ``tl.dot``
into the tile's own fp32 accumulator, K steps in order. A row tile's arithmetic is therefore the
same instruction sequence whether its program holds one row tile or eight; the group only saves the
weight's re-reads (a verify of 80 rows is one group of five). With one split (a plan of the shape:
wide products such as the LM head) the program rounds each tile and stores it. With several it
writes the tiles to an ``[splits, M, N]`` workspace and arrives at the group's counter; the group's
last program to arrive sums the workspace's partials in split order ``0 .. splits - 1``, whichever
program it is, rounds once and resets the counter: the serial split-K fix-up of skinny_linear.py
(its counters, set 2, and its synchronisation), in the product's own launch. An output element
therefore depends only on its own row of ``x``, its column of ``weight`` and the shape's fixed plan:
a row alone (padded to a tile with masked zero rows), one of 2, 10 or 16 rows, or the last row of a
prefill chunk get the same bits. The MMA instruction is chosen by the tile shape, which never
changes; padding rows are zeros and never stored. (That takes a tile product that computes every
row and column of the tile alike: the GPU's ``tl.dot`` does; the interpreter's is the CPU's BLAS,
which need not, so off CUDA the kernel sums each element's products itself: ops/exact_dot.py.) A program of one row tile (a decode step's, a
batch-1 verify's) requests its first K step's weight tiles before the PDL wait (ops/_dispatch.py),
under its predecessor's tail, as skinny_linear does: when a load is issued changes no sum. A
launch holds at most ``MAX_SPLIT_TILES`` (row group, column tile) counters; a longer split product
runs as several launches over consecutive row ranges, which changes no row's bits.

``lfmspark::exact_swiglu`` is the same kernel with ``SWIGLU``: for a dense SwiGLU's stacked
``w13 = [gate; up]`` each program loads its gate tile and the up tile ``F`` rows below it every K
step, runs the same 16-row ``tl.dot`` on each into two accumulators a row tile (at most
:data:`SWIGLU_ROW_TILES` row tiles a program: the five of an 80-row verify), and applies the
activation in the epilogue (or the fix-up) with the unfused module's roundings: the gate and up
sums are ``exact_linear``'s of ``w13`` under the same plan, and the ``[M, 2F]`` product is never
written nor read back.

Cost: a narrow weight's product is split so that a one-row product still has about 128 programs
streaming it, which a prefill chunk pays as extra partial traffic through L2; wide ones are not
split (:func:`exact_config`). The fast default mode is unchanged; exact mode's price is measured
per model (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._dispatch import pdl_kwargs, use_triton
from ..exact_dot import exact_dot
from .skinny_linear import MAX_SPLIT_TILES, _arrives_last, _counter_buffer, _store_out, _sum_partials

EXACT_COUNTERS = 2      # the counter set of these launches (skinny_linear's main and side streams use 0 and 1)

BLOCK_M = 16            # rows per tile, for every M (tl.dot's minimum)
MAX_ROW_TILES = 8       # row tiles a program of 64-column tiles runs against one weight tile
SWIGLU_ROW_TILES = 5    # with the SwiGLU epilogue (two accumulators a row tile: the kernel holds ten)


@dataclass(frozen=True)
class ExactConfig:
    block_n: int
    block_k: int
    splits: int         # K splits, each ``steps`` K steps of ``block_k`` (the last may be shorter)
    steps: int
    num_warps: int = 4  # launch parameters (they change no sum's order), fixed per shape like the tiles
    num_stages: int = 4
    row_programs: int = 0   # the programs a launch of many rows aims for (row_tiles_per_program), 0: none


def exact_config(N: int, K: int, *, block_k: int = 256, block_n: int = 64, unsplit_tiles: int = 48,
                 target_programs: int = 128, min_split_steps: int = 2, num_warps: int = 4,
                 num_stages: int = 4, row_programs: int = 0) -> ExactConfig:
    """The launch plan of a weight ``[N, K]``: a function of the shape only, never of ``M`` or the
    device, which is what makes the op batch-invariant (module doc).

    The rule (the keywords are its constants, for benchmarks/kernels/exact_linear.py's sweep; the op
    uses the defaults, chosen by that sweep with the row-tile programs: docs/decisions.md):
    256-wide K steps and 64-column tiles for every shape (a program of 64 columns holds all five row
    tiles of an 80-row verify, where 128 columns would hold four and read the weight twice); no K
    split once the column tiles number ``unsplit_tiles`` (a split costs the workspace's traffic and
    the tile's serial sum), otherwise splits of at least ``min_split_steps`` K steps up to about
    ``target_programs`` programs (a one-row product of a narrow weight needs them to stream it).
    ``row_programs`` (a launch parameter, :func:`row_tiles_per_program`): the programs a launch of
    several row tiles aims for by running them in more groups; 0, the default, keeps them in as few
    groups as the accumulators allow (the sweep's axis: a narrow unsplit product of 48 column tiles
    runs an 80-row verify on 48 SMs, each with five tiles' 16-row MMAs)."""
    k_steps = max(1, triton.cdiv(K, block_k))
    col_tiles = triton.cdiv(N, block_n)
    want = 1 if col_tiles >= unsplit_tiles else triton.cdiv(target_programs, col_tiles)
    splits = max(1, min(want, k_steps // min_split_steps))
    steps = triton.cdiv(k_steps, splits)
    return ExactConfig(block_n, block_k, triton.cdiv(k_steps, steps), steps, num_warps, num_stages, row_programs)


def _stages_that_fit(cfg: ExactConfig, row_tiles: int, element_size: int, smem_limit: int | None,
                     weight_tiles: int = 1) -> int:
    """The plan's pipeline depth, less where ``smem_limit`` (the device's shared memory per block;
    None: no limit, off the GPU) cannot hold its buffers, each ``weight_tiles`` weight tiles (two
    with the SwiGLU epilogue) and ``row_tiles`` x tiles (a launch parameter: the sums' order is the
    tile's, whatever the depth). Triton 3.6 keeps ``num_stages - 1`` such buffers in shared memory
    (scripts/compile_sm90.py prints the sizes: 3 x 40 KB for one row tile of 64 x 256 at 4 stages,
    the peeled first K step included)."""
    if not smem_limit:
        return cfg.num_stages
    buffer_bytes = (weight_tiles * cfg.block_n + row_tiles * BLOCK_M) * cfg.block_k * element_size
    return max(1, min(cfg.num_stages, smem_limit // buffer_bytes + 1))


def _smem_limit(x: torch.Tensor) -> int | None:
    if x.device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(x.device), "shared_memory_per_block_optin", None)


def row_tiles_per_program(M: int, block_n: int, programs_per_group: int = 1, row_programs: int = 0,
                          weight_tiles: int = 1) -> int:
    """Row tiles each program of an ``M``-row launch runs against its ``weight_tiles`` weight tiles
    (two with the SwiGLU epilogue: two accumulators a row tile): all of them up to the accumulators'
    register budget (``MAX_ROW_TILES`` 64-wide row tiles' worth, ``SWIGLU_ROW_TILES`` with the
    SwiGLU epilogue, never more row tiles than that: the kernel's accumulators), else as even a
    share as the groups allow; with ``row_programs``, in enough groups (of ``programs_per_group``
    programs each: the column tiles times the splits) for that many programs, each group re-reading
    the weight tiles (from L2 after the first). A launch parameter: every row tile's arithmetic is
    the same whatever it is."""
    cap = MAX_ROW_TILES if weight_tiles == 1 else SWIGLU_ROW_TILES
    most = max(1, min(cap, cap * 64 // block_n))   # never past the kernel's accumulators
    tiles = triton.cdiv(M, BLOCK_M)
    groups = max(triton.cdiv(tiles, most), min(tiles, triton.cdiv(row_programs, programs_per_group)))
    return triton.cdiv(tiles, groups)


@triton.jit
def _row_tile(x_ptr, tile, M, k, k_ok, stride_xm, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr):
    # one row tile's 16 rows of x at K step k (zeros past M and K)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + k[None, :], mask=(rows < M)[:, None] & k_ok[None, :],
                other=0.0)
    if UPCAST:  # the Triton interpreter multiplies bf16 dot operands as raw integers
        a = a.to(tl.float32)
    return a


@triton.jit
def _tile_dot(x_ptr, tile, M, k, k_ok, stride_xm, wt, acc, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
              UPCAST: tl.constexpr, ROWWISE: tl.constexpr):
    # one row tile's K step: its 16 rows of x against the program's weight tile ([BLOCK_K, BLOCK_N]),
    # the same instruction sequence for a row tile whichever program and launch it is in (ROWWISE:
    # under the interpreter, each element's own sum: ops/exact_dot.py)
    a = _row_tile(x_ptr, tile, M, k, k_ok, stride_xm, BLOCK_M, UPCAST)
    return exact_dot(a, wt, acc, DOT_PRECISION, ROWWISE)


@triton.jit
def _tile_dot_pair(x_ptr, tile, M, k, k_ok, stride_xm, wt, wut, acc, acc_u, BLOCK_M: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROWWISE: tl.constexpr):
    # SWIGLU: the row tile loaded once, against the gate tile and the up tile, each dot the one the
    # plain product runs on that weight tile
    a = _row_tile(x_ptr, tile, M, k, k_ok, stride_xm, BLOCK_M, UPCAST)
    return (exact_dot(a, wt, acc, DOT_PRECISION, ROWWISE),
            exact_dot(a, wut, acc_u, DOT_PRECISION, ROWWISE))


@triton.jit
def _tile_store(acc, tile, M, cols64, col_ok, dst_ptr, stride_m, BLOCK_M: tl.constexpr):
    # a row tile's [BLOCK_M, BLOCK_N] values to dst (the output, rounded to its dtype, or a split's
    # fp32 slice of the workspace)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & col_ok[None, :]
    tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_m + cols64[None, :], acc.to(dst_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _tile_fix_up(tile, M, N, cols64, col_ok, ws_ptr, stride_ws, stride_wsm, out_ptr, stride_om, splits,
                 BLOCK_M: tl.constexpr, SWIGLU: tl.constexpr):
    # a row tile's partials summed in split order, rounded once, stored (SWIGLU: the up partials sit
    # N columns to the right of the gate's; the activation then as the unfused module rounds it)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    mask = (rows < M)[:, None] & col_ok[None, :]
    partials = ws_ptr + rows64[:, None] * stride_wsm + cols64[None, :]
    total = _sum_partials(partials, mask, stride_ws, splits)
    total_u = _sum_partials(partials + N, mask, stride_ws, splits) if SWIGLU else total
    _store_out(out_ptr + rows64[:, None] * stride_om + cols64[None, :], mask, total, total_u, SWIGLU)


@triton.jit
def _swiglu_store(acc, acc_u, tile, M, cols64, col_ok, out_ptr, stride_om, BLOCK_M: tl.constexpr):
    # one split, SWIGLU: a row tile's gate and up sums through the activation into the output
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & col_ok[None, :]
    _store_out(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols64[None, :], mask, acc, acc_u, True)


@triton.jit
def _store_row_tiles(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, t0, M, cols64, col_ok, dst_ptr, stride_m,
                     BLOCK_M: tl.constexpr, ROW_TILES: tl.constexpr):
    _tile_store(acc0, t0, M, cols64, col_ok, dst_ptr, stride_m, BLOCK_M)
    if ROW_TILES > 1:
        _tile_store(acc1, t0 + 1, M, cols64, col_ok, dst_ptr, stride_m, BLOCK_M)
    if ROW_TILES > 2:
        _tile_store(acc2, t0 + 2, M, cols64, col_ok, dst_ptr, stride_m, BLOCK_M)
    if ROW_TILES > 3:
        _tile_store(acc3, t0 + 3, M, cols64, col_ok, dst_ptr, stride_m, BLOCK_M)
    if ROW_TILES > 4:
        _tile_store(acc4, t0 + 4, M, cols64, col_ok, dst_ptr, stride_m, BLOCK_M)
    if ROW_TILES > 5:
        _tile_store(acc5, t0 + 5, M, cols64, col_ok, dst_ptr, stride_m, BLOCK_M)
    if ROW_TILES > 6:
        _tile_store(acc6, t0 + 6, M, cols64, col_ok, dst_ptr, stride_m, BLOCK_M)
    if ROW_TILES > 7:
        _tile_store(acc7, t0 + 7, M, cols64, col_ok, dst_ptr, stride_m, BLOCK_M)


@triton.jit
def _weight_tiles(w_ptr, cols64, col_ok, N, k, k_ok, stride_wn, SWIGLU: tl.constexpr, UPCAST: tl.constexpr):
    # a K step's weight tile of the program's columns (SWIGLU: and the up tile N rows below it)
    mask = col_ok[:, None] & k_ok[None, :]
    w = tl.load(w_ptr + cols64[:, None] * stride_wn + k[None, :], mask=mask, other=0.0)
    wu = w
    if SWIGLU:
        wu = tl.load(w_ptr + (cols64 + N)[:, None] * stride_wn + k[None, :], mask=mask, other=0.0)
    if UPCAST:  # the Triton interpreter multiplies bf16 dot operands as raw integers
        w = w.to(tl.float32)
        wu = wu.to(tl.float32)
    return w, wu


@triton.jit
def _k_step(x_ptr, t0, M, k, k_ok, stride_xm, w, wu, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc8, acc9,
            BLOCK_M: tl.constexpr, ROW_TILES: tl.constexpr, SWIGLU: tl.constexpr,
            DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROWWISE: tl.constexpr):
    # one K step of the program's row tiles against its weight tile(s) (the accumulators: module doc
    # and _exact_linear_kernel), the same 16-row tl.dot for every row tile
    wt = tl.trans(w)
    if SWIGLU:
        wut = tl.trans(wu)
        acc0, acc5 = _tile_dot_pair(x_ptr, t0, M, k, k_ok, stride_xm, wt, wut, acc0, acc5, BLOCK_M, DOT_PRECISION,
                                    UPCAST, ROWWISE)
        if ROW_TILES > 1:
            acc1, acc6 = _tile_dot_pair(x_ptr, t0 + 1, M, k, k_ok, stride_xm, wt, wut, acc1, acc6, BLOCK_M,
                                        DOT_PRECISION, UPCAST, ROWWISE)
        if ROW_TILES > 2:
            acc2, acc7 = _tile_dot_pair(x_ptr, t0 + 2, M, k, k_ok, stride_xm, wt, wut, acc2, acc7, BLOCK_M,
                                        DOT_PRECISION, UPCAST, ROWWISE)
        if ROW_TILES > 3:
            acc3, acc8 = _tile_dot_pair(x_ptr, t0 + 3, M, k, k_ok, stride_xm, wt, wut, acc3, acc8, BLOCK_M,
                                        DOT_PRECISION, UPCAST, ROWWISE)
        if ROW_TILES > 4:
            acc4, acc9 = _tile_dot_pair(x_ptr, t0 + 4, M, k, k_ok, stride_xm, wt, wut, acc4, acc9, BLOCK_M,
                                        DOT_PRECISION, UPCAST, ROWWISE)
    else:
        acc0 = _tile_dot(x_ptr, t0, M, k, k_ok, stride_xm, wt, acc0, BLOCK_M, DOT_PRECISION, UPCAST, ROWWISE)
        if ROW_TILES > 1:
            acc1 = _tile_dot(x_ptr, t0 + 1, M, k, k_ok, stride_xm, wt, acc1, BLOCK_M, DOT_PRECISION, UPCAST, ROWWISE)
        if ROW_TILES > 2:
            acc2 = _tile_dot(x_ptr, t0 + 2, M, k, k_ok, stride_xm, wt, acc2, BLOCK_M, DOT_PRECISION, UPCAST, ROWWISE)
        if ROW_TILES > 3:
            acc3 = _tile_dot(x_ptr, t0 + 3, M, k, k_ok, stride_xm, wt, acc3, BLOCK_M, DOT_PRECISION, UPCAST, ROWWISE)
        if ROW_TILES > 4:
            acc4 = _tile_dot(x_ptr, t0 + 4, M, k, k_ok, stride_xm, wt, acc4, BLOCK_M, DOT_PRECISION, UPCAST, ROWWISE)
        if ROW_TILES > 5:
            acc5 = _tile_dot(x_ptr, t0 + 5, M, k, k_ok, stride_xm, wt, acc5, BLOCK_M, DOT_PRECISION, UPCAST, ROWWISE)
        if ROW_TILES > 6:
            acc6 = _tile_dot(x_ptr, t0 + 6, M, k, k_ok, stride_xm, wt, acc6, BLOCK_M, DOT_PRECISION, UPCAST, ROWWISE)
        if ROW_TILES > 7:
            acc7 = _tile_dot(x_ptr, t0 + 7, M, k, k_ok, stride_xm, wt, acc7, BLOCK_M, DOT_PRECISION, UPCAST, ROWWISE)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc8, acc9


@triton.jit(do_not_specialize=["M"])
def _exact_linear_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, cnt_ptr,
    M, N, K, steps,
    stride_xm, stride_wn, stride_ws, stride_wsm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_TILES: tl.constexpr,
    SPLIT: tl.constexpr, SWIGLU: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, DOT_ROWWISE: tl.constexpr, PDL: tl.constexpr,
):
    # program (row group, column tile, split): ROW_TILES consecutive row tiles (1 to MAX_ROW_TILES),
    # each with its own accumulator and the same 16-row tl.dot per K step, against one weight tile
    # loaded once per K step for all of them (unrolled by hand: Triton has no arrays of tiles; the
    # accumulators past ROW_TILES are never touched and compile away). SWIGLU (w = [gate; up], the
    # output N = F columns): the program also loads the up rows N + its columns, and row tile j's up
    # sums go to accumulator j + 5 (so at most 5 row tiles, SWIGLU_ROW_TILES)
    tl.static_assert(ROW_TILES <= (5 if SWIGLU else 8), "ten accumulators: 8 row tiles, 5 with SWIGLU")
    if PDL:  # ops/_dispatch.py: x may come from the predecessor
        tl.extra.cuda.gdc_launch_dependents()
    pid_g, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = pid_g * ROW_TILES
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)     # offsets past 2^31 elements (long prompts x vocab)
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc5 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc6 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc7 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc8 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc9 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k0 = pid_s * steps * BLOCK_K
    if ROW_TILES == 1:
        # one row tile (a decode step's, a batch-1 verify's): the first K step is peeled, its weight
        # tiles requested before the PDL wait, under the predecessor's tail, as skinny_linear does (x
        # is read after it). The same K steps in the same order, the same dots: the same bits as
        # unpeeled. Not with more row tiles, whose accumulators leave no registers for the held tiles
        # (ptxas: spills in the K loop)
        k = k0 + ks
        k_ok = k < K
        w, wu = _weight_tiles(w_ptr, cols64, col_ok, N, k, k_ok, stride_wn, SWIGLU, UPCAST)
        if PDL:
            tl.extra.cuda.gdc_wait()
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc8, acc9 = _k_step(
            x_ptr, t0, M, k, k_ok, stride_xm, w, wu, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc8, acc9,
            BLOCK_M, ROW_TILES, SWIGLU, DOT_PRECISION, UPCAST, DOT_ROWWISE)
        first = 1
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        first = 0
    for i in range(first, steps):
        k = k0 + i * BLOCK_K + ks
        k_ok = k < K
        w, wu = _weight_tiles(w_ptr, cols64, col_ok, N, k, k_ok, stride_wn, SWIGLU, UPCAST)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc8, acc9 = _k_step(
            x_ptr, t0, M, k, k_ok, stride_xm, w, wu, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc8, acc9,
            BLOCK_M, ROW_TILES, SWIGLU, DOT_PRECISION, UPCAST, DOT_ROWWISE)
    # one split (a plan of the shape, whatever M): each row tile rounded once into the output (SWIGLU:
    # through the activation); several: the partials to this split's slice of the workspace (SWIGLU:
    # the up sums N columns right of the gate's), and the group's last program to arrive sums them in
    # split order
    if SPLIT:
        ws_split = ws_ptr + pid_s.to(tl.int64) * stride_ws
        if SWIGLU:
            _store_row_tiles(acc0, acc1, acc2, acc3, acc4, acc0, acc0, acc0, t0, M, cols64, col_ok, ws_split,
                             stride_wsm, BLOCK_M, ROW_TILES)
            _store_row_tiles(acc5, acc6, acc7, acc8, acc9, acc5, acc5, acc5, t0, M, cols64, col_ok, ws_split + N,
                             stride_wsm, BLOCK_M, ROW_TILES)
        else:
            _store_row_tiles(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, t0, M, cols64, col_ok, ws_split,
                             stride_wsm, BLOCK_M, ROW_TILES)
        counter = cnt_ptr + pid_g * tl.num_programs(1) + pid_n
        splits = tl.num_programs(2)
        if _arrives_last(counter, splits):
            for j in tl.static_range(ROW_TILES):
                _tile_fix_up(t0 + j, M, N, cols64, col_ok, ws_ptr, stride_ws, stride_wsm, out_ptr, stride_om, splits,
                             BLOCK_M, SWIGLU)
            tl.store(counter, 0)  # reusable by the next launch
    elif SWIGLU:
        _swiglu_store(acc0, acc5, t0, M, cols64, col_ok, out_ptr, stride_om, BLOCK_M)
        if ROW_TILES > 1:
            _swiglu_store(acc1, acc6, t0 + 1, M, cols64, col_ok, out_ptr, stride_om, BLOCK_M)
        if ROW_TILES > 2:
            _swiglu_store(acc2, acc7, t0 + 2, M, cols64, col_ok, out_ptr, stride_om, BLOCK_M)
        if ROW_TILES > 3:
            _swiglu_store(acc3, acc8, t0 + 3, M, cols64, col_ok, out_ptr, stride_om, BLOCK_M)
        if ROW_TILES > 4:
            _swiglu_store(acc4, acc9, t0 + 4, M, cols64, col_ok, out_ptr, stride_om, BLOCK_M)
    else:
        _store_row_tiles(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, t0, M, cols64, col_ok, out_ptr, stride_om,
                         BLOCK_M, ROW_TILES)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("weight must be row-major (stride(1) == 1)")


def _check_swiglu(x: torch.Tensor, w13: torch.Tensor) -> None:
    _check(x, w13)
    if w13.shape[0] % 2:
        raise ValueError(f"exact_swiglu: w13 stacks the gate and up rows [2F, K], got {w13.shape[0]} rows (odd)")


def exact_linear_triton(x: torch.Tensor, weight: torch.Tensor, config: ExactConfig | None = None) -> torch.Tensor:
    """The op on the Triton kernels (``config``: the plan override, for tests)."""
    _check(x, weight)
    return _launch(x, weight, weight.shape[0], config or exact_config(weight.shape[0], x.shape[1]), swiglu=False)


def exact_swiglu_triton(x: torch.Tensor, w13: torch.Tensor, config: ExactConfig | None = None) -> torch.Tensor:
    """``lfmspark::exact_swiglu`` on the Triton kernels (``config``: the plan override, for tests;
    by default the plan of the stacked ``[2F, K]`` product, so the gate and up sums are
    ``exact_linear``'s of ``w13``)."""
    _check_swiglu(x, w13)
    return _launch(x, w13, w13.shape[0] // 2, config or exact_config(w13.shape[0], x.shape[1]), swiglu=True)


def _launch(x: torch.Tensor, weight: torch.Tensor, N: int, cfg: ExactConfig, swiglu: bool) -> torch.Tensor:
    # the [M, N] output of the plan cfg: the product, or (swiglu) the activation of the gate rows
    # [0, N) and the up rows [N, 2N) of weight
    M, K = x.shape
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if K == 0:   # zero sums (the activation of zeros is zero)
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    split = cfg.splits > 1
    col_tiles = triton.cdiv(N, cfg.block_n)
    if split and col_tiles > MAX_SPLIT_TILES:
        op = "exact_swiglu" if swiglu else "exact_linear"
        raise ValueError(f"{op}: a split plan over {col_tiles} column tiles needs one counter each, at most "
                         f"{MAX_SPLIT_TILES}; plan one split for so wide a product (exact_config does)")
    weight_tiles = 2 if swiglu else 1   # weight tiles a K step loads (and accumulators a row tile holds)
    row_tiles = row_tiles_per_program(M, cfg.block_n, col_tiles * cfg.splits, cfg.row_programs, weight_tiles)
    group_rows = row_tiles * BLOCK_M
    # a launch's (row group, column tile) counters fit the counter set: longer split products run in row ranges
    rows_per_launch = MAX_SPLIT_TILES // col_tiles * group_rows if split else M
    ws = (torch.empty((cfg.splits, min(M, rows_per_launch), weight_tiles * N), dtype=torch.float32, device=x.device)
          if split else out)
    counters = _counter_buffer(x.device, EXACT_COUNTERS) if split else out
    for r0 in range(0, M, rows_per_launch):
        xs, outs = x[r0:r0 + rows_per_launch], out[r0:r0 + rows_per_launch]
        grid = (triton.cdiv(xs.shape[0], group_rows), col_tiles, cfg.splits)
        _exact_linear_kernel[grid](
            xs, weight, ws, outs, counters, xs.shape[0], N, K, cfg.steps, xs.stride(0), weight.stride(0),
            ws.stride(0), ws.stride(1), outs.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            ROW_TILES=row_tiles, SPLIT=split, SWIGLU=swiglu,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",   # fp32: no TF32 rounding
            UPCAST=x.device.type != "cuda" and x.dtype == torch.bfloat16,
            DOT_ROWWISE=x.device.type != "cuda",   # the interpreter: each element's own sum (ops/exact_dot.py)
            num_warps=cfg.num_warps,
            num_stages=_stages_that_fit(cfg, row_tiles, x.element_size(), _smem_limit(x), weight_tiles),
            **pdl_kwargs(x),
        )
    return out


def exact_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation, one rounding (the oracle of the tests; its own order is BLAS's)."""
    _check(x, weight)
    return (x.float() @ weight.float().T).to(x.dtype)


@torch.library.custom_op("lfmspark::exact_linear", mutates_args=())
def exact_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T`` -> ``[M, N]`` in ``x``'s dtype, each row's bits independent of the
    other rows of the launch (module doc). The CPU reference is not batch-invariant by this
    construction (BLAS picks its own order); under ``LFMSPARK_TRITON_ON_CPU=1`` the kernels run."""
    if use_triton(x):
        return exact_linear_triton(x, weight)
    return exact_linear_reference(x, weight)


@exact_linear.register_kernel("cuda")
def _exact_linear_cuda(x, weight):
    return exact_linear_triton(x, weight)


@exact_linear.register_fake
def _exact_linear_fake(x, weight):
    _check(x, weight)
    return x.new_empty((x.shape[0], weight.shape[0]))


def exact_swiglu_reference(x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    """The unfused module: the stacked product rounded, then ``silu(gate) * up`` in eager PyTorch."""
    _check_swiglu(x, w13)
    gate, up = exact_linear_reference(x, w13).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@torch.library.custom_op("lfmspark::exact_swiglu", mutates_args=())
def exact_swiglu(x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    """``silu(x @ gate^T) * (x @ up^T)`` -> ``[M, F]`` for ``w13 = [gate; up]`` ``[2F, K]``: a dense
    SwiGLU's gate/up product with its activation in the epilogue (exact mode), each row's bits
    independent of the other rows of the launch; the gate and up sums are those of
    ``exact_linear(x, w13)`` and the activation rounds as the unfused module does (gate and up,
    ``silu(gate)``, the product)."""
    if use_triton(x):
        return exact_swiglu_triton(x, w13)
    return exact_swiglu_reference(x, w13)


@exact_swiglu.register_kernel("cuda")
def _exact_swiglu_cuda(x, w13):
    return exact_swiglu_triton(x, w13)


@exact_swiglu.register_fake
def _exact_swiglu_fake(x, w13):
    _check_swiglu(x, w13)
    return x.new_empty((x.shape[0], w13.shape[0] // 2))
