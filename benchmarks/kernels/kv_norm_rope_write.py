"""Benchmark of ``lfmspark::kv_norm_rope_write`` at LFM2.5-1.2B DSpark draft shapes.

5 draft layers, 8 kv heads, head_dim 64, bf16: ``kv [B, T, 5 * 2 * 512]``. Commit windows (T = 10,
``lens`` drawn from 1..10) at batch 1, 4 and 16, and prefill (T = 512 and 8192, batch 1, every
column committed). Bytes count what the kernel moves: the committed tokens' ``kv`` read plus their
K and V written (masked columns are neither read nor written). Times are CUDA-graph replays;
batch-1 rows also report the plain launch (``us_nograph``), where the op is launch-bound.
"""

from __future__ import annotations

import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.attention.rope import rope_cos_sin_table

try:
    from .common import copy_bandwidth_gbps, row, time_ms
except ImportError:  # run as a script
    from common import copy_bandwidth_gbps, row, time_ms

N_LAYERS, N_KV, HEAD_DIM = 5, 8, 64
THETA, EPS = 1e6, 1e-5
CACHE_LEN = 8192 + 64
# (B, T): commit windows, then prefill
SHAPES = [(1, 10), (4, 10), (16, 10), (1, 512), (1, 8192)]


def _inputs(B: int, T: int, seed: int = 0) -> tuple[tuple, int]:
    """The op's arguments and the number of committed tokens."""
    dev, dtype = "cuda", torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(seed)
    KV = N_KV * HEAD_DIM
    kv = torch.randn(B, T, N_LAYERS * 2 * KV, generator=g).to(dev, dtype)
    weight = (1.0 + 0.1 * torch.randn(N_LAYERS, HEAD_DIM, generator=g)).to(dev, dtype)
    cos_sin = rope_cos_sin_table(CACHE_LEN, HEAD_DIM, THETA, device=dev)
    k_cache = torch.zeros(N_LAYERS, B, CACHE_LEN, N_KV, HEAD_DIM, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(B, dtype=torch.int32)
    if T <= 16:  # commit window: somewhere in the sequence, 1..T tokens accepted
        start = torch.randint(0, CACHE_LEN - 64 - T, (B,), generator=g, dtype=torch.int32)
        lens = torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int32)
    else:        # prefill from position 0, all columns
        start = torch.zeros(B, dtype=torch.int32)
        lens = torch.full((B,), T, dtype=torch.int32)
    committed = int(lens.sum())
    args = (kv, weight, cos_sin, k_cache, v_cache, 0, slots.to(dev), start.to(dev), lens.to(dev), EPS, False)
    return args, committed


def run(copy_gbps: float) -> list[dict]:
    rows = []
    for B, T in SHAPES:
        args, committed = _inputs(B, T)
        width = args[0].shape[-1]
        n_bytes = 2 * committed * width * args[0].element_size()  # kv read + the same K/V bytes written

        def call(args=args):
            torch.ops.lfmspark.kv_norm_rope_write(*args)

        ms = time_ms(call)
        extra = {"tokens": committed}
        if B == 1:
            extra["us_nograph"] = round(time_ms(call, use_graph=False) * 1e3, 2)
        rows.append(row("kv_norm_rope_write", f"B={B} T={T} n={N_LAYERS} kv={N_KV}x{HEAD_DIM} bf16", ms,
                        n_bytes, copy_gbps, **extra))
        del args
    return rows


if __name__ == "__main__":
    from tabulate import tabulate

    print(tabulate(run(copy_bandwidth_gbps()), headers="keys"))
