"""Building blocks shared by the target and draft modules.

Environment switches (read at each call; under compile, at trace time):

- ``LFMSPARK_SKINNY_LINEAR`` (``few`` default, ``gemv``, ``off``, ``all``, ``verify``): which row
  counts of a product run on ``lfmspark::skinny_linear`` on CUDA (:func:`skinny_rows`). A dense
  :class:`SwiGLU`'s gate/up product of a routed row count runs with its activation fused: one row
  on ``lfmspark::swiglu_gemv``, 2-16 rows on ``lfmspark::skinny_swiglu``; routed counts above 16
  (``all``, ``verify``) on ``skinny_linear`` followed by the separate activation.
- ``LFMSPARK_FUSED_NORM`` (``1`` default, ``0``): on the one-row CUDA decode path (one row routed to
  the GEMV kernels), the residual add, RMSNorm and the following projection run as one
  ``lfmspark::add_rmsnorm_gemv`` (:func:`norm_linear`, :func:`norm_feed_forward`); ``0`` keeps them
  separate (the add and norm then fuse under compile, the product is its own kernel).
- ``LFMSPARK_NORM_EPILOGUE`` (``1`` default, ``0``): on the several-row CUDA route outside decode
  steps (2-16 rows: the batch-1 verify and draft), a mixer's output projection adds the residual and computes the
  feed-forward RMSNorm's statistics in its epilogue, and the gate/up product applies the norm's
  row scale in its own (:func:`project_norm_feed_forward`): no norm kernel between the products.
- ``LFMSPARK_NORM_CARRY`` (``1`` default, ``0``; needs ``LFMSPARK_NORM_EPILOGUE=1``): on that route, the
  norms *between* layers as well, where the callers ask for it (the target's verify, the draft's
  block): a layer's down projection adds the residual and computes the next layer's RMSNorm
  statistics in its epilogue and hands them on as a :class:`NormedCarry`, whose consumer (the
  next ``in_proj`` / ``qkv_proj`` / draft q + K/V pair, or the LM head after the final norm) applies
  the row scale in its own epilogue. The one-row decode GEMV rounds the same way
  (:func:`norm_linear`).
- ``LFMSPARK_HEAD_ARGMAX`` (``1`` default, ``0``): where an LM head takes a :class:`NormedCarry` (the
  batch-1 verify and draft) and an argmax follows it (greedy picks, the greedy Markov walk), the head
  also writes its rows' argmax partials (``lfmspark::skinny_linear_argmax``, :func:`head_logits`):
  the verify's picks then need one small launch instead of two, and the draft's Jacobi walk no guess
  pass. ``0``: the plain head and ``argmax_rows`` / the walk's own guesses (the same tokens).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops  # noqa: F401  (registers torch.ops.lfmspark.*)
from ..ops.add_rmsnorm_gemv import MAX_K as FUSED_NORM_MAX_K
from ..ops.argmax_rows import argmax_last
from ..ops.skinny_linear import MAX_M, SWIGLU_MAX_M, pair_problem

lfm = torch.ops.lfmspark


_FEW_ROWS = 16   # the swap-AB kernel's BLOCK_M = 16 covers the batch-1 verify (10 rows) and draft (9)
_SKINNY_MODES = {"off": (1, 0), "gemv": (1, 1), "few": (1, _FEW_ROWS), "all": (1, MAX_M), "verify": (2, MAX_M)}


def skinny_rows() -> tuple[int, int]:
    """Row counts routed to ``lfmspark::skinny_linear`` on CUDA, from ``LFMSPARK_SKINNY_LINEAR``:
    ``few`` (default: 1..16 rows; on the H200 the GEMV kernel beat cuBLAS at every served shape for
    one row, and the swap-AB kernel for ten, docs/benchmarks.md), ``gemv`` (one row only), ``off``
    (cuBLAS everywhere), ``all`` (1..64 rows) or ``verify`` (2..64; 17..64 rows are untimed).
    Read at each call (under compile: at trace time), so a process can compare modes."""
    mode = os.environ.get("LFMSPARK_SKINNY_LINEAR", "few")
    if mode not in _SKINNY_MODES:
        raise ValueError(f"LFMSPARK_SKINNY_LINEAR={mode!r}: use one of {sorted(_SKINNY_MODES)}")
    return _SKINNY_MODES[mode]


def _routed_to_skinny(x: torch.Tensor) -> bool:
    """Whether a product with input ``x [..., K]`` runs on the skinny kernels (CUDA only)."""
    rows = x.numel() // x.shape[-1]
    lo, hi = skinny_rows()
    return x.is_cuda and lo <= rows <= hi


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (no bias): ``F.linear``, or ``lfmspark::skinny_linear`` for few-row products on
    CUDA when ``LFMSPARK_SKINNY_LINEAR`` selects it (see :func:`skinny_rows`)."""
    rows = x.numel() // x.shape[-1]
    if _routed_to_skinny(x):
        return lfm.skinny_linear(x.reshape(rows, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def linear_pair(x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor, carry: NormedCarry | None = None,
                eps: float = 0.0) -> torch.Tensor | None:
    """``x @ [w_a; w_b].T`` (``[..., N_A + N_B]``) as one ``lfmspark::skinny_linear_pair`` launch when
    ``x`` has 2-16 rows on the skinny route (:func:`_routed_to_skinny`) and the weights are ones the
    op takes (a model in one dtype always qualifies); else None, and the caller runs its products
    as before. Why: two weights that must stay apart (the draft's q projection and its slice of
    the stacked K/V projections) cost one launch instead of two, without a stacked copy. One row
    stays on the GEMV kernel, which has no pair variant. With ``carry`` (of the RMSNorm of ``eps``
    that ``x`` would be the output of), the product of that norm's output, from the carry."""
    rows = x.numel() // x.shape[-1]
    x2 = x.reshape(rows, x.shape[-1]) if carry is None else carry.scaled
    if not (_routed_to_skinny(x) and 2 <= rows <= _FEW_ROWS) or pair_problem(x2, w_a, w_b) is not None:
        return None
    if carry is None:
        out = lfm.skinny_linear_pair(x2, w_a, w_b)
    else:
        out = lfm.skinny_linear_pair(x2, w_a, w_b, carry.ssq, eps)
    return out.view(*x.shape[:-1], out.shape[-1])


class NormedCarry(NamedTuple):
    """A layer's output whose next RMSNorm is half done (``LFMSPARK_NORM_CARRY``, see the module doc):
    the sum ``s`` travels as the residual stream ``h`` beside it; here are ``scaled = s * g`` ``[rows,
    H]`` for the consumer norm's weight ``g`` and the per-tile row sums of ``s^2`` ``[tiles, rows]``
    (fp32), what ``row_ssq`` takes. A consumer that cannot use them runs the norm on ``h`` instead."""

    scaled: torch.Tensor
    ssq: torch.Tensor


# what a layer hands the next with its residual stream h: a pending feed-forward output (the layer's
# output is h + delta), a NormedCarry (h is the output), or nothing (h is the output: the embeddings)
Pending = torch.Tensor | NormedCarry | None


def completed(h: torch.Tensor, pending: Pending) -> torch.Tensor:
    """The layer output that ``h`` and its ``pending`` part stand for."""
    return h + pending if isinstance(pending, torch.Tensor) else h


def fused_norm_requested() -> bool:
    """``LFMSPARK_FUSED_NORM`` (default ``1``): whether one-row add + RMSNorm + projection chains
    may run as ``lfmspark::add_rmsnorm_gemv`` (see the module doc); ``0`` turns the fusion off."""
    value = os.environ.get("LFMSPARK_FUSED_NORM", "1")
    if value not in ("0", "1"):
        raise ValueError(f"LFMSPARK_FUSED_NORM={value!r}: use 1 (fused add + RMSNorm + GEMV) or 0 (off)")
    return value == "1"


def _fuses_norm(h: torch.Tensor, norm: RMSNorm, weight: torch.Tensor) -> bool:
    """Whether ``(h + delta, norm, product with weight)`` runs as one ``lfmspark::add_rmsnorm_gemv``:
    exactly one row, which :func:`_routed_to_skinny` sends to the GEMV kernels (CUDA), the switch
    on, and shapes and dtypes the op takes (a model in one dtype always qualifies)."""
    return (fused_norm_requested() and h.numel() == h.shape[-1] and _routed_to_skinny(h)
            and h.shape[-1] <= FUSED_NORM_MAX_K and norm.weight.dtype == h.dtype == weight.dtype)


def _one_row(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, t.shape[-1]).contiguous()


def _fused_norm_gemv(h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, weight: torch.Tensor,
                     swiglu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # each product rounds its normalised input as the batch-1 verify's epilogues do while those are
    # on (scale_last): the feed-forward's (LFMSPARK_NORM_EPILOGUE), and with LFMSPARK_NORM_CARRY those
    # after a layer (delta given: the first layer's input, the embeddings, is normed by the module)
    scale_last = norm_epilogue_requested() and (swiglu or (delta is not None and norm_carry_requested()))
    s, y = lfm.add_rmsnorm_gemv(_one_row(h), None if delta is None else _one_row(delta), norm.weight, norm.eps,
                                weight, swiglu, scale_last)
    # without delta the sum is h itself (the op's s is a copy of it)
    return h if delta is None else s.view(h.shape), y.view(*h.shape[:-1], y.shape[-1])


def norm_linear(h: torch.Tensor, delta: Pending, norm: RMSNorm, proj: nn.Linear, fuse: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, proj(norm(s)))`` with ``s = h + delta`` (``h`` itself when ``delta`` is None or a
    :class:`NormedCarry`).

    With a carry (made for this ``norm``), one ``lfmspark::skinny_linear`` with its row scale. With
    ``fuse`` (the caller's one-row decode path) and a single row on the GEMV route (see
    :func:`_fuses_norm`), the three run as one ``lfmspark::add_rmsnorm_gemv`` kernel; otherwise as
    the modules: the add, ``norm``, ``proj`` (bit-identical to calling them)."""
    if isinstance(delta, NormedCarry):
        y = lfm.skinny_linear(delta.scaled, proj.weight, delta.ssq, norm.eps)
        return h, y.view(*h.shape[:-1], y.shape[-1])
    if fuse and _fuses_norm(h, norm, proj.weight):
        return _fused_norm_gemv(h, delta, norm, proj.weight, swiglu=False)
    s = h if delta is None else h + delta
    return s, proj(norm(s))


class HeadLogits(NamedTuple):
    """An LM head's logits ``[..., V]`` and, with ``LFMSPARK_HEAD_ARGMAX``, each row's argmax partials
    ``(values, columns)`` ``[rows, tiles]`` from its epilogue (ops/head_argmax.py), else None."""

    logits: torch.Tensor
    partials: tuple[torch.Tensor, torch.Tensor] | None


def head_logits(h: torch.Tensor, delta: Pending, norm: RMSNorm, proj: nn.Linear) -> HeadLogits:
    """``proj(norm(h + delta))`` as :func:`norm_linear` computes it, for a head whose rows' argmax is
    wanted: with a :class:`NormedCarry` and ``LFMSPARK_HEAD_ARGMAX`` on, in one
    ``lfmspark::skinny_linear_argmax`` (the same logits, bit for bit, and their argmax partials)."""
    if isinstance(delta, NormedCarry) and head_argmax_requested():
        y, part_v, part_i = lfm.skinny_linear_argmax(delta.scaled, proj.weight, delta.ssq, norm.eps)
        return HeadLogits(y.view(*h.shape[:-1], y.shape[-1]), (part_v, part_i))
    return HeadLogits(norm_linear(h, delta, norm, proj)[1], None)


def greedy_picks(head: HeadLogits) -> torch.Tensor:
    """``head.logits.argmax(-1)`` (int64 ``[...]``): from the partials when the head wrote them."""
    if head.partials is None:
        return argmax_last(head.logits)
    return lfm.argmax_of_partials(*head.partials).view(head.logits.shape[:-1])


def head_argmax_requested() -> bool:
    """``LFMSPARK_HEAD_ARGMAX`` (default ``1``): whether LM heads on a :class:`NormedCarry` write argmax
    partials for the argmax that follows them (see the module doc)."""
    value = os.environ.get("LFMSPARK_HEAD_ARGMAX", "1")
    if value not in ("0", "1"):
        raise ValueError(f"LFMSPARK_HEAD_ARGMAX={value!r}: use 1 (argmax partials from the LM head's epilogue) "
                         "or 0 (a separate argmax)")
    return value == "1"


def norm_feed_forward(h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, feed_forward: nn.Module,
                      fuse: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, feed_forward(norm(s)))`` with ``s = h + delta``, as :func:`norm_linear`: a dense
    :class:`SwiGLU` on the fused path computes ``silu(gate) * up`` in ``lfmspark::add_rmsnorm_gemv``
    (then ``w2``); any other feed-forward (the MoE block) runs unfused."""
    if fuse and isinstance(feed_forward, SwiGLU) and _fuses_norm(h, norm, feed_forward.w13.weight):
        s, act = _fused_norm_gemv(h, delta, norm, feed_forward.w13.weight, swiglu=True)
        return s, feed_forward.w2(act)
    s = h if delta is None else h + delta
    return s, feed_forward(norm(s))


def norm_carry_requested() -> bool:
    """``LFMSPARK_NORM_CARRY`` (default ``1``): whether the norms between layers may ride in the
    products' epilogues too (:class:`NormedCarry`; only while ``LFMSPARK_NORM_EPILOGUE`` is on)."""
    value = os.environ.get("LFMSPARK_NORM_CARRY", "1")
    if value not in ("0", "1"):
        raise ValueError(f"LFMSPARK_NORM_CARRY={value!r}: use 1 (the norms between layers in the products' "
                         "epilogues, with LFMSPARK_NORM_EPILOGUE=1) or 0 (off)")
    return value == "1"


def norm_epilogue_requested() -> bool:
    """``LFMSPARK_NORM_EPILOGUE`` (default ``1``): whether several-row mixer outputs may run their
    residual add and the next RMSNorm in the products' epilogues (see the module doc)."""
    value = os.environ.get("LFMSPARK_NORM_EPILOGUE", "1")
    if value not in ("0", "1"):
        raise ValueError(f"LFMSPARK_NORM_EPILOGUE={value!r}: use 1 (add + RMSNorm in the products' epilogues) "
                         "or 0 (off)")
    return value == "1"


def _norm_in_epilogues(y: torch.Tensor, h: torch.Tensor, proj: nn.Linear, norm: RMSNorm,
                       feed_forward: nn.Module, decode: bool) -> bool:
    """Whether :func:`project_norm_feed_forward` runs its epilogue pair: 2-16 rows on the skinny
    route outside a decode step, a dense :class:`SwiGLU`, the switch on, one dtype throughout.

    Decode steps of 2-16 rows keep the modules: with the served drafts (blocks of 9 or more) the
    verify of such a batch is wider than 16 rows (cuBLAS and the modules), and speculative and
    target-only decoding should round alike. (With a block under 8, a batch of 2-3 verifies at 16
    rows or fewer on the pair while its decode keeps the modules: bf16 rounding differences only.)"""
    rows = y.numel() // y.shape[-1]
    return (not decode and isinstance(feed_forward, SwiGLU) and 2 <= rows <= SWIGLU_MAX_M and _routed_to_skinny(y)
            and norm_epilogue_requested()
            and y.dtype == h.dtype == proj.weight.dtype == norm.weight.dtype == feed_forward.w13.weight.dtype)


def _carries(s: torch.Tensor, next_norm: torch.Tensor | None) -> bool:
    """Whether a layer with output ``s`` hands it on as a :class:`NormedCarry`: the caller asks for one
    (``next_norm``, the weight of the RMSNorm that follows), 2-16 rows on the skinny route, both
    switches on, one dtype."""
    rows = s.numel() // s.shape[-1]
    return (next_norm is not None and 2 <= rows <= _FEW_ROWS and _routed_to_skinny(s) and norm_epilogue_requested()
            and norm_carry_requested() and next_norm.dtype == s.dtype)


def _carry_of(out: torch.Tensor, next_norm: torch.Tensor) -> NormedCarry:
    """The carry of a layer output made by other kernels (an MoE feed-forward's layer): the
    statistics of ``skinny_linear_add_norm``'s epilogue in plain ops, one fused kernel under compile."""
    out32 = out.reshape(-1, out.shape[-1]).float()
    return NormedCarry((out32 * next_norm.float()).to(out.dtype), out32.pow(2).sum(-1)[None, :])


def project_norm_feed_forward(h: torch.Tensor, y: torch.Tensor, proj: nn.Linear, norm: RMSNorm,
                              feed_forward: nn.Module, fuse: bool = True, next_norm: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, Pending]:
    """``(s, feed_forward(norm(s)))`` with ``s = h + proj(y)``: a mixer's output projection, the
    residual add and the feed-forward after its RMSNorm. ``fuse``: the caller's decode step.
    ``next_norm``: the weight of the RMSNorm after the layer, which the caller may ask the layer
    to start (``LFMSPARK_NORM_CARRY``): then, on the route below, ``(out, NormedCarry)`` for the
    layer's output ``out = s + feed_forward(norm(s))``, the down projection adding the residual
    and writing the statistics in its epilogue (``lfmspark::skinny_linear_add_norm``).

    On 2-16 rows of the skinny route outside a decode step (:func:`_norm_in_epilogues`: the batch-1
    verify, the draft's block, short prompt chunks) the norm has no kernel of its own:
    ``lfmspark::skinny_linear_add_norm`` adds the residual in the projection's epilogue and writes
    ``s``, ``s * norm.weight`` and the per-row partial sums of ``s^2``, and ``lfmspark::skinny_swiglu``
    multiplies ``s * norm.weight`` by the gate/up weights and scales each row by ``rsqrt(mean square
    + eps)`` in its epilogue. Why: each add + RMSNorm kernel sat between two products of the batch-1
    round (docs/benchmarks.md, session 14). Numerics: ``s`` is the modules'; the feed-forward's input
    is rounded once as ``s * weight`` where the module rounds ``s * rstd`` and then its product with
    the weight, a difference within bf16 noise; the one-row decode's fused kernel rounds as this
    pair does (ops/add_rmsnorm_gemv.py). Otherwise :func:`norm_feed_forward` over ``proj(y)``."""
    if not _norm_in_epilogues(y, h, proj, norm, feed_forward, decode=fuse):
        s, ff = norm_feed_forward(h, proj(y), norm, feed_forward, fuse)
        if _carries(s, next_norm):
            out = s + ff
            return out, _carry_of(out, next_norm)
        return s, ff
    rows, width = y.numel() // y.shape[-1], h.shape[-1]
    s, scaled, ssq = lfm.skinny_linear_add_norm(y.reshape(rows, y.shape[-1]), proj.weight,
                                                h.reshape(rows, width), norm.weight)
    act = lfm.skinny_swiglu(scaled, feed_forward.w13.weight, ssq, norm.eps)
    if _carries(s, next_norm):
        out, scaled, ssq = lfm.skinny_linear_add_norm(act, feed_forward.w2.weight, s, next_norm)
        return out.view(h.shape), NormedCarry(scaled, ssq)
    return s.view(h.shape), feed_forward.w2(act.view(*h.shape[:-1], act.shape[-1]))


class Linear(nn.Linear):
    """A bias-free ``nn.Linear`` computed by :func:`linear`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class RMSNorm(nn.Module):
    """HF LFM2 / Qwen3 RMSNorm: fp32 statistics, cast to the input dtype, then ``weight *`` (no +1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SwiGLU(nn.Module):
    """``down(silu(gate x) * up x)`` with gate and up fused into one ``[2F, H]`` weight ``w13``
    (HF ``w1`` rows first, then ``w3``), so a decode step issues one GEMM instead of two."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w13 = Linear(hidden, 2 * ffn)
        self.w2 = Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if _routed_to_skinny(x) and rows <= SWIGLU_MAX_M:
            # rows on the skinny kernels (batch-1 decode, verify, draft): the activation rides in the
            # gate/up product's epilogue, so the [rows, 2F] product is never written and costs no
            # separate activation kernel; one row on the GEMV, 2-16 on the swap-AB kernel
            fused = lfm.swiglu_gemv if rows == 1 else lfm.skinny_swiglu
            h = fused(x.reshape(rows, x.shape[-1]), self.w13.weight).view(*x.shape[:-1], -1)
            return self.w2(h)
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
