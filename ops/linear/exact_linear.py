"""Batch-invariant linear: ``x [M, K] @ weight[N, K]^T`` where every output row is computed with the
same arithmetic whatever ``M`` is and wherever the row sits in the launch (issue 39's exact mode).

Why: the default products pick their kernel and its reduction by the number of rows (the one-row
GEMV, the swap-AB ``tl.dot`` kernel with a split-K that follows ``M``, cuBLAS past 16 rows:
ops/routing.py). A token's logits in a one-row decode step and in a ten-row verify window are then
summed in different orders, and a near-tied argmax can flip between target-only and speculative
decoding on the GPU. Exact mode routes every product through this op, which fixes the order.

Design: one tile shape for every ``M`` (:data:`BLOCK_M` rows, ``tl.dot``'s minimum; ``BLOCK_N`` x
``BLOCK_K`` from :func:`exact_config`), and the K range cut into a number of splits fixed by the
weight's shape ``(N, K)`` alone. Program ``(row tile, column tile, split)`` sums its split's K steps in
order into an fp32 tile with ``tl.dot``. With one split (a plan of the shape: wide products such as
the LM head) it rounds the tile and stores it. With several it writes the tile to an ``[splits, M,
N]`` workspace and arrives at the tile's counter; the tile's last program to arrive sums the
workspace's partials in split order ``0 .. splits - 1``, whichever program it is, rounds once and
resets the counter: the serial split-K fix-up of skinny_linear.py (its counters, set 2, and its
synchronisation), in the product's own launch. An output element therefore depends only on its own
row of ``x``, its column of ``weight`` and the shape's fixed plan: a row alone (padded to a tile with
masked zero rows), one of 2, 10 or 16 rows, or the last row of a prefill chunk get the same bits.
The MMA instruction is chosen by the tile shape, which never changes; padding rows are zeros and
never stored. A launch holds at most ``MAX_SPLIT_TILES`` (row tile, column tile) counters; a longer
split product runs as several launches over consecutive row ranges, which changes no row's bits.

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
from .skinny_linear import MAX_SPLIT_TILES, _arrives_last, _counter_buffer, _sum_partials

EXACT_COUNTERS = 2      # the counter set of these launches (skinny_linear's main and side streams use 0 and 1)

BLOCK_M = 16            # rows per tile, for every M (tl.dot's minimum)


@dataclass(frozen=True)
class ExactConfig:
    block_n: int
    block_k: int
    splits: int         # K splits, each ``steps`` K steps of ``block_k`` (the last may be shorter)
    steps: int
    num_warps: int = 4  # launch parameters (they change no sum's order), fixed per shape like the tiles
    num_stages: int = 3


def exact_config(N: int, K: int, *, block_k: int = 256, block_n: int = 64, wide_block_n: int = 128,
                 wide_n: int = 8192, unsplit_tiles: int = 64, target_programs: int = 128, min_split_steps: int = 2,
                 num_warps: int = 4, num_stages: int = 3) -> ExactConfig:
    """The launch plan of a weight ``[N, K]``: a function of the shape only, never of ``M`` or the
    device, which is what makes the op batch-invariant (module doc).

    The rule (the keywords are its constants, for benchmarks/kernels/exact_linear.py's sweep; the op
    uses the defaults, chosen by that sweep on the H100 in session 33): 256-wide K steps; column
    tiles of ``wide_block_n`` for outputs of ``wide_n`` or more, else ``block_n``; no K split once
    the column tiles number ``unsplit_tiles`` (a split costs the workspace's traffic and the tile's
    serial sum), otherwise splits of at least ``min_split_steps`` K steps up to about
    ``target_programs`` programs (a one-row product of a narrow weight needs them to stream it)."""
    block_n = wide_block_n if N >= wide_n else block_n
    k_steps = max(1, triton.cdiv(K, block_k))
    col_tiles = triton.cdiv(N, block_n)
    want = 1 if col_tiles >= unsplit_tiles else triton.cdiv(target_programs, col_tiles)
    splits = max(1, min(want, k_steps // min_split_steps))
    steps = triton.cdiv(k_steps, splits)
    return ExactConfig(block_n, block_k, triton.cdiv(k_steps, steps), steps, num_warps, num_stages)


def _stages_that_fit(cfg: ExactConfig, x: torch.Tensor) -> int:
    """The plan's pipeline depth, less where the device's shared memory per block cannot hold it (a
    launch parameter: the sums' order is the tile's, whatever the depth)."""
    if x.device.type != "cuda":
        return cfg.num_stages
    limit = getattr(torch.cuda.get_device_properties(x.device), "shared_memory_per_block_optin", 0)
    stage_bytes = (cfg.block_n + BLOCK_M) * cfg.block_k * x.element_size()
    return max(1, min(cfg.num_stages, limit // stage_bytes)) if limit else cfg.num_stages


@triton.jit(do_not_specialize=["M"])
def _exact_linear_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, cnt_ptr,
    M, N, K, steps,
    stride_xm, stride_wn, stride_ws, stride_wsm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # ops/_dispatch.py: x may come from the predecessor
        tl.extra.cuda.gdc_launch_dependents()
    # row tiles vary fastest: the programs that read one weight tile run side by side, so it comes from
    # DRAM once and from L2 for the other row tiles (a verify of 80 rows has 5; the order of a row's sum
    # is the same either way)
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)     # offsets past 2^31 elements (long prompts x vocab)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k0 = pid_s * steps * BLOCK_K
    for i in range(steps):
        k = k0 + i * BLOCK_K + ks
        k_ok = k < K
        a = tl.load(x_ptr + rows64[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols64[:, None] * stride_wn + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the Triton interpreter multiplies bf16 dot operands as raw integers
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    out_ptrs = out_ptr + rows64[:, None] * stride_om + cols64[None, :]
    if SPLIT:    # the partial to the workspace; the tile's last program sums them in split order
        ws_offs = rows64[:, None] * stride_wsm + cols64[None, :]
        tl.store(ws_ptr + pid_s.to(tl.int64) * stride_ws + ws_offs, acc, mask=mask)
        tile = pid_m * tl.num_programs(1) + pid_n
        if _arrives_last(cnt_ptr + tile, tl.num_programs(2)):
            total = _sum_partials(ws_ptr + ws_offs, mask, stride_ws, tl.num_programs(2))
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(cnt_ptr + tile, 0)  # reusable by the next launch
    else:        # one split (a plan of the shape, whatever M): round once
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("weight must be row-major (stride(1) == 1)")


def exact_linear_triton(x: torch.Tensor, weight: torch.Tensor, config: ExactConfig | None = None) -> torch.Tensor:
    """The op on the Triton kernels (``config``: the plan override, for tests)."""
    _check(x, weight)
    (M, K), N = x.shape, weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or exact_config(N, K)
    split = cfg.splits > 1
    col_tiles = triton.cdiv(N, cfg.block_n)
    if split and col_tiles > MAX_SPLIT_TILES:
        raise ValueError(f"exact_linear: a split plan over {col_tiles} column tiles needs one counter each, at most "
                         f"{MAX_SPLIT_TILES}; plan one split for so wide a product (exact_config does)")
    # a launch's (row tile, column tile) counters fit the counter set: longer split products run in row ranges
    rows_per_launch = MAX_SPLIT_TILES // col_tiles * BLOCK_M if split else M
    ws = torch.empty((cfg.splits, min(M, rows_per_launch), N), dtype=torch.float32, device=x.device) if split else out
    counters = _counter_buffer(x.device, EXACT_COUNTERS) if split else out
    for r0 in range(0, M, rows_per_launch):
        xs, outs = x[r0:r0 + rows_per_launch], out[r0:r0 + rows_per_launch]
        grid = (triton.cdiv(xs.shape[0], BLOCK_M), col_tiles, cfg.splits)
        _exact_linear_kernel[grid](
            xs, weight, ws, outs, counters, xs.shape[0], N, K, cfg.steps, xs.stride(0), weight.stride(0),
            ws.stride(0), ws.stride(1), outs.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            SPLIT=split, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",   # fp32: no TF32 rounding
            UPCAST=x.device.type != "cuda" and x.dtype == torch.bfloat16,
            num_warps=cfg.num_warps, num_stages=_stages_that_fit(cfg, x), **pdl_kwargs(x),
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
