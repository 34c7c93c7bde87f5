"""Exact mode (``Engine(exact=True)``, ops/routing.py): in bf16, with the kernels running (Triton's
interpreter here, ``LFMSPARK_TRITON_ON_CPU=1``), greedy speculative output equals greedy target-only
output token for token with drafts that are accepted often and rarely, and a request's tokens and
log-probabilities do not depend on the batch it shares. The per-kernel guarantees behind it are
tested with each op (tests/ops/test_exact_linear.py, test_exact_swiglu.py, test_exact_norm.py, test_cache_attention.py,
test_moe.py); tests/e2e/test_exact_mode_gpu.py holds the GPU runs (bf16, CUDA graphs, the presets' shapes)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lfmspark.runtime import Engine, SamplingParams
from spec_fixtures import bigram_target, oracle_draft, permutation, random_tiny_draft, random_tiny_target
from env_vars import interpret_triton


class RecordedOps(TorchDispatchMode):
    """The names of the aten / lfmspark ops a region dispatches."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


PROMPTS = [[3, 9, 27], [5, 17, 2, 8]]
HD = 16   # the attention kernels' smallest head size


def bf16(model):
    return model.to(torch.bfloat16)


def models(kind: str, moe: bool):
    if kind == "often":      # a context-dependent bigram target and the draft that guesses its bigrams
        perm = permutation(4)
        return bf16(bigram_target(perm, leak=0.2, moe=moe, head_dim=HD)), bf16(oracle_draft(perm, head_dim=HD))
    return bf16(random_tiny_target(moe=moe, seed=2, head_dim=HD)), bf16(random_tiny_draft(seed=3, head_dim=HD))


def generate(target, draft, prompts, exact=True, **params):
    engine = Engine(target, draft, max_batch=4, max_seq_len=96, exact=exact)
    return engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True, **params))


@pytest.mark.parametrize("moe, kind", [(False, "often"), (True, "rarely")], ids=["dense-often", "moe-rarely"])
def test_exact_speculation_equals_target_only_in_bf16(monkeypatch, moe: bool, kind: str):
    """(Slow: every kernel runs under Triton's interpreter, so a few tokens of two prompts; the GPU
    test, tests/e2e/test_exact_mode_gpu.py, runs hundreds of prompts.)"""
    interpret_triton(monkeypatch)
    target, draft = models(kind, moe)
    spec = generate(target, draft, PROMPTS)
    plain = generate(target, None, PROMPTS)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    if kind == "often":                                  # the windows really held accepted drafts
        assert sum(o.stats.tau for o in spec) / len(spec) > 2


def test_exact_output_does_not_depend_on_the_batch(monkeypatch):
    interpret_triton(monkeypatch)
    target, draft = models("rarely", moe=False)
    alone = generate(target, draft, PROMPTS[:1], logprobs=0)[0]
    batched = generate(target, draft, PROMPTS, logprobs=0)[0]
    assert batched.token_ids == alone.token_ids
    assert [t.logprob for t in batched.logprobs] == [t.logprob for t in alone.logprobs]


def test_exact_must_be_a_bool():
    with pytest.raises(ValueError, match="exact must be True or False"):
        Engine(random_tiny_target(), None, max_batch=1, max_seq_len=64, exact="yes")


def test_exact_mode_compiles_and_matches_its_eager_run():
    """The compiled regions traced in exact mode (fp32 CPU: the ops' references) give the eager tokens."""
    target, draft = random_tiny_target(seed=2, head_dim=HD), random_tiny_draft(seed=3, head_dim=HD)
    outs = []
    for compile in (False, True):
        engine = Engine(target, draft, max_batch=2, max_seq_len=64, exact=True, compile=compile)
        outs.append([o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True))])
    assert outs[0] == outs[1]


def test_exact_mode_refuses_a_model_in_two_dtypes():
    from lfmspark.models.layers import RMSNorm
    from lfmspark.ops.routing import exact_scope

    norm = RMSNorm(16, 1e-6)                       # fp32 weight
    with exact_scope(True), pytest.raises(ValueError, match="exact mode needs one dtype"):
        norm(torch.ones(2, 16, dtype=torch.bfloat16))


def test_exact_seeded_sampling_does_not_depend_on_the_batch(monkeypatch):
    """Seeded sampling (temperature, top-k, top-p: the sampled round's transforms and draws) gives a
    request the same tokens and log-probabilities alone and beside another request."""
    interpret_triton(monkeypatch)
    target, draft = models("often", moe=False)
    params = dict(temperature=0.8, top_k=20, top_p=0.9, seed=11, logprobs=0)
    alone = generate(target, draft, PROMPTS[:1], **params)[0]
    batched = generate(target, draft, PROMPTS, **params)[0]
    assert batched.token_ids == alone.token_ids
    assert [t.logprob for t in batched.logprobs] == [t.logprob for t in alone.logprobs]


def test_exact_mode_adds_the_residual_in_the_norms_launch(monkeypatch):
    """models/layers.py ``add_norm`` in exact mode: one ``lfmspark::exact_add_rms_norm`` (no separate
    add), with the bits of the add followed by the exact norm (fp32: no rounding of the sum)."""
    from lfmspark.models.layers import RMSNorm, add_norm
    from lfmspark.ops.routing import exact_scope

    interpret_triton(monkeypatch)
    g = torch.Generator().manual_seed(0)
    h, delta = torch.randn(3, 5, 32, generator=g), torch.randn(3, 5, 32, generator=g)
    norm = RMSNorm(32, 1e-5)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(32, generator=g))
    with exact_scope(True), torch.no_grad():
        with RecordedOps() as ops:
            s, normed = add_norm(h, delta, norm)
        unfused = norm(h + delta)
    assert "lfmspark.exact_add_rms_norm.default" in ops.names
    assert not any(name.startswith("aten.add") for name in ops.names)
    assert torch.equal(s, h + delta) and torch.equal(normed, unfused)


def test_exact_mode_runs_the_swiglu_activation_in_the_products_launch(monkeypatch):
    """models/layers.py ``SwiGLU`` in exact mode: ``lfmspark::exact_swiglu`` (no separate silu or
    multiply) then the down product, within an fp32 unit of the unfused module's result (the
    activation's exp is Triton's, not torch's)."""
    from lfmspark.models.layers import SwiGLU
    from lfmspark.ops.routing import exact_scope

    interpret_triton(monkeypatch)
    torch.manual_seed(0)
    mlp = SwiGLU(32, 48)
    x = torch.randn(3, 5, 32)
    with exact_scope(True), torch.no_grad():
        with RecordedOps() as ops:
            out = mlp(x)
        gate, up = mlp.w13(x).chunk(2, dim=-1)
        unfused = mlp.w2(torch.nn.functional.silu(gate) * up)
    assert "lfmspark.exact_swiglu.default" in ops.names
    assert not any(name.startswith(("aten.silu", "aten.mul")) for name in ops.names)
    assert out.shape == (3, 5, 32)
    torch.testing.assert_close(out, unfused, rtol=1e-5, atol=1e-6)
    with exact_scope(True), torch.no_grad():
        assert mlp(torch.randn(2, 0, 32)).shape == (2, 0, 32)    # no rows: the output's width is named

