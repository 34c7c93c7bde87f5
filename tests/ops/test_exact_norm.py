"""``lfmspark::exact_rms_norm`` (exact mode's RMSNorm): the Triton kernel (interpreter on CPU, native on
CUDA) against models/layers.py's RMSNorm, and a row's bits alone and inside 2-, 10- and 16-row
launches at every position."""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.models.layers import RMSNorm
from lfmspark.ops.exact_norm import exact_rms_norm_reference, exact_rms_norm_triton

EPS = 1e-5


def _inputs(device: str, dtype: torch.dtype, M: int, H: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(M, H, generator=g)).to(device, dtype)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(device, dtype)
    return x, w


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M, H", [(1, 64), (10, 200), (33, 2048)])
def test_matches_the_models_rmsnorm(triton_device: str, dtype: torch.dtype, atol: float, M: int, H: int) -> None:
    x, w = _inputs(triton_device, dtype, M, H, seed=H)
    norm = RMSNorm(H, EPS).to(triton_device, dtype)
    norm.weight.data.copy_(w)
    want = norm(x)
    torch.testing.assert_close(exact_rms_norm_reference(x, w, EPS), want, atol=0, rtol=0)
    torch.testing.assert_close(exact_rms_norm_triton(x, w, EPS), want, atol=atol, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_bits_do_not_depend_on_the_launch(triton_device: str, dtype: torch.dtype) -> None:
    x, w = _inputs(triton_device, dtype, 16, 300, seed=1)
    others, _ = _inputs(triton_device, dtype, 16, 300, seed=2)
    alone = torch.cat([exact_rms_norm_triton(x[r:r + 1], w, EPS) for r in range(16)])
    assert torch.equal(exact_rms_norm_triton(x, w, EPS), alone)
    for rows in (2, 10):
        for pos in range(rows):
            batch = others[:rows].clone()
            batch[pos] = x[5]
            assert torch.equal(exact_rms_norm_triton(batch, w, EPS)[pos], alone[5])


def test_opcheck() -> None:
    x, w = _inputs("cpu", torch.float32, 3, 16, seed=0)
    torch.library.opcheck(torch.ops.lfmspark.exact_rms_norm, (x, w, EPS))
