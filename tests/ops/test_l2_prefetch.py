"""L2 prefetch of the next product's weights (ops/l2_prefetch.py): the budget switch, when the
launchers turn it off, and on the GPU that a product's result does not depend on what it
prefetches (bit for bit, with and without, every kernel taking a prefetch range).

A prefetch is a hint: the only thing to get wrong is a result (a kernel reading the prefetch
arguments as data, or a bad address), which the GPU tests catch; whether it is *faster* is measured
by the benchmark (docs/benchmarks.md), never asserted.
"""

from __future__ import annotations

import pytest
import torch

from lfmspark.models.layers import leading_view, prefetch_view
from lfmspark.ops.add_rmsnorm_gemv import add_rmsnorm_gemv_triton
from lfmspark.ops.l2_prefetch import MODES, l2_prefetch_budget, prefetch_args, prefetch_mode
from lfmspark.ops.skinny_linear import SkinnyConfig, skinny_linear_triton, skinny_swiglu_triton
from lfmspark.ops.swiglu_gemv import swiglu_gemv_triton


def test_budget_switch(monkeypatch) -> None:
    monkeypatch.delenv("LFMSPARK_L2_PREFETCH_MB", raising=False)
    assert l2_prefetch_budget() == 8 << 20
    monkeypatch.setenv("LFMSPARK_L2_PREFETCH_MB", "0")
    assert l2_prefetch_budget() == 0
    monkeypatch.setenv("LFMSPARK_L2_PREFETCH_MB", "0.5")
    assert l2_prefetch_budget() == 1 << 19
    for bad in ("-1", "lots"):
        monkeypatch.setenv("LFMSPARK_L2_PREFETCH_MB", bad)
        with pytest.raises(ValueError, match="LFMSPARK_L2_PREFETCH_MB"):
            l2_prefetch_budget()


def test_mode_switch(monkeypatch) -> None:
    monkeypatch.delenv("LFMSPARK_L2_PREFETCH_MODE", raising=False)
    assert prefetch_mode() == MODES["program"]
    monkeypatch.setenv("LFMSPARK_L2_PREFETCH_MODE", "lines")
    assert prefetch_mode() == MODES["lines"]
    monkeypatch.setenv("LFMSPARK_L2_PREFETCH_MODE", "tma")
    with pytest.raises(ValueError, match="LFMSPARK_L2_PREFETCH_MODE"):
        prefetch_mode()


def test_leading_view() -> None:
    w = torch.arange(64, dtype=torch.float32).view(8, 8)
    v = leading_view(w, 40)                         # 10 fp32 elements
    assert v.shape == (10,) and v.data_ptr() == w.data_ptr() and torch.equal(v, torch.arange(10.0))
    assert leading_view(w, 1 << 20).shape == (64,)  # the whole weight when smaller than the budget
    assert leading_view(w, 3) is None               # less than one element
    assert prefetch_view(w) is None                 # not on CUDA: nothing to prefetch
    assert prefetch_view(None) is None


def test_launcher_turns_prefetch_off_off_cuda() -> None:
    w = torch.ones(4, 4)
    assert prefetch_args(w, w) == {"pf_ptr": w, "pf_bytes": 0, "PREFETCH": 0}
    assert prefetch_args(None, w)["PREFETCH"] == 0


@pytest.mark.gpu
def test_launcher_arguments_on_cuda() -> None:
    w = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    args = prefetch_args(w.view(-1)[:1001], w)             # 2002 bytes -> 2000 (16-byte multiple)
    assert args["PREFETCH"] == MODES["program"] and args["pf_bytes"] == 2000
    assert not prefetch_args(w.view(-1)[1:100], w)["PREFETCH"]   # base not 16-byte aligned
    assert not prefetch_args(w.view(-1)[:7], w)["PREFETCH"]      # under 16 bytes
    with pytest.raises(ValueError, match="contiguous"):
        prefetch_args(w[:, :8], w)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("n_bytes", [16, 4096 + 16, 3 << 20, 40 << 20], ids=["tiny", "odd", "3MB", "40MB"])
def test_results_do_not_depend_on_the_prefetch(monkeypatch, mode: str, n_bytes: int) -> None:
    """Every kernel with a prefetch range, at served-like shapes (one wave and several, split-K),
    gives the same bits with a prefetch of ``n_bytes`` of another tensor as without, in every mode."""
    monkeypatch.setenv("LFMSPARK_L2_PREFETCH_MODE", mode)
    other = torch.empty(n_bytes // 2, device="cuda", dtype=torch.bfloat16)
    pf = other.view(-1)
    K, N, F = 2048, 2048, 2816
    x1, x10 = _rand(1, K, seed=1), _rand(10, K, seed=2)
    w, w13, w2 = _rand(N, K, seed=3) / 40, _rand(2 * F, K, seed=4) / 40, _rand(N, 4 * K, seed=5) / 40
    x1_long = _rand(1, 4 * K, seed=6)
    h, delta, nw = _rand(1, K, seed=7), _rand(1, K, seed=8), _rand(K, seed=9)
    cases = {
        "gemv": lambda p: skinny_linear_triton(x1, w, prefetch=p),
        "gemv_split": lambda p: skinny_linear_triton(x1_long, w2, SkinnyConfig(block_n=4, block_k=1024, split_k=4,
                                                                              gemv=True), prefetch=p),
        "swap_ab": lambda p: skinny_linear_triton(x10, w, prefetch=p),
        "swap_ab_long_k": lambda p: skinny_linear_triton(_rand(10, 4 * K, seed=10), w2, prefetch=p),
        "skinny_swiglu": lambda p: skinny_swiglu_triton(x10, w13, prefetch=p),
        "swiglu_gemv": lambda p: swiglu_gemv_triton(x1, w13, prefetch=p),
        "add_rmsnorm_gemv": lambda p: add_rmsnorm_gemv_triton(h, delta, nw, 1e-5, w, False, prefetch=p),
        "add_rmsnorm_swiglu": lambda p: add_rmsnorm_gemv_triton(h, delta, nw, 1e-5, w13, True, prefetch=p),
    }
    for name, run in cases.items():
        want, got = run(None), run(pf)
        for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
            assert torch.equal(a, b), name
