"""``lfmspark::exact_rms_norm`` (exact mode's RMSNorm): the Triton kernel (interpreter on CPU, native on
CUDA) against models/layers.py's RMSNorm, and a row's bits alone and inside 2-, 10- and 16-row
launches at every position; ``lfmspark::exact_add_rms_norm`` (the residual add in the same launch):
the same bits as the add followed by ``exact_rms_norm``."""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.models.layers import RMSNorm
from lfmspark.ops.exact_norm import (exact_add_rms_norm_reference, exact_add_rms_norm_triton, exact_rms_norm_reference,
                                     exact_rms_norm_triton)

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M, H", [(1, 64), (10, 200), (33, 2048)])
def test_the_add_in_the_norms_launch_gives_the_add_then_the_norms_bits(triton_device: str, dtype: torch.dtype, M: int,
                                                                       H: int) -> None:
    h, w = _inputs(triton_device, dtype, M, H, seed=H + 1)
    delta, _ = _inputs(triton_device, dtype, M, H, seed=H + 2)
    s, out = exact_add_rms_norm_triton(h, delta, w, EPS)
    if triton_device == "cuda" or dtype == torch.float32:
        assert torch.equal(s, h + delta)
    else:   # Triton's interpreter truncates fp32 -> bf16 where the GPU (and PyTorch) round to nearest even
        torch.testing.assert_close(s, h + delta, rtol=2 ** -7, atol=0)
    assert torch.equal(out, exact_rms_norm_triton(s, w, EPS))      # the norm of the sum: the same arithmetic
    norm = RMSNorm(H, EPS).to(triton_device, dtype)
    norm.weight.data.copy_(w)
    ref_s, ref_out = exact_add_rms_norm_reference(h, delta, w, EPS)
    assert torch.equal(ref_s, h + delta) and torch.equal(ref_out, norm(h + delta))


def test_the_add_in_the_norms_launch_keeps_a_rows_bits_in_any_launch(triton_device: str) -> None:
    h, w = _inputs(triton_device, torch.bfloat16, 10, 300, seed=3)
    delta, _ = _inputs(triton_device, torch.bfloat16, 10, 300, seed=4)
    s, out = exact_add_rms_norm_triton(h, delta, w, EPS)
    for r in range(10):
        s1, out1 = exact_add_rms_norm_triton(h[r:r + 1], delta[r:r + 1], w, EPS)
        assert torch.equal(s1[0], s[r]) and torch.equal(out1[0], out[r]), r


def test_the_add_in_the_norms_launch_refuses_mismatched_inputs() -> None:
    h, w = _inputs("cpu", torch.float32, 3, 16, seed=0)
    with pytest.raises(ValueError, match="one shape"):
        exact_add_rms_norm_triton(h, h[:2], w, EPS)
    with pytest.raises(ValueError, match="one dtype"):
        exact_add_rms_norm_triton(h, h.to(torch.bfloat16), w, EPS)


def test_opcheck_add() -> None:
    h, w = _inputs("cpu", torch.float32, 3, 16, seed=0)
    delta, _ = _inputs("cpu", torch.float32, 3, 16, seed=1)
    torch.library.opcheck(torch.ops.lfmspark.exact_add_rms_norm, (h, delta, w, EPS))


def test_a_column_major_input_gives_row_major_outputs(triton_device: str) -> None:
    # a transposed [8, 64] view (column stride 8): the outputs must not take its layout
    x, w = _inputs(triton_device, torch.float32, 64, 8, seed=5)
    delta, _ = _inputs(triton_device, torch.float32, 64, 8, seed=6)
    x, delta, w = x.T, delta.T, torch.ones(64, device=triton_device)
    torch.testing.assert_close(exact_rms_norm_triton(x, w, EPS), exact_rms_norm_reference(x, w, EPS))
    s, out = exact_add_rms_norm_triton(x, delta, w, EPS)
    ref_s, ref_out = exact_add_rms_norm_reference(x, delta, w, EPS)
    assert torch.equal(s, ref_s)
    torch.testing.assert_close(out, ref_out)
