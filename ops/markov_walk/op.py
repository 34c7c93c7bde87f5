"""Greedy Markov walk of the DSpark draft's vanilla Markov head, fused: base logits in, tokens out.

For ``k = 0 .. G-1`` (``prev`` = the anchor for ``k = 0``, else token ``k-1``)::

    e        = w1[prev]                           # [B, r], the weight dtype
    bias     = F.linear(e, w2).float()            # [B, V], fp32 sum rounded once to the weight dtype
    token_k  = argmax(base[:, k] + bias, dim=-1)  # first index among equal maxima

which is exactly what ``DSparkDraft.walk`` (models/dspark.py) computes for a vanilla head, and what
the CPU implementation (:func:`markov_greedy_walk_reference`) runs. A sampling round runs the same
walk over its logits plus Gumbel noise at the row's temperature, which makes each argmax a draw. ``base``
may also be bf16 / fp16 (the LM head's own output), which saves materializing its fp32 copy: the
sum is taken in fp32 either way, so the tokens are the same.

Why: at batch 1 the walk is 9 sequential steps, each a cuBLAS GEMV (``w2 [65536, 256]`` bf16,
33.5 MB) plus an Inductor ``add + argmax`` kernel in which one program scans the whole 65536-wide
row (12-15 us each, ~135 us of a 1.93 ms round: docs/decisions.md).

Design: one launch per step, grid ``(n_blocks, cdiv(B, BLOCK_B))``. The program ``(j, row block)``
of step ``k`` first reduces step ``k-1``'s partials of its rows (``n_blocks`` (value, index) pairs
per row, a few KB from L2) to get ``prev`` (programs ``j = 0`` also write token ``k-1``), gathers
``e = w1[prev]``, multiplies it with its ``[BLOCK_V, r]`` slice of ``w2`` (``tl.dot``, fp32
accumulation; rows padded to 16), rounds to the weight dtype, adds ``base`` and writes one partial
``(max, first index)`` per row. A last small launch (ops/argmax_rows.py's stage 2) reduces the
last step's partials. ``G + 1`` launches in all, static grids, no host sync: CUDA-graph safe.
``w2`` is re-read every step (33.5 MB fits in L2), once per step for up to ``BLOCK_B``
rows.

Numerics: the bias is the fp32 sum of exact bf16 x bf16 products rounded once (round to nearest
even) to the weight dtype, as ``F.linear`` in bf16; the summation order differs from cuBLAS / the
CPU, so a bias may differ by one bf16 ulp and a token may differ where the top two logits are
that close. NaN logits win the argmax as in ``torch.argmax``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._dispatch import pdl_kwargs, use_triton
from ..argmax_rows import _argmax_final_kernel, block_argmax, block_p, reduce_partials_rows
from ..routing import walk_kernel
from ..tuning import tuned
from .jacobi import markov_greedy_walk_jacobi
from .persistent import markov_greedy_walk_persistent
from ..weight_rounding import ROUND_MODE, round_to_weight_dtype

# ---------------------------------------------------------------------------------------------
# kernels

@triton.jit
def _markov_walk_step_kernel(
    base_ptr, anchor_ptr, w1_ptr, w2_ptr, pv_ptr, pi_ptr, tok_ptr,
    k, B, V, NB,
    stride_bb, stride_bk, stride_w1, stride_w2, stride_tb,
    RANK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, FIRST: tl.constexpr, ROUND: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    # program (column block j, row block) of step k; partials are [G, B, NB] (value fp32, index int32)
    if PDL:  # ops/_dispatch.py
        tl.extra.cuda.gdc_launch_dependents()
    j = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    cols = j * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    # columns past V read row `c % V` instead of being masked (unmasked weight loads); never kept
    w_ptrs = w2_ptr + (cols % V).to(tl.int64)[:, None] * stride_w2
    # w2 depends on no earlier kernel: the first rank chunk of this program's slice (all of it when
    # BLOCK_R == RANK) is requested before waiting for the previous step, whose tail it overlaps
    w_first = _load_rank_chunk(w_ptrs, 0, RANK, BLOCK_R)
    if PDL:  # everything else (the previous step's partials, base, the anchor) comes from earlier kernels
        tl.extra.cuda.gdc_wait()
    if FIRST:
        prev = tl.load(anchor_ptr + rows, mask=row_ok, other=0)
    else:
        prev = reduce_partials_rows(pv_ptr + (k - 1) * B * NB, pi_ptr + (k - 1) * B * NB, rows, row_ok, NB, BLOCK_P)
        prev = tl.where(row_ok, prev, 0)
        if j == 0:
            tl.store(tok_ptr + rows * stride_tb + (k - 1), prev.to(tl.int64), mask=row_ok)
    e_ptrs = w1_ptr + prev.to(tl.int64)[:, None] * stride_w1
    acc = tl.zeros((BLOCK_B, BLOCK_V), dtype=tl.float32)
    for c in tl.static_range(0, RANK, BLOCK_R):
        rk = c + tl.arange(0, BLOCK_R)
        if c == 0:
            w = w_first
        else:
            w = _load_rank_chunk(w_ptrs, c, RANK, BLOCK_R)
        if RANK % BLOCK_R == 0:
            e = tl.load(e_ptrs + rk[None, :], mask=row_ok[:, None], other=0.0)
        else:
            e = tl.load(e_ptrs + rk[None, :], mask=row_ok[:, None] & (rk < RANK)[None, :], other=0.0)
        if UPCAST:  # the Triton 3.9 interpreter multiplies bf16 dot operands as raw integers
            e, w = e.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(e, tl.trans(w), acc, input_precision=DOT_PRECISION)
    bias = round_to_weight_dtype(acc, ROUND)
    ok = row_ok[:, None] & col_ok[None, :]
    base = tl.load(base_ptr + rows.to(tl.int64)[:, None] * stride_bb + k * stride_bk + cols[None, :], mask=ok,
                   other=0.0).to(tl.float32)
    best_v, best_i = block_argmax(base + bias, cols[None, :], ok, 1)
    part = (k * B + rows) * NB + j
    tl.store(pv_ptr + part, best_v, mask=row_ok)
    tl.store(pi_ptr + part, best_i, mask=row_ok)


@triton.jit
def _load_rank_chunk(w_ptrs, c: tl.constexpr, RANK: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rank columns ``c .. c + BLOCK_R`` of the program's ``w2`` rows (zeros past ``RANK``)."""
    rk = c + tl.arange(0, BLOCK_R)
    if RANK % BLOCK_R == 0:
        w = tl.load(w_ptrs + rk[None, :])
    else:
        w = tl.load(w_ptrs + rk[None, :], mask=(rk < RANK)[None, :], other=0.0)
    return w


# ---------------------------------------------------------------------------------------------
# launcher

@dataclass(frozen=True)
class WalkConfig:
    """Launch parameters of the step kernel."""
    block_v: int = 256      # V = 65536: 256 column blocks, about two programs per SM at B <= 16
    block_r: int = 64       # rank columns per dot step (unrolled over the rank)
    num_warps: int = 8


def walk_config(B: int, V: int, rank: int) -> WalkConfig:
    """Default launch parameters (the fastest of 18 in a sweep at batch 1, docs/decisions.md;
    ``LFMSPARK_TUNE`` kind ``walk`` replaces them, ops/tuning.py)."""
    return WalkConfig(block_v=tuned("walk", "block_v", min(256, max(16, triton.next_power_of_2(V)))),
                      block_r=tuned("walk", "block_r", min(64, max(16, triton.next_power_of_2(rank)))),
                      num_warps=tuned("walk", "num_warps", WalkConfig.num_warps))


def _check(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
    if base.dim() != 3 or anchor.dim() != 1 or w1.dim() != 2 or w2.dim() != 2:
        raise ValueError(f"expected base [B, G, V], anchor [B], w1 [V, r], w2 [V, r], got {tuple(base.shape)}, "
                         f"{tuple(anchor.shape)}, {tuple(w1.shape)}, {tuple(w2.shape)}")
    B, _, V = base.shape
    if anchor.shape[0] != B or w2.shape[0] != V or w1.shape[1] != w2.shape[1] or w1.shape[0] < V:
        raise ValueError(f"shape mismatch: base {tuple(base.shape)}, anchor {tuple(anchor.shape)}, "
                         f"w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    if base.dtype not in ROUND_MODE or anchor.dtype != torch.int64:
        raise ValueError(f"base must be fp32, bf16 or fp16 and anchor int64, got {base.dtype} and {anchor.dtype}")
    if w1.dtype != w2.dtype or w2.dtype not in ROUND_MODE:
        raise ValueError(f"w1 and w2 must share a float dtype (fp32, bf16, fp16), got {w1.dtype} and {w2.dtype}")
    if V == 0 or w2.shape[1] == 0:
        raise ValueError("empty vocabulary or rank")
    if V >= 2 ** 31 - 1:
        raise ValueError(f"V = {V} does not fit the kernel's int32 column indices")


def markov_greedy_walk_triton(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                              walk: str = "jacobi", config: WalkConfig | None = None,
                              count_passes: bool = False) -> torch.Tensor:
    """The op on the Triton kernels: the one ops/routing.py ``walk_kernel`` picks under the engine's
    ``walk`` choice, or the step kernels with ``config`` (a launch override, for tests and tuning).
    ``count_passes``: the Jacobi kernel tallies its passes (jacobi.py ``jacobi_pass_counts``)."""
    _check(base, anchor, w1, w2)
    B, G, V = base.shape
    rank = w2.shape[1]
    kernel = walk_kernel(walk, base.device, B, G, rank)
    tokens = torch.empty((B, G), dtype=torch.int64, device=base.device)
    if B == 0 or G == 0:
        return tokens
    base = base if base.stride(2) == 1 else base.contiguous()
    w1 = w1 if w1.stride(1) == 1 else w1.contiguous()
    w2 = w2 if w2.stride(1) == 1 else w2.contiguous()
    anchor = anchor.contiguous()
    if config is None and kernel == "jacobi":
        return markov_greedy_walk_jacobi(base, anchor, w1, w2, count_passes=count_passes)
    if config is None and kernel == "persistent":
        return markov_greedy_walk_persistent(base, anchor, w1, w2)
    cfg = config or walk_config(B, V, rank)
    nb = triton.cdiv(V, cfg.block_v)
    block_b = 16 if B <= 16 else 32
    pv = torch.empty((G, B, nb), dtype=torch.float32, device=base.device)
    pi = torch.empty((G, B, nb), dtype=torch.int32, device=base.device)
    grid = (nb, triton.cdiv(B, block_b))
    for k in range(G):
        _markov_walk_step_kernel[grid](
            base, anchor, w1, w2, pv, pi, tokens,
            k, B, V, nb,
            base.stride(0), base.stride(1), w1.stride(0), w2.stride(0), tokens.stride(0),
            RANK=rank, BLOCK_B=block_b, BLOCK_V=cfg.block_v, BLOCK_R=cfg.block_r, BLOCK_P=block_p(nb),
            FIRST=k == 0, ROUND=ROUND_MODE[w2.dtype],
            DOT_PRECISION="ieee" if w2.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding
            UPCAST=base.device.type != "cuda" and w2.dtype != torch.float32,
            num_warps=cfg.num_warps, **pdl_kwargs(base),
        )
    last = tokens[:, G - 1]
    _argmax_final_kernel[(B,)](pv[G - 1], pi[G - 1], last, nb, last.stride(0), BLOCK_P=block_p(nb), num_warps=4,
                               **pdl_kwargs(pv))
    return tokens


# ---------------------------------------------------------------------------------------------
# reference

def markov_greedy_walk_reference(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor,
                                 w2: torch.Tensor) -> torch.Tensor:
    """The plain loop, op for op what ``DSparkDraft.walk`` runs for a vanilla head and argmax picks."""
    prev, tokens = anchor, []
    for k in range(base.shape[1]):
        bias = F.linear(F.embedding(prev, w1), w2)
        prev = (base[:, k] + bias.float()).argmax(dim=-1)
        tokens.append(prev)
    if not tokens:
        return anchor.new_empty((base.shape[0], 0))
    return torch.stack(tokens, dim=1)


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::markov_greedy_walk", mutates_args=())
def markov_greedy_walk(base: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                       walk: str = "jacobi", count_passes: bool = False) -> torch.Tensor:
    """Greedy walk of a vanilla Markov head: ``base [B, G, V]`` draft logits (fp32; bf16 / fp16 are
    read exactly as their fp32 values), ``anchor [B]`` int64, ``w1 [V, r]`` (``markov_w1``),
    ``w2 [V, r]`` (``markov_w2``) -> tokens ``[B, G]`` int64. ``walk``: the kernel family
    (ops/routing.py ``WALKS``; the tokens are the same whichever runs). ``count_passes``: the Jacobi
    kernel tallies its passes for the benchmark (a side counter, not an output)."""
    if use_triton(base):
        return markov_greedy_walk_triton(base, anchor, w1, w2, walk, count_passes=count_passes)
    _check(base, anchor, w1, w2)  # the same limits on every device
    walk_kernel(walk, base.device, *base.shape[:2], w2.shape[1])   # and the same refusal of a bad choice
    return markov_greedy_walk_reference(base, anchor, w1, w2)


@markov_greedy_walk.register_kernel("cuda")
def _markov_greedy_walk_cuda(base, anchor, w1, w2, walk="jacobi", count_passes=False):
    return markov_greedy_walk_triton(base, anchor, w1, w2, walk, count_passes=count_passes)


@markov_greedy_walk.register_fake
def _markov_greedy_walk_fake(base, anchor, w1, w2, walk="jacobi", count_passes=False):
    _check(base, anchor, w1, w2)
    return base.new_empty((base.shape[0], base.shape[1]), dtype=torch.int64)
