"""``lfmspark::skinny_linear_fp8``: the skinny product kernels reading float8 e4m3fn weights with
per-output-channel scales (interpreter on CPU, native on CUDA) against the fp64 product of the
dequantized weight; the reference (dequantize to x's dtype, then the bf16 product) meets the same
bound. One row runs the GEMV kernel, several the swap-AB ``tl.dot`` kernel; forced split-K, the row
scale of a carried norm, registration checks and torch.compile.

Tolerances as in test_skinny_linear.py (relative Frobenius errors): fp32 1e-5, bf16 1e-2. The oracle
is exact in the fp8 values: the kernels do not round the dequantized weight, the reference rounds it
to x's dtype (bf16: ~2**-9 per weight)."""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.models.quant import quantize_fp8
from lfmspark.ops.linear.skinny_linear import MAX_M, SkinnyConfig, row_rstd_reference
from lfmspark.ops.linear.skinny_linear_fp8 import skinny_linear_fp8_reference, skinny_linear_fp8_triton
from env_vars import interpret_triton

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _inputs(device: str, dtype: torch.dtype, M: int, N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    # rows of different magnitudes, one all zero: each column's own scale matters
    w = torch.randn(N, K, generator=g) / K ** 0.5 * torch.logspace(-2, 1, N)[:, None]
    w[N // 2] = 0.0
    q = quantize_fp8(w)
    return x, q.weight.to(device), q.scale.to(device)


def _oracle(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.double() @ (weight.double() * scale.double()[:, None]).T


def _err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want).norm() / want.norm()).item()


def _check(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    assert out.shape == (x.shape[0], weight.shape[0]) and out.dtype == x.dtype and out.device == x.device
    want = _oracle(x, weight, scale)
    assert _err(out, want) < TOL[x.dtype]
    assert _err(skinny_linear_fp8_reference(x, weight, scale), want) < TOL[x.dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [1, 8, 16])
@pytest.mark.parametrize("N, K", [(160, 256), (33, 96 + 32 + 7)], ids=["even", "tails"])
def test_kernel_matches_the_dequantized_product(triton_device: str, dtype: torch.dtype, M: int, N: int,
                                                K: int) -> None:
    x, w, s = _inputs(triton_device, dtype, M, N, K, seed=M)
    _check(skinny_linear_fp8_triton(x, w, s), x, w, s)


@pytest.mark.parametrize("M, cfg", [
    (1, SkinnyConfig(block_n=8, block_k=64, split_k=3, gemv=True)),      # GEMV: splits, K tail in the last
    (8, SkinnyConfig(block_n=16, block_k=32, split_k=3)),                # swap-AB: splits, K tail in the last
    (16, SkinnyConfig(block_n=64, block_k=64, split_k=1)),               # one program per column tile
], ids=["gemv_split", "tile_split", "tile"])
def test_forced_configs(triton_device: str, M: int, cfg: SkinnyConfig) -> None:
    x, w, s = _inputs(triton_device, torch.float32, M, 100, 200, seed=M + 1)
    _check(skinny_linear_fp8_triton(x, w, s, cfg), x, w, s)


def test_the_row_scale_of_a_carried_norm(triton_device: str) -> None:
    """With ``row_ssq`` each row is scaled by ``rsqrt(mean square + eps)`` before its one rounding, on
    the tile kernel even for one row (skinny_linear's ROW_NORM)."""
    for M in (1, 10):
        x, w, s = _inputs(triton_device, torch.float32, M, 48, 64, seed=M + 2)
        ssq = torch.rand(3, M, generator=torch.Generator().manual_seed(M)).to(triton_device) * 64
        out = skinny_linear_fp8_triton(x, w, s, row_ssq=ssq, eps=1e-5)
        want = _oracle(x, w, s) * row_rstd_reference(ssq, 64, 1e-5).double()
        assert _err(out, want) < 1e-5
        assert _err(skinny_linear_fp8_reference(x, w, s, ssq, 1e-5), want) < 1e-5


def test_empty_shapes(triton_device: str) -> None:
    x, w, s = _inputs(triton_device, torch.float32, 0, 32, 64)
    assert skinny_linear_fp8_triton(x, w, s).shape == (0, 32)


def test_rejects_unsupported(triton_device: str) -> None:
    x, w, s = _inputs(triton_device, torch.float32, 4, 32, 64)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        skinny_linear_fp8_triton(x, w.float(), s)
    with pytest.raises(ValueError, match="scale must be contiguous fp32"):
        skinny_linear_fp8_triton(x, w, s[:-1])
    with pytest.raises(ValueError, match="scale must be contiguous fp32"):
        skinny_linear_fp8_triton(x, w, s.double())
    with pytest.raises(ValueError, match=str(MAX_M)):
        torch.ops.lfmspark.skinny_linear_fp8(torch.zeros(MAX_M + 1, 64), w.cpu(), s.cpu())
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        skinny_linear_fp8_triton(x.double(), w, s)


def _op_args() -> tuple[torch.Tensor, ...]:
    return _inputs("cpu", torch.float32, 10, 48, 96)


# opcheck's schema test compares the inputs before and after the call with torch.allclose, which has
# no fp8 kernel on the CPU: the other checks run there, and the inputs' bits are compared here
OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck() -> None:
    args = _op_args()
    before = [a.clone() for a in args]
    torch.library.opcheck(torch.ops.lfmspark.skinny_linear_fp8, args, test_utils=OPCHECKS)
    torch.ops.lfmspark.skinny_linear_fp8(*args)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(args, before))  # no mutation


def test_opcheck_reference() -> None:
    _opcheck()


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    _opcheck()


def test_torch_compile_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    x, w, s = _op_args()

    def project(x, w, s):
        return torch.ops.lfmspark.skinny_linear_fp8(x * 2, w, s).relu()

    torch._dynamo.reset()
    compiled = torch.compile(project, fullgraph=True)
    eager = project(x, w, s)
    torch.testing.assert_close(compiled(x, w, s), eager, rtol=0, atol=0)
    torch.testing.assert_close(eager, skinny_linear_fp8_reference(x * 2, w, s).relu(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 10, 16])
@pytest.mark.parametrize("N, K", [(6144, 2048), (2048, 8192), (3072, 2048)])
def test_gpu_served_shapes(M: int, N: int, K: int) -> None:
    x, w, s = _inputs("cuda", torch.bfloat16, M, N, K, seed=M)
    _check(torch.ops.lfmspark.skinny_linear_fp8(x, w, s), x, w, s)
