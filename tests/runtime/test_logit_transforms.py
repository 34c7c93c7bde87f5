"""Bias, penalties, min_p and min_tokens follow the exactly enumerated target distribution, with and
without speculation. As test_lossless_sampling.py: an 8-token vocabulary, the joint of
the 2nd and 3rd tokens (the first round's) enumerated from full-sequence target forwards with an
independent NumPy implementation of every transform, and a chi-square test over thousands of
sampled requests. The 3rd token's history holds the 2nd, often an accepted draft: a round that
leaves the block's own drafts out of the history fails the test (checked)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lfmspark.models.cache import TargetCache
from lfmspark.models.lfm2 import ForwardMode
from lfmspark.runtime import Engine, SamplingParams
from lfmspark.runtime import steps as steps_module
from spec_fixtures import random_tiny_draft, random_tiny_target
from sampling_oracles import PROMPT, VOCAB, chi_square_pvalue, filtered


def reference(logits: np.ndarray, output: list[int], p: SamplingParams, stops: list[int]) -> np.ndarray:
    """The next-token distribution after ``PROMPT + output`` (transforms in vLLM / HF order)."""
    x = logits.astype(np.float64).copy()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=VOCAB).astype(np.float64)
    seen = (counts > 0) | np.isin(np.arange(VOCAB), PROMPT)
    x = np.where(seen, np.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    x = x - p.presence_penalty * (counts > 0) - p.frequency_penalty * counts
    if len(output) < p.min_tokens:
        x[stops] = -np.inf
    if p.temperature == 0:
        out = np.zeros(VOCAB)
        out[int(np.argmax(x))] = 1.0
        return out
    probs = filtered(x, p.temperature, p.top_k, p.top_p)
    if p.min_p > 0:
        probs = probs * (probs >= p.min_p * probs.max())
        probs = probs / probs.sum()
    return probs


@torch.no_grad()
def exact_joint(target, p: SamplingParams, stops: list[int]) -> np.ndarray:
    def next_dist(output):
        tokens = PROMPT + output
        cache = TargetCache.allocate(target.config, 1, 32, 2, torch.float32, "cpu")
        z = torch.zeros(1, dtype=torch.int64)
        out = target(torch.tensor([tokens]), cache, z, z, torch.tensor([len(tokens)]), ForwardMode.PREFILL)
        return reference(out.logits[0, -1].numpy(), output, p, stops)

    joint = np.zeros((VOCAB, VOCAB))
    p1 = next_dist([])
    for t1 in np.flatnonzero(p1):
        p2 = next_dist([int(t1)])
        for t2 in np.flatnonzero(p2):
            joint[t2] += p1[t1] * p2[t2] * next_dist([int(t1), int(t2)])
    return joint


def sample_pairs(target, draft, p: SamplingParams, n: int) -> np.ndarray:
    engine = Engine(target, draft, max_batch=64, max_seq_len=32)
    reqs = [SamplingParams(**{**p.__dict__, "seed": 1000 + i}) for i in range(n)]
    counts = np.zeros((VOCAB, VOCAB))
    for o in engine.generate([PROMPT] * n, reqs):
        counts[o.token_ids[1], o.token_ids[2]] += 1
    return counts


STOPS = [3, 4]
SETTINGS = {
    "repetition": dict(temperature=1.0, repetition_penalty=2.5),
    "presence+frequency": dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=1.0),
    "all penalties+bias+min_p": dict(temperature=0.9, repetition_penalty=1.5, presence_penalty=0.5,
                                     frequency_penalty=0.5, min_p=0.1, logit_bias={2: 2.0, 5: -3.0}),
    "top_k+top_p+min_p": dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.2),
    "min_tokens": dict(temperature=1.0, min_tokens=2),
}


def params(setting: dict) -> SamplingParams:
    """Stop tokens only with min_tokens (which keeps them out of the first two tokens; a stop as the
    third ends the request there, after the pair the test reads)."""
    stops = STOPS if setting.get("min_tokens") else []
    return SamplingParams(max_new_tokens=3, stop_token_ids=stops, ignore_eos=True, **setting)


@pytest.fixture(scope="module")
def models():
    return random_tiny_target(seed=3, vocab=VOCAB), random_tiny_draft(block=3, seed=4, vocab=VOCAB)


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
def test_transformed_sampling_follows_the_target_distribution(models, name, speculative):
    target, draft = models
    p = params(SETTINGS[name])
    probs = exact_joint(target, p, list(p.stop_token_ids))
    counts = sample_pairs(target, draft if speculative else None, p, 4000)
    assert counts.sum() == 4000
    if name == "min_tokens":          # the 2nd token (output index 1 < 2) is never a stop token
        assert probs[STOPS].sum() == 0 and counts[STOPS].sum() == 0
    assert chi_square_pvalue(counts.ravel(), probs.ravel()) > 1e-3


def test_leaving_the_blocks_own_drafts_out_of_the_history_is_caught(models, monkeypatch):
    """The deliberately wrong round: penalties at block position i computed without d_1..d_(i-1)."""
    target, draft = models
    p = params(dict(temperature=1.0, repetition_penalty=3.0, frequency_penalty=2.0, presence_penalty=2.0))
    probs = exact_joint(target, p, [])
    real = steps_module.block_history
    monkeypatch.setattr(steps_module, "block_history", lambda tokens, vocab: torch.zeros_like(real(tokens, vocab)))
    counts = sample_pairs(target, draft, p, 4000)
    assert chi_square_pvalue(counts.ravel(), probs.ravel()) < 1e-6


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
def test_greedy_takes_the_argmax_of_the_transformed_logits(models, speculative):
    target, draft = models
    p = SamplingParams(max_new_tokens=8, stop_token_ids=[], frequency_penalty=2.0, repetition_penalty=1.3,
                       logit_bias={6: 1.0})
    out = Engine(target, draft if speculative else None, max_batch=2, max_seq_len=32).generate([PROMPT], p)[0]
    expected: list[int] = []
    for _ in range(8):
        tokens = PROMPT + expected
        cache = TargetCache.allocate(target.config, 1, 32, 2, torch.float32, "cpu")
        z = torch.zeros(1, dtype=torch.int64)
        with torch.no_grad():
            logits = target(torch.tensor([tokens]), cache, z, z, torch.tensor([len(tokens)]),
                            ForwardMode.PREFILL).logits[0, -1].numpy()
        expected.append(int(np.argmax(reference(logits, expected, p, []))))
    assert out.token_ids == expected
    plain = Engine(target, None, max_batch=2, max_seq_len=32).generate([PROMPT], SamplingParams(
        max_new_tokens=8, stop_token_ids=[]))[0].token_ids
    assert plain != expected                  # the transforms moved the argmax: the test has power


@pytest.mark.parametrize("field, value, message", [
    ("min_p", 1.5, "min_p must be"), ("repetition_penalty", 0.0, "repetition_penalty must be"),
    ("presence_penalty", 2.5, "presence_penalty must be"), ("frequency_penalty", True, "frequency_penalty"),
    ("min_tokens", 200, "min_tokens must be"), ("logit_bias", {99: 1.0}, "logit_bias entries"),
    ("logit_bias", {1: 500.0}, "logit_bias entries"), ("logit_bias", [1, 2], "logit_bias must be a dict"),
])
def test_bad_transform_values_are_refused(models, field, value, message):
    from lfmspark.runtime import RequestError

    with pytest.raises(RequestError, match=message):
        Engine(models[0], None, max_batch=1, max_seq_len=32).generate([PROMPT], SamplingParams(
            max_new_tokens=4, **{field: value}))
