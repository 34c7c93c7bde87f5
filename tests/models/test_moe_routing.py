"""The router's top-k selection (``top_k_ids``) against ``torch.topk``."""

from __future__ import annotations

import pytest
import torch

from lfmspark.models.lfm2_moe import top_k_ids


@pytest.mark.parametrize("k", [1, 4, 8])
def test_top_k_ids_equals_torch_topk_on_distinct_scores(k):
    gen = torch.Generator().manual_seed(k)
    scores = torch.rand(64, 32, generator=gen) + torch.randn(32, generator=gen) * 0.1   # fp32, like the router
    assert torch.equal(top_k_ids(scores, k), torch.topk(scores, k).indices)


def test_top_k_ids_breaks_ties_by_lower_index_and_is_compilable():
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    expected = torch.tensor([[1, 3, 0], [0, 1, 2]])
    assert torch.equal(top_k_ids(scores, 3), expected)
    assert torch.equal(torch.compile(top_k_ids, fullgraph=True)(scores, 3), expected)
