"""A round of width ``W`` verifies ``g = W - 1`` drafts, and its draft runs its head, walk and
confidences over those slots only (runtime/steps.py ``finish_draft``, models/dspark.py
``block_prefix``): its proposals must be the whole block's first ``g``, greedy and sampled.

The reference is the draft's whole-block proposal computed on its own over the same draft
context, slot by slot (a sampled slot drawn from the draft's tempered distribution with its
position's key). Rows on permuted slots at different lengths.
"""

from __future__ import annotations

import pytest
import torch

import lfmspark.models.layers as layers
from lfmspark.models.dspark import DraftProposal
from lfmspark.ops import routing
from lfmspark.runtime import Engine, SamplingParams
from lfmspark.runtime.distributions import SamplingMode
from lfmspark.runtime.randomness import STREAM_DRAFT, draw_key, sample
from engine_fixtures import map_slots
from spec_fixtures import random_tiny_draft, random_tiny_target

GAMMA = 4
PROMPTS = [[5, 6, 7], [9], [40, 41, 42, 43, 44, 45]]
SLOTS = [2, 0, 3]
SAMPLED = dict(temperature=0.9, top_k=20, top_p=0.95)


def prefilled(mode: SamplingMode) -> tuple[Engine, torch.Tensor]:
    """An engine over the tiny pair (confidences computed) with :data:`PROMPTS` prefilled into
    :data:`SLOTS`, sampled with fixed seeds in a sampling ``mode``."""
    engine = Engine(random_tiny_target(seed=3), random_tiny_draft(block=GAMMA, seed=4), max_batch=4, max_seq_len=64,
                    verify_widths=list(range(1, GAMMA + 2)))
    runner = engine.model_runner
    params = SamplingParams(**SAMPLED) if mode.sampling else SamplingParams()
    for i, (slot, prompt) in enumerate(zip(SLOTS, PROMPTS)):
        runner.state.sampling.set(slot, params, 1000 + i, prompt, frozenset())
    map_slots(engine, SLOTS)
    slots = torch.tensor(SLOTS)
    lens = torch.tensor([len(p) for p in PROMPTS])
    ids = torch.zeros(len(PROMPTS), int(lens.max()), dtype=torch.int64)
    for i, p in enumerate(PROMPTS):
        ids[i, :len(p)] = torch.tensor(p)
    with torch.no_grad():
        runner.steps.prefill(ids, slots, torch.zeros_like(lens), lens, mode)
    return engine, slots


@torch.no_grad()
def whole_block(engine: Engine, slots: torch.Tensor, mode: SamplingMode) -> DraftProposal:
    """The draft's proposal of its whole block for the rows in ``slots``, computed apart from the
    round, slot by slot: the draft's layers, final norm and LM head over the block, then each slot's
    Markov-corrected logits from the token before it, its token their argmax (greedy) or drawn by
    the exponential race from ``softmax(logits / T)`` with its position's key (sampled), then the
    confidence head over the block."""
    runner = engine.model_runner
    draft, state = runner.draft, runner.state
    head = draft.markov_head
    assert head.kind == "vanilla"
    index = state.gather_index(slots)
    s, x0 = state.seq_len[index], state.anchor[index]
    x, delta = draft.block_hidden(x0, runner.dcache, slots, s)
    h = draft.norm(layers.completed(x, delta))
    base = draft.lm_head(h).float()
    rows = state.sampling.rows(index, grammar=False)
    prev, tokens, logits = x0, [], []
    for k in range(base.shape[1]):
        logits_k = base[:, k] + head.markov_w2(head.markov_w1(prev)).float()
        logits.append(logits_k)
        if mode.sampling:
            probs = torch.softmax(logits_k / rows.temperature[:, None], dim=-1)
            prev = sample(probs, draw_key(rows.seed, s + k + 1, STREAM_DRAFT))
        else:
            prev = logits_k.argmax(dim=-1)
        tokens.append(prev)
    tokens = torch.stack(tokens, dim=1)
    return DraftProposal(tokens, torch.stack(logits, dim=1), draft.confidences(h, x0, tokens))


@pytest.mark.parametrize("carry", [False, True], ids=["modules", "carry"])
@pytest.mark.parametrize("mode", [SamplingMode.GREEDY, SamplingMode.FULL], ids=["greedy", "sampled"])
def test_a_narrow_round_drafts_the_whole_blocks_first_slots(mode, carry, monkeypatch):
    """At every width 2..gamma+1 the round's drafts and confidences are the whole block's first
    ``g``, its sampled q has ``B * g`` rows, and the confidences past slot ``g`` are NaN. ``carry``:
    the few-row product route forced on CPU (as tests/models/test_norm_carry.py), where the draft's
    last layer hands on a ``NormedCarry`` of 3 rows x 4 slots that the narrow round slices."""
    if carry:
        monkeypatch.setattr(routing, "product_kernels", lambda x: 1 <= routing.rows_of(x) <= 16)
    engine, slots = prefilled(mode)
    steps = engine.model_runner.steps
    assert steps.want_confidence
    reference = whole_block(engine, slots, mode)
    if carry:
        with torch.no_grad():
            _, pending = engine.model_runner.draft.block_hidden(
                engine.model_runner.state.anchor[slots], engine.model_runner.dcache, slots,
                engine.model_runner.state.seq_len[slots])
        assert isinstance(pending, layers.NormedCarry)
    B = len(SLOTS)
    for width in range(2, GAMMA + 2):
        g = width - 1
        with torch.no_grad():
            drafted = steps.round_draft(steps.round_inputs(slots, mode, width))
        assert drafted.tokens.shape == (B, g)
        assert torch.equal(drafted.tokens, reference.tokens[:, :g]), width
        assert drafted.confidence.shape == (B, GAMMA)
        torch.testing.assert_close(drafted.confidence[:, :g], reference.confidence[:, :g], rtol=1e-5, atol=1e-6)
        assert drafted.confidence[:, g:].isnan().all()
        if mode.sampling:
            assert drafted.q.x.shape[0] == B * g
            # row b * g + k is slot k of row b: q is the distribution its token was drawn from
            want = torch.softmax(reference.logits[:, :g] / SAMPLED["temperature"], dim=-1)
            torch.testing.assert_close(drafted.q.probs().view(B, g, -1), want, rtol=1e-5, atol=1e-7)
    if mode.sampling:        # the sampled walk drew other tokens than the argmax somewhere: the draws are tested
        assert not torch.equal(reference.tokens, whole_block(engine, slots, SamplingMode.GREEDY).tokens)


def test_narrow_rounds_compute_no_confidence_for_slots_they_do_not_verify():
    """The round's StepOutput keeps ``[B, gamma]`` confidences, NaN past the verified drafts; a round
    of width 1 computes none."""
    engine, slots = prefilled(SamplingMode.GREEDY)
    steps = engine.model_runner.steps
    with torch.no_grad():
        out = steps.spec_round(slots, SamplingMode.GREEDY, 3)
        assert out.confidence.shape == (len(SLOTS), GAMMA)
        assert not out.confidence[:, :2].isnan().any() and out.confidence[:, 2:].isnan().all()
        out = steps.spec_round(slots, SamplingMode.GREEDY, 1)
        assert out.confidence.shape == (len(SLOTS), GAMMA) and out.confidence.isnan().all()
