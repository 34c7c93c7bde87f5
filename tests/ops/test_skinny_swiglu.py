"""``lfmspark::skinny_swiglu``: ``silu(x @ w1^T) * (x @ w3^T)`` for 1-16 rows from the fused ``w13``,
on the swap-AB kernel with the ``SWIGLU`` epilogue (interpreter on CPU, native on CUDA), against the
op's reference (``F.linear`` then ``F.silu`` times up, the unfused module) and an fp64 oracle; with
and without split-K (the activation then runs in the last program's fix-up); the launch heuristic;
shape errors; registration.

Tolerances: fp32, the sums differ from the reference's only in
order (1e-5 relative); bf16, the kernel rounds gate, up, silu and the product at the reference's
points (the interpreter truncates instead of rounding), so results agree to a few bf16 ulps.
"""

from __future__ import annotations


import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.linear.skinny_linear import (SWIGLU_MAX_M, SkinnyConfig, _split_counters, skinny_swiglu_reference,
                                        skinny_swiglu_triton, split_k_plan, swap_ab_config, swiglu_config)
from env_vars import interpret_triton

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
lfm = torch.ops.lfmspark


def _inputs(device: str, dtype: torch.dtype, M: int, F: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w13 = (torch.randn(2 * F, K, generator=g) * 2 / K ** 0.5).to(device, dtype)  # gates of unit scale
    return x, w13


def _oracle(x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    gate, up = (x.double() @ w13.double().T).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def _check(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor) -> None:
    assert out.shape == (x.shape[0], w13.shape[0] // 2) and out.dtype == x.dtype and out.device == x.device
    want, ref = _oracle(x, w13), skinny_swiglu_reference(x, w13)
    assert _rel_err(out, want) < TOL[x.dtype]
    assert _rel_err(ref, want) < TOL[x.dtype]            # the reference meets the same bound
    assert _rel_err(out, ref) < TOL[x.dtype]


# (F, K, cfg): one split with F and K tails; split-K with a K tail in the last split; more splits
# than the fix-up loads at once, a column tile wider than F
CASES = [
    (100, 200, SkinnyConfig(block_n=64, block_k=64)),
    (80, 300, SkinnyConfig(block_n=64, block_k=64, split_k=3)),
    (24, 192, SkinnyConfig(block_n=32, block_k=16, split_k=6)),
]


def test_cases_split_as_named() -> None:
    assert [split_k_plan(K, cfg.block_k, cfg.split_k)[1] for _, K, cfg in CASES] == [1, 3, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [1, 2, 9, 10, 16])
@pytest.mark.parametrize("F, K, cfg", CASES, ids=["one_split", "split_k", "six_splits"])
def test_kernel_matches_reference(triton_device: str, dtype: torch.dtype, M: int, F: int, K: int,
                                  cfg: SkinnyConfig) -> None:
    x, w13 = _inputs(triton_device, dtype, M, F, K, seed=M + F + K)
    _check(skinny_swiglu_triton(x, w13, cfg), x, w13)


@pytest.mark.parametrize("M", [3, 10])
def test_heuristic_config_and_narrow_tiles(triton_device: str, M: int) -> None:
    """The default config (split-K at this size on the interpreter's 8 "SMs"), and the SWIGLU
    epilogue on 32-column tiles with two splits."""
    F, K = 160, 2048
    cfg = swiglu_config(M, F, K, 4, 8)
    assert not cfg.gemv and split_k_plan(K, cfg.block_k, cfg.split_k)[1] > 1
    x, w13 = _inputs(triton_device, torch.float32, M, F, K, seed=M)
    _check(skinny_swiglu_triton(x, w13), x, w13)
    _check(skinny_swiglu_triton(x, w13, SkinnyConfig(block_n=32, block_k=64, split_k=2)), x, w13)


def test_split_k_is_deterministic_and_resets_its_counters(triton_device: str) -> None:
    F, K, cfg = CASES[1]
    x, w13 = _inputs(triton_device, torch.float32, 10, F, K)
    first = skinny_swiglu_triton(x, w13, cfg)
    counters = _split_counters(x.device, side_stream=False)
    assert not counters.any()
    assert torch.equal(skinny_swiglu_triton(x, w13, cfg), first)
    assert not counters.any()
    # the split and unsplit sums agree to fp32 rounding: the activation runs on the full sums
    unsplit = skinny_swiglu_triton(x, w13, SkinnyConfig(block_n=64, block_k=64))
    torch.testing.assert_close(first, unsplit, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cfg", [CASES[0][2], CASES[1][2]], ids=["one_split", "split_k"])
def test_gate_and_up_halves_are_not_swapped(triton_device: str, cfg: SkinnyConfig) -> None:
    """up rows zero: the output vanishes; up = 1 in every column: the output is silu(gate)."""
    F, K = 40, 256
    x, w13 = _inputs(triton_device, torch.float32, 9, F, K)
    w13[F:] = 0
    assert torch.equal(skinny_swiglu_triton(x, w13, cfg), torch.zeros(9, F, device=triton_device))
    x = torch.ones_like(x)
    w13[F:, 0] = 1                       # up = x[:, 0] = 1
    gate = x @ w13[:F].T
    torch.testing.assert_close(skinny_swiglu_triton(x, w13, cfg), torch.nn.functional.silu(gate),
                               rtol=1e-5, atol=1e-6)


def test_strided_x_empty_and_zero_k(triton_device: str) -> None:
    wide, w13 = _inputs(triton_device, torch.float32, 10, 48, 3 * 64)
    x, w = wide[:, 64:128], w13[:, :64].contiguous()
    _check(skinny_swiglu_triton(x, w), x, w)
    x, w13 = _inputs(triton_device, torch.float32, 0, 16, 64)
    assert skinny_swiglu_triton(x, w13).shape == (0, 16)
    x, w13 = _inputs(triton_device, torch.float32, 4, 16, 0)
    assert torch.equal(skinny_swiglu_triton(x, w13), torch.zeros(4, 16, device=triton_device))


@pytest.mark.parametrize("route", ["op", "triton"])
def test_rejects_bad_shapes(route: str) -> None:
    fn = lfm.skinny_swiglu if route == "op" else skinny_swiglu_triton   # the op: the reference path on CPU
    x = torch.randn(10, 8)
    with pytest.raises(ValueError, match="stack gate and up"):
        fn(x, torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"x \[M, H\] and w13 \[2F, H\]"):
        fn(x, torch.randn(6, 9))
    with pytest.raises(ValueError, match=r"x \[M, H\] and w13 \[2F, H\]"):
        fn(x[0], torch.randn(6, 8))
    with pytest.raises(ValueError, match=f"at most {SWIGLU_MAX_M} rows"):
        fn(torch.randn(SWIGLU_MAX_M + 1, 8), torch.randn(6, 8))
    with pytest.raises(ValueError, match="dtype"):
        fn(x, torch.randn(6, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="row-major"):
        fn(x, torch.randn(8, 6).T)


@pytest.mark.parametrize("M", [9, 10, 16])
@pytest.mark.parametrize("F, K", [(8192, 2048), (7168, 2048), (4608, 1024)])
def test_heuristic_at_served_shapes(M: int, F: int, K: int) -> None:
    """On 132 SMs: the swap-AB heuristic for F columns (LFM2.5-1.2B, LFM2-8B-A1B dense and a small
    shape), with stages that fit both weight tiles in the swap-AB shared-memory budget."""
    cfg, plain = swiglu_config(M, F, K, 2, 132), swap_ab_config(M, F, K, 2, 132)
    assert (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps) == \
        (plain.block_n, plain.block_k, plain.split_k, plain.num_warps)
    assert 2 <= cfg.num_stages <= plain.num_stages
    assert cfg.num_stages * (2 * cfg.block_n + 16) * cfg.block_k * 2 <= 200 * 1024
    if F in (8192, 7168):  # one program per 64 gate columns, no split; fewer programs than SMs: 5 stages
        assert (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_stages) == (64, 128, 1, 5)


def test_heuristic_drops_stages_for_two_tiles() -> None:
    """fp32 at a split shape: five stages of one tile fit, of two tiles they do not."""
    plain, cfg = swap_ab_config(10, 2048, 8192, 4, 132), swiglu_config(10, 2048, 8192, 4, 132)
    assert plain.split_k > 1 and cfg.num_stages < plain.num_stages
    assert cfg.num_stages * (2 * cfg.block_n + 16) * cfg.block_k * 4 <= 200 * 1024


def test_opcheck_reference() -> None:
    torch.library.opcheck(lfm.skinny_swiglu, _inputs("cpu", torch.float32, 10, 24, 96))


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    torch.library.opcheck(lfm.skinny_swiglu, _inputs("cpu", torch.float32, 10, 24, 96))


def test_torch_compile_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    x, w13 = _inputs("cpu", torch.float32, 9, 24, 96)

    def mlp(x, w13):
        return lfm.skinny_swiglu(x * 2, w13) + 1

    torch._dynamo.reset()
    eager = mlp(x, w13)
    torch.testing.assert_close(torch.compile(mlp, fullgraph=True)(x, w13), eager, rtol=0, atol=0)
    torch.testing.assert_close(eager, skinny_swiglu_reference(x * 2, w13) + 1, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# CUDA: the served shapes (LFM2.5-1.2B and its draft: w13 [16384, 2048]; LFM2-8B-A1B dense layers)

@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 9, 10, 16])
@pytest.mark.parametrize("F, K", [(8192, 2048), (7168, 2048)])
def test_gpu_served_shapes(M: int, F: int, K: int) -> None:
    x, w13 = _inputs("cuda", torch.bfloat16, M, F, K, seed=M)
    _check(lfm.skinny_swiglu(x, w13), x, w13)


@pytest.mark.gpu
def test_gpu_split_k_graph_replay() -> None:
    """A split SwiGLU in a CUDA graph: follows its input, bit-identical replay to replay."""
    x, w13 = _inputs("cuda", torch.bfloat16, 10, 1024, 8192)
    cfg = swiglu_config(10, 1024, 8192, 2, torch.cuda.get_device_properties(0).multi_processor_count)
    assert split_k_plan(8192, cfg.block_k, cfg.split_k)[1] > 1
    skinny_swiglu_triton(x, w13, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_swiglu_triton(x, w13, cfg)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _check(out, x, w13)
    first = out.clone()
    for _ in range(5):
        graph.replay()
        assert torch.equal(out, first)
    assert not _split_counters(x.device, side_stream=False).any()
