"""The norm-statistics pair on the swap-AB kernel (ops/skinny_linear.py, "Norm statistics"):
``lfmspark::skinny_linear_residual`` (``s = h + x @ w^T`` and per-column-tile sums of ``s^2``) and
``lfmspark::skinny_norm_linear`` (RMSNorm of ``s`` from those sums, then the product or SwiGLU), on
the interpreter (CPU) or natively (CUDA), against their references; split-K and unsplit launches,
N past the last full tile, K tails, the regular (x as A operand) kernel; the statistics against a
hand computation from the kernel's own ``s``; the tile-width function the fake and the reference
share; compile; registration.

Tolerances as tests/ops/test_skinny_swiglu.py: fp32 differs from the references only in summation
order; in bf16 the interpreter truncates the kernel's roundings (the GPU rounds to nearest), so
results agree to a few bf16 ulps (relative norm error 2e-2).
"""

from __future__ import annotations

import pytest
import torch
import triton

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.skinny_linear import (STATS_MAX_M, SkinnyConfig, _split_counters, skinny_linear_residual_reference,
                                        skinny_linear_residual_triton, skinny_norm_linear_reference,
                                        skinny_norm_linear_triton, split_k_plan, stats_block_n, swap_ab_config)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS = 1e-5
lfm = torch.ops.lfmspark


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def _residual_inputs(device: str, dtype: torch.dtype, M: int, N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    h = torch.randn(M, N, generator=g).to(device, dtype)
    return x, w, h


def _norm_inputs(device: str, dtype: torch.dtype, M: int, K: int, n_out: int, block_n: int, seed: int = 0):
    """A stream ``s [M, K]`` with rows of different scales, its statistics for ``block_n``-wide tiles,
    an RMSNorm weight around 1 and a product weight ``[n_out, K]``."""
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(M, K, generator=g) * torch.linspace(0.5, 4.0, M)[:, None]).to(device, dtype)
    sumsq = skinny_linear_residual_reference(torch.zeros(M, 1, dtype=dtype, device=device),
                                             torch.zeros(K, 1, dtype=dtype, device=device), s, block_n)[1]
    nw = (1 + 0.2 * torch.randn(K, generator=g)).to(device, dtype)
    w = (torch.randn(n_out, K, generator=g) * 2 / K ** 0.5).to(device, dtype)
    return s, sumsq, nw, w


def _hand_sumsq(s: torch.Tensor, block_n: int) -> torch.Tensor:
    """Per tile t, per row: the fp64 sum of s^2 over columns t * block_n .. (< N), one loop each."""
    M, N = s.shape
    out = torch.zeros(triton.cdiv(N, block_n), M, dtype=torch.float64)
    for t in range(out.shape[0]):
        for m in range(M):
            out[t, m] = (s[m, t * block_n:(t + 1) * block_n].double() ** 2).sum()
    return out


def _normed_oracle(s: torch.Tensor, nw: torch.Tensor, w: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """fp64 RMSNorm of s (torch's own mean of squares) and the product."""
    y = s.double() * torch.rsqrt(s.double().pow(2).mean(-1, keepdim=True) + EPS) * nw.double()
    out = y @ w.double().T
    if swiglu:
        gate, up = out.chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
    return out


# (N, K, cfg): one split with N and K tails; split-K with a K tail; many splits, narrow tiles; the
# regular kernel (x as the A operand) split
CASES = [
    (100, 200, SkinnyConfig(block_n=64, block_k=64, swap_ab=True)),
    (80, 300, SkinnyConfig(block_n=64, block_k=64, split_k=3, swap_ab=True)),
    (72, 192, SkinnyConfig(block_n=32, block_k=16, split_k=6, swap_ab=True)),
    (96, 128, SkinnyConfig(block_n=32, block_k=32, split_k=2)),
]
IDS = ["one_split", "split_k", "six_splits", "regular_split"]


def test_cases_split_as_named() -> None:
    assert [split_k_plan(K, cfg.block_k, cfg.split_k)[1] for _, K, cfg in CASES] == [1, 3, 6, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [2, 9, 10, 16])
@pytest.mark.parametrize("N, K, cfg", CASES, ids=IDS)
def test_residual_matches_reference(triton_device: str, dtype: torch.dtype, M: int, N: int, K: int,
                                    cfg: SkinnyConfig) -> None:
    x, w, h = _residual_inputs(triton_device, dtype, M, N, K, seed=M + N + K)
    s, sumsq = skinny_linear_residual_triton(x, w, h, cfg)
    ref_s, ref_sumsq = skinny_linear_residual_reference(x, w, h, cfg.block_n)
    assert s.shape == (M, N) and s.dtype == dtype and sumsq.shape == (triton.cdiv(N, cfg.block_n), M)
    assert sumsq.dtype == torch.float32
    assert _rel_err(s, ref_s) < TOL[dtype]
    assert _rel_err(s, h.double() + x.double() @ w.double().T) < TOL[dtype]
    # the statistics are those of the kernel's own s, tile by tile, to fp32 summation order
    torch.testing.assert_close(sumsq.double().cpu(), _hand_sumsq(s.cpu(), cfg.block_n), rtol=1e-5, atol=1e-5)
    assert _rel_err(sumsq, ref_sumsq) < TOL[dtype]


def test_residual_rounds_the_product_then_the_sum(triton_device: str) -> None:
    """bf16: s is the unfused h + F.linear(x, w) (the product rounded, then the sum); a huge h makes
    an fp32 sum rounded once differ from it."""
    x, w, _ = _residual_inputs(triton_device, torch.float32, 4, 64, 64)
    x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
    h = torch.full((4, 64), 256.0, dtype=torch.bfloat16, device=triton_device)
    s, _ = skinny_linear_residual_triton(x, w, h, CASES[0][2])
    ref = skinny_linear_residual_reference(x, w, h, 64)[0]
    assert (s.float() - ref.float()).abs().max() <= 2.0     # one bf16 ulp at 256 (interpreter: truncation)


@pytest.mark.parametrize("swiglu", [False, True], ids=["linear", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [2, 10, 16])
@pytest.mark.parametrize("N, K, cfg", CASES, ids=IDS)
def test_norm_prologue_matches_reference(triton_device: str, swiglu: bool, dtype: torch.dtype, M: int, N: int,
                                         K: int, cfg: SkinnyConfig) -> None:
    """The consumer: K is the stream's width (statistics from 32-wide tiles: K // 32 + 1 partials),
    N the product's (gate) columns."""
    s, sumsq, nw, w = _norm_inputs(triton_device, dtype, M, K, 2 * N if swiglu else N, 32, seed=M + K)
    out = skinny_norm_linear_triton(s, sumsq, nw, EPS, w, swiglu, cfg)
    ref = skinny_norm_linear_reference(s, sumsq, nw, EPS, w, swiglu)
    assert out.shape == ref.shape == (M, N) and out.dtype == dtype
    # bf16 SwiGLU on the interpreter: six truncated roundings (two of the norm, four of the
    # activation) instead of rounded ones drift further than the plain product's three
    tol = 4e-2 if swiglu and dtype == torch.bfloat16 and triton_device == "cpu" else TOL[dtype]
    assert _rel_err(out, ref) < tol
    assert _rel_err(out, _normed_oracle(s, nw, w, swiglu)) < tol


def test_norm_uses_the_given_statistics(triton_device: str) -> None:
    """Scaling a row's partials by 4 halves that row's rstd: the output row halves (fp32), the
    others are unchanged; the statistics are not recomputed from s."""
    s, sumsq, nw, w = _norm_inputs(triton_device, torch.float32, 5, 128, 48, 64)
    cfg = SkinnyConfig(block_n=64, block_k=64, swap_ab=True)
    base = skinny_norm_linear_triton(s, sumsq, nw, 0.0, w, False, cfg)
    sumsq[:, 2] *= 4
    out = skinny_norm_linear_triton(s, sumsq, nw, 0.0, w, False, cfg)
    torch.testing.assert_close(out[2], base[2] / 2, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[[0, 1, 3, 4]], base[[0, 1, 3, 4]])


def test_chain_matches_the_unfused_modules(triton_device: str) -> None:
    """The producer's statistics feed the consumer: RMSNorm(h + x w^T) then the product, as the
    model's modules compute it, with a split producer and an unsplit consumer."""
    from lfmspark.models.layers import RMSNorm

    x, w, h = _residual_inputs(triton_device, torch.float32, 10, 96, 160)
    s, sumsq = skinny_linear_residual_triton(x, w, h, CASES[2][2])
    norm = RMSNorm(96, EPS).to(triton_device)
    torch.nn.init.normal_(norm.weight, 1.0, 0.2)
    w_next = torch.randn(40, 96, device=triton_device) / 96 ** 0.5
    out = skinny_norm_linear_triton(s, sumsq, norm.weight.detach(), EPS, w_next, False, CASES[0][2])
    want = torch.nn.functional.linear(norm(h + torch.nn.functional.linear(x, w)), w_next)
    torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-5)


def test_split_k_is_deterministic_and_resets_its_counters(triton_device: str) -> None:
    N, K, cfg = CASES[1]
    x, w, h = _residual_inputs(triton_device, torch.float32, 10, N, K)
    s, sumsq = skinny_linear_residual_triton(x, w, h, cfg)
    assert not _split_counters(x.device).any()
    s2, sumsq2 = skinny_linear_residual_triton(x, w, h, cfg)
    assert torch.equal(s, s2) and torch.equal(sumsq, sumsq2)
    # a split consumer reading those statistics: deterministic too
    nw, w_next = torch.ones(N, device=x.device), torch.randn(48, N, device=x.device) / N ** 0.5
    cfg_next = SkinnyConfig(block_n=16, block_k=16, split_k=3, swap_ab=True)
    out = skinny_norm_linear_triton(s, sumsq, nw, EPS, w_next, False, cfg_next)
    assert not _split_counters(x.device).any()
    assert torch.equal(out, skinny_norm_linear_triton(s, sumsq, nw, EPS, w_next, False, cfg_next))


def test_default_launch_and_tile_width(triton_device: str) -> None:
    """Without a config: the op's statistics have one row per column tile of stats_block_n (the
    heuristic's; the interpreter's 8 "SMs" split this shape), also under LFMSPARK_TUNE."""
    M, N, K = 10, 200, 2048
    bn = stats_block_n(M, N, K, torch.float32, torch.device(triton_device))
    sms = torch.cuda.get_device_properties(0).multi_processor_count if triton_device == "cuda" else 8
    cfg = swap_ab_config(M, N, K, 4, sms)
    assert bn == cfg.block_n and (triton_device == "cuda" or split_k_plan(K, cfg.block_k, cfg.split_k)[1] > 1)
    x, w, h = _residual_inputs(triton_device, torch.float32, M, N, K)
    s, sumsq = skinny_linear_residual_triton(x, w, h)
    ref_s, ref_sumsq = skinny_linear_residual_reference(x, w, h, bn)
    assert sumsq.shape == ref_sumsq.shape == (triton.cdiv(N, bn), M)
    assert _rel_err(s, ref_s) < 1e-5 and _rel_err(sumsq, ref_sumsq) < 1e-5


def test_tuned_tile_width_is_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LFMSPARK_TUNE", "tile@200x64.block_n=32")
    assert stats_block_n(10, 200, 64, torch.float32, torch.device("cpu")) == 32
    x, w, h = _residual_inputs("cpu", torch.float32, 10, 200, 64)
    assert lfm.skinny_linear_residual(x, w, h)[1].shape == (7, 10)


def test_empty_and_zero_k(triton_device: str) -> None:
    x, w, h = _residual_inputs(triton_device, torch.float32, 4, 40, 0)
    s, sumsq = skinny_linear_residual_triton(x, w, h)
    assert torch.equal(s, h) and sumsq.shape[1] == 4
    torch.testing.assert_close(sumsq.sum(0), (h * h).sum(-1))


@pytest.mark.parametrize("route", ["op", "triton"])
def test_rejects_bad_inputs(route: str) -> None:
    residual = lfm.skinny_linear_residual if route == "op" else skinny_linear_residual_triton
    norm = lfm.skinny_norm_linear if route == "op" else skinny_norm_linear_triton
    x, w, h = torch.randn(10, 8), torch.randn(6, 8), torch.randn(10, 6)
    with pytest.raises(ValueError, match=r"expected h \[10, 6\]"):
        residual(x, w, h[:, :5])
    with pytest.raises(ValueError, match=f"at most {STATS_MAX_M} rows"):
        residual(torch.randn(STATS_MAX_M + 1, 8), w, torch.randn(STATS_MAX_M + 1, 6))
    s, sumsq, nw = torch.randn(10, 8), torch.rand(2, 10), torch.ones(8)
    with pytest.raises(ValueError, match=r"sumsq \[T, 10\] fp32"):
        norm(s, sumsq.double(), nw, EPS, w, False)
    with pytest.raises(ValueError, match=r"sumsq \[T, 10\] fp32"):
        norm(s, sumsq[:, :9], nw, EPS, w, False)
    with pytest.raises(ValueError, match=r"norm_weight \[8\]"):
        norm(s, sumsq, nw[:7], EPS, w, False)
    with pytest.raises(ValueError, match="stack gate and up"):
        norm(s, sumsq, nw, EPS, torch.randn(5, 8), True)


def test_opcheck_reference() -> None:
    x, w, h = _residual_inputs("cpu", torch.float32, 10, 24, 96)
    torch.library.opcheck(lfm.skinny_linear_residual, (x, w, h))
    s, sumsq, nw, w2 = _norm_inputs("cpu", torch.float32, 10, 96, 48, 32)
    torch.library.opcheck(lfm.skinny_norm_linear, (s, sumsq, nw, EPS, w2, True))


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    x, w, h = _residual_inputs("cpu", torch.float32, 10, 24, 96)
    torch.library.opcheck(lfm.skinny_linear_residual, (x, w, h))
    s, sumsq, nw, w2 = _norm_inputs("cpu", torch.float32, 10, 96, 24, 32)
    torch.library.opcheck(lfm.skinny_norm_linear, (s, sumsq, nw, EPS, w2, False))


def test_torch_compile_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pair under torch.compile(fullgraph=True) (the fakes' shapes) with glue around them."""
    monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    x, w, h = _residual_inputs("cpu", torch.float32, 9, 80, 96)
    nw, w2 = 1 + 0.1 * torch.randn(80), torch.randn(48, 80) / 80 ** 0.5

    def block(x, w, h, nw, w2):
        s, sumsq = lfm.skinny_linear_residual(x * 2, w, h)
        return s, lfm.skinny_norm_linear(s, sumsq, nw, EPS, w2, True) + 1

    torch._dynamo.reset()
    eager = block(x, w, h, nw, w2)
    compiled = torch.compile(block, fullgraph=True)(x, w, h, nw, w2)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# CUDA: the served shapes of LFM2.5-1.2B (out_proj [2048, 2048] split, w2 [2048, 8192] split; the
# consumers in_proj [6144, 2048], qkv [3072, 2048], w13 [16384, 2048], LM head [65536, 2048])

@pytest.mark.gpu
@pytest.mark.parametrize("M", [2, 9, 10, 16])
@pytest.mark.parametrize("N, K", [(2048, 2048), (2048, 8192)])
def test_gpu_residual_served_shapes(M: int, N: int, K: int) -> None:
    x, w, h = _residual_inputs("cuda", torch.bfloat16, M, N, K, seed=M)
    s, sumsq = lfm.skinny_linear_residual(x, w, h)
    bn = stats_block_n(M, N, K, torch.bfloat16, x.device)
    ref_s, ref_sumsq = skinny_linear_residual_reference(x, w, h, bn)
    assert _rel_err(s, ref_s) < 1e-2 and sumsq.shape == ref_sumsq.shape
    torch.testing.assert_close(sumsq.double().cpu(), _hand_sumsq(s.cpu(), bn), rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [2, 10, 16])
@pytest.mark.parametrize("n_out, swiglu", [(6144, False), (3072, False), (16384, True), (65536, False)])
def test_gpu_norm_served_shapes(M: int, n_out: int, swiglu: bool) -> None:
    s, sumsq, nw, w = _norm_inputs("cuda", torch.bfloat16, M, 2048, n_out, 64, seed=M)
    out = lfm.skinny_norm_linear(s, sumsq, nw, EPS, w, swiglu)
    assert _rel_err(out, skinny_norm_linear_reference(s, sumsq, nw, EPS, w, swiglu)) < 1e-2
