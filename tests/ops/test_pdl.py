"""Programmatic dependent launch (ops/_dispatch.py): the switch, and on the GPU that a chain of
PDL kernels replayed from a CUDA graph computes exactly what the same kernels compute without PDL.

A kernel that read its predecessor's output before ``gdc_wait`` would read stale or partial data in
the graph replay (where the successor really starts early), so the bit-exact comparison of long,
dependent chains is the check that every kernel in the chain honours the contract.
"""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops._dispatch import pdl_kwargs, pdl_requested, use_pdl

lfm = torch.ops.lfmspark


def test_off_on_cpu() -> None:
    assert not use_pdl(torch.zeros(1))
    assert pdl_kwargs(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LFMSPARK_PDL", raising=False)
    assert pdl_requested()
    monkeypatch.setenv("LFMSPARK_PDL", "0")
    assert not pdl_requested()
    monkeypatch.setenv("LFMSPARK_PDL", "yes")
    with pytest.raises(ValueError, match="LFMSPARK_PDL='yes'"):
        pdl_requested()


def _chain(x: torch.Tensor, weights: list[torch.Tensor], w13: torch.Tensor, rows10: torch.Tensor) -> torch.Tensor:
    """A decode-like chain: GEMVs, a SwiGLU GEMV, several-row products with split-K, an argmax;
    every step consumes the previous one's output."""
    h = x
    for w in weights:
        h = lfm.skinny_linear(h, w)[:, : x.shape[1]] * 0.5 + x
    h = lfm.swiglu_gemv(h, w13)
    ten = lfm.skinny_linear(rows10 + h[:, : rows10.shape[1]], weights[0])  # M = 10: split-K + reduce
    return torch.cat([lfm.argmax_rows(ten).float(), ten.float().flatten()[:64]])


@pytest.mark.gpu
def test_graph_replay_with_pdl_is_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    K = 2048
    x = torch.randn(1, K, device="cuda", generator=g, dtype=torch.bfloat16)
    weights = [torch.randn(n, K, device="cuda", generator=g, dtype=torch.bfloat16) / K ** 0.5
               for n in (6144, 2048, 3072, 2048) * 3]
    w13 = torch.randn(2 * 2 * K, K, device="cuda", generator=g, dtype=torch.bfloat16) / K ** 0.5
    rows10 = torch.randn(10, K, device="cuda", generator=g, dtype=torch.bfloat16)

    monkeypatch.setenv("LFMSPARK_PDL", "0")
    want = _chain(x, weights, w13, rows10)

    monkeypatch.setenv("LFMSPARK_PDL", "1")
    assert use_pdl(x), "the H200 supports PDL"
    _chain(x, weights, w13, rows10)  # compile the PDL variants outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _chain(x, weights, w13, rows10)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
