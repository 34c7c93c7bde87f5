"""The norms between layers in the products' epilogues (models/layers.py ``NormedCarry``), exercised
on CPU.

On CUDA, in a target VERIFY and the draft's block of 2-16 rows, a layer's down projection runs as
``lfmspark::skinny_linear_add_norm`` with the *next* norm's weight (the next layer's
``operator_norm`` / ``input_layernorm``, or the final norm; the callers pass it as ``next_norm``)
and hands on ``s * g`` and the row sums of ``s^2``; the next product (``skinny_linear`` /
``skinny_linear_pair`` with ``row_ssq``, the LM head included) applies the row scale. Here the
route is forced on CPU by patching the routing predicate (``routing.product_kernels``, as in
test_norm_epilogue.py), the ops run their PyTorch references (the kernels are checked against
those in tests/ops/test_skinny_add_norm.py), and the comparison is the same model on the plain
module path (``product_kernels`` false, as on an unpatched CPU). Each norm's input is rounded at
another point (``s * g`` instead of ``RMSNorm(s)``), so fp32 agrees to summation order and bf16
to rounding.
"""

from __future__ import annotations

import pytest
import torch

from lfmspark.ops import routing
import lfmspark.models.layers as layers
from lfmspark.models.cache import DraftCache, TargetCache
from lfmspark.models.lfm2 import ForwardMode, Rows
from op_calls import OpCalls
from spec_fixtures import random_tiny_draft_with_context, random_tiny_target
from verify_window import TOL, assert_verify_close, rel_err, verify_window


class RouteCalls:
    """``torch.ops.lfmspark`` for models/layers.py with the calls of the producer and of the
    row-scaled consumers recorded: their positional arguments (a consumer call passes ``row_ssq``:
    more than its two or three tensors); keywords (``side_stream``) pass through unrecorded."""

    RECORDED = ("skinny_linear_add_norm", "skinny_linear", "skinny_linear_pair")

    def __init__(self):
        self.calls: dict[str, list[tuple]] = {name: [] for name in self.RECORDED}

    def __getattr__(self, attr: str):
        op = getattr(torch.ops.lfmspark, attr)
        if attr not in self.RECORDED:
            return op

        def recorded(*args, **kwargs):
            self.calls[attr].append(args)
            return op(*args, **kwargs)
        return recorded

    @property
    def producer(self) -> list[tuple]:
        return self.calls["skinny_linear_add_norm"]

    def clear(self) -> None:
        for calls in self.calls.values():
            calls.clear()

    def row_scaled(self) -> tuple[int, int]:
        """(skinny_linear, skinny_linear_pair) calls that took ``row_ssq``."""
        return (sum(len(c) > 2 and c[2] is not None for c in self.calls["skinny_linear"]),
                sum(len(c) > 3 and c[3] is not None for c in self.calls["skinny_linear_pair"]))


@pytest.fixture
def route(monkeypatch) -> RouteCalls:
    monkeypatch.setattr(routing, "product_kernels", lambda x: 1 <= x.numel() // x.shape[-1] <= 16)
    calls = RouteCalls()
    monkeypatch.setattr(layers, "lfm", calls)
    return calls


def _modules_route(monkeypatch) -> None:
    """The plain module path: no product on lfmspark's kernels (an unpatched CPU's routing)."""
    monkeypatch.setattr(routing, "product_kernels", lambda x: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_verify_matches_the_modules(monkeypatch, route, moe: bool, dtype: torch.dtype) -> None:
    """Logits, aux taps and caches of a verify window agree with the modules'. On the carry's route
    each dense layer runs the producer twice (the feed-forward's norm and the next one) and every
    norm after a layer is finished by its consumer: the later layers' input products and the LM
    head (an MoE layer hands its output on through plain ops); on the modules', neither."""
    model = random_tiny_target(moe, seed=5).to(dtype)
    cfg = model.config
    on, cache_on = verify_window(model, dtype)
    dense = sum(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) if moe else cfg.num_hidden_layers
    assert len(route.producer) == 2 * dense
    assert route.row_scaled() == (cfg.num_hidden_layers, 0)   # layers 1.. and the LM head
    route.clear()
    _modules_route(monkeypatch)
    off, cache_off = verify_window(model, dtype)
    assert route.producer == [] and route.row_scaled() == (0, 0)
    assert_verify_close(on, cache_on, off, cache_off, dtype)


def test_verify_greedy_picks_are_the_argmax_of_the_carried_logits(route) -> None:
    """The verify's greedy picks (``compute_greedy``, what the round's acceptance reads) with a
    NormedCarry of the final norm: its logits are ``compute_logits``' bit for bit, from one LM head
    product that applies the carried row scale, and the picks are their argmax; they are also the
    picks of the final norm module over the layer output ``h`` (complete beside a carry)."""
    model = random_tiny_target(seed=5)
    cache = TargetCache.allocate(model.config, 2, 64, 8, torch.float32, "cpu")
    with torch.no_grad():
        model(torch.arange(3, 20)[None], cache, torch.tensor([1]), torch.tensor([0]), mode=ForwardMode.PREFILL)
        h, delta, _ = model.hidden_states(torch.tensor([[5, 35, 8, 9, 12, 40]]), cache, torch.tensor([1]),
                                          torch.tensor([17]), mode=ForwardMode.VERIFY)
        assert isinstance(delta, layers.NormedCarry)
        route.clear()
        logits, picks = model.compute_greedy(h, delta)
        assert route.row_scaled() == (1, 0) and len(route.calls["skinny_linear"]) == 1
        assert torch.equal(logits, model.compute_logits(h, delta))
        assert picks.shape == (1, 6) and torch.equal(picks, logits.argmax(-1))
        modules = model.lm_head(model.model.embedding_norm(h))
    assert rel_err(logits, modules) < TOL[torch.float32]
    assert torch.equal(picks, modules.argmax(-1))


def test_picked_logits_drop_the_carry(monkeypatch, route) -> None:
    """A VERIFY forward that projects one column per row (``logits_index``) runs the final norm on
    the completed output: the carry's statistics cover every column, so the LM head takes no row
    scale (the later layers' input products still do)."""
    model = random_tiny_target(seed=7)
    n_layers = model.config.num_hidden_layers
    index = torch.tensor([3])
    on, _ = verify_window(model, torch.float32, index)
    assert len(route.producer) == 2 * n_layers and route.row_scaled() == (n_layers - 1, 0)
    _modules_route(monkeypatch)
    off, _ = verify_window(model, torch.float32, index)
    assert on.logits.shape == off.logits.shape == (1, model.config.vocab_size)
    assert rel_err(on.logits, off.logits) < TOL[torch.float32]


def test_carry_only_in_verify_and_draft(route) -> None:
    """A 5-row prefill takes the feed-forward pair but no carry; decode steps take neither."""
    model = random_tiny_target(seed=3)
    cache = TargetCache.allocate(model.config, 2, 64, 4, torch.float32, "cpu")
    with torch.no_grad():
        model(torch.arange(5)[None], cache, torch.tensor([1]), torch.tensor([0]), mode=ForwardMode.PREFILL)
        model(torch.tensor([[4], [5]]), cache, torch.tensor([0, 1]), torch.tensor([0, 5]), mode=ForwardMode.DECODE)
    assert len(route.producer) == model.config.num_hidden_layers
    assert route.row_scaled() == (0, 0)


def test_draft_block_and_greedy_walk_match_the_modules(monkeypatch, route) -> None:
    """The draft's block (4 rows): hidden states, greedy proposal and the corrected logits a sampling
    round asks the walk for agree with the modules'. On the carry's route the block ends in a
    NormedCarry: two producer calls per layer, and the later layers' pair products and the LM head
    finish the carried norms; the walk's tokens are the same with and without its logits."""
    draft, cache, slot, start = random_tiny_draft_with_context()
    n_layers = draft.config.num_hidden_layers
    anchor = torch.tensor([7])

    runs = {}
    for on in (True, False):
        if not on:
            _modules_route(monkeypatch)
        route.clear()
        fresh = DraftCache(k=cache.k.clone(), v=cache.v.clone(), page_table=cache.page_table, rope=cache.rope)
        with torch.no_grad():
            x, pending = draft.block_hidden(anchor, fresh, slot, start)
            greedy = draft.head_and_walk(x, pending, anchor)
            general = draft.head_and_walk(x, pending, anchor, logits=True)
        assert isinstance(pending, layers.NormedCarry) == on
        runs[on] = (layers.completed(x, pending), greedy, general)
        assert len(route.producer) == (2 * n_layers if on else 0)
        assert route.row_scaled() == ((2, n_layers - 1) if on else (0, 0))   # the LM head once per walk
    (h_on, greedy_on, general_on), (h_off, greedy_off, general_off) = runs[True], runs[False]
    assert rel_err(h_on, h_off) < TOL[torch.float32]
    assert greedy_on.logits is None and general_on.logits is not None
    assert torch.equal(greedy_on.tokens, greedy_off.tokens)
    assert torch.equal(general_on.tokens, greedy_on.tokens)
    assert rel_err(general_on.logits, general_off.logits) < TOL[torch.float32]


def test_one_row_decode_rounds_as_the_carry(monkeypatch) -> None:
    """The one-row decode's fused GEMVs round as the verify's consumers: every plain product after
    a layer (operator norms of layers 1.., the LM head) takes ``scale_last``; the first layer's
    (after the embeddings) does not."""
    fused = OpCalls("add_rmsnorm_gemv")
    monkeypatch.setattr(routing, "product_kernels", lambda x: x.numel() == x.shape[-1])
    monkeypatch.setattr(layers, "lfm", fused)
    model = random_tiny_target(seed=6)
    cache = TargetCache.allocate(model.config, 1, 32, 4, torch.float32, "cpu")
    with torch.no_grad():
        model(torch.tensor([[4]]), cache, torch.tensor([0]), torch.tensor([0]), mode=ForwardMode.DECODE)
    plain = [(args[1] is not None, args[6]) for args in fused.calls if not args[5]]   # (has delta, scale_last)
    assert len(plain) == model.config.num_hidden_layers + 1
    assert plain[0] == (False, False)
    assert all(has_delta and scale_last for has_delta, scale_last in plain[1:])


def test_verify_layer_compiles_with_the_carry(monkeypatch) -> None:
    """A verify decoder layer taking and handing on a carry under torch.compile(fullgraph=True)
    matches the eager layer."""
    monkeypatch.setattr(routing, "product_kernels", lambda x: 1 <= x.numel() // x.shape[-1] <= 16)
    model = random_tiny_target(seed=4)
    cfg = model.config
    cache = TargetCache.allocate(cfg, 1, 32, 8, torch.float32, "cpu")
    rows = Rows(torch.tensor([0]), torch.tensor([0]), torch.tensor([5]))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 5, cfg.hidden_size, generator=g)
    carry = layers._carry_of(h, model.model.layers[1].operator_norm.weight)
    layer = model.model.layers[1]
    args = (h, carry, cache.layer_caches(cfg)[1], rows, ForwardMode.VERIFY, cache.rope, model.next_norm_weight(1))
    with torch.no_grad():
        want = layer(*args)
        torch._dynamo.reset()
        got = torch.compile(layer, backend="inductor", fullgraph=True)(*args)
    assert isinstance(want[2], layers.NormedCarry) and isinstance(got[2], layers.NormedCarry)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
