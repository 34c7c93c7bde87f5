"""Add + RMSNorm + skinny product: ``s = h + delta``, ``y = rmsnorm(s) @ weight^T`` for 2-16 rows in one
kernel (or, with ``swiglu``, the dense feed-forward's ``silu(gate) * up`` over a stacked ``[2F, K]``).

Why: ``lfmspark::add_rmsnorm_gemv`` removed the separate add + RMSNorm kernel before every one-row
product of a decode step; the speculative round's verify (10 rows) and draft (9 rows) still ran it
before each swap-AB product (``lfmspark::skinny_linear`` / ``skinny_swiglu``): about 43 extra kernels
per round at the LFM2.5-1.2B shape with a 5-layer draft. Here the swap-AB kernel of
ops/skinny_linear.py does that work as a prologue (its ``NORM`` path).

Design: the product's programs (column tile x K split, as ``skinny_linear`` / ``skinny_swiglu``
launch them, with the same configs) request their first weight block before the PDL wait, then
make a first pass over the whole rows of ``h`` (and ``delta``), from L2 (``K`` is the hidden size,
1024-2048 for the LFM2 models), for each row's fp32 ``rsqrt(mean(s^2) + eps)``; every K split needs
the statistics of the full row. The main K loop then builds each ``x`` block from ``h``, ``delta``
and the norm weight (only its own K range) and feeds it to the ``tl.dot`` as the plain product feeds
``x``. Program ``(0, 0)`` stores ``s`` (all programs compute the same values).

Numerics: those of the unfused modules (models/layers.py ``RMSNorm`` then ``F.linear``, HF eager),
as ``lfmspark::add_rmsnorm_gemv``: ``s`` rounded to the dtype; fp32 statistics of the rounded ``s``,
the normalised row cast to the dtype, times the norm weight, rounded; fp32 dot products rounded once
(for ``swiglu``: gate, up, ``silu(gate)`` and the product each rounded). The summation orders differ
from the reference's, so bf16 outputs may differ by an ulp. Static grid, no host sync: CUDA-graph
safe; split-K launches share the per-device arrival counters (ops/skinny_linear.py).
"""

from __future__ import annotations

import torch

from ._dispatch import use_triton
from .add_rmsnorm_gemv import _DTYPES, add_rmsnorm_gemv_reference
from .skinny_linear import (SWIGLU_MAX_M, NormPrologue, SkinnyConfig, _launch, _sm_count, swap_ab_config,
                            swiglu_config)

MIN_M = 2  # one row is add_rmsnorm_gemv's (the GEMV kernel)
MAX_M = SWIGLU_MAX_M  # BLOCK_M = 16: the batch-1 verify (10 rows) and draft (9)


# ---------------------------------------------------------------------------------------------
# launcher

def _check(h: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor,
           swiglu: bool) -> None:
    if h.dim() != 2 or not MIN_M <= h.shape[0] <= MAX_M:
        raise ValueError(f"add_rmsnorm_skinny takes h [M, K] with {MIN_M} <= M <= {MAX_M} (one row: "
                         f"add_rmsnorm_gemv), got h of shape {tuple(h.shape)}")
    K = h.shape[1]
    if K < 1 or weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"expected h [M, K] and weight [N, K] with K >= 1, got {tuple(h.shape)} and "
                         f"{tuple(weight.shape)}")
    if delta is not None and delta.shape != h.shape:
        raise ValueError(f"delta must have h's shape {tuple(h.shape)}, got {tuple(delta.shape)}")
    if norm_weight.shape != (K,):
        raise ValueError(f"norm_weight must be [K] = [{K}], got {tuple(norm_weight.shape)}")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"with swiglu, weight must stack gate and up rows ([2F, K]), got {weight.shape[0]} rows")
    if h.dtype not in _DTYPES:
        raise ValueError(f"h must be bf16, fp16 or fp32, got {h.dtype}")
    others = {"delta": None if delta is None else delta.dtype, "norm_weight": norm_weight.dtype,
              "weight": weight.dtype}
    for name, dt in others.items():
        if dt is not None and dt != h.dtype:
            raise ValueError(f"h and {name} must share a dtype, got {h.dtype} and {dt}")
    if weight.stride(1) != 1 or norm_weight.stride(0) != 1:
        raise ValueError("weight and norm_weight must be contiguous along K (stride(-1) == 1)")
    devices = {t.device for t in (h, delta, norm_weight, weight) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def default_config(M: int, N: int, K: int, elem_size: int, sms: int, swiglu: bool) -> SkinnyConfig:
    """The launch of the plain product with the same shape (``skinny_swiglu``'s for ``swiglu``, ``N``
    gate columns): the prologue adds only L2 reads of ``h``, ``delta`` and the norm weight."""
    return (swiglu_config if swiglu else swap_ab_config)(M, N, K, elem_size, sms)


def add_rmsnorm_skinny_triton(h: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                              weight: torch.Tensor, swiglu: bool, prefetch: torch.Tensor | None = None,
                              config: SkinnyConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on the swap-AB kernel's ``NORM`` path. ``config``: launch override (tests, tuning);
    it must be a swap-AB one."""
    _check(h, delta, norm_weight, weight, swiglu)
    (M, K), N = h.shape, weight.shape[0] // 2 if swiglu else weight.shape[0]
    h = h.contiguous()  # h, delta and s share the kernel's row stride
    delta = None if delta is None else delta.contiguous()
    s = torch.empty_like(h)
    out = torch.empty((M, N), dtype=h.dtype, device=h.device)
    if N == 0:  # no weight rows: only the sum
        s.copy_(h if delta is None else h + delta)
        return s, out
    cfg = config or default_config(M, N, K, h.element_size(), _sm_count(h.device), swiglu)
    _launch(h, weight, out, cfg, swiglu, prefetch, NormPrologue(delta, norm_weight, eps, s))
    return s, out


# ---------------------------------------------------------------------------------------------
# op

@torch.library.custom_op("lfmspark::add_rmsnorm_skinny", mutates_args=())
def add_rmsnorm_skinny(h: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, swiglu: bool, prefetch: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, y)`` for ``h [M, K]``, ``2 <= M <= 16``: ``s = h + delta`` (a copy of ``h`` when ``delta`` is
    None) and ``y = rmsnorm(s) @ weight[N, K]^T`` ``[M, N]``, or with ``swiglu`` ``silu(gate) * up``
    ``[M, F]`` of the stacked ``weight [2F, K]``; all in ``h``'s dtype. ``prefetch``: bytes (the next
    product's weights) to request into L2, a hint that never changes the result (ops/l2_prefetch.py)."""
    if use_triton(h):
        return add_rmsnorm_skinny_triton(h, delta, norm_weight, eps, weight, swiglu, prefetch)
    _check(h, delta, norm_weight, weight, swiglu)  # the same limits on every device
    return add_rmsnorm_gemv_reference(h, delta, norm_weight, eps, weight, swiglu)


@add_rmsnorm_skinny.register_kernel("cuda")
def _add_rmsnorm_skinny_cuda(h, delta, norm_weight, eps, weight, swiglu, prefetch=None):
    return add_rmsnorm_skinny_triton(h, delta, norm_weight, eps, weight, swiglu, prefetch)


@add_rmsnorm_skinny.register_fake
def _add_rmsnorm_skinny_fake(h, delta, norm_weight, eps, weight, swiglu, prefetch=None):
    _check(h, delta, norm_weight, weight, swiglu)
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    return torch.empty_like(h, memory_format=torch.contiguous_format), h.new_empty((h.shape[0], N))
