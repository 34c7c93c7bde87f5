"""The residual add and the feed-forward RMSNorm in the products' epilogues (models/layers.py
``project_norm_feed_forward``, ops/routing.py ``NormRoute.EPILOGUE``), exercised on CPU.

On CUDA, 2-16 rows outside decode steps (the batch-1 verify, the draft's block) run a mixer's output projection as
``lfmspark::skinny_linear_add_norm`` (residual add, ``s * g`` and the row statistics in its epilogue)
and the gate/up product as ``lfmspark::skinny_swiglu`` with the norm's row scale. Here the route
is forced on CPU by patching the routing predicate (``routing.product_kernels``, as
tests/models/test_fused_norm.py does) and the ops run their PyTorch references (the kernels are
checked against those in tests/ops/test_skinny_add_norm.py); the comparison is the same model on
the plain module path (``product_kernels`` false, as on an unpatched CPU: product, add, RMSNorm,
SwiGLU). The feed-forward input is rounded at another point (``s * g`` instead of ``RMSNorm(s)``),
so fp32 agrees to summation order and bf16 to rounding. The norms between layers (a
``NormedCarry``, which a layer hands on when its caller passes ``next_norm``: the target's VERIFY
forward, the draft's block) are withheld here by dropping ``next_norm`` from the layers' calls;
tests/models/test_norm_carry.py covers them.
"""

from __future__ import annotations

import pytest
import torch

from lfmspark.ops import routing
import lfmspark.models.layers as layers
from lfmspark.models import dspark, lfm2
from lfmspark.models.cache import DraftCache, TargetCache
from lfmspark.models.lfm2 import ForwardMode
from op_calls import OpCalls
from spec_fixtures import random_tiny_draft_with_context, random_tiny_target
from verify_window import TOL, assert_verify_close, rel_err, verify_window

ADD_NORM = "skinny_linear_add_norm"


@pytest.fixture
def several_row_route(monkeypatch) -> OpCalls:
    """CUDA's routing on the CPU: 1-16 rows on the skinny ops (their CPU implementations); records
    the producer's calls. The norms between layers stay off (:func:`_withhold_next_norm`)."""
    _withhold_next_norm(monkeypatch)
    monkeypatch.setattr(routing, "product_kernels", lambda x: 1 <= x.numel() // x.shape[-1] <= 16)
    calls = OpCalls(ADD_NORM)
    monkeypatch.setattr(layers, "lfm", calls)
    return calls


def _withhold_next_norm(monkeypatch) -> None:
    """The target's and the draft's decoder layers called without ``next_norm`` (the weight of the
    norm after them), so none hands on a ``NormedCarry``: each returns its feed-forward output as a
    pending delta, with the feed-forward's norm still in the epilogues."""
    target_forward, draft_forward = lfm2.Lfm2DecoderLayer.forward, dspark.DraftLayer.forward

    def target_without_next_norm(self, h, delta, layer_cache, rows, mode, rope, next_norm=None):
        return target_forward(self, h, delta, layer_cache, rows, mode, rope)

    def draft_without_next_norm(self, x, delta, kv_weight, k_norm_weight, k_cache, v_cache, page_table, rope, slots,
                                start, lens, next_norm=None):
        return draft_forward(self, x, delta, kv_weight, k_norm_weight, k_cache, v_cache, page_table, rope, slots, start,
                             lens)

    monkeypatch.setattr(lfm2.Lfm2DecoderLayer, "forward", target_without_next_norm)
    monkeypatch.setattr(dspark.DraftLayer, "forward", draft_without_next_norm)


def _modules_route(monkeypatch) -> None:
    """The plain module path: no product on lfmspark's kernels (an unpatched CPU's routing)."""
    monkeypatch.setattr(routing, "product_kernels", lambda x: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_verify_matches_the_modules(monkeypatch, several_row_route, moe: bool, dtype: torch.dtype) -> None:
    """Logits, aux taps and caches of a verify window agree with the modules'; the producer ran
    once per dense feed-forward layer on the epilogue route (the MoE layers keep the modules),
    never on the modules'."""
    model = random_tiny_target(moe, seed=5).to(dtype)
    cfg = model.config
    on, cache_on = verify_window(model, dtype)
    dense = sum(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) if moe else cfg.num_hidden_layers
    assert len(several_row_route.calls) == dense
    several_row_route.calls.clear()
    _modules_route(monkeypatch)
    off, cache_off = verify_window(model, dtype)
    assert several_row_route.calls == []
    assert_verify_close(on, cache_on, off, cache_off, dtype)


def test_draft_block_matches_the_modules(monkeypatch, several_row_route) -> None:
    """The draft's block (4 rows) on the epilogue pair, one producer call per layer, against the
    modules (none)."""
    draft, cache, slot, start = random_tiny_draft_with_context()
    cfg = draft.config
    blocks = {}
    for on in (True, False):
        if not on:
            _modules_route(monkeypatch)
        several_row_route.calls.clear()
        c = DraftCache(k=cache.k.clone(), v=cache.v.clone(), page_table=cache.page_table, rope=cache.rope)
        with torch.no_grad():
            blocks[on] = draft.block_hidden(torch.tensor([7]), c, slot, start)
        assert len(several_row_route.calls) == (cfg.num_hidden_layers if on else 0)
    for a, b in zip(blocks[True], blocks[False], strict=True):
        assert rel_err(a, b) < TOL[torch.float32]


def test_decode_and_wide_windows_keep_their_paths(several_row_route) -> None:
    """A one-row decode (the fused GEMV route), a two-row decode (its batch's verify is wider than 16
    rows and takes the modules, so its decode does too) and a 17-row prefill (off the skinny route)
    never call the producer; a 5-row prefill does."""
    model = random_tiny_target(seed=3)
    cache = TargetCache.allocate(model.config, 2, 64, 4, torch.float32, "cpu")
    with torch.no_grad():
        model(torch.arange(17)[None], cache, torch.tensor([0]), torch.tensor([0]), mode=ForwardMode.PREFILL)
        model(torch.tensor([[4]]), cache, torch.tensor([0]), torch.tensor([17]), mode=ForwardMode.DECODE)
        model(torch.tensor([[4], [5]]), cache, torch.tensor([0, 1]), torch.tensor([18, 0]), mode=ForwardMode.DECODE)
        assert several_row_route.calls == []
        model(torch.arange(5)[None], cache, torch.tensor([1]), torch.tensor([1]), mode=ForwardMode.PREFILL)
    assert len(several_row_route.calls) == model.config.num_hidden_layers


def test_one_row_decode_rounds_as_the_pair(monkeypatch) -> None:
    """The one-row decode's fused SwiGLU GEMVs take the pair's roundings (``scale_last``), so
    target-only decoding rounds its feed-forward norms as the verify does (the other fused products
    round as the carry: tests/models/test_norm_carry.py)."""
    fused = OpCalls("add_rmsnorm_gemv")
    monkeypatch.setattr(routing, "product_kernels", lambda x: x.numel() == x.shape[-1])
    monkeypatch.setattr(layers, "lfm", fused)
    model = random_tiny_target(seed=6)
    cache = TargetCache.allocate(model.config, 1, 32, 4, torch.float32, "cpu")
    with torch.no_grad():
        model(torch.tensor([[4]]), cache, torch.tensor([0]), torch.tensor([0]), mode=ForwardMode.DECODE)
    flags = [(args[5], args[6]) for args in fused.calls]    # (swiglu, scale_last)
    assert {swiglu for swiglu, _ in flags} == {True, False}
    assert sum(swiglu for swiglu, _ in flags) == model.config.num_hidden_layers
    assert all(scale_last for swiglu, scale_last in flags if swiglu)


def test_layer_compiles_with_the_pair(monkeypatch) -> None:
    """A verify decoder layer under torch.compile(fullgraph=True) holds the producer op (its fake
    registration traced) and matches the eager layer."""
    from torch._inductor.compile_fx import compile_fx

    from lfmspark.models.lfm2 import Rows

    monkeypatch.setattr(routing, "product_kernels", lambda x: 1 <= x.numel() // x.shape[-1] <= 16)
    model = random_tiny_target(seed=4)
    cfg = model.config
    cache = TargetCache.allocate(cfg, 1, 32, 8, torch.float32, "cpu")
    rows = Rows(torch.tensor([0]), torch.tensor([0]), torch.tensor([5]))
    g = torch.Generator().manual_seed(0)
    h, delta = torch.randn(1, 5, cfg.hidden_size, generator=g), torch.randn(1, 5, cfg.hidden_size, generator=g)
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes)
        return compile_fx(gm, example_inputs)

    layer = model.model.layers[1]
    with torch.no_grad():
        want = layer(h, delta, cache.layer_caches(cfg)[1], rows, ForwardMode.VERIFY, cache.rope)
        torch._dynamo.reset()
        got = torch.compile(layer, backend=backend, fullgraph=True)(
            h, delta, cache.layer_caches(cfg)[1], rows, ForwardMode.VERIFY, cache.rope)
    assert any(ADD_NORM in t for t in targets)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
