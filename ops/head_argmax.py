"""The several-row LM head with its rows' argmax partials from the product's epilogue.

Why: at batch 1 both LM heads of the speculative round feed an argmax. The verify's greedy picks
ran ``argmax_rows`` on the logits (two launches; the first re-reads the ``[10, 65536]`` logits);
the draft's Jacobi Markov walk (ops/markov_walk_jacobi.py) began with a pass that re-read the
base logits for its guesses, each slot's argmax, and a grid barrier to combine them. But the LM
head's programs hold every logit in registers once: each can reduce its tile's columns to one
``(max, first column)`` per row as it stores them. Then the verify's picks are one small launch
over those partials (the second stage of ops/argmax_rows.py), and the walk's programs combine the
partials themselves, with no guess pass and no barrier. Measured on the H200 (docs/benchmarks.md,
session 22): 0.2-0.7 us less per walk, and the round within noise, as the verify's two argmax
launches ran beside the overlapped context injection; kept for doing less work (the logits are
not re-read; a launch and a grid barrier fewer).

Ops:

- ``lfmspark::skinny_linear_argmax(x, weight, row_ssq, eps) -> (out, part_v, part_i)``: the product
  of ``lfmspark::skinny_linear`` (the same kernel and launch parameters, bit-identical ``out``) and,
  per row, one partial per column tile of the rounded output, ``[M, tiles]`` (fp32 values, int32
  columns), in column order. ``tiles`` follows the launch's column tiles (:func:`argmax_tiles`).
- ``lfmspark::argmax_of_partials(part_v, part_i) -> int64 [R]``: each row's winning column.

Together they equal ``torch.argmax(out.float(), dim=-1)`` exactly (the first index among equal
maxima, a NaN wins), as ``argmax_rows`` does: each partial follows those rules over its columns,
and the partials are combined in column order by the same rules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from ._dispatch import use_triton
from .argmax_rows import reduce_partials_into
from .skinny_linear import (SkinnyConfig, _check, _check_row_ssq, _launch, _sm_count, skinny_linear_reference,
                            swap_ab_config)

# ---------------------------------------------------------------------------------------------
# launcher


def head_argmax_config(x: torch.Tensor, weight: torch.Tensor) -> SkinnyConfig:
    """Launch parameters: the swap-AB tiles of the several-row products (for one row too: the epilogue
    is the ``tl.dot`` kernel's); the LM head at M = 9-10: 512 programs of 128 columns."""
    (M, K), N = x.shape, weight.shape[0]
    return swap_ab_config(M, N, K, x.element_size(), _sm_count(x.device))


def argmax_tiles(x: torch.Tensor, weight: torch.Tensor) -> int:
    """The partials per row: the launch's column tiles."""
    return triton.cdiv(weight.shape[0], head_argmax_config(x, weight).block_n)


def skinny_linear_argmax_triton(x: torch.Tensor, weight: torch.Tensor, row_ssq: torch.Tensor | None = None,
                                eps: float = 0.0, config: SkinnyConfig | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op on the ``tl.dot`` kernel (``config``: launch override, for tests; ``gemv`` is ignored)."""
    _check_argmax(x, weight, row_ssq)
    config = config or head_argmax_config(x, weight)
    (M, K), N = x.shape, weight.shape[0]
    if M == 0 or K == 0:
        return skinny_linear_argmax_reference(x, weight, row_ssq, eps, config.block_n)
    tiles = triton.cdiv(N, config.block_n)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    part_v = torch.empty((M, tiles), dtype=torch.float32, device=x.device)
    part_i = torch.empty((M, tiles), dtype=torch.int32, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    _launch(x, weight, out, config, swiglu=False, row_ssq=row_ssq, eps=eps, argmax_parts=(part_v, part_i))
    return out, part_v, part_i


def argmax_of_partials_triton(part_v: torch.Tensor, part_i: torch.Tensor) -> torch.Tensor:
    _check_partials(part_v, part_i)
    R = part_v.shape[0]
    out = torch.empty(R, dtype=torch.int64, device=part_v.device)
    if R:
        reduce_partials_into(part_v.contiguous(), part_i.contiguous(), out)
    return out


def _check_argmax(x: torch.Tensor, weight: torch.Tensor, row_ssq: torch.Tensor | None) -> None:
    _check(x, weight)
    _check_row_ssq(x, row_ssq)
    if weight.shape[0] == 0:
        raise ValueError("skinny_linear_argmax of an empty row (weight has no rows, N = 0)")
    if weight.shape[0] >= 2 ** 31 - 1:
        raise ValueError(f"N = {weight.shape[0]} does not fit the kernel's int32 column indices")


def _check_partials(part_v: torch.Tensor, part_i: torch.Tensor) -> None:
    if part_v.dim() != 2 or part_v.shape != part_i.shape or part_v.shape[1] == 0:
        raise ValueError(f"expected argmax partials part_v, part_i [R, tiles >= 1] of one shape, got "
                         f"{tuple(part_v.shape)} and {tuple(part_i.shape)}")
    if part_v.dtype != torch.float32 or part_i.dtype != torch.int32:
        raise ValueError(f"argmax partials are fp32 values and int32 columns, got {part_v.dtype} and {part_i.dtype}")


# ---------------------------------------------------------------------------------------------
# references


def argmax_partials_reference(out: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``(max, first column)`` of ``out [M, N]`` (compared in fp32) over every ``block_n``
    columns, ``[M, tiles]``: ``torch.argmax`` per tile (a NaN wins)."""
    M, N = out.shape
    tiles = triton.cdiv(N, block_n)
    v = F.pad(out.float(), (0, tiles * block_n - N), value=float("-inf")).view(M, tiles, block_n)
    local = v.argmax(dim=-1, keepdim=True)          # padding (-inf) follows the real columns: never first
    cols = local[..., 0] + torch.arange(tiles, device=out.device)[None, :] * block_n
    return v.gather(-1, local)[..., 0], cols.to(torch.int32)


def skinny_linear_argmax_reference(x: torch.Tensor, weight: torch.Tensor, row_ssq: torch.Tensor | None, eps: float,
                                   block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = skinny_linear_reference(x, weight, row_ssq, eps)
    return (out, *argmax_partials_reference(out, block_n))


def argmax_of_partials_reference(part_v: torch.Tensor, part_i: torch.Tensor) -> torch.Tensor:
    """The first partial holding the maximum (or the first NaN), in column order: its column."""
    return part_i.gather(1, part_v.argmax(dim=1, keepdim=True))[:, 0].to(torch.int64)


# ---------------------------------------------------------------------------------------------
# ops


@torch.library.custom_op("lfmspark::skinny_linear_argmax", mutates_args=())
def skinny_linear_argmax(x: torch.Tensor, weight: torch.Tensor, row_ssq: torch.Tensor | None = None,
                         eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, part_v, part_i)``: ``out`` = ``lfmspark::skinny_linear(x, weight, row_ssq, eps)`` ``[M, N]``
    and each row's argmax partials over its column tiles, ``[M, tiles]`` fp32 values and int32
    columns (:func:`argmax_tiles`); ``argmax_of_partials`` turns them into the rows' argmax."""
    if use_triton(x):
        return skinny_linear_argmax_triton(x, weight, row_ssq, eps)
    _check_argmax(x, weight, row_ssq)  # the same limits on every device
    return skinny_linear_argmax_reference(x, weight, row_ssq, eps, head_argmax_config(x, weight).block_n)


@skinny_linear_argmax.register_kernel("cuda")
def _skinny_linear_argmax_cuda(x, weight, row_ssq=None, eps=0.0):
    return skinny_linear_argmax_triton(x, weight, row_ssq, eps)


@skinny_linear_argmax.register_fake
def _skinny_linear_argmax_fake(x, weight, row_ssq=None, eps=0.0):
    _check_argmax(x, weight, row_ssq)
    M, tiles = x.shape[0], argmax_tiles(x, weight)
    return (x.new_empty((M, weight.shape[0])), x.new_empty((M, tiles), dtype=torch.float32),
            x.new_empty((M, tiles), dtype=torch.int32))


@torch.library.custom_op("lfmspark::argmax_of_partials", mutates_args=())
def argmax_of_partials(part_v: torch.Tensor, part_i: torch.Tensor) -> torch.Tensor:
    """Each row's argmax column (int64 ``[R]``) from its partials ``[R, tiles]`` in column order (those
    of ``skinny_linear_argmax``)."""
    if use_triton(part_v):
        return argmax_of_partials_triton(part_v, part_i)
    _check_partials(part_v, part_i)
    return argmax_of_partials_reference(part_v, part_i)


@argmax_of_partials.register_kernel("cuda")
def _argmax_of_partials_cuda(part_v, part_i):
    return argmax_of_partials_triton(part_v, part_i)


@argmax_of_partials.register_fake
def _argmax_of_partials_fake(part_v, part_i):
    _check_partials(part_v, part_i)
    return part_v.new_empty((part_v.shape[0],), dtype=torch.int64)
