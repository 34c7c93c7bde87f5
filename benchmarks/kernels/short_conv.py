"""Benchmark of the ShortConv ops at LFM2.5-1.2B shapes (hidden 2048, 10 conv layers, bf16).

Prefill/decode (``short_conv_prefill`` with T = 1 and a 512-token prefill), verify with its tape
(W = 10) and the commit of all 10 layers, at batch 1, 4 and 16. The prefill/verify ops take the
in_proj output ``bcx [B, T, 3H]`` and apply both gates (``C * conv(B * x)``). Bytes: B, C and x
read, the output ``[B, T, H]`` and the state/tape written, the conv state read. These ops move
kilobytes per call, so at these shapes they are launch-bound: the figure to read is the
graph-replayed microseconds.
"""

from __future__ import annotations

import torch

import lfmspark.ops  # noqa: F401  (registers the ops)

try:
    from .common import copy_bandwidth_gbps, row, time_ms
except ImportError:  # run as a script
    from common import copy_bandwidth_gbps, row, time_ms

H, N_CONV, K = 2048, 10, 3


def run(copy_gbps: float) -> list[dict]:
    ops, dev, dt = torch.ops.lfmspark, "cuda", torch.bfloat16
    rows = []
    for B in (1, 4, 16):
        state = torch.randn(N_CONV, B, K - 1, H, device=dev).to(dt)
        weight = torch.randn(H, K, device=dev).to(dt)
        slots = torch.arange(B, device=dev)
        start = torch.full((B,), 100, device=dev)
        for T in (1, 512) if B == 1 else (1,):
            bcx = torch.randn(B, T, 3 * H, device=dev).to(dt)
            lens = torch.full((B,), T, device=dev)
            ms = time_ms(lambda: ops.short_conv_prefill(bcx, weight, state, 3, slots, start, lens))
            n_bytes = (3 + 1) * B * T * H * 2 + 2 * B * (K - 1) * H * 2
            rows.append(row("short_conv_prefill", f"B={B} T={T}", ms, n_bytes, copy_gbps))
        W = 10
        bcx = torch.randn(B, W, 3 * H, device=dev).to(dt)
        tape = torch.zeros(N_CONV, B, W + K - 1, H, device=dev, dtype=dt)
        ms = time_ms(lambda: ops.short_conv_verify(bcx, weight, state, tape, 3, slots))
        n_bytes = (3 + 1) * B * W * H * 2 + B * (W + K - 1) * H * 2 + B * (K - 1) * H * 2
        rows.append(row("short_conv_verify", f"B={B} W={W}", ms, n_bytes, copy_gbps))
        accepted = torch.randint(1, W + 1, (B,), device=dev)
        ms = time_ms(lambda: ops.short_conv_commit(state, tape, slots, accepted))
        rows.append(row("short_conv_commit", f"B={B} all {N_CONV} layers", ms, 2 * N_CONV * B * (K - 1) * H * 2,
                        copy_gbps))
    return rows


if __name__ == "__main__":
    from tabulate import tabulate

    print(tabulate(run(copy_bandwidth_gbps()), headers="keys"))
