"""``lfmspark::top_values``: the two-stage Triton row top-k values (interpreter on CPU, native on
CUDA) against ``torch.topk(...).values``, compared exactly: random rows, k not a power of two,
ties (bf16 rows), ``-inf`` padding, rows shorter than a block, a forced small block, strided
inputs; registration, errors and torch.compile."""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.top_values import top_values_triton
from env_vars import interpret_triton


def _same(x: torch.Tensor, k: int, block_v: int | None = None) -> None:
    out = top_values_triton(x, k, block_v)
    assert out.dtype == torch.float32 and out.shape == (x.shape[0], k) and out.device == x.device
    want = torch.topk(x.float(), k, dim=-1).values
    assert torch.equal(out, want), (out, want)


@pytest.mark.parametrize("R, V, k", [(1, 8, 8), (3, 5, 3), (10, 256, 64), (3, 1000, 50), (1, 4099, 17)])
def test_random_rows(triton_device: str, R: int, V: int, k: int) -> None:
    g = torch.Generator().manual_seed(R * 7919 + V)
    _same(torch.randn(R, V, generator=g).to(triton_device), k)


@pytest.mark.gpu
def test_served_vocabulary(triton_device: str) -> None:
    x = torch.randn(2, 65536, generator=torch.Generator().manual_seed(2)).to(triton_device)
    x[1, 65535] = 50.0            # the maximum in the last block
    _same(x, 64)


@pytest.mark.parametrize("block_v", [16, 64])
def test_forced_small_blocks_with_ties_and_minus_inf(triton_device: str, block_v: int) -> None:
    """bf16 rows round to few distinct values (many ties across blocks); a row mostly ``-inf``."""
    x = torch.randn(3, 700, generator=torch.Generator().manual_seed(block_v)).mul(2).round().to(torch.bfloat16)
    x[2, :690] = float("-inf")
    _same(x.to(triton_device), 16, block_v)


def test_strided_rows(triton_device: str) -> None:
    x = torch.randn(4, 600, generator=torch.Generator().manual_seed(5)).to(triton_device)[:, ::2]
    _same(x, 10)


def test_bad_arguments_name_the_problem() -> None:
    with pytest.raises(ValueError, match="k = 9 must be in"):
        torch.ops.lfmspark.top_values(torch.zeros(2, 8), 9)
    with pytest.raises(ValueError, match="expected x"):
        torch.ops.lfmspark.top_values(torch.zeros(8), 2)
    with pytest.raises(ValueError, match="below k rounded up"):
        top_values_triton(torch.zeros(1, 64), 16, block_v=8)


def test_registered_op_compiles_with_the_triton_kernels(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``torch.compile`` (fullgraph) the op keeps its semantics; on CPU the kernels run in the
    interpreter (``LFMSPARK_TRITON_ON_CPU``)."""
    interpret_triton(monkeypatch)
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(9)).to(triton_device)
    fn = torch.compile(lambda t: torch.ops.lfmspark.top_values(t * 2.0, 7), fullgraph=True)
    assert torch.equal(fn(x), torch.topk(x * 2.0, 7).values)


@pytest.mark.parametrize("on_triton", [False, True], ids=["reference", "triton"])
def test_opcheck(monkeypatch: pytest.MonkeyPatch, on_triton: bool) -> None:
    if on_triton:
        interpret_triton(monkeypatch)
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(3))
    torch.library.opcheck(torch.ops.lfmspark.top_values, (x, 7))
