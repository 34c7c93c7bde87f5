"""The fused add + RMSNorm + product path for several rows (models/layers.py ``norm_linear`` /
``norm_linears`` / ``norm_feed_forward`` on ``lfmspark::add_rmsnorm_skinny``, ``LFMSPARK_FUSED_NORM``):
the target's VERIFY forward, the draft's block and the round's commit, exercised on CPU.

On CUDA, 2-16 rows of a fusing caller (verify, draft block, the commit's final norm) run each
residual add, RMSNorm and the product after it as one kernel. Here the route is forced on CPU by
patching the routing predicate (``_routed_to_skinny``: up to 16 rows go to the skinny kernels, as
on CUDA by default) and the fused op runs its Triton kernel under the interpreter; the reference is
the same model with ``LFMSPARK_FUSED_NORM=0``. Checked: outputs and caches against the unfused path,
how many fused calls each forward makes, that prefill and more than 16 rows stay unfused, and a
speculative engine run emitting the same tokens fused and unfused.
"""

from __future__ import annotations

import os

import pytest
import torch

import lfmspark.models.layers as layers
import lfmspark.ops.add_rmsnorm_skinny as fused_op_module
from lfmspark.models.cache import DraftCache, TargetCache
from lfmspark.models.dspark import greedy_pick
from lfmspark.models.lfm2 import ForwardMode
from spec_fixtures import random_tiny_draft, random_tiny_target


class _CountingOps:
    """Stands in for ``torch.ops.lfmspark`` in models/layers.py, counting fused-op calls."""

    def __init__(self):
        self.calls: list[bool] = []          # the swiglu flag of each add_rmsnorm_skinny call

    def __getattr__(self, name):
        op = getattr(torch.ops.lfmspark, name)
        if name != "add_rmsnorm_skinny":
            return op

        def counted(*args):
            self.calls.append(args[5])   # (h, delta, norm_weight, eps, weight, swiglu, prefetch)
            return op(*args)
        return counted


@pytest.fixture
def rows_route(monkeypatch) -> _CountingOps:
    """The CUDA routing on CPU: 1-16 rows go to the skinny kernels (their CPU implementations; the
    fused op's Triton kernel in the interpreter where it is on, its reference otherwise)."""
    monkeypatch.setattr(layers, "_routed_to_skinny", lambda x: 1 <= x.numel() // x.shape[-1] <= 16)
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    monkeypatch.setattr(fused_op_module, "use_triton", lambda t: interpreter)
    counting = _CountingOps()
    monkeypatch.setattr(layers, "lfm", counting)
    return counting


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _clone(c: TargetCache) -> TargetCache:
    return TargetCache(k=c.k.clone(), v=c.v.clone(), conv_state=c.conv_state.clone(), conv_tape=c.conv_tape.clone(),
                       rope=c.rope)


# bounds on the relative error of the fused path against the unfused one: fp32 differs only in
# summation orders; in bf16 the interpreter truncates the kernel's roundings (to nearest on the GPU)
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("moe, dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)],
                         ids=["dense-fp32", "moe-fp32", "dense-bf16"])
def test_fused_verify_matches_unfused(monkeypatch, rows_route, moe, dtype):
    model = random_tiny_target(moe, seed=11).to(dtype)
    cfg = model.config
    cache = TargetCache.allocate(cfg, 2, 32, 10, dtype, "cpu")
    prompt, slot = [3, 14, 15, 9, 26], 1
    monkeypatch.setenv("LFMSPARK_FUSED_NORM", "1")
    with torch.no_grad():                  # prefill (five routed rows) stays unfused
        model(torch.tensor([prompt]), cache, torch.tensor([slot]), torch.tensor([0]), mode=ForwardMode.PREFILL)
    assert rows_route.calls == []
    ref_cache = _clone(cache)
    window = torch.tensor([[5, 35, 8, 9, 7, 9, 3, 2, 3, 8]])          # the batch-1 verify: ten rows
    out = {}
    for fused, c in ((True, cache), (False, ref_cache)):
        monkeypatch.setenv("LFMSPARK_FUSED_NORM", "1" if fused else "0")
        with torch.no_grad():
            out[fused] = model(window, c, torch.tensor([slot]), torch.tensor([len(prompt)]), mode=ForwardMode.VERIFY,
                               aux_layer_ids=(0, 2)).__dict__
    # operator_norm (every layer) + ffn_norm (dense SwiGLU layers) + the final norm, once each
    n_dense = sum(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) if moe else cfg.num_hidden_layers
    assert sorted(rows_route.calls) == sorted([False] * cfg.num_hidden_layers + [True] * n_dense + [False])
    for name in ("logits", "aux"):
        assert out[True][name].dtype == dtype and _rel_err(out[True][name], out[False][name]) < TOL[dtype]
    for x, y in ((cache.k, ref_cache.k), (cache.v, ref_cache.v), (cache.conv_tape, ref_cache.conv_tape)):
        assert _rel_err(x, y) < TOL[dtype]


def test_more_than_16_rows_stay_unfused(monkeypatch, rows_route):
    """A verify of two rows x 9 columns (18 product rows) takes the modules."""
    monkeypatch.setenv("LFMSPARK_FUSED_NORM", "1")
    model = random_tiny_target(seed=11)
    cache = TargetCache.allocate(model.config, 2, 32, 9, torch.float32, "cpu")
    with torch.no_grad():
        model(torch.arange(18).view(2, 9), cache, torch.tensor([0, 1]), torch.tensor([0, 0]), mode=ForwardMode.VERIFY)
    assert rows_route.calls == []


def _draft_pair(dtype: torch.dtype = torch.float32):
    target = random_tiny_target(seed=3).to(dtype)
    draft = random_tiny_draft(block=9, seed=5).to(dtype)         # the served block: nine rows
    draft.attach_target(target.model.embed_tokens, target.lm_head)
    return target, draft


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampling_pick"])
def test_fused_draft_matches_unfused(monkeypatch, rows_route, greedy):
    """The draft block: input_layernorm fused into q_proj and K/V (two calls), post_attention_layernorm
    into the gate/up product, per layer; the final norm into the LM head only where the walk reads
    just the logits (the fused greedy walk), not for a general picker (which needs the normed h)."""
    target, draft = _draft_pair()
    cfg = draft.config
    cache = DraftCache.allocate(cfg, 2, 32, torch.float32, "cpu")
    slots, aux = torch.tensor([1]), torch.randn(1, 3, cfg.n_taps * target.config.hidden_size)
    with torch.no_grad():
        draft.inject_context(aux, cache, slots, torch.tensor([0]), torch.tensor([3]))
    ref_cache = DraftCache(k=cache.k.clone(), v=cache.v.clone(), rope=cache.rope)
    pick = greedy_pick if greedy else (lambda k, logits: logits.argmax(-1))
    out = {}
    for fused, c in ((True, cache), (False, ref_cache)):
        monkeypatch.setenv("LFMSPARK_FUSED_NORM", "1" if fused else "0")
        with torch.no_grad():
            x, delta = draft.block_hidden(torch.tensor([7]), c, slots, torch.tensor([3]))
            out[fused] = (x, delta, draft.head_and_walk(x, delta, torch.tensor([7]), pick))
        if fused:
            assert rows_route.calls.count(False) == 2 * cfg.num_hidden_layers + greedy
            assert rows_route.calls.count(True) == cfg.num_hidden_layers
    assert rows_route.calls.count(False) == 2 * cfg.num_hidden_layers + greedy   # none unfused
    (x, delta, prop), (rx, rdelta, rprop) = out[True], out[False]
    assert _rel_err(x + delta, rx + rdelta) < TOL[torch.float32]
    assert _rel_err(cache.k, ref_cache.k) < TOL[torch.float32]
    assert torch.equal(prop.tokens, rprop.tokens)
    if not greedy:
        assert _rel_err(prop.logits, rprop.logits) < TOL[torch.float32]


def test_engine_speculative_rounds_take_the_fused_path(monkeypatch, rows_route):
    """Batch-1 greedy speculative decoding (draft block, verify and the commit's LM head on the
    fused op) emits the same tokens fused and unfused."""
    from lfmspark.runtime import Engine, SamplingParams

    target, draft = _draft_pair()
    params = SamplingParams(max_new_tokens=12)
    tokens = {}
    for fused in (True, False):
        monkeypatch.setenv("LFMSPARK_FUSED_NORM", "1" if fused else "0")
        rows_route.calls.clear()
        engine = Engine(target, draft, max_batch=1, max_seq_len=96)
        tokens[fused] = engine.generate([[3, 1, 4, 1, 5]], params)[0].token_ids
        assert bool(rows_route.calls) == fused
    assert tokens[True] == tokens[False]
