"""Which weight each product prefetches into L2 (models/layers.py ``prefetch_view``): the next
product's, in the order the forward reads them.

On CUDA every skinny product asks L2 for the first megabytes of the weight read after it (the
target: ``in_proj`` / ``qkv_proj`` -> ``out_proj`` -> gate/up -> ``w2`` -> the next layer's first
weight -> the LM head; the draft likewise, then its LM head -> the Markov ``w2``, and the context
injection ``fc`` -> K/V projection -> the first draft layer's ``q_proj``). Here the CUDA routing is
forced on CPU (rows to the skinny ops, the views built whatever the device) and every skinny op
call is recorded with its weight and prefetch view; the check is that each call's view starts at
the weight of the call after it. A wrong link costs only speed on the GPU, which no result would
show, so this is the test that keeps the chain right.
"""

from __future__ import annotations

import pytest
import torch

import lfmspark.models.dspark as dspark
import lfmspark.models.layers as layers
import lfmspark.models.lfm2 as lfm2
from lfmspark.models.cache import DraftCache, TargetCache
from lfmspark.models.dspark import greedy_pick
from lfmspark.models.lfm2 import ForwardMode
from spec_fixtures import random_tiny_draft, random_tiny_target

# op name -> positions of (weight, prefetch) in its arguments
_PRODUCTS = {"skinny_linear": (1, 2), "skinny_swiglu": (1, 2), "swiglu_gemv": (1, 2), "add_rmsnorm_gemv": (4, 6),
             "add_rmsnorm_skinny": (4, 6)}


class _Recorder:
    """Stands in for ``torch.ops.lfmspark`` in models/layers.py, recording each product's weight and
    prefetch view."""

    def __init__(self):
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []

    def __getattr__(self, name):
        op = getattr(torch.ops.lfmspark, name)
        if name not in _PRODUCTS:
            return op
        w_at, pf_at = _PRODUCTS[name]

        def recorded(*args):
            self.calls.append((name, args[w_at], args[pf_at] if len(args) > pf_at else None))
            return op(*args)
        return recorded

    def links(self) -> list[tuple[int | None, int]]:
        """(data pointer of call i's prefetch view, of call i + 1's weight) for consecutive calls."""
        return [(None if pf is None else pf.data_ptr(), nxt.data_ptr())
                for (_, _, pf), (_, nxt, _) in zip(self.calls, self.calls[1:])]


@pytest.fixture
def recorder(monkeypatch) -> _Recorder:
    def any_device_view(weight):            # prefetch_view without its CUDA condition
        return None if weight is None else layers.leading_view(weight, 1 << 20)

    for module in (layers, lfm2, dspark):
        monkeypatch.setattr(module, "prefetch_view", any_device_view)
    monkeypatch.setattr(layers, "_routed_to_skinny", lambda x: x.numel() // x.shape[-1] <= 16)
    rec = _Recorder()
    monkeypatch.setattr(layers, "lfm", rec)
    return rec


def _assert_chain(rec: _Recorder, n_expected: int) -> None:
    assert len(rec.calls) == n_expected, [c[0] for c in rec.calls]
    for i, (pf, nxt) in enumerate(rec.links()):
        assert pf == nxt, f"call {i} ({rec.calls[i][0]}) does not prefetch the weight of call {i + 1}"


@pytest.mark.parametrize("mode, T", [(ForwardMode.DECODE, 1), (ForwardMode.VERIFY, 4)], ids=["decode", "verify"])
def test_target_products_prefetch_the_next_weight(recorder: _Recorder, mode: ForwardMode, T: int) -> None:
    model = random_tiny_target(seed=3)
    cfg = model.config
    cache = TargetCache.allocate(cfg, 2, 32, 4, torch.float32, "cpu")
    with torch.no_grad():
        model(torch.tensor([[3, 1, 4, 1, 5]]), cache, torch.tensor([0]), torch.tensor([0]))   # a prompt first
        recorder.calls.clear()
        model(torch.arange(T)[None], cache, torch.tensor([0]), torch.tensor([5]), mode=mode)
    # four products per layer (mixer in, mixer out, gate/up, w2), then the LM head
    _assert_chain(recorder, 4 * cfg.num_hidden_layers + 1)
    assert recorder.calls[-1][1] is model.lm_head.weight and recorder.calls[-1][2] is None
    # every norm + product is a fused op: the GEMV's for one row, the swap-AB kernel's for several
    fused = "add_rmsnorm_gemv" if mode is ForwardMode.DECODE else "add_rmsnorm_skinny"
    assert sum(name == fused for name, _, _ in recorder.calls) == 2 * cfg.num_hidden_layers + 1


def test_target_first_weight() -> None:
    model = random_tiny_target(seed=3)
    for i, layer in enumerate(model.model.layers):
        want = layer.self_attn.qkv_proj.weight if layer.is_attention else layer.conv.in_proj.weight
        assert model.first_weight(i) is want
    assert model.first_weight(model.config.num_hidden_layers) is model.lm_head.weight


def test_draft_products_prefetch_the_next_weight(recorder: _Recorder) -> None:
    target = random_tiny_target(seed=3)
    draft = random_tiny_draft(block=4, seed=5)
    draft.attach_target(target.model.embed_tokens, target.lm_head)
    cfg = draft.config
    cache = DraftCache.allocate(cfg, 2, 32, torch.float32, "cpu")
    slots, start = torch.tensor([1]), torch.tensor([0])
    aux = torch.randn(1, 3, cfg.n_taps * target.config.hidden_size)
    with torch.no_grad():
        draft.inject_context(aux, cache, slots, start, torch.tensor([3]))
        # fc -> stacked K/V projection -> (the next round's) first draft layer
        assert [c[0] for c in recorder.calls] == ["skinny_linear"] * 2
        assert recorder.calls[0][2].data_ptr() == draft.kv_proj.data_ptr()
        assert recorder.calls[1][2].data_ptr() == draft.first_weight(0).data_ptr()
        recorder.calls.clear()
        draft.propose(torch.tensor([7]), cache, slots, torch.tensor([3]), greedy_pick)
    # per layer q, K/V, o, gate/up, w2; then the LM head, which prefetches the Markov head's w2; the
    # norms ride in q, K/V (each recomputing input_layernorm), gate/up and the LM head
    _assert_chain(recorder, 5 * cfg.num_hidden_layers + 1)
    assert [c[0] for c in recorder.calls[:5]] == ["add_rmsnorm_skinny"] * 2 + ["skinny_linear"] + \
        ["add_rmsnorm_skinny", "skinny_linear"]
    assert sum(c[0] == "add_rmsnorm_skinny" for c in recorder.calls) == 3 * cfg.num_hidden_layers + 1
    name, weight, pf = recorder.calls[-1]
    assert weight is target.lm_head.weight and pf.data_ptr() == draft.markov_head.markov_w2.weight.data_ptr()
    assert draft.first_weight(cfg.num_hidden_layers) is target.lm_head.weight
