"""``lfmspark::skinny_linear_pair``: ``x @ [w_a; w_b]^T`` from two separate weights in one launch of the
swap-AB kernel (``TWO_WEIGHTS``; interpreter on CPU, native on CUDA), against the op's reference
(two ``F.linear`` concatenated) and an fp64 oracle, with and without split-K; each half of the
output bit-identical to the one-weight kernel on that weight with the same launch parameters (the
pair only picks a program's weight); the launch heuristic; input errors; registration.

Tolerances as tests/ops/test_skinny_linear.py (relative Frobenius errors): fp32 1e-5, bf16 1e-2.
"""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.linear.skinny_linear import (MAX_M, SkinnyConfig, _split_counters, pair_config,
                                        skinny_linear_pair_reference, skinny_linear_pair_triton, skinny_linear_triton,
                                        split_k_plan, swap_ab_config)
from env_vars import interpret_triton, set_env

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
lfm = torch.ops.lfmspark


def _inputs(device: str, dtype: torch.dtype, M: int, N_A: int, N_B: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w_a = (torch.randn(N_A, K, generator=g) / K ** 0.5).to(device, dtype)
    w_b = (3 * torch.randn(N_B, K, generator=g) / K ** 0.5).to(device, dtype)  # another scale: halves told apart
    return x, w_a, w_b


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def _check(out: torch.Tensor, x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor) -> None:
    assert out.shape == (x.shape[0], w_a.shape[0] + w_b.shape[0]) and out.dtype == x.dtype
    want = x.double() @ torch.cat([w_a, w_b]).double().T
    assert _rel_err(out, want) < TOL[x.dtype]
    assert _rel_err(skinny_linear_pair_reference(x, w_a, w_b), want) < TOL[x.dtype]   # the reference meets it too


# (N_A, N_B, K, cfg): one split, K tail, w_b's rows not whole tiles; split-K with a K tail in the
# last split; narrow tiles, more splits than the fix-up loads at once; the first weight of one tile
CASES = [
    (64, 48, 200, SkinnyConfig(block_n=64, block_k=64)),
    (128, 64, 300, SkinnyConfig(block_n=32, block_k=64, split_k=3)),
    (32, 40, 192, SkinnyConfig(block_n=16, block_k=16, split_k=6)),
    (64, 200, 128, SkinnyConfig(block_n=64, block_k=32, split_k=2)),
]
CASE_IDS = ["one_split", "split_k", "six_splits", "one_a_tile"]


def test_cases_split_as_named() -> None:
    assert [split_k_plan(K, cfg.block_k, cfg.split_k)[1] for _, _, K, cfg in CASES] == [1, 3, 6, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [2, 9, 10, 16])
@pytest.mark.parametrize("N_A, N_B, K, cfg", CASES, ids=CASE_IDS)
def test_kernel_matches_reference_and_the_one_weight_kernel(triton_device: str, dtype: torch.dtype, M: int,
                                                             N_A: int, N_B: int, K: int, cfg: SkinnyConfig) -> None:
    x, w_a, w_b = _inputs(triton_device, dtype, M, N_A, N_B, K, seed=M + N_A + K)
    out = skinny_linear_pair_triton(x, w_a, w_b, cfg)
    _check(out, x, w_a, w_b)
    # each program streams one weight with the one-weight kernel's loop: the same sums, bit for bit
    assert torch.equal(out[:, :N_A], skinny_linear_triton(x, w_a, cfg))
    assert torch.equal(out[:, N_A:], skinny_linear_triton(x, w_b, cfg))


@pytest.mark.parametrize("M", [1, 3, 10, 33])
def test_heuristic_config(triton_device: str, M: int) -> None:
    """The default config (split-K on the interpreter's 8 "SMs"); one row and more than 16 also run
    on the tile kernel (the op has no GEMV variant)."""
    x, w_a, w_b = _inputs(triton_device, torch.float32, M, 128, 64, 2048, seed=M)
    _check(lfm.skinny_linear_pair(x, w_a, w_b), x, w_a, w_b)


def test_zero_second_weight_gives_zero_columns(triton_device: str) -> None:
    """``w_b = 0``: the last columns vanish and the first are ``x @ w_a^T`` (the halves not swapped)."""
    N_A, N_B, K, cfg = CASES[1]
    x, w_a, w_b = _inputs(triton_device, torch.float32, 9, N_A, N_B, K)
    out = skinny_linear_pair_triton(x, w_a, torch.zeros_like(w_b), cfg)
    assert torch.equal(out[:, N_A:], torch.zeros(9, N_B, device=triton_device))
    torch.testing.assert_close(out[:, :N_A], x @ w_a.T, rtol=1e-5, atol=1e-5)


def test_weights_as_slices_of_a_stack(triton_device: str) -> None:
    """As the draft calls it: ``w_b`` one layer's slice of a stacked ``[L, N_B, K]`` parameter."""
    x, w_a, _ = _inputs(triton_device, torch.float32, 10, 64, 0, 256)
    stack = torch.randn(3, 96, 256, device=triton_device)
    _check(skinny_linear_pair_triton(x, w_a, stack[1]), x, w_a, stack[1])


def test_split_k_is_deterministic_and_resets_its_counters(triton_device: str) -> None:
    N_A, N_B, K, cfg = CASES[2]
    x, w_a, w_b = _inputs(triton_device, torch.float32, 10, N_A, N_B, K)
    first = skinny_linear_pair_triton(x, w_a, w_b, cfg)
    assert not _split_counters(x.device, side_stream=False).any()
    assert torch.equal(skinny_linear_pair_triton(x, w_a, w_b, cfg), first)
    assert not _split_counters(x.device, side_stream=False).any()


def test_empty_and_zero_k(triton_device: str) -> None:
    x, w_a, w_b = _inputs(triton_device, torch.float32, 0, 32, 16, 64)
    assert skinny_linear_pair_triton(x, w_a, w_b).shape == (0, 48)
    x, w_a, w_b = _inputs(triton_device, torch.float32, 4, 32, 16, 0)
    assert torch.equal(skinny_linear_pair_triton(x, w_a, w_b), torch.zeros(4, 48, device=triton_device))


@pytest.mark.parametrize("route", ["op", "triton"])
def test_rejects_mismatched_weights(route: str) -> None:
    fn = lfm.skinny_linear_pair if route == "op" else skinny_linear_pair_triton  # the op: the reference on CPU
    x, w_a, w_b = torch.randn(10, 8), torch.randn(16, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"x \[M, K\], w_a \[N_A, K\] and w_b \[N_B, K\]"):
        fn(x, w_a, torch.randn(6, 9))
    with pytest.raises(ValueError, match=r"x \[M, K\], w_a \[N_A, K\] and w_b \[N_B, K\]"):
        fn(x, torch.randn(16, 9), w_b)
    with pytest.raises(ValueError, match="share a dtype"):
        fn(x, w_a, w_b.double())
    with pytest.raises(ValueError, match="share a row stride"):
        fn(x, w_a, torch.randn(6, 16)[:, :8])
    with pytest.raises(ValueError, match="row-major"):
        fn(x, w_a, torch.randn(8, 6).T)
    with pytest.raises(ValueError, match="multiple of 16"):
        fn(x, torch.randn(24, 8), w_b)
    with pytest.raises(ValueError, match=f"at most {MAX_M} rows"):
        fn(torch.randn(MAX_M + 1, 8), w_a, w_b)


def test_rejects_a_config_splitting_a_tile_between_the_weights(triton_device: str) -> None:
    x, w_a, w_b = _inputs(triton_device, torch.float32, 4, 48, 16, 64)
    with pytest.raises(ValueError, match="48 rows must be whole column tiles"):
        skinny_linear_pair_triton(x, w_a, w_b, SkinnyConfig(block_n=32, block_k=32))


def test_pair_config() -> None:
    """The served draft shape (q 2048 + K/V 1024 columns, K = 2048, 132 SMs) gets the swap-AB config
    of its 3072 columns (64-row tiles, 32 of them in q, 2 splits); a first weight that is not whole
    64-row tiles gets narrower tiles, down to 16."""
    cfg = pair_config(10, 2048, 1024, 2048, 2, 132)
    assert cfg == swap_ab_config(10, 3072, 2048, 2, 132)
    assert (cfg.block_n, cfg.block_k, cfg.split_k) == (64, 128, 2)
    assert pair_config(10, 96, 1024, 2048, 2, 132).block_n == 32
    assert pair_config(10, 48, 1024, 2048, 2, 132).block_n == 16


def test_pair_config_follows_the_tuning_of_the_total(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, TUNE="tile@3072x2048.block_n=128,tile@3072x2048.split_k=3")
    cfg = pair_config(10, 2048, 1024, 2048, 2, 132)
    assert (cfg.block_n, cfg.split_k) == (128, 3)


def test_opcheck_reference() -> None:
    torch.library.opcheck(lfm.skinny_linear_pair, _inputs("cpu", torch.float32, 10, 32, 24, 96))


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    torch.library.opcheck(lfm.skinny_linear_pair, _inputs("cpu", torch.float32, 10, 32, 24, 96))


def test_torch_compile_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    x, w_a, w_b = _inputs("cpu", torch.float32, 9, 32, 24, 96)

    def proj(x, w_a, w_b):
        return lfm.skinny_linear_pair(x * 2, w_a, w_b) + 1

    torch._dynamo.reset()
    eager = proj(x, w_a, w_b)
    torch.testing.assert_close(torch.compile(proj, fullgraph=True)(x, w_a, w_b), eager, rtol=0, atol=0)
    torch.testing.assert_close(eager, skinny_linear_pair_reference(x * 2, w_a, w_b) + 1, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# CUDA: the served draft shape (LFM2.5-1.2B's DSpark: q_proj [2048, 2048] and a layer's kv_proj
# slice [1024, 2048] of the stacked [L, 1024, 2048])

@pytest.mark.gpu
@pytest.mark.parametrize("M", [2, 9, 10, 16])
def test_gpu_served_shape(M: int) -> None:
    x, w_a, _ = _inputs("cuda", torch.bfloat16, M, 2048, 0, 2048, seed=M)
    stack = (torch.randn(3, 1024, 2048, device="cuda") / 2048 ** 0.5).to(torch.bfloat16)
    out = lfm.skinny_linear_pair(x, w_a, stack[1])
    _check(out, x, w_a, stack[1])
    cfg = pair_config(M, 2048, 1024, 2048, 2, torch.cuda.get_device_properties(0).multi_processor_count)
    assert torch.equal(out[:, :2048], skinny_linear_triton(x, w_a, cfg))
    assert torch.equal(out[:, 2048:], skinny_linear_triton(x, stack[1], cfg))


@pytest.mark.gpu
def test_gpu_split_k_graph_replay() -> None:
    """The split pair product in a CUDA graph: follows its input, bit-identical replay to replay."""
    x, w_a, w_b = _inputs("cuda", torch.bfloat16, 10, 2048, 1024, 2048)
    cfg = pair_config(10, 2048, 1024, 2048, 2, torch.cuda.get_device_properties(0).multi_processor_count)
    assert split_k_plan(2048, cfg.block_k, cfg.split_k)[1] > 1
    lfm.skinny_linear_pair(x, w_a, w_b)                    # warm-up: compiles, creates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lfm.skinny_linear_pair(x, w_a, w_b)
    for seed in (1, 2):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to("cuda", x.dtype))
        graph.replay()
        first = out.clone()
        graph.replay()
        assert torch.equal(out, first)
        _check(out, x, w_a, w_b)
