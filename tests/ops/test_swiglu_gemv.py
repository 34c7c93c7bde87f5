"""``lfmspark::swiglu_gemv``: the Triton kernel (interpreter on CPU, native on CUDA) against the
unfused reference ``silu(gate) * up`` of ``F.linear(x, w13)``.

fp32: the kernel's sums differ from the reference's only in order (1e-5 relative). bf16: the
reference rounds gate, up, silu and the product to bf16; the kernel rounds at the same points
(the interpreter truncates instead of rounding), so results agree to a few bf16 ulps.
"""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.swiglu_gemv import swiglu_gemv_reference, swiglu_gemv_triton

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(device: str, dtype: torch.dtype, F: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, K, generator=g).to(device, dtype)
    w13 = (torch.randn(2 * F, K, generator=g) * 2 / K ** 0.5).to(device, dtype)
    return x, w13


def _oracle(x: torch.Tensor, w13: torch.Tensor) -> torch.Tensor:
    gate, up = (x.double() @ w13.double().T).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("F, K", [(64, 512), (37, 1024 + 96), (5, 40)], ids=["even", "tails", "tiny"])
def test_kernel_matches_reference(triton_device: str, dtype: torch.dtype, F: int, K: int) -> None:
    x, w13 = _inputs(triton_device, dtype, F, K, seed=F + K)
    out = swiglu_gemv_triton(x, w13)
    assert out.shape == (1, F) and out.dtype == dtype
    want = _oracle(x, w13)
    assert _rel_err(out, want) < TOL[dtype]
    assert _rel_err(swiglu_gemv_reference(x, w13), want) < TOL[dtype]   # the reference meets the same bound


def test_gate_and_up_halves_are_not_swapped(triton_device: str) -> None:
    # up rows zero: the output must vanish; gate rows zero: silu(0) = 0 vanishes too, so instead
    # make up = 1-vector products and check silu(gate) comes out
    x, w13 = _inputs(triton_device, torch.float32, 16, 64)
    w13[16:] = 0
    assert torch.equal(swiglu_gemv_triton(x, w13), torch.zeros(1, 16, device=triton_device))
    x, w13 = _inputs(triton_device, torch.float32, 16, 64, seed=1)
    w13[16:] = 0
    w13[16:, 0] = 1 / x[0, 0]                  # up = 1 in every column
    gate = x @ w13[:16].T
    torch.testing.assert_close(swiglu_gemv_triton(x, w13), torch.nn.functional.silu(gate), rtol=1e-5, atol=1e-6)


def test_rejects_bad_shapes() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"x \[1, H\]"):
        torch.ops.lfmspark.swiglu_gemv(x, torch.randn(6, 8))
    with pytest.raises(ValueError, match="stack gate and up"):
        torch.ops.lfmspark.swiglu_gemv(x[:1], torch.randn(5, 8))


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LFMSPARK_TRITON_ON_CPU", "1")
    torch.library.opcheck(torch.ops.lfmspark.swiglu_gemv, _inputs("cpu", torch.float32, 24, 96))


def test_opcheck_reference() -> None:
    torch.library.opcheck(torch.ops.lfmspark.swiglu_gemv, _inputs("cpu", torch.float32, 24, 96))


@pytest.mark.gpu
@pytest.mark.parametrize("F, K", [(8192, 2048), (4096, 2048)])
def test_gpu_served_shapes(F: int, K: int) -> None:
    x, w13 = _inputs("cuda", torch.bfloat16, F, K)
    assert _rel_err(torch.ops.lfmspark.swiglu_gemv(x, w13), _oracle(x, w13)) < TOL[torch.bfloat16]
