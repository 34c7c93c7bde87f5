"""Skinny linear: ``x [M, K] @ weight[N, K]^T`` for a handful of rows (``M <= 64``), fp32 accumulation.

Why: a decode step at batch 1 multiplies one row by every weight matrix, and a speculative verify
``M = 10`` rows (the draft ``M = 9``); such products are bound by reading the weight once. For
``M = 1`` a ``tl.dot``-free GEMV kernel streams the served LFM2.5-1.2B shapes 3-31% faster than
cuBLAS on the H200 (up to 0.998 of copy bandwidth on the LM head; docs/benchmarks.md), so one-row
products use it by default. For several rows (the batch-1 verify and draft) the swap-AB ``tl.dot``
kernel below beat cuBLAS at every served shape at ``M = 10`` (2048 x 2048: 4.76 vs 6.06 us; the
down projection 10.71 vs 13.83 us; docs/benchmarks.md), so products of up to 16 rows use it by
default (models/layers.py, ``LFMSPARK_SKINNY_LINEAR``).

Design (``M > 1``): each program owns ``BLOCK_N`` output columns for all ``M`` rows (padded to ``BLOCK_M``, a
power of two >= 16, ``tl.dot``'s minimum) and streams its ``[BLOCK_N, K]`` slice of the weight
exactly once; ``x`` is tiny and is re-read from L2 by every program. When ``N`` is too small to
give every SM a couple of programs (e.g. ``N = 2048, K = 8192``), the K range is split as well: the
program ``(n block, k split)`` writes fp32 partials to a ``[SPLIT_K, M, N]`` workspace, which a
second kernel sums in a fixed split order. No atomics: results are the same run to run.

Swap-AB (``SkinnyConfig(swap_ab=True)``, the default for ``M > 1``, with ``swap_ab_config`` fitted
to the H200 sweep): each program computes the transposed tile ``out^T [BLOCK_N, BLOCK_M] = weight
tile [BLOCK_N, BLOCK_K] @ x tile^T [BLOCK_K, BLOCK_M]``, so the wide weight tile is ``tl.dot``'s A
operand and the few rows its N dimension. With x as A (``swap_ab=False``, kept as the sweep's
comparison) the A operand has ``BLOCK_M`` rows, fewer than wgmma's 64 for ``M <= 32``, which keeps
Hopper on the older mma.sync path; with 64- or 128-row weight tiles as A, Triton can issue wgmma
with ``BLOCK_M`` (16 for ``M <= 16``) as the instruction's N.

Numerics: ``torch.nn.functional.linear`` (the reference), i.e. fp32 accumulation and one rounding
to ``x``'s dtype; the summation order differs, so bf16 results may differ by an ulp. Static grids,
no host sync: the launcher is CUDA-graph safe.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs, use_triton

MAX_M = 64  # rows the kernel handles (BLOCK_M up to 64); larger M is compute-bound: use cuBLAS


# ---------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, dst_ptr,
    M, N, K, k_split,
    stride_xm, stride_wn, stride_ds, stride_dm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    # program (n block, k split): BLOCK_N output columns of all rows, summed over the K range
    # [k0, k0 + k_split); dst is the output (one split, stride_ds = 0) or the fp32 workspace.
    # SWAP_AB: the weight tile is the MMA's A operand, out^T [BLOCK_N, BLOCK_M] = w @ x^T, stored
    # transposed; else x is, out [BLOCK_M, BLOCK_N] = x @ w^T
    if PDL:
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
    w_ptrs = w_ptr + (cols % N).to(tl.int64)[:, None] * stride_wn + ks[None, :]
    # the first K block is peeled: its weights depend on no earlier kernel, so they are requested
    # before waiting for the predecessor (PDL); x is its output and is read after the wait
    w = _load_w_block(w_ptrs, k0, k_end, BLOCK_K, EVEN_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
    a = _load_x_block(x_ptrs, row_ok, k0, k_end, BLOCK_K, EVEN_K)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _dot_block(a, w, acc, SWAP_AB, DOT_PRECISION, UPCAST)
    for k in range(k0 + BLOCK_K, k_end, BLOCK_K):
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        w = _load_w_block(w_ptrs, k, k_end, BLOCK_K, EVEN_K)
        a = _load_x_block(x_ptrs, row_ok, k, k_end, BLOCK_K, EVEN_K)
        acc = _dot_block(a, w, acc, SWAP_AB, DOT_PRECISION, UPCAST)
    dst = dst_ptr + split * stride_ds
    if SWAP_AB:
        tl.store(dst + rows[None, :] * stride_dm + cols[:, None], acc.to(dst_ptr.dtype.element_ty),
                 mask=(cols < N)[:, None] & row_ok[None, :])
    else:
        tl.store(dst + rows[:, None] * stride_dm + cols[None, :], acc.to(dst_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < N)[None, :])


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
def _dot_block(a, w, acc, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # the Triton 3.9 interpreter multiplies bf16 dot operands as raw integers
        a, w = a.to(tl.float32), w.to(tl.float32)
    # one return: after a return inside a constexpr branch the compiler still visits what follows
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, dst_ptr,
    N, K, k_split,
    stride_wn, stride_ds,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
):
    # the M = 1 case without tl.dot (whose 16-row minimum wastes 15/16 of its registers on padding):
    # program (n block, k split) keeps a [BLOCK_N, BLOCK_K] fp32 elementwise accumulator and reduces
    # it once at the end, so each K step is one wide weight load and a multiply-add
    if PDL:
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
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = w.to(tl.float32) * _load_x_vector(x_ptr, k0, k_end, BLOCK_K, EVEN_K)[None, :]
    for k in range(k0 + BLOCK_K, k_end, BLOCK_K):
        w_ptrs += BLOCK_K
        w = _load_w_block(w_ptrs, k, k_end, BLOCK_K, EVEN_K)
        acc += w.to(tl.float32) * _load_x_vector(x_ptr, k, k_end, BLOCK_K, EVEN_K)[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(dst_ptr + split * stride_ds + cols, out.to(dst_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _load_x_vector(x_ptr, k, k_end, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    ks = k + tl.arange(0, BLOCK_K)
    if EVEN_K:
        return tl.load(x_ptr + ks).to(tl.float32)
    return tl.load(x_ptr + ks, mask=ks < k_end, other=0.0).to(tl.float32)


@triton.jit
def _skinny_reduce_kernel(ws_ptr, out_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # out (contiguous [M, N]) = sum of the SPLIT_K workspace slices, in split order (deterministic);
    # the unrolled loop issues all the slices' loads at once
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


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
    gemv: bool = False  # M = 1 only: the tl.dot-free kernel (_gemv_kernel); ignored for M > 1
    swap_ab: bool = False  # the tl.dot kernel with the weight tile as its A operand (SWAP_AB);
    #                        used whenever the GEMV kernel is not (for M = 1, gemv takes precedence)


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


def skinny_config(M: int, N: int, K: int, elem_size: int, sms: int) -> SkinnyConfig:
    """Default launch parameters for ``[M, K] x [N, K]^T`` with ``sms`` SMs: the GEMV kernel for one
    row, the swap-AB kernel (:func:`swap_ab_config`) for several."""
    if M == 1:
        # the tl.dot-free kernel: on the H200 (benchmarks/kernels/skinny_linear.py --sweep) 4 columns
        # x 1024-wide K steps per program was the best or within 3% of the best at every served shape,
        # and beat cuBLAS's GEMVs by 3-31% (docs/benchmarks.md); no split: N / 4 programs already
        # oversubscribe the SMs at N >= 2048
        return SkinnyConfig(block_n=4, block_k=min(1024, max(16, triton.next_power_of_2(K))), split_k=1,
                            num_warps=4, num_stages=2, gemv=True)
    return swap_ab_config(M, N, K, elem_size, sms)


def regular_config(M: int, N: int, K: int, elem_size: int, sms: int) -> SkinnyConfig:
    """Launch parameters of the regular ``tl.dot`` kernel (x as the A operand), the comparison point
    of the sweep (``python benchmarks/kernels/skinny_linear.py --sweep``); slower than swap-AB at
    every served shape on the H200.

    The kernel is bound by the weight stream, so the aims are (1) enough programs to keep every SM
    loading, at least ``_MIN_PROGRAMS_PER_SM`` per SM, and (2) enough weight bytes in flight per
    program. Column tiles are taken as wide as (1) allows, from 128 down: wide tiles re-read ``x``
    (from L2) less often, ``M / BLOCK_N`` times the weight bytes, which is why tiles stay >= 32
    for ``M > 16``. If even the narrowest tile leaves SMs idle, K is split too, to about
    ``_PROGRAMS_PER_SM`` programs per SM, keeping ``_MIN_SPLIT_ITERS`` K steps per split (the fp32
    partials cost ``2 * SPLIT_K * M * N * 4`` bytes, mostly in L2, and a second launch). The K
    step (64-256) is the longest whose weight and ``x`` tiles fit ``_STAGE_BYTES`` (256 for narrow
    bf16 tiles, 64 for 128-wide ones; shortened to divide K when K % 64 == 0), with as many
    pipeline stages (2-4) as fit ``_SMEM_BYTES``.
    """
    block_m = _block_m(M)
    widths = [bn for bn in (128, 64, 32, 16) if bn >= (16 if block_m == 16 else 32)]
    block_n = next((bn for bn in widths if triton.cdiv(N, bn) >= _MIN_PROGRAMS_PER_SM * sms), widths[-1])
    block_n = min(block_n, max(16, triton.next_power_of_2(N)))
    block_k = 256
    while block_k > 64 and (block_n + block_m) * block_k * elem_size > _STAGE_BYTES:
        block_k //= 2
    if K % 64 == 0:
        while K % block_k:  # the widest step that divides K (>= 64): the unmasked path
            block_k //= 2
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    n_blocks = triton.cdiv(N, block_n)
    split_k = 1
    if n_blocks < _MIN_PROGRAMS_PER_SM * sms:
        max_split = max(1, triton.cdiv(K, block_k) // _MIN_SPLIT_ITERS)
        split_k = min(triton.cdiv(_PROGRAMS_PER_SM * sms, n_blocks), max_split)
    stage_bytes = (block_n + block_m) * block_k * elem_size
    num_stages = max(2, min(4, _SMEM_BYTES // stage_bytes))
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=num_stages)


_SWAP_SMEM_BYTES = 200 * 1024  # swap-AB pipeline buffers: one program per SM (227 KB on the H200)


def swap_ab_config(M: int, N: int, K: int, elem_size: int, sms: int) -> SkinnyConfig:
    """Launch parameters of the swap-AB kernel (``M > 1``), fitted to the H200 sweep at ``M = 10``
    (``benchmarks/kernels/skinny_linear.py --sweep --rows 10 --target-shapes``, docs/benchmarks.md),
    whose winners it reproduces at every served LFM2.5-1.2B shape:

    - 64-row weight tiles (wgmma's A height) with 128-wide K steps; 128-row tiles with 64-wide steps
      when ``N / 128`` alone gives two programs per SM (the LM head: 512 programs);
    - K split only up to one wave of programs (``n_blocks * split <= sms``, at least 4 K steps per
      split): the winners ran 96-128 programs on 132 SMs (2048 x 2048: 32 tiles x 4 splits), and
      splitting further lost to the extra partial traffic and reduction;
    - 5 pipeline stages when split (short loops), 3-4 otherwise; 4 warps (one warpgroup).
    """
    block_m = _block_m(M)
    block_n = 128 if triton.cdiv(N, 128) >= 2 * sms else 64
    block_k = 64 if block_n == 128 else 128
    if K % 64 == 0:
        while K % block_k:
            block_k //= 2
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    n_blocks = triton.cdiv(N, block_n)
    split_k = 1
    if n_blocks < sms:
        want = min(max(1, sms // n_blocks), max(1, triton.cdiv(K, block_k) // _MIN_SPLIT_ITERS))
        split_k = split_k_plan(K, block_k, want)[1]
    num_stages = 5 if split_k > 1 else (4 if block_n == 128 else 3)
    while num_stages > 2 and num_stages * (block_n + block_m) * block_k * elem_size > _SWAP_SMEM_BYTES:
        num_stages -= 1  # wide rows (M > 16) or fp32
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=num_stages,
                        swap_ab=True)


def split_k_plan(K: int, block_k: int, split_k: int) -> tuple[int, int]:
    """``(k_split, splits)``: the K range each split covers (whole K blocks) and the number of
    non-empty splits the launcher runs for a requested ``split_k``."""
    k_split = triton.cdiv(triton.cdiv(K, max(1, split_k)), block_k) * block_k
    return k_split, triton.cdiv(K, k_split)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] > MAX_M:
        raise ValueError(f"skinny_linear supports at most {MAX_M} rows, got M = {x.shape[0]}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("weight must be row-major (stride(1) == 1)")


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None) -> torch.Tensor:
    """The op on the Triton kernels (``config``: launch override, for tests and tuning)."""
    _check(x, weight)
    (M, K), N = x.shape, weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or skinny_config(M, N, K, x.element_size(), _sm_count(x.device))
    block_m = _block_m(M)
    k_split, split_k = split_k_plan(K, cfg.block_k, cfg.split_k)  # recounting the splits drops empty ones
    if split_k > 1:
        dst = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    else:
        dst = out
    if M == 1 and cfg.gemv:
        _gemv_kernel[(triton.cdiv(N, cfg.block_n), split_k)](
            x, weight, dst, N, K, k_split, weight.stride(0), dst.stride(0) if split_k > 1 else 0,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(x),
        )
    else:
        _skinny_linear_kernel[(triton.cdiv(N, cfg.block_n), split_k)](
            x, weight, dst,
            M, N, K, k_split,
            x.stride(0), weight.stride(0), dst.stride(0) if split_k > 1 else 0, dst.stride(-2),
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0,
            SWAP_AB=cfg.swap_ab, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding
            UPCAST=x.device.type != "cuda" and x.dtype == torch.bfloat16,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(x),
        )
    if split_k > 1:
        block = 1024
        _skinny_reduce_kernel[(triton.cdiv(M * N, block),)](dst, out, M * N, SPLIT_K=split_k, BLOCK=block,
                                                           **pdl_kwargs(x))
    return out


# ---------------------------------------------------------------------------------------------
# reference

def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T`` -> ``[M, N]`` in ``x``'s dtype, for ``M <= 64``."""
    if use_triton(x):
        return skinny_linear_triton(x, weight)
    _check(x, weight)  # the same limits on every device
    return skinny_linear_reference(x, weight)


@skinny_linear.register_kernel("cuda")
def _skinny_linear_cuda(x, weight):
    return skinny_linear_triton(x, weight)


@skinny_linear.register_fake
def _skinny_linear_fake(x, weight):
    _check(x, weight)
    return x.new_empty((x.shape[0], weight.shape[0]))
