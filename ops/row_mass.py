"""Row mass above a threshold: ``sum_i exp(x_i - top) over the x_i >= threshold`` for each row of
``x [R, V]`` (a few rows of a large vocabulary), fp32 ``[R]``.

Why: a sampled distribution in threshold form (runtime/distributions.py) needs its kept mass ``z``,
a reduction over the whole vocabulary. Left to Inductor, that reduction is fused with the draft
walk's other pointwise and small reductions, and at batch 1 Inductor (torch 2.11) fails to generate
the fused kernel (``assert self.inside_reduction`` in its Triton reduction codegen). As an op it is
opaque to Inductor, and it is split over many programs per row (like ops/argmax_rows.py) instead of
one program scanning 65536 columns alone.

Design: two launches with static grids (no host sync, CUDA-graph safe). Stage 1, grid
``(n_blocks, R)``: each program sums ``BLOCK_V`` columns of one row to a partial. Stage 2, grid
``(R,)``: one program sums a row's partials (in chunks, in column order), so the result is the
same bits on every run.

Semantics: a column counts when ``x_i >= threshold`` (NaN never does; ties are kept whole); the
others contribute exactly 0, whatever their value. Inputs of any float dtype are read in fp32. The
sum's order differs from ``torch.sum``'s, so the two agree to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs, use_triton
from .argmax_rows import _sm_count, argmax_block_v, block_p


@triton.jit
def _partial_mass_kernel(x_ptr, top_ptr, thr_ptr, part_ptr, V, NB, stride_xr, BLOCK_V: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (column block j, row r): the kept mass of BLOCK_V columns
    j = tl.program_id(0)
    r = tl.program_id(1)
    cols = j * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = cols < V
    x = tl.load(x_ptr + r.to(tl.int64) * stride_xr + cols, mask=ok, other=0.0).to(tl.float32)
    top = tl.load(top_ptr + r)
    thr = tl.load(thr_ptr + r)
    kept = ok & (x >= thr)
    e = tl.where(kept, tl.exp(tl.where(kept, x, top) - top), 0.0)
    tl.store(part_ptr + r * NB + j, tl.sum(e, axis=0))


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, NB, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (row r): the sum of its NB partials, BLOCK_P at a time in column order
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    total = tl.sum(tl.load(part_ptr + r * NB + offs, mask=offs < NB, other=0.0), axis=0)
    for p0 in range(BLOCK_P, NB, BLOCK_P):
        total += tl.sum(tl.load(part_ptr + r * NB + p0 + offs, mask=p0 + offs < NB, other=0.0), axis=0)
    tl.store(out_ptr + r, total)


def _check(x: torch.Tensor, top: torch.Tensor, threshold: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"expected x [R, V], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"row_mass takes a floating-point x, got {x.dtype}")
    for name, t in (("top", top), ("threshold", threshold)):
        if t.shape != (x.shape[0],) or t.dtype != torch.float32:
            raise ValueError(f"row_mass: {name} must be fp32 [R] = [{x.shape[0]}], got {t.dtype} {tuple(t.shape)}")


def row_mass_triton(x: torch.Tensor, top: torch.Tensor, threshold: torch.Tensor,
                    block_v: int | None = None) -> torch.Tensor:
    """The op on the Triton kernels (``block_v``: launch override, for tests)."""
    _check(x, top, threshold)
    R, V = x.shape
    out = torch.empty(R, dtype=torch.float32, device=x.device)
    if R == 0:
        return out
    if V == 0:
        return out.zero_()
    if x.stride(1) != 1:
        x = x.contiguous()
    top, threshold = top.contiguous(), threshold.contiguous()
    bv = block_v or argmax_block_v(R, V, _sm_count(x.device))
    nb = triton.cdiv(V, bv)
    part = torch.empty((R, nb), dtype=torch.float32, device=x.device)
    _partial_mass_kernel[(nb, R)](x, top, threshold, part, V, nb, x.stride(0), BLOCK_V=bv,
                                  num_warps=4 if bv >= 1024 else 2, **pdl_kwargs(x))
    _sum_partials_kernel[(R,)](part, out, nb, BLOCK_P=block_p(nb), num_warps=4, **pdl_kwargs(x))
    return out


def row_mass_reference(x: torch.Tensor, top: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    x = x.float()
    kept = x >= threshold[:, None]
    return torch.where(kept, torch.exp(torch.where(kept, x, top[:, None]) - top[:, None]), 0.0).sum(dim=-1)


@torch.library.custom_op("lfmspark::row_mass", mutates_args=())
def row_mass(x: torch.Tensor, top: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``sum(exp(x - top[:, None]) where x >= threshold[:, None], dim=-1)`` for ``x [R, V]`` and fp32
    ``top, threshold [R]`` -> fp32 ``[R]``."""
    if use_triton(x):
        return row_mass_triton(x, top, threshold)
    _check(x, top, threshold)  # the same limits on every device
    return row_mass_reference(x, top, threshold)


@row_mass.register_kernel("cuda")
def _row_mass_cuda(x, top, threshold):
    return row_mass_triton(x, top, threshold)


@row_mass.register_fake
def _row_mass_fake(x, top, threshold):
    _check(x, top, threshold)
    return x.new_empty((x.shape[0],), dtype=torch.float32)
