"""The several-row GEMV (ops/rows_gemv.py, ``LFMSPARK_ROWS_GEMV``): the kernel (interpreter on CPU,
native on CUDA) against the references of the products it can run (plain, ``ADD_NORM``,
``ROW_NORM``), the switch's parsing and routing, and the served shapes on the GPU.

Tolerances as tests/ops/test_skinny_add_norm.py: fp32 1e-5 relative (only the summation order
differs), bf16 2e-2 (a few ulps).
"""

from __future__ import annotations

import pytest
import torch

from lfmspark.ops.rows_gemv import MAX_K, rows_gemv_config, rows_gemv_eligible, rows_gemv_shapes
from lfmspark.ops.skinny_linear import (SkinnyConfig, add_norm_config, skinny_config, skinny_linear_add_norm_reference,
                                        skinny_linear_add_norm_triton, skinny_linear_reference, skinny_linear_triton)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-5


def _inputs(device: str, dtype: torch.dtype, M: int, N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    residual = torch.randn(M, N, generator=g).to(device, dtype)
    norm_weight = (torch.rand(N, generator=g) + 0.5).to(device, dtype)
    return x, w, residual, norm_weight


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def _cfg(block_n: int, K: int, block_k: int | None = None) -> SkinnyConfig:
    return SkinnyConfig(block_n=block_n, block_k=block_k or max(16, 1 << (K - 1).bit_length()), num_warps=4,
                        num_stages=1, rows_gemv=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [2, 9, 16])
@pytest.mark.parametrize("N, K, block_n, block_k", [(64, 128, 16, None), (100, 96 + 7, 16, None), (40, 64, 64, None),
                                                   (48, 160, 16, 32), (32, 200, 8, 64)],
                         ids=["even", "tails", "wide_tile", "k_steps", "k_steps_tail"])
def test_plain_product_matches_reference(triton_device: str, dtype: torch.dtype, M: int, N: int, K: int,
                                         block_n: int, block_k: int | None) -> None:
    x, w, _, _ = _inputs(triton_device, dtype, M, N, K, seed=M * N)
    out = skinny_linear_triton(x, w, _cfg(block_n, K, block_k))
    assert out.shape == (M, N) and out.dtype == dtype
    assert _rel_err(out, x.double() @ w.double().T) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [2, 10])
def test_add_norm_matches_reference(triton_device: str, dtype: torch.dtype, M: int) -> None:
    N, K, block_n = 72, 80, 16   # N tail: the last tile's ssq covers 8 columns
    x, w, residual, g = _inputs(triton_device, dtype, M, N, K, seed=M)
    s, scaled, ssq = skinny_linear_add_norm_triton(x, w, residual, g, _cfg(block_n, K, 32))
    want_s, want_scaled, want_ssq = skinny_linear_add_norm_reference(x, w, residual, g, block_n)
    assert ssq.shape == want_ssq.shape == (5, M)
    assert _rel_err(s, want_s) < TOL[dtype]
    assert _rel_err(scaled, want_scaled) < TOL[dtype]
    assert _rel_err(ssq, want_ssq) < TOL[dtype]
    torch.testing.assert_close(ssq.sum(0), s.float().pow(2).sum(-1), rtol=1e-5, atol=1e-4)


def test_row_scale_reaches_each_row(triton_device: str) -> None:
    """Rows of known mean squares (each given in three partial sums) come out divided by their rms."""
    M, H, N = 4, 64, 48
    x = torch.randn(M, H, device=triton_device)
    w = torch.randn(N, H, device=triton_device) / H ** 0.5
    ssq = torch.tensor([[1.0, 4.0, 16.0, 64.0]], device=triton_device) * H * torch.tensor([[0.5], [0.25], [0.25]],
                                                                                        device=triton_device)
    out = skinny_linear_triton(x, w, _cfg(16, H), row_ssq=ssq, eps=0.0)
    c = torch.tensor([1.0, 0.5, 0.25, 0.125], device=triton_device)[:, None]
    torch.testing.assert_close(out, c * (x @ w.T), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_scaled_product_matches_reference(triton_device: str, dtype: torch.dtype) -> None:
    M, N, K = 10, 96, 64
    x, w, _, _ = _inputs(triton_device, dtype, M, N, K, seed=3)
    ssq = torch.rand(3, M, device=triton_device) * K
    out = skinny_linear_triton(x, w, _cfg(32, K), row_ssq=ssq, eps=EPS)
    assert _rel_err(out, skinny_linear_reference(x, w, ssq, EPS)) < TOL[dtype]


def test_switch_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LFMSPARK_ROWS_GEMV", raising=False)
    assert rows_gemv_shapes() == frozenset() and not rows_gemv_eligible(10, 2048, 2048)
    monkeypatch.setenv("LFMSPARK_ROWS_GEMV", "1")
    assert rows_gemv_shapes() is None and rows_gemv_eligible(10, 2048, 2048)
    assert not rows_gemv_eligible(1, 2048, 2048) and not rows_gemv_eligible(17, 2048, 2048)
    assert not rows_gemv_eligible(10, 2048, MAX_K * 2)
    monkeypatch.setenv("LFMSPARK_ROWS_GEMV", "2048x2048, 6144x2048")
    assert rows_gemv_shapes() == {(2048, 2048), (6144, 2048)}
    assert rows_gemv_eligible(9, 6144, 2048) and not rows_gemv_eligible(9, 3072, 2048)
    for bad in ("yes", "2048", "2048x", "0x2048"):
        monkeypatch.setenv("LFMSPARK_ROWS_GEMV", bad)
        with pytest.raises(ValueError, match="LFMSPARK_ROWS_GEMV"):
            rows_gemv_shapes()


def test_heuristics_route_by_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LFMSPARK_ROWS_GEMV", "2048x2048")
    cfg = skinny_config(10, 2048, 2048, 2, 132)
    assert cfg.rows_gemv and cfg == rows_gemv_config(10, 2048, 2048) and cfg.block_k == 256
    assert not skinny_config(10, 6144, 2048, 2, 132).rows_gemv
    assert not skinny_config(1, 2048, 2048, 2, 132).rows_gemv            # one row: the GEMV kernel
    x, w = torch.empty(10, 2048), torch.empty(2048, 2048)
    assert add_norm_config(x, w).rows_gemv
    monkeypatch.setenv("LFMSPARK_TUNE", "rows_gemv@2048x2048.block_n=8,rows_gemv.num_warps=8")
    cfg = rows_gemv_config(10, 2048, 2048)
    assert (cfg.block_n, cfg.num_warps, rows_gemv_config(10, 1024, 2048).block_n) == (8, 8, 16)
    monkeypatch.setenv("LFMSPARK_ROWS_GEMV", "0")
    assert not skinny_config(10, 2048, 2048, 2, 132).rows_gemv


def test_op_routes_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """``lfmspark::skinny_linear_add_norm`` with the switch on: the kernel's tiling (16-column ssq
    partials) and values (interpreter on CPU)."""
    monkeypatch.setenv("LFMSPARK_ROWS_GEMV", "1")
    monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    x, w, residual, g = _inputs("cpu", torch.float32, 10, 64, 48)
    s, scaled, ssq = torch.ops.lfmspark.skinny_linear_add_norm(x, w, residual, g)
    want = skinny_linear_add_norm_reference(x, w, residual, g, 16)
    assert ssq.shape == (4, 10)
    for a, b in zip((s, scaled, ssq), want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_opcheck_with_the_switch_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op's registration (fake included: its ssq tiles follow the routed config) on the kernel route."""
    monkeypatch.setenv("LFMSPARK_ROWS_GEMV", "1")
    monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    torch.library.opcheck(torch.ops.lfmspark.skinny_linear_add_norm.default, _inputs("cpu", torch.float32, 10, 64, 48))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [9, 10])
@pytest.mark.parametrize("N", [2048, 3072, 6144])
def test_gpu_served_shapes(M: int, N: int) -> None:
    x, w, residual, g = _inputs("cuda", torch.bfloat16, M, N, 2048, seed=N + M)
    cfg = rows_gemv_config(M, N, 2048)
    assert _rel_err(skinny_linear_triton(x, w, cfg), x.double() @ w.double().T) < TOL[torch.bfloat16]
    s, scaled, ssq = skinny_linear_add_norm_triton(x, w, residual, g, cfg)
    want = skinny_linear_add_norm_reference(x, w, residual, g, cfg.block_n)
    for a, b in zip((s, scaled, ssq), want, strict=True):
        assert _rel_err(a, b) < TOL[torch.bfloat16]
