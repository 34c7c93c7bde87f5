"""Which attention path the models take (models/lfm2.py ``attend``, ops/routing.py ``window_attention``):
windows of one attention row tile run ``lfmspark::qkv_window_attention``, longer ones
``qkv_norm_rope_write`` + ``cache_attention`` (here also every window, with the route patched). On the ops' CPU
references the two paths compute the same numbers (the window op's reference is the two ops', with
the window's keys past ``lens`` hidden, which no verify or decode row before ``lens`` can see), so
the prefill + verify of tests/models/verify_window.py must agree bit for bit; the kernels are
checked against those references in tests/ops/test_window_attention.py."""

from __future__ import annotations

import pytest
import torch

import lfmspark.models.lfm2 as lfm2
from lfmspark.ops.routing import window_attention
from op_calls import OpCalls
from spec_fixtures import random_tiny_target
from verify_window import verify_window

WINDOW = "qkv_window_attention"


def _run(model, monkeypatch: pytest.MonkeyPatch, window: str):
    with monkeypatch.context() as m:
        if window == "0":    # every window on the two launches
            m.setattr(lfm2, "window_attention", lambda *args: False)
        calls = OpCalls(WINDOW)
        m.setattr(lfm2, "lfm", calls)
        out, cache = verify_window(model, torch.float32)
    return out, cache, [args[0].shape[1] for args in calls.calls]   # the window length of each call


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_both_paths_compute_the_same_verify(monkeypatch: pytest.MonkeyPatch, moe: bool) -> None:
    model = random_tiny_target(moe, seed=7)
    cfg = model.config
    on, cache_on, lengths_on = _run(model, monkeypatch, "1")
    off, cache_off, lengths_off = _run(model, monkeypatch, "0")
    # routed: every window that fits one tile (the 6-token verify; the 17-token prompt only if it fits)
    fits = [n for n in (17, 6) if window_attention(n, cfg.num_attention_heads, cfg.num_key_value_heads)]
    assert lengths_on == [n for n in fits for _ in cfg.attention_layers] and 6 in lengths_on
    assert lengths_off == []
    assert torch.equal(on.logits, off.logits) and torch.equal(on.aux, off.aux)
    assert torch.equal(cache_on.k, cache_off.k) and torch.equal(cache_on.v, cache_off.v)
