"""Greedy speculative decoding is lossless: the output equals target-only decoding token for token
(fp32 on CPU), whatever the draft proposes, and the state after every round equals the state of
target-only decoding of the same committed tokens."""

from __future__ import annotations

import pytest
import torch

from lfmspark.models.cache import DraftCache, TargetCache
from lfmspark.models.lfm2 import ForwardMode
from lfmspark.runtime import Engine, SamplingParams
from lfmspark.runtime.distributions import SamplingMode
from engine_fixtures import map_slots
from spec_fixtures import (bigram_target, derangement_of, mix_permutations, oracle_draft, permutation,
                           random_tiny_draft, random_tiny_target)

PROMPTS = [[3, 9, 27], [5], [11, 12], list(range(1, 40)), [60, 2, 2, 2, 7, 8, 1], [33] * 5, [4, 40], [21]]


def run(target, draft, prompts, max_new=24, max_batch=8, **params):
    engine = Engine(target, draft, max_batch=max_batch, max_seq_len=128)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, **params))
    assert engine.scheduler.pool.in_use == 0 and engine.idle
    return outs


def draft_for(kind: str, perm: torch.Tensor, seed: int):
    if kind == "random":
        return random_tiny_draft(seed=seed)
    if kind == "oracle":
        return oracle_draft(perm)
    if kind == "partial":
        return oracle_draft(mix_permutations(perm, derangement_of(perm), 0.6, seed))
    return oracle_draft(derangement_of(perm))                    # "never"


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("draft_kind", ["oracle", "partial", "never", "random"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_speculation_equals_target_only(moe, draft_kind, batch):
    seed = batch * 10 + len(draft_kind)
    perm = permutation(seed)
    # a leaky bigram target: mostly perm, sometimes the context wins (so the oracle is not perfect)
    target = bigram_target(perm, leak=0.05, moe=moe, seed=seed)
    draft = draft_for(draft_kind, perm, seed)
    prompts = PROMPTS[:batch]
    reference = run(target, None, prompts)
    spec = run(target, draft, prompts)
    for ref, out in zip(reference, spec):
        assert out.token_ids == ref.token_ids
        assert out.finish_reason == ref.finish_reason == "length"
    taus = [o.stats.tau for o in spec]
    gamma = draft.config.block_size
    if draft_kind == "oracle":
        assert min(taus) > 0.8 * (gamma + 1)          # nearly every draft accepted
    if draft_kind == "never":
        assert max(taus) == 1.0                       # nothing accepted, the bonus token only
    if draft_kind == "partial":
        assert 1.0 < sum(taus) / len(taus) < gamma + 1


@pytest.mark.parametrize("width", [2, 3, 4])
def test_greedy_speculation_at_every_narrow_width_equals_target_only(width):
    """Every round at one narrow width (its draft walks and scores the first ``width - 1`` slots only:
    runtime/steps.py ``finish_draft``) gives target-only decoding's output, with drafts accepted."""
    perm = permutation(7)
    target = bigram_target(perm, leak=0.05, seed=7)
    draft = oracle_draft(mix_permutations(perm, derangement_of(perm), 0.8, 7))
    prompts = PROMPTS[:4]
    reference = run(target, None, prompts)
    engine = Engine(target, draft, max_batch=4, max_seq_len=128, verify_widths=[width])
    spec = engine.generate(prompts, SamplingParams(max_new_tokens=24))
    assert [o.token_ids for o in spec] == [r.token_ids for r in reference]
    assert set(engine.speculation_stats["rounds_by_width"]) == {width}
    assert 0 < sum(o.stats.draft_tokens_accepted for o in spec)
    assert max(max(o.stats.drafts_verified) for o in spec) == width - 1


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_lossless_on_random_models(moe):
    target = random_tiny_target(moe=moe, seed=5)
    draft = random_tiny_draft(seed=6)
    prompts = PROMPTS[:5]
    for ref, out in zip(run(target, None, prompts, max_new=20), run(target, draft, prompts, max_new=20)):
        assert out.token_ids == ref.token_ids


def test_exact_bigram_oracle_accepts_every_draft():
    perm = permutation(3)
    target, draft = bigram_target(perm, leak=0.0), oracle_draft(perm, block=5)
    outs = run(target, draft, PROMPTS[:4], max_new=31)
    for o, prompt in zip(outs, PROMPTS):
        assert o.stats.accept_lengths[:-1] == [6] * (len(o.stats.accept_lengths) - 1)
        expected, tok = [], prompt[-1]
        for _ in range(31):
            tok = int(perm[tok])
            expected.append(tok)
        assert o.token_ids == expected


def test_stop_token_inside_an_accepted_block_ends_the_sequence_there():
    perm = permutation(4)
    target, draft = bigram_target(perm, leak=0.0), oracle_draft(perm, block=6)
    def chain_from(tok: int) -> list[int]:
        out = []
        for _ in range(10):
            tok = int(perm[tok])
            out.append(tok)
        return out

    start = next(t for t in range(64) if len(set(chain_from(t)[:4])) == 4)   # a long enough cycle
    prompt, chain = [start], chain_from(start)
    stop = chain[3]                               # the 4th generated token: inside the first round's block
    ref = run(target, None, [prompt], max_new=20, stop_token_ids=[stop])[0]
    out = run(target, draft, [prompt], max_new=20, stop_token_ids=[stop])[0]
    assert out.token_ids == ref.token_ids == chain[:4]
    assert out.finish_reason == ref.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 5, 6, 7, 13])
def test_max_new_tokens_is_never_exceeded(max_new):
    perm = permutation(8)
    target, draft = bigram_target(perm, leak=0.0), oracle_draft(perm, block=5)
    outs = run(target, draft, PROMPTS[:3], max_new=max_new)
    ref = run(target, None, PROMPTS[:3], max_new=max_new)
    for o, r in zip(outs, ref):
        assert len(o.token_ids) == max_new and o.token_ids == r.token_ids and o.finish_reason == "length"


# -- state after every round ---------------------------------------------------------------------

@torch.no_grad()
def reference_state(target, tokens: list[int], max_seq_len: int, width: int):
    """Conv state and K/V after target-only decoding of ``tokens`` (prompt prefill of the first
    token, then one DECODE step per token), in a fresh cache, slot 0."""
    cache = TargetCache.allocate(target.config, 1, max_seq_len, width, torch.float32, "cpu")
    zero, one = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    target(torch.tensor([tokens[:1]]), cache, zero, zero, one, ForwardMode.PREFILL)
    for t in range(1, len(tokens)):
        target(torch.tensor([[tokens[t]]]), cache, zero, zero + t, one, ForwardMode.DECODE)
    return cache


@torch.no_grad()
def reference_draft_context(target, draft, tokens: list[int], max_seq_len: int, width: int):
    """Draft context K/V from one target prefill over ``tokens``."""
    tcache = TargetCache.allocate(target.config, 1, max_seq_len, width, torch.float32, "cpu")
    dcache = DraftCache.allocate(draft.config, 1, max_seq_len, torch.float32, "cpu")
    zero, n = torch.zeros(1, dtype=torch.int64), torch.tensor([len(tokens)])
    out = target(torch.tensor([tokens]), tcache, zero, zero, n, ForwardMode.PREFILL,
                 aux_layer_ids=draft.config.target_layer_ids)
    draft.inject_context(out.aux, dcache, zero, zero, n)
    return dcache


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_state_after_every_round_equals_target_only_decoding(moe):
    perm = permutation(11)
    target = bigram_target(perm, leak=0.05, moe=moe, seed=2)
    draft = oracle_draft(mix_permutations(perm, derangement_of(perm), 0.6, 1))
    S = 96
    engine = Engine(target, draft, max_batch=4, max_seq_len=S)
    steps, st, W = engine.model_runner.steps, engine.model_runner.state, engine.verify_width
    prompts = [[5, 6, 7], [9], [40, 41, 42, 43, 44, 45]]
    slots = torch.tensor([2, 0, 3, -1])               # permuted slots and a padding row
    lens = torch.tensor([len(p) for p in prompts] + [1])
    ids = torch.zeros(4, max(lens), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    untouched = engine.model_runner.tcache.conv_state[:, 1].clone()
    map_slots(engine, [2, 0, 3])
    first = steps.prefill(ids, slots, torch.zeros(4, dtype=torch.int64), lens, SamplingMode.GREEDY)
    seqs = [p + [int(first[i])] for i, p in enumerate(prompts)]     # committed tokens + the anchor
    for _ in range(5):
        out = steps.spec_round(slots, SamplingMode.GREEDY)
        for i in range(3):
            n = int(out.n_new[i])
            seqs[i] += out.tokens[i, :n].tolist()
            slot = int(slots[i])
            s = int(st.seq_len[slot])
            committed = seqs[i][:-1]                  # the anchor is not in any cache yet
            assert s == len(committed) and int(st.anchor[slot]) == seqs[i][-1]
            ref = reference_state(target, committed, S, W)
            torch.testing.assert_close(engine.model_runner.tcache.conv_state[:, slot], ref.conv_state[:, 0], rtol=1e-5, atol=1e-5)
            for got, want in zip(engine.model_runner.tcache.gather(slot, s), ref.gather(0, s)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            dref = reference_draft_context(target, draft, committed, S, W)
            for got, want in zip(engine.model_runner.dcache.gather(slot, s), dref.gather(0, s)):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(engine.model_runner.tcache.conv_state[:, 1], untouched)    # the padding row wrote nothing
