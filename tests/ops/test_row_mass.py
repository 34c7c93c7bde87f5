"""``lfmspark::row_mass``: the two-stage Triton kept-mass sum (interpreter on CPU, native on CUDA)
against the masked ``exp(x - top)`` sum in plain PyTorch (fp64 as the oracle): random rows and
thresholds, ties at the threshold, ``-inf`` entries and NaN (never kept), thresholds above the row
(mass 0) and at ``-inf`` (the softmax denominator), a chunked second stage, strided and bf16 inputs;
registration, errors, opcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops import argmax_rows as argmax_rows_module
from lfmspark.ops.row_mass import row_mass_triton
from env_vars import interpret_triton


def _oracle(x: torch.Tensor, top: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """The kept mass in fp64, written out column by column's rule (kept: x >= threshold, not NaN)."""
    xd = x.double().cpu()
    kept = xd >= threshold.double().cpu()[:, None]
    e = torch.exp(xd.masked_fill(~kept, 0.0) - top.double().cpu()[:, None])
    return (e * kept).sum(dim=-1)


def _check(x: torch.Tensor, top: torch.Tensor, threshold: torch.Tensor, block_v: int | None = None) -> torch.Tensor:
    out = row_mass_triton(x, top, threshold, block_v)
    assert out.dtype == torch.float32 and out.shape == x.shape[:1] and out.device == x.device
    torch.testing.assert_close(out.double().cpu(), _oracle(x, top, threshold), rtol=2e-6, atol=1e-30)
    return out


def _row_inputs(R: int, V: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * 3
    top = x.max(dim=-1).values
    threshold = top - torch.rand(R, generator=g) * 6      # keeps between a few and most of the row
    return x.to(device), top.to(device), threshold.to(device)


@pytest.mark.parametrize("R, V", [(1, 1), (3, 7), (10, 256), (4, 1000), (1, 4099)])
def test_random_rows(triton_device: str, R: int, V: int) -> None:
    _check(*_row_inputs(R, V, R * 7919 + V, triton_device))


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 10, 80])
def test_served_vocabulary(triton_device: str, R: int) -> None:
    _check(*_row_inputs(R, 65536, R, triton_device))


def test_ties_kept_whole_minus_inf_and_nan_never_kept(triton_device: str) -> None:
    x = torch.tensor([[2.0, 1.0, 1.0, 0.0, float("-inf")],
                      [1.0, float("nan"), 1.0, float("-inf"), 3.0],
                      [5.0, 4.0, 3.0, 2.0, 1.0]])
    top = torch.tensor([2.0, 3.0, 5.0])
    threshold = torch.tensor([1.0, float("-inf"), 6.0])    # a tie at 1.0; everything; nothing
    out = _check(x.to(triton_device), top.to(triton_device), threshold.to(triton_device))
    e = torch.exp(torch.tensor(-1.0))
    want = torch.stack([1 + 2 * e, 1 + 2 * torch.exp(torch.tensor(-2.0)), torch.tensor(0.0)])
    torch.testing.assert_close(out.cpu(), want)


@pytest.mark.parametrize("max_block_p", [16, 1024])
def test_forced_blocks_and_chunked_second_stage(triton_device: str, monkeypatch: pytest.MonkeyPatch,
                                                max_block_p: int) -> None:
    """64 columns per block over 5000 columns: 79 partials per row, summed 16 at a time or at once."""
    monkeypatch.setattr(argmax_rows_module, "_MAX_BLOCK_P", max_block_p)
    _check(*_row_inputs(3, 5000, max_block_p, triton_device), block_v=64)


def test_strided_and_bf16_rows(triton_device: str) -> None:
    x, top, threshold = _row_inputs(4, 1200, 5, triton_device)
    _check(x[:, ::2], x[:, ::2].max(dim=-1).values, threshold)
    xb = x.to(torch.bfloat16)
    _check(xb, xb.float().max(dim=-1).values, threshold)


def test_bad_arguments_name_the_problem() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="expected x"):
        torch.ops.lfmspark.row_mass(torch.zeros(8), torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="threshold must be fp32"):
        torch.ops.lfmspark.row_mass(x, torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="top must be fp32"):
        torch.ops.lfmspark.row_mass(x, torch.zeros(2, dtype=torch.float64), torch.zeros(2))


@pytest.mark.parametrize("on_triton", [False, True], ids=["reference", "triton"])
def test_opcheck(monkeypatch: pytest.MonkeyPatch, on_triton: bool) -> None:
    if on_triton:
        interpret_triton(monkeypatch)
    torch.library.opcheck(torch.ops.lfmspark.row_mass, _row_inputs(3, 300, 1, "cpu"))


def test_registered_op_compiles_with_the_triton_kernels(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    x, top, threshold = _row_inputs(3, 300, 9, triton_device)
    fn = torch.compile(lambda t, m, h: torch.ops.lfmspark.row_mass(t * 2.0, m * 2.0, h * 2.0), fullgraph=True)
    torch.testing.assert_close(fn(x, top, threshold).double().cpu(), _oracle(x * 2.0, top * 2.0, threshold * 2.0),
                               rtol=2e-6, atol=1e-30)
