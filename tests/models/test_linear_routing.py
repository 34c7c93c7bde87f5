"""``models.layers.linear``: the LFMSPARK_SKINNY_LINEAR switch is validated; CPU always uses F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lfmspark.models.layers import linear


def test_unknown_skinny_mode_is_refused(monkeypatch):
    monkeypatch.setenv("LFMSPARK_SKINNY_LINEAR", "1")
    with pytest.raises(ValueError, match="LFMSPARK_SKINNY_LINEAR='1'.*'all'"):
        linear(torch.randn(2, 8), torch.randn(4, 8))


@pytest.mark.parametrize("mode", ["off", "all", "verify"])
def test_cpu_products_are_f_linear_in_every_mode(monkeypatch, mode):
    monkeypatch.setenv("LFMSPARK_SKINNY_LINEAR", mode)
    x, w = torch.randn(3, 5, 8), torch.randn(6, 8)
    assert torch.equal(linear(x, w), F.linear(x, w))
