"""Building blocks shared by the target and draft modules."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops  # noqa: F401  (registers torch.ops.lfmspark.*)
from ..ops.skinny_linear import MAX_M

lfm = torch.ops.lfmspark


_SKINNY_MODES = {"off": (1, 0), "gemv": (1, 1), "all": (1, MAX_M), "verify": (2, MAX_M)}


def _skinny_rows() -> tuple[int, int]:
    """Row counts routed to ``lfmspark::skinny_linear`` on CUDA, from ``LFMSPARK_SKINNY_LINEAR``:
    ``gemv`` (default: one-row products, where its GEMV kernel beat cuBLAS at every served shape on
    the H200), ``off`` (cuBLAS everywhere), ``all`` (1..64 rows) or ``verify`` (2..64). The
    several-row kernel measured no faster than cuBLAS (docs/benchmarks.md), so it is opt-in.
    Read at each call (under compile: at trace time), so a process can compare modes."""
    mode = os.environ.get("LFMSPARK_SKINNY_LINEAR", "gemv")
    if mode not in _SKINNY_MODES:
        raise ValueError(f"LFMSPARK_SKINNY_LINEAR={mode!r}: use one of {sorted(_SKINNY_MODES)}")
    return _SKINNY_MODES[mode]


def _routed_to_skinny(x: torch.Tensor) -> bool:
    """Whether a product with input ``x [..., K]`` runs on the skinny kernels (CUDA only)."""
    rows = x.numel() // x.shape[-1]
    lo, hi = _skinny_rows()
    return x.is_cuda and lo <= rows <= hi


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (no bias): ``F.linear``, or ``lfmspark::skinny_linear`` for few-row products on
    CUDA when ``LFMSPARK_SKINNY_LINEAR`` selects it (see :func:`_skinny_rows`)."""
    rows = x.numel() // x.shape[-1]
    if _routed_to_skinny(x):
        return lfm.skinny_linear(x.reshape(rows, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


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
        if _routed_to_skinny(x) and x.numel() == x.shape[-1]:
            # one row (batch-1 decode): the activation rides in the gate/up GEMV's epilogue
            h = lfm.swiglu_gemv(x.reshape(1, -1), self.w13.weight).view(*x.shape[:-1], -1)
            return self.w2(h)
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
