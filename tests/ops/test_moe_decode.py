"""ops/moe_decode.py, the two-launch MoE path for a few (token, expert) pairs: the Triton kernels
(interpreter on CPU, native on CUDA) against the fp64 oracle of ops/moe.py's tests, with K tails,
tokens sharing experts, one and four experts per token; and the route: ``moe_experts`` takes it up to
``LFMSPARK_TUNE``'s ``moe_decode.max_pairs`` pairs (none by default), never in exact mode."""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops import moe_decode
from lfmspark.ops.moe import moe_experts_triton
from lfmspark.ops.moe_decode import DecodeConfig, moe_decode_triton
from env_vars import set_env
from test_moe import _check, _inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, k, routing", [(1, 4, "random"), (1, 1, "random"), (3, 2, "same"), (4, 4, "few")])
def test_matches_the_oracle(triton_device, N, k, routing, dtype):
    args = _inputs(N, k, 8, 96, 80, dtype, triton_device, routing=routing, seed=N * 10 + k)
    _check(args, moe_decode_triton(*args), triton_device)


def test_small_tiles_and_k_tails(triton_device):
    args = _inputs(2, 3, 6, 100, 72, torch.float32, triton_device, seed=4)       # H, I not multiples of 32
    _check(args, moe_decode_triton(*args, config=DecodeConfig(block_n1=16, block_n2=32, block_k=32)), triton_device)


def test_moe_experts_takes_the_path_up_to_the_tuned_pair_count(triton_device, monkeypatch):
    calls = []
    real = moe_decode.moe_decode_triton
    monkeypatch.setattr(moe_decode, "moe_decode_triton", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    small, large = (_inputs(n, 4, 8, 64, 48, torch.float32, triton_device) for n in (2, 3))
    moe_experts_triton(*small)
    assert calls == []                                          # off by default
    set_env(monkeypatch, TUNE="moe_decode.max_pairs=8")
    out = moe_experts_triton(*small)
    moe_experts_triton(*large)                                  # 12 pairs: the general path
    moe_experts_triton(*small, exact=True)                      # exact mode: its own tiles
    assert calls == [2]
    _check(small, out, triton_device)
