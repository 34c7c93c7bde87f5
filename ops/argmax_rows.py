"""Row argmax: ``torch.argmax(x, dim=-1)`` for ``x [R, V]`` (a few rows of a large vocabulary).

Why: greedy decoding takes the argmax of ``R = B`` (decode, prefill) or ``R = B * (gamma + 1)``
(the verify's target picks) rows of ``V = 65536`` logits. Inductor reduces each row in a single
program, which scans all 65536 columns alone: 10.9 us per decode step, for 256 KB of
input. Here the row is split over many programs instead.

Design: two launches with static grids (no host sync, CUDA-graph safe). Stage 1, grid
``(n_blocks, R)``: each program reduces ``BLOCK_V`` columns of one row to a partial
``(value, index)``. Stage 2, grid ``(R,)``: one program reduces a row's ``n_blocks`` partials (in
chunks of at most ``_MAX_BLOCK_P``, in column order) and writes the int64 index.

Semantics equal ``torch.argmax`` exactly, NaN included: the first index among equal maxima (``-0.0``
equals ``0.0``), and a NaN counts as the maximum (the first NaN's index wins). An all ``-inf`` row
gives 0. Inputs of any float dtype are compared in fp32 (exact for bf16 / fp16).

The jitted helpers :func:`block_argmax` and :func:`combine_argmax` are shared with the fused greedy
Markov walk (ops/markov_walk/op.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._dispatch import pdl_kwargs, use_triton

_BIG = 2147483647             # "no index": larger than any column index (V < 2**31 - 1)
_MIN_BLOCK_V, _MAX_BLOCK_V = 256, 4096
_MAX_BLOCK_P = 1024           # partials a stage-2 program reduces per step of its loop
_PROGRAMS_PER_SM = 4          # stage 1 aims for at least this many programs per SM


# ---------------------------------------------------------------------------------------------
# shared jitted helpers

@triton.jit
def block_argmax(v, idx, valid, AXIS: tl.constexpr):
    """``(value, index)`` of ``torch.argmax`` along ``AXIS`` over the lanes where ``valid``: a NaN
    wins (the lowest index among NaNs, value NaN), else the maximum with the lowest index among
    equal maxima. ``v`` fp32, ``idx`` int32 (the lanes' column indices, in any order; broadcast
    against ``v``). With no valid lane the result is ``(-inf, 2**31 - 1)``."""
    is_nan = (v != v) & valid
    vm = tl.where(valid & (v == v), v, float("-inf"))
    m = tl.max(vm, axis=AXIS)
    i_max = tl.min(tl.where(valid & (vm == tl.expand_dims(m, AXIS)), idx, 2147483647), axis=AXIS)
    i_nan = tl.min(tl.where(is_nan, idx, 2147483647), axis=AXIS)
    has_nan = i_nan < 2147483647
    return tl.where(has_nan, float("nan"), m), tl.where(has_nan, i_nan, i_max)


@triton.jit
def combine_argmax(best_v, best_i, v, i):
    """Merge the running ``(best_v, best_i)`` with a candidate ``(v, i)`` whose columns all follow
    ``best``'s: the candidate wins only if strictly greater, or a NaN against a non-NaN."""
    take = (v > best_v) | ((v != v) & (best_v == best_v))
    return tl.where(take, v, best_v), tl.where(take, i, best_i)


@triton.jit
def reduce_partials(pv_row, pi_row, NB, BLOCK_P: tl.constexpr):
    """The winning index (int32 scalar) of ``NB >= 1`` partials ``pv_row[j], pi_row[j]`` stored
    in column order, read ``BLOCK_P`` at a time."""
    offs = tl.arange(0, BLOCK_P)
    ok = offs < NB
    best_v, best_i = block_argmax(tl.load(pv_row + offs, mask=ok, other=0.0),
                                  tl.load(pi_row + offs, mask=ok, other=0), ok, 0)
    for p0 in range(BLOCK_P, NB, BLOCK_P):
        ok = p0 + offs < NB
        v, i = block_argmax(tl.load(pv_row + p0 + offs, mask=ok, other=0.0),
                            tl.load(pi_row + p0 + offs, mask=ok, other=0), ok, 0)
        best_v, best_i = combine_argmax(best_v, best_i, v, i)
    return best_i


@triton.jit
def reduce_partials_rows(pv_ptr, pi_ptr, rows, row_ok, NB, BLOCK_P: tl.constexpr):
    """:func:`reduce_partials` for a block of rows: row ``rows[b]``'s ``NB`` partials are
    ``pv_ptr[rows[b] * NB + j]``; returns int32 ``[BLOCK_B]`` (``2**31 - 1`` where not ``row_ok``)."""
    offs = tl.arange(0, BLOCK_P)
    base = rows[:, None] * NB
    ok = row_ok[:, None] & (offs < NB)[None, :]
    best_v, best_i = block_argmax(tl.load(pv_ptr + base + offs[None, :], mask=ok, other=0.0),
                                  tl.load(pi_ptr + base + offs[None, :], mask=ok, other=0), ok, 1)
    for p0 in range(BLOCK_P, NB, BLOCK_P):
        ok = row_ok[:, None] & (p0 + offs < NB)[None, :]
        v, i = block_argmax(tl.load(pv_ptr + base + p0 + offs[None, :], mask=ok, other=0.0),
                            tl.load(pi_ptr + base + p0 + offs[None, :], mask=ok, other=0), ok, 1)
        best_v, best_i = combine_argmax(best_v, best_i, v, i)
    return best_i


# ---------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _argmax_partial_kernel(x_ptr, pv_ptr, pi_ptr, V, NB, stride_xr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (column block, row): one partial (value, first index) of BLOCK_V columns
    j = tl.program_id(0)
    r = tl.program_id(1)
    cols = j * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = cols < V
    v = tl.load(x_ptr + r.to(tl.int64) * stride_xr + cols, mask=ok, other=0.0).to(tl.float32)
    best_v, best_i = block_argmax(v, cols, ok, 0)
    tl.store(pv_ptr + r * NB + j, best_v)
    tl.store(pi_ptr + r * NB + j, best_i)


@triton.jit
def _argmax_final_kernel(pv_ptr, pi_ptr, out_ptr, NB, stride_out, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # ops/_dispatch.py: everything this kernel reads may come from its predecessor
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # program (row): the row's partials -> its int64 index
    r = tl.program_id(0)
    best_i = reduce_partials(pv_ptr + r * NB, pi_ptr + r * NB, NB, BLOCK_P)
    tl.store(out_ptr + r * stride_out, best_i.to(tl.int64))


# ---------------------------------------------------------------------------------------------
# launcher

@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: only sizes the heuristic


def argmax_block_v(R: int, V: int, sms: int) -> int:
    """Columns per stage-1 program: the widest power of two in ``[256, 4096]`` that still gives
    ``_PROGRAMS_PER_SM`` programs per SM over the ``R`` rows (``R = 1, V = 65536`` on 132 SMs:
    256 columns, 256 programs; ``R = 10``: 2048 columns, 320 programs)."""
    per_row = max(1, triton.cdiv(_PROGRAMS_PER_SM * sms, max(R, 1)))
    block = triton.next_power_of_2(max(1, triton.cdiv(V, per_row)))
    return max(_MIN_BLOCK_V, min(_MAX_BLOCK_V, block))


def block_p(n_blocks: int) -> int:
    return max(16, min(_MAX_BLOCK_P, triton.next_power_of_2(n_blocks)))


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"expected x [R, V], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"argmax_rows takes a floating-point x, got {x.dtype}")
    if x.shape[1] == 0:
        raise ValueError("argmax_rows of an empty row (V = 0)")
    if x.shape[1] >= _BIG:
        raise ValueError(f"V = {x.shape[1]} does not fit the kernel's int32 column indices")


def argmax_rows_triton(x: torch.Tensor, block_v: int | None = None) -> torch.Tensor:
    """The op on the Triton kernels (``block_v``: launch override, for tests and tuning)."""
    _check(x)
    R, V = x.shape
    out = torch.empty(R, dtype=torch.int64, device=x.device)
    if R == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    bv = block_v or argmax_block_v(R, V, _sm_count(x.device))
    nb = triton.cdiv(V, bv)
    pv = torch.empty((R, nb), dtype=torch.float32, device=x.device)
    pi = torch.empty((R, nb), dtype=torch.int32, device=x.device)
    _argmax_partial_kernel[(nb, R)](x, pv, pi, V, nb, x.stride(0), BLOCK_V=bv, num_warps=4 if bv >= 1024 else 2,
                                    **pdl_kwargs(x))
    reduce_partials_into(pv, pi, out)
    return out


def reduce_partials_into(pv: torch.Tensor, pi: torch.Tensor, out: torch.Tensor) -> None:
    """Stage 2: ``out[r]`` (int64 ``[R]``, contiguous) = the argmax column of row ``r``'s partials
    ``pv, pi [R, nb]`` (contiguous, column order)."""
    R, nb = pv.shape
    _argmax_final_kernel[(R,)](pv, pi, out, nb, 1, BLOCK_P=block_p(nb), num_warps=4, **pdl_kwargs(pv))


# ---------------------------------------------------------------------------------------------
# reference

def argmax_rows_reference(x: torch.Tensor) -> torch.Tensor:
    return torch.argmax(x, dim=-1)


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::argmax_rows", mutates_args=())
def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` for ``x [R, V]`` -> int64 ``[R]`` (first index among equal
    maxima; a NaN counts as the maximum)."""
    if use_triton(x):
        return argmax_rows_triton(x)
    _check(x)  # the same limits on every device
    return argmax_rows_reference(x)


@argmax_rows.register_kernel("cuda")
def _argmax_rows_cuda(x):
    return argmax_rows_triton(x)


@argmax_rows.register_fake
def _argmax_rows_fake(x):
    _check(x)
    return x.new_empty((x.shape[0],), dtype=torch.int64)


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for any leading shape, through ``lfmspark::argmax_rows``."""
    return argmax_rows(x.reshape(-1, x.shape[-1])).view(x.shape[:-1])
