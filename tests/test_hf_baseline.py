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


def test_a_compiled_baseline_past_its_time_limit_is_reported_as_failed(monkeypatch):
    import time

    from lfmspark.runtime import bench, hf_baseline

    def too_slow(*args, **kwargs):
        time.sleep(5)
        return {"ttft_ms": 1.0, "tpot_ms": 1.0}

    monkeypatch.setattr(hf_baseline, "time_hf_generate", too_slow)
    cfg = bench.BenchConfig(prompt_len=4, output_len=2, runs=1, hf_compile=True, hf_compile_timeout_s=0.3)
    t0 = time.perf_counter()
    row = bench._hf_row(random_tiny_target(seed=1), cfg, 1, torch.device("cpu"), compiled=True)
    assert time.perf_counter() - t0 < 3
    assert row["error"].startswith("BaselineTimeout: did not finish within 0.3 s")
    assert "tpot_ms_p50" not in row
