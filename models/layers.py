"""Building blocks shared by the target and draft modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        self.w13 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
