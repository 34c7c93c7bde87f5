"""Row top values: ``torch.topk(x, k, dim=-1).values`` (sorted, largest first) for ``x [R, V]``, a
few rows of a large vocabulary and a small ``k``.

Why: a sampled round filters each block position's distribution with top-k / top-p / min-p
(runtime/distributions.py). Given the ``k <= 64`` largest logits of a row, every threshold of a
request with ``top_k <= 64`` follows from them, so the full-vocabulary sort that top-p otherwise
needs (cub's radix sort: several launches per position, 65536 keys per row) goes away. ATen's
``topk`` on one row of 65536 runs a multi-pass radix select; this is two launches.

Design: static grids (no host sync, CUDA-graph safe). Stage 1, grid ``(n_blocks, R)``: each program
sorts ``BLOCK_V`` columns of one row (bitonic, in registers) and keeps its ``KP`` largest (``KP``: ``k``
rounded up to a power of two). Stage 2, grid ``(R,)``: one program sorts a row's ``n_blocks * KP``
survivors and writes the first ``k``. Values only: the samplers find the kept tokens by comparing
against the thresholds these give, so ties are kept whole and no index is needed.

Semantics: the same values as ``torch.topk(x.float(), k).values`` for rows without NaN (a NaN's
place in the order is unspecified here); ``-inf`` and ``+inf`` sort as numbers. Inputs of any float
dtype are compared in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs, use_triton

_MAX_K = 1024
_STAGE2_BLOCKS = 32           # stage 1 splits a row in about this many blocks, so stage 2 sorts <= 32 * KP values


@triton.jit
def _block_top_kernel(x_ptr, part_ptr, V, stride_xr, BLOCK_V: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (column block j, row r): the block's KP largest values, sorted, to part[r, j, :]
    j = tl.program_id(0)
    r = tl.program_id(1)
    nb = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_V)
    cols = j * BLOCK_V + offs
    v = tl.load(x_ptr + r.to(tl.int64) * stride_xr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    v = tl.sort(v, descending=True)
    tl.store(part_ptr + (r * nb + j) * KP + offs, v, mask=offs < KP)


@triton.jit
def _merge_top_kernel(part_ptr, out_ptr, n_part, K, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (row r): the K largest of the row's n_part survivors, sorted
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    v = tl.load(part_ptr + r * n_part + offs, mask=offs < n_part, other=float("-inf"))
    v = tl.sort(v, descending=True)
    tl.store(out_ptr + r * K + offs, v, mask=offs < K)


def _check(x: torch.Tensor, k: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"expected x [R, V], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"top_values takes a floating-point x, got {x.dtype}")
    if not 1 <= k <= min(x.shape[1], _MAX_K):
        raise ValueError(f"top_values: k = {k} must be in [1, min(V = {x.shape[1]}, {_MAX_K})]")


def top_block_v(V: int, kp: int) -> int:
    """Columns per stage-1 program: a power of two >= ``kp`` that splits the row into at most
    ``_STAGE2_BLOCKS`` blocks (``V = 65536``: 2048; ``V = 128000``: 4096)."""
    return max(kp, triton.next_power_of_2(triton.cdiv(V, _STAGE2_BLOCKS)))


def top_values_triton(x: torch.Tensor, k: int, block_v: int | None = None) -> torch.Tensor:
    """The op on the Triton kernels (``block_v``: launch override, for tests)."""
    _check(x, k)
    R, V = x.shape
    out = torch.empty((R, k), dtype=torch.float32, device=x.device)
    if R == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    kp = triton.next_power_of_2(k)
    bv = block_v or top_block_v(V, kp)
    if bv < kp:
        raise ValueError(f"top_values: block_v = {bv} is below k rounded up to a power of two ({kp})")
    nb = triton.cdiv(V, bv)
    part = torch.empty((R, nb, kp), dtype=torch.float32, device=x.device)
    _block_top_kernel[(nb, R)](x, part, V, x.stride(0), BLOCK_V=bv, KP=kp, num_warps=4 if bv >= 1024 else 2,
                               **pdl_kwargs(x))
    n_part = nb * kp
    _merge_top_kernel[(R,)](part, out, n_part, k, BLOCK_P=triton.next_power_of_2(n_part),
                            num_warps=4 if n_part >= 1024 else 2, **pdl_kwargs(x))
    return out


def top_values_reference(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x.float(), k, dim=-1).values


@torch.library.custom_op("lfmspark::top_values", mutates_args=())
def top_values(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest values of each row of ``x [R, V]``, largest first: fp32 ``[R, k]``."""
    if use_triton(x):
        return top_values_triton(x, k)
    _check(x, k)  # the same limits on every device
    return top_values_reference(x, k)


@top_values.register_kernel("cuda")
def _top_values_cuda(x, k):
    return top_values_triton(x, k)


@top_values.register_fake
def _top_values_fake(x, k):
    _check(x, k)
    return x.new_empty((x.shape[0], k), dtype=torch.float32)
