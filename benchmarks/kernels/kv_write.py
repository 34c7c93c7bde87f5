"""Benchmark of ``lfmspark::kv_write`` at LFM2.5-1.2B target shapes (8 kv heads, head_dim 64,
bf16): decode (T = 1) and verify (T = 10) at batch 1, 4 and 16, and a 2048-token prefill.
Bytes: K and V read and written. Small windows are launch-bound (read the microseconds)."""

from __future__ import annotations

import torch

import lfmspark.ops  # noqa: F401  (registers the ops)

try:
    from .common import copy_bandwidth_gbps, row, time_ms
except ImportError:  # run as a script
    from common import copy_bandwidth_gbps, row, time_ms

N_ATTN, N_KV, HD, S = 6, 8, 64, 8192 + 64


def run(copy_gbps: float) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    rows = []
    for B, T in ((1, 1), (4, 1), (16, 1), (1, 10), (4, 10), (16, 10), (1, 2048)):
        k = torch.randn(B, T, N_KV, HD, device=dev).to(dt)
        v = torch.randn_like(k)
        kc = torch.zeros(N_ATTN, max(B, 1), S, N_KV, HD, device=dev, dtype=dt)
        vc = torch.zeros_like(kc)
        slots = torch.arange(B, device=dev)
        start = torch.randint(0, S - T - 1, (B,), device=dev)
        lens = torch.full((B,), T, device=dev)
        ms = time_ms(lambda: torch.ops.lfmspark.kv_write(k, v, kc, vc, 2, slots, start, lens))
        rows.append(row("kv_write", f"B={B} T={T}", ms, 4 * k.numel() * 2, copy_gbps))
    return rows


if __name__ == "__main__":
    from tabulate import tabulate

    print(tabulate(run(copy_bandwidth_gbps()), headers="keys"))
