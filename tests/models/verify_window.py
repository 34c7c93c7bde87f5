"""A batch-1 VERIFY window on a tiny target, and the comparison of two runs of it (the norm-epilogue
tests: tests/models/test_norm_epilogue.py, tests/models/test_norm_carry.py)."""

from __future__ import annotations

import torch

from lfmspark.models.cache import TargetCache
from lfmspark.models.lfm2 import ForwardMode

TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def verify_window(model, dtype: torch.dtype, logits_index: torch.Tensor | None = None):
    """Prefill a prompt (17 rows: off the several-row route), then VERIFY a 6-token window at batch 1
    (6 rows). Returns the verify's output and the cache."""
    cache = TargetCache.allocate(model.config, 2, 64, 8, dtype, "cpu")
    prompt = torch.arange(3, 20)[None] % model.config.vocab_size
    window = torch.tensor([[5, 35, 8, 9, 12, 40]])
    slot = torch.tensor([1])
    with torch.no_grad():
        model(prompt, cache, slot, torch.tensor([0]), mode=ForwardMode.PREFILL)
        out = model(window, cache, slot, torch.tensor([prompt.shape[1]]), mode=ForwardMode.VERIFY,
                    aux_layer_ids=(0, 2), logits_index=logits_index)
    return out, cache


def assert_verify_close(on, cache_on, off, cache_off, dtype: torch.dtype) -> None:
    """Logits, aux taps, K cache and conv tape of two verify runs agree to ``TOL`` (fp32: the same
    greedy picks too)."""
    assert rel_err(on.logits, off.logits) < TOL[dtype]
    assert rel_err(on.aux, off.aux) < TOL[dtype]
    for a, b in ((cache_on.k, cache_off.k), (cache_on.conv_tape, cache_off.conv_tape)):
        assert rel_err(a, b) < TOL[dtype]
    if dtype == torch.float32:
        assert torch.equal(on.logits.argmax(-1), off.logits.argmax(-1))
