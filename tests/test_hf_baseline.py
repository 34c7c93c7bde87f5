"""The benchmark's HF baseline runs transformers on exactly our weights (mapped back to HF names)."""

from __future__ import annotations

import pytest
import torch

from lfmspark.models.cache import TargetCache
from lfmspark.models.lfm2 import ForwardMode
from lfmspark.runtime.hf_baseline import hf_model_like, time_hf_generate
from spec_fixtures import random_tiny_target


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_hf_model_shares_our_weights_and_matches_our_logits(moe):
    model = random_tiny_target(moe=moe, seed=1)
    hf = hf_model_like(model)
    assert hf.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    cache = TargetCache.allocate(model.config, 2, 32, 2, torch.float32, "cpu")
    zero = torch.zeros(2, dtype=torch.int64)
    with torch.no_grad():
        ours = model(ids, cache, torch.arange(2), zero, None, ForwardMode.PREFILL).logits
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    timing = time_hf_generate(hf, ids, 4, runs=1)
    assert timing["tpot_ms"] > 0 and timing["ttft_ms"] > 0
