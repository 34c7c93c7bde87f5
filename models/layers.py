"""Building blocks shared by the target and draft modules.

Environment switches (read at each call; under compile, at trace time):

- ``LFMSPARK_SKINNY_LINEAR`` (``few`` default, ``gemv``, ``off``, ``all``, ``verify``): which row
  counts of a product run on ``lfmspark::skinny_linear`` on CUDA (:func:`_skinny_rows`). A dense
  :class:`SwiGLU`'s gate/up product of a routed row count runs with its activation fused: one row
  on ``lfmspark::swiglu_gemv``, 2-16 rows on ``lfmspark::skinny_swiglu``; routed counts above 16
  (``all``, ``verify``) on ``skinny_linear`` followed by the separate activation.
- ``LFMSPARK_FUSED_NORM`` (``1`` default, ``0``): for products of 1-16 rows routed to the skinny
  kernels (CUDA) whose caller fuses (decode, verify, the draft block), the residual add, RMSNorm
  and the following projection run as one kernel (:func:`norm_linear`, :func:`norm_linears`,
  :func:`norm_feed_forward`): one row on ``lfmspark::add_rmsnorm_gemv``, 2-16 rows on
  ``lfmspark::add_rmsnorm_skinny``; ``0`` keeps them separate (the add and norm then fuse under
  compile, the product is its own kernel).
- ``LFMSPARK_L2_PREFETCH_MB`` (``8`` default, ``0`` off): how many bytes of the next product's
  weight a skinny product asks L2 to fetch once its own loads are out (ops/l2_prefetch.py,
  :func:`prefetch_view`). The modules pass each product the view of what runs after it: within a
  layer its own next weight, across layers the ``next_weight`` their caller hands them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops  # noqa: F401  (registers torch.ops.lfmspark.*)
from ..ops.add_rmsnorm_gemv import MAX_K as FUSED_NORM_MAX_K
from ..ops.add_rmsnorm_skinny import MAX_M as FUSED_NORM_MAX_ROWS
from ..ops.l2_prefetch import l2_prefetch_budget
from ..ops.skinny_linear import MAX_M, SWIGLU_MAX_M

lfm = torch.ops.lfmspark


_FEW_ROWS = 16   # the swap-AB kernel's BLOCK_M = 16 covers the batch-1 verify (10 rows) and draft (9)
_SKINNY_MODES = {"off": (1, 0), "gemv": (1, 1), "few": (1, _FEW_ROWS), "all": (1, MAX_M), "verify": (2, MAX_M)}


def _skinny_rows() -> tuple[int, int]:
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
    lo, hi = _skinny_rows()
    return x.is_cuda and lo <= rows <= hi


def prefetch_view(weight: torch.Tensor | None) -> torch.Tensor | None:
    """What a product asks L2 to prefetch of the ``weight`` read after it: its first
    ``LFMSPARK_L2_PREFETCH_MB`` megabytes as a flat view (no copy; the rows the next kernel's first
    programs read), or None (no weight, not on CUDA, or the budget is 0). Every weight of at least
    the budget gives a view of the same shape, so a compiled layer taking one as an input serves
    all of them."""
    if weight is None or not weight.is_cuda:
        return None
    return leading_view(weight, l2_prefetch_budget())


def leading_view(weight: torch.Tensor, n_bytes: int) -> torch.Tensor | None:
    """The first ``n_bytes`` of a contiguous ``weight`` (all of it if smaller) as a flat view; None for
    ``n_bytes`` < one element."""
    n = min(n_bytes // weight.element_size(), weight.numel())
    return weight.reshape(-1)[:n] if n else None


def linear(x: torch.Tensor, weight: torch.Tensor, prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` (no bias): ``F.linear``, or ``lfmspark::skinny_linear`` for few-row products on
    CUDA when ``LFMSPARK_SKINNY_LINEAR`` selects it (see :func:`_skinny_rows`), which also requests
    ``prefetch`` (a :func:`prefetch_view`) into L2."""
    rows = x.numel() // x.shape[-1]
    if _routed_to_skinny(x):
        return lfm.skinny_linear(x.reshape(rows, x.shape[-1]), weight, prefetch).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def fused_norm_requested() -> bool:
    """``LFMSPARK_FUSED_NORM`` (default ``1``): whether add + RMSNorm + projection chains of 1-16 rows
    may run as one fused op (see the module doc); ``0`` turns the fusion off."""
    value = os.environ.get("LFMSPARK_FUSED_NORM", "1")
    if value not in ("0", "1"):
        raise ValueError(f"LFMSPARK_FUSED_NORM={value!r}: use 1 (fused add + RMSNorm + product) or 0 (off)")
    return value == "1"


def _fuses_norm(h: torch.Tensor, norm: RMSNorm, weight: torch.Tensor) -> bool:
    """Whether ``(h + delta, norm, product with weight)`` runs as one fused op: 1-16 rows, which
    :func:`_routed_to_skinny` sends to the skinny kernels (CUDA), the switch on, and shapes and
    dtypes the ops take (a model in one dtype always qualifies)."""
    rows = h.numel() // h.shape[-1]
    return (fused_norm_requested() and rows <= FUSED_NORM_MAX_ROWS and _routed_to_skinny(h)
            and (rows > 1 or h.shape[-1] <= FUSED_NORM_MAX_K) and norm.weight.dtype == h.dtype == weight.dtype)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def _fused_norm(h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, weight: torch.Tensor,
                swiglu: bool, prefetch: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op for ``h``'s rows: one row on ``lfmspark::add_rmsnorm_gemv`` (the GEMV kernel),
    2-16 on ``lfmspark::add_rmsnorm_skinny`` (the swap-AB kernel's norm prologue)."""
    rows = h.numel() // h.shape[-1]
    op = lfm.add_rmsnorm_gemv if rows == 1 else lfm.add_rmsnorm_skinny
    s, y = op(_as_rows(h), None if delta is None else _as_rows(delta), norm.weight, norm.eps, weight, swiglu,
              prefetch)
    # without delta the sum is h itself (the op's s is a copy of it)
    return h if delta is None else s.view(h.shape), y.view(*h.shape[:-1], y.shape[-1])


def _weight(proj: Linear | torch.Tensor) -> torch.Tensor:
    return proj.weight if isinstance(proj, Linear) else proj


def _project(x: torch.Tensor, proj: Linear | torch.Tensor, prefetch: torch.Tensor | None) -> torch.Tensor:
    # a module is called as such (its forward hooks run), a bare weight goes to linear()
    return proj(x, prefetch) if isinstance(proj, Linear) else linear(x, proj, prefetch)


def norm_linears(h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, projs: Sequence[Linear | torch.Tensor],
                 fuse: bool = True, prefetches: Sequence[torch.Tensor | None] | None = None
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(s, [proj(norm(s)) for proj in projs])`` with ``s = h + delta`` (``h`` itself when ``delta`` is
    None): products of one normalised input (the draft's q and K/V projections share it); each
    ``proj`` a :class:`Linear` or a bare weight ``[N, K]``.

    With ``fuse`` (a caller whose rows may fuse: decode, verify, the draft block) and rows the
    fused ops take (see :func:`_fuses_norm`), each product runs as one fused op computing the add
    and the norm in its prologue: the first adds ``delta``, the later ones take its ``s`` and
    recompute the norm (the same values, no norm kernel). Otherwise as the modules: the add,
    ``norm`` once, the products (bit-identical to calling them). ``prefetches``: each product's
    :func:`prefetch_view` of the weight read after it (default none)."""
    prefetches = [None] * len(projs) if prefetches is None else prefetches
    if fuse and all(_fuses_norm(h, norm, _weight(p)) for p in projs):
        ys = []
        for proj, pf in zip(projs, prefetches, strict=True):
            s, y = _fused_norm(h, delta, norm, _weight(proj), False, pf)
            h, delta = s, None  # the later products normalise the same sum
            ys.append(y)
        return h, ys
    s = h if delta is None else h + delta
    x = norm(s)
    return s, [_project(x, proj, pf) for proj, pf in zip(projs, prefetches, strict=True)]


def norm_linear(h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, proj: Linear | torch.Tensor,
                fuse: bool = True, prefetch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, proj(norm(s)))`` with ``s = h + delta``: :func:`norm_linears` for one product
    (``lfmspark::add_rmsnorm_gemv`` for one row, ``lfmspark::add_rmsnorm_skinny`` for 2-16, where
    fused). ``prefetch``: the :func:`prefetch_view` of the weight read next."""
    s, (y,) = norm_linears(h, delta, norm, (proj,), fuse, (prefetch,))
    return s, y


def norm_feed_forward(h: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, feed_forward: nn.Module,
                      fuse: bool = True, prefetch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, feed_forward(norm(s)))`` with ``s = h + delta``, as :func:`norm_linear`: a dense
    :class:`SwiGLU` on the fused path computes ``silu(gate) * up`` in the fused op (then ``w2``); any
    other feed-forward (the MoE block) runs unfused. ``prefetch``: the :func:`prefetch_view` of the
    weight read after the feed-forward (a dense one's ``w2`` takes it)."""
    if isinstance(feed_forward, SwiGLU):
        if fuse and _fuses_norm(h, norm, feed_forward.w13.weight):
            s, act = _fused_norm(h, delta, norm, feed_forward.w13.weight, True, prefetch_view(feed_forward.w2.weight))
            return s, feed_forward.w2(act, prefetch)
        s = h if delta is None else h + delta
        return s, feed_forward(norm(s), prefetch)
    s = h if delta is None else h + delta
    return s, feed_forward(norm(s))


class Linear(nn.Linear):
    """A bias-free ``nn.Linear`` computed by :func:`linear`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor, prefetch: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, prefetch)


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

    def forward(self, x: torch.Tensor, prefetch: torch.Tensor | None = None) -> torch.Tensor:
        """``prefetch``: the :func:`prefetch_view` of the weight read after this block (``w2`` takes it)."""
        rows = x.numel() // x.shape[-1]
        if _routed_to_skinny(x) and rows <= SWIGLU_MAX_M:
            # rows on the skinny kernels (batch-1 decode, verify, draft): the activation rides in the
            # gate/up product's epilogue, so the [rows, 2F] product is never written and costs no
            # separate activation kernel; one row on the GEMV, 2-16 on the swap-AB kernel
            fused = lfm.swiglu_gemv if rows == 1 else lfm.skinny_swiglu
            h = fused(x.reshape(rows, x.shape[-1]), self.w13.weight, prefetch_view(self.w2.weight))
            return self.w2(h.view(*x.shape[:-1], -1), prefetch)
        gate, up = self.w13(x, prefetch_view(self.w2.weight)).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up, prefetch)
