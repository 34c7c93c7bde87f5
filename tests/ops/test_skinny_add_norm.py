"""The norm-in-epilogue pair: ``lfmspark::skinny_linear_add_norm`` (a product whose epilogue adds the
residual and writes ``s``, ``s * g`` and per-tile sums of ``s^2``) and ``lfmspark::skinny_swiglu``
with ``row_ssq`` (the gate/up product scaled per row by ``rsqrt(mean square + eps)``), on the
kernels (interpreter on CPU, native on CUDA) against their references, and the pair against the
modules it replaces (RMSNorm of the sum, then the SwiGLU), whose roundings differ by one rounding
of the normalised input.

Tolerances: fp32, only the summation order differs (1e-5 relative); bf16, a few ulps.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.models.layers import RMSNorm
from lfmspark.ops.linear.skinny_linear import (SkinnyConfig, _split_counters, add_norm_config,
                                        skinny_linear_add_norm_reference, skinny_linear_add_norm_triton,
                                        skinny_linear_pair_reference, skinny_linear_pair_triton,
                                        skinny_linear_reference, skinny_linear_triton, skinny_swiglu_reference,
                                        skinny_swiglu_triton, split_k_plan)
from env_vars import interpret_triton

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-5
lfm = torch.ops.lfmspark


def _inputs(device: str, dtype: torch.dtype, M: int, N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    residual = torch.randn(M, N, generator=g).to(device, dtype)
    norm_weight = (torch.rand(N, generator=g) + 0.5).to(device, dtype)
    return x, w, residual, norm_weight


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


# (N, K, cfg): N and K tails without a split; split-K (the epilogue in the fix-up); narrow tiles
# with two splits; a column tile wider than N
CASES = [
    (200, 96, SkinnyConfig(block_n=64, block_k=32)),
    (160, 300, SkinnyConfig(block_n=64, block_k=64, split_k=3)),
    (96, 128, SkinnyConfig(block_n=32, block_k=32, split_k=2)),
    (40, 64, SkinnyConfig(block_n=64, block_k=32)),
]


def test_cases_split_as_named() -> None:
    assert [split_k_plan(K, cfg.block_k, cfg.split_k)[1] for _, K, cfg in CASES] == [1, 3, 2, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [2, 10, 16])
@pytest.mark.parametrize("N, K, cfg", CASES, ids=["tails", "split_k", "narrow_split", "wide_tile"])
def test_add_norm_matches_reference(triton_device: str, dtype: torch.dtype, M: int, N: int, K: int,
                                    cfg: SkinnyConfig) -> None:
    x, w, residual, g = _inputs(triton_device, dtype, M, N, K, seed=M + N)
    s, scaled, ssq = skinny_linear_add_norm_triton(x, w, residual, g, cfg)
    want_s, want_scaled, want_ssq = skinny_linear_add_norm_reference(x, w, residual, g, cfg.block_n)
    assert ssq.shape == want_ssq.shape == (-(-N // cfg.block_n), M) and ssq.dtype == torch.float32
    assert s.dtype == scaled.dtype == dtype
    assert _rel_err(s, want_s) < TOL[dtype]
    assert _rel_err(scaled, want_scaled) < TOL[dtype]
    assert _rel_err(ssq, want_ssq) < TOL[dtype]
    # the partials sum to the row's sum of squares of s (the kernel's own s)
    torch.testing.assert_close(ssq.sum(0), s.float().pow(2).sum(-1), rtol=1e-5, atol=1e-4)


def test_add_norm_takes_a_column_major_residual(triton_device: str) -> None:
    """A residual that is not row-major is read as its values (the outputs are row-major)."""
    N, K, cfg = CASES[0][:3]
    x, w, residual, g = _inputs(triton_device, torch.float32, 10, N, K)
    transposed = residual.T.contiguous().T
    assert not transposed.is_contiguous()
    got = skinny_linear_add_norm_triton(x, w, transposed, g, cfg)
    want = skinny_linear_add_norm_triton(x, w, residual, g, cfg)
    assert all(t.is_contiguous() for t in got)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_row_scale_on_narrow_split_tiles(triton_device: str) -> None:
    """ROW_NORM on 32-column tiles with two K splits scales the same rows (the scaling is linear, so
    each split's partial is scaled before the fix-up sums them)."""
    x, w, residual, g = _inputs(triton_device, torch.float32, 9, 64, 48)
    _, scaled, ssq = skinny_linear_add_norm_triton(x, w, residual, g, CASES[2][2])
    w13 = torch.randn(2 * 40, 64, generator=torch.Generator().manual_seed(2)).to(triton_device) / 8
    got = skinny_swiglu_triton(scaled, w13, SkinnyConfig(block_n=32, block_k=32, split_k=2), row_ssq=ssq, eps=EPS)
    assert _rel_err(got, skinny_swiglu_reference(scaled, w13, ssq, EPS)) < TOL[torch.float32]


def test_add_norm_split_k_is_deterministic_and_resets_its_counters(triton_device: str) -> None:
    N, K, cfg = CASES[1][:3]
    args = _inputs(triton_device, torch.float32, 10, N, K)
    first = skinny_linear_add_norm_triton(*args, cfg)
    assert not _split_counters(args[0].device, side_stream=False).any()
    for a, b in zip(skinny_linear_add_norm_triton(*args, cfg), first, strict=True):
        assert torch.equal(a, b)


def _module_pair(x, w, residual, g, w13):
    """The modules the pair replaces: the product, the add, RMSNorm, the unfused SwiGLU."""
    norm = RMSNorm(w.shape[0], EPS).to(x.device)
    norm.weight.data = g
    s = residual + torch.nn.functional.linear(x, w)
    return s, skinny_swiglu_reference(norm(s), w13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [2, 9])
def test_pair_matches_the_modules(triton_device: str, dtype: torch.dtype, M: int) -> None:
    N, K, F = 128, 96, 80
    x, w, residual, g = _inputs(triton_device, dtype, M, N, K, seed=M)
    w13 = (torch.randn(2 * F, N, generator=torch.Generator().manual_seed(1)) * 2 / N ** 0.5).to(triton_device, dtype)
    s, scaled, ssq = skinny_linear_add_norm_triton(x, w, residual, g, CASES[0][2])
    act = skinny_swiglu_triton(scaled, w13, SkinnyConfig(block_n=32, block_k=32, split_k=2),
                               row_ssq=ssq, eps=EPS)
    want_s, want_act = _module_pair(x, w, residual, g, w13)
    assert _rel_err(s, want_s) < TOL[dtype]
    assert _rel_err(act, want_act) < TOL[dtype]
    assert _rel_err(act, skinny_swiglu_reference(scaled, w13, ssq, EPS)) < TOL[dtype]


def test_row_scale_reaches_each_row(triton_device: str) -> None:
    """Rows whose sums of squares differ by known factors come out scaled by their rsqrt, in both
    the gate and up halves (so the SwiGLU of a row scaled by c is silu(c gate) * c up)."""
    M, H, F = 4, 64, 16
    x = torch.randn(M, H, device=triton_device)
    w13 = torch.randn(2 * F, H, device=triton_device) / H ** 0.5
    ssq = torch.tensor([[1.0, 4.0, 16.0, 64.0]], device=triton_device) * H   # mean squares 1, 4, 16, 64
    out = skinny_swiglu_triton(x, w13, SkinnyConfig(block_n=16, block_k=32), row_ssq=ssq, eps=0.0)
    gate, up = (x @ w13.T).chunk(2, dim=-1)
    c = torch.tensor([1.0, 0.5, 0.25, 0.125], device=triton_device)[:, None]
    torch.testing.assert_close(out, torch.nn.functional.silu(c * gate) * (c * up), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N, K, cfg", CASES, ids=["tails", "split_k", "narrow_split", "wide_tile"])
def test_row_scaled_products_match_the_modules(triton_device: str, dtype: torch.dtype, N: int, K: int,
                                               cfg: SkinnyConfig) -> None:
    """The norms between layers (models/layers.py ``NormedCarry``): the producer's ``s * g`` and row
    sums, through ``skinny_linear`` / ``skinny_linear_pair`` with ``row_ssq``, against their
    references and against the modules (RMSNorm of the sum, then the product)."""
    M, H = 10, 48
    x, w, residual, g = _inputs(triton_device, dtype, M, H, 40, seed=N)
    # three column tiles of the producer: the consumers add three partial sums per row
    s, scaled, ssq = skinny_linear_add_norm_triton(x, w, residual, g, SkinnyConfig(block_n=16, block_k=32,
                                                                                   ))
    assert ssq.shape == (3, M)
    gen = torch.Generator().manual_seed(K)
    w_next = (torch.randn(N, H, generator=gen) / H ** 0.5).to(triton_device, dtype)
    # the pair's first weight: whole column tiles
    w_a = (torch.randn(cfg.block_n, H, generator=gen) / H ** 0.5).to(triton_device, dtype)
    norm = RMSNorm(H, EPS).to(triton_device)
    norm.weight.data = g
    product_cfg = replace(cfg, split_k=min(cfg.split_k, 2))   # K = H = 48: at most two 32-wide splits
    got = skinny_linear_triton(scaled, w_next, product_cfg, row_ssq=ssq, eps=EPS)
    assert _rel_err(got, skinny_linear_reference(scaled, w_next, ssq, EPS)) < TOL[dtype]
    assert _rel_err(got, torch.nn.functional.linear(norm(s), w_next)) < TOL[dtype]
    pair = skinny_linear_pair_triton(scaled, w_a, w_next, product_cfg, row_ssq=ssq, eps=EPS)
    assert _rel_err(pair, skinny_linear_pair_reference(scaled, w_a, w_next, ssq, EPS)) < TOL[dtype]
    assert _rel_err(pair, torch.cat([norm(s) @ w_a.T, norm(s) @ w_next.T], dim=-1)) < TOL[dtype]


def test_row_scaled_product_reaches_each_row(triton_device: str) -> None:
    """``skinny_linear``'s row scale: rows of known mean squares (each sum given in three partials)
    come out divided by their rms."""
    M, H, N = 4, 64, 48
    x = torch.randn(M, H, device=triton_device)
    w = torch.randn(N, H, device=triton_device) / H ** 0.5
    ssq = torch.tensor([[1.0, 4.0, 16.0, 64.0]], device=triton_device) * H * torch.tensor([[0.5], [0.25], [0.25]],
                                                                                        device=triton_device)
    out = skinny_linear_triton(x, w, SkinnyConfig(block_n=16, block_k=32), row_ssq=ssq, eps=0.0)
    c = torch.tensor([1.0, 0.5, 0.25, 0.125], device=triton_device)[:, None]
    torch.testing.assert_close(out, c * (x @ w.T), rtol=1e-5, atol=1e-6)


def test_op_on_cpu_matches_kernel_tiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op's reference route and its kernel route return the same shapes (the fake's), so a
    compiled graph may take either; and the defaults follow add_norm_config."""
    args = _inputs("cpu", torch.float32, 10, 200, 96)
    ref = lfm.skinny_linear_add_norm(*args)
    interpret_triton(monkeypatch)
    tri = lfm.skinny_linear_add_norm(*args)
    assert ref[2].shape == tri[2].shape == (-(-200 // add_norm_config(args[0], args[1]).block_n), 10)
    for a, b in zip(tri, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("route", ["op", "triton"])
def test_rejects_bad_inputs(route: str) -> None:
    add_norm = lfm.skinny_linear_add_norm if route == "op" else skinny_linear_add_norm_triton
    swiglu = lfm.skinny_swiglu if route == "op" else skinny_swiglu_triton
    x, w, residual, g = _inputs("cpu", torch.float32, 10, 64, 32)
    with pytest.raises(ValueError, match=r"residual must be \[M, N\]"):
        add_norm(x, w, residual[:, :32], g)
    with pytest.raises(ValueError, match="residual must be"):
        add_norm(x, w, residual.double(), g)
    with pytest.raises(ValueError, match=r"norm_weight must be \[N\]"):
        add_norm(x, w, residual, g[:10])
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        add_norm(x, w[:, :16], residual, g)
    with pytest.raises(ValueError, match="on one device"):
        add_norm(x, w, residual.to("meta"), g)
    w13 = torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"row_ssq must be \[tiles, M\]"):
        swiglu(residual, w13, row_ssq=torch.ones(2, 9), eps=EPS)
    with pytest.raises(ValueError, match="contiguous fp32"):
        swiglu(residual, w13, row_ssq=torch.ones(2, 10, dtype=torch.float64), eps=EPS)
    with pytest.raises(ValueError, match="x's device"):
        swiglu(residual, w13, row_ssq=torch.ones(2, 10, device="meta"), eps=EPS)
    linear = lfm.skinny_linear if route == "op" else skinny_linear_triton
    pair = lfm.skinny_linear_pair if route == "op" else skinny_linear_pair_triton
    with pytest.raises(ValueError, match=r"row_ssq must be \[tiles, M\]"):
        linear(residual, w13, row_ssq=torch.ones(2, 9), eps=EPS)
    with pytest.raises(ValueError, match="contiguous fp32"):
        pair(residual, w13[:16], w13, row_ssq=torch.ones(2, 10).bfloat16(), eps=EPS)


def test_opcheck() -> None:
    torch.library.opcheck(lfm.skinny_linear_add_norm, _inputs("cpu", torch.float32, 10, 96, 64))
    x, _, _, _ = _inputs("cpu", torch.float32, 10, 96, 64)
    torch.library.opcheck(lfm.skinny_swiglu, (x, torch.randn(48, 64), torch.rand(3, 10) + 1, EPS))
    torch.library.opcheck(lfm.skinny_linear, (x, torch.randn(48, 64), torch.rand(3, 10) + 1, EPS))
    torch.library.opcheck(lfm.skinny_linear_pair, (x, torch.randn(16, 64), torch.randn(32, 64), torch.rand(3, 10) + 1,
                                                   EPS))


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    torch.library.opcheck(lfm.skinny_linear_add_norm, _inputs("cpu", torch.float32, 10, 96, 64))


# ---------------------------------------------------------------------------------------------
# CUDA: the served shapes (LFM2.5-1.2B's out_proj 2048 x 2048 and its w2 2048 x 8192, w13 [16384, 2048])

@pytest.mark.gpu
@pytest.mark.parametrize("M", [9, 10, 16])
@pytest.mark.parametrize("K", [2048, 8192])
def test_gpu_served_shapes(M: int, K: int) -> None:
    x, w, residual, g = _inputs("cuda", torch.bfloat16, M, 2048, K, seed=M)
    s, scaled, ssq = lfm.skinny_linear_add_norm(x, w, residual, g)
    want = skinny_linear_add_norm_reference(x, w, residual, g, add_norm_config(x, w).block_n)
    for out, ref in zip((s, scaled, ssq), want, strict=True):
        assert _rel_err(out, ref) < TOL[torch.bfloat16]
    w13 = (torch.randn(16384, 2048, device="cuda") * 2 / 2048 ** 0.5).bfloat16()
    act = lfm.skinny_swiglu(scaled, w13, ssq, EPS)
    assert _rel_err(act, _module_pair(x, w, residual, g, w13)[1]) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_pair_graph_replay() -> None:
    """The pair in a CUDA graph follows its inputs and replays bit-identically."""
    x, w, residual, g = _inputs("cuda", torch.bfloat16, 10, 2048, 2048)
    w13 = (torch.randn(16384, 2048, device="cuda") * 2 / 2048 ** 0.5).bfloat16()

    def pair():
        s, scaled, ssq = lfm.skinny_linear_add_norm(x, w, residual, g)
        return s, lfm.skinny_swiglu(scaled, w13, ssq, EPS)

    pair()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = pair()
    x.copy_(torch.randn_like(x))
    graph.replay()
    first = [t.clone() for t in outs]
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(outs, first, strict=True))
    eager = pair()
    assert all(torch.equal(a, b) for a, b in zip(eager, first, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("N", [3072, 6144, 65536])
def test_gpu_row_scaled_served_shapes(N: int) -> None:
    """The norms between layers at the served shapes: a down projection (2048 x 8192) with the next
    norm in its epilogue, then qkv_proj / in_proj / the LM head, and the draft's q + K/V pair, with
    the row scale, against the modules."""
    x, w2, residual, g = _inputs("cuda", torch.bfloat16, 10, 2048, 8192, seed=N)
    s, scaled, ssq = lfm.skinny_linear_add_norm(x, w2, residual, g)
    norm = RMSNorm(2048, EPS).cuda()
    norm.weight.data = g
    w = (torch.randn(N, 2048, device="cuda") / 2048 ** 0.5).bfloat16()
    got = lfm.skinny_linear(scaled, w, ssq, EPS)
    assert _rel_err(got, torch.nn.functional.linear(norm(s), w)) < TOL[torch.bfloat16]
    pair = lfm.skinny_linear_pair(scaled, w[:2048], w[-1024:], ssq, EPS)
    assert _rel_err(pair, torch.nn.functional.linear(norm(s), torch.cat([w[:2048], w[-1024:]]))) < TOL[torch.bfloat16]
