"""Rotary position embedding: the cos/sin table and the rotation (reference math).

One table serves both pairings: row ``p`` is ``[cos(p * inv_freq), sin(p * inv_freq)]`` in fp32
(``head_dim`` columns). Neox ("rotate half") pairs element ``i`` with ``i + D/2``; interleaved
(GPT-J) pairs ``2i`` with ``2i + 1``. LFM2 targets use neox, the LFM2 DSpark drafts interleaved
(DESIGN §1: mixing them up silently collapses acceptance).
"""

from __future__ import annotations

import torch


def rope_cos_sin_table(max_positions: int, head_dim: int, theta: float,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """``[max_positions, head_dim]`` fp32: cos in the first half of each row, sin in the second."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    pos = torch.arange(max_positions, dtype=torch.int64, device=device).float()
    freqs = torch.outer(pos, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate ``x [..., D]`` (any float dtype; math in the dtype given) with ``cos``/``sin [..., D/2]``.

    ``cos``/``sin`` broadcast against ``x[..., :D/2]``.
    """
    half = x.shape[-1] // 2
    if is_neox:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def gather_cos_sin(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin rows ``[..., D/2]`` (fp32) for integer ``positions`` (clamped into the table)."""
    rows = table[positions.clamp(0, table.shape[0] - 1)]
    half = table.shape[-1] // 2
    return rows[..., :half], rows[..., half:]


def window_positions(start: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, T]`` absolute positions ``start[b] + t`` of a window of ``T`` tokens."""
    return start[:, None] + torch.arange(T, device=start.device)[None, :]

