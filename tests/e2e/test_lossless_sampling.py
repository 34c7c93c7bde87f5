"""Sampled speculative decoding follows the target distribution.

With an 8-token vocabulary the exact distribution of the 2nd and 3rd generated tokens (the first
ones produced by speculative rounds; the 1st comes from prefill) is enumerated from the target's
logits with an independent temperature / top-k / top-p implementation, and a chi-square test
compares thousands of sampled requests against it. A wrong residual distribution (e.g. drawing
corrections from ``p`` instead of ``max(p - q, 0)``) fails it by a wide margin.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from lfmspark.models.lfm2_moe import quantize_target
from lfmspark.runtime import Engine, SamplingParams, distributions
from lfmspark.runtime.distributions import SamplingMode
from lfmspark.runtime.sampling import sampling_mode
from sampling_oracles import PROMPT, VOCAB, chi_square_pvalue, exact_joint
from spec_fixtures import random_tiny_draft, random_tiny_target

def sample_pairs(target, draft, params: SamplingParams, n: int) -> np.ndarray:
    engine = Engine(target, draft, max_batch=64, max_seq_len=32)
    reqs = [SamplingParams(**{**params.__dict__, "seed": 1000 + i}) for i in range(n)]
    outs = engine.generate([PROMPT] * n, reqs)
    counts = np.zeros((VOCAB, VOCAB))
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    return counts


PLAIN, FILTERED = dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)
TOP_3 = dict(temperature=0.8, top_k=3, top_p=0.8)
# (setting, MAX_THRESHOLD_TOP_K): the thresholds without a sort (runtime/distributions.py) for plain,
# top-k + top-p and top-3 sampling, and from the full sort where the limit is lowered to 4 below the
# setting's top_k (PLAIN's all-keeping top_k 8 is the plain distribution)
CASES = {"plain/threshold-mode": (PLAIN, 128), "filtered/threshold-mode": (FILTERED, 128),
         "top3/threshold-mode": (TOP_3, 128), "plain/full-mode": ({**PLAIN, "top_k": VOCAB}, 4),
         "filtered/full-mode": (FILTERED, 4)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
def test_sampled_tokens_follow_the_target_distribution(case, speculative, monkeypatch):
    setting, limit = CASES[case]
    monkeypatch.setattr(distributions, "MAX_THRESHOLD_TOP_K", limit)
    want = SamplingMode.THRESHOLD if case.endswith("threshold-mode") else SamplingMode.FULL
    assert sampling_mode([SamplingParams(**setting)], VOCAB) is want
    target = random_tiny_target(seed=3, vocab=VOCAB)
    draft = random_tiny_draft(block=3, seed=4, vocab=VOCAB) if speculative else None
    params = SamplingParams(max_new_tokens=3, stop_token_ids=[], **setting)
    probs = exact_joint(target, **setting).ravel()
    counts = sample_pairs(target, draft, params, 4000).ravel()
    assert counts.sum() == 4000
    assert chi_square_pvalue(counts, probs) > 1e-3


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_sampled_tokens_follow_the_fp8_targets_distribution(moe):
    """``quantization="fp8"``: speculative sampling follows the fp8 target's distribution (the oracle
    runs a copy of the target quantized on its own), which is not the model dtype's: the test can
    tell them apart."""
    target = random_tiny_target(moe=moe, seed=3, vocab=VOCAB)
    quantized = copy.deepcopy(target)
    assert quantize_target(quantized) > 0
    probs = exact_joint(quantized, **FILTERED).ravel()
    full_probs = exact_joint(target, **FILTERED).ravel()
    assert 0.5 * np.abs(probs - full_probs).sum() > 0.05            # fp8 moved the distribution (TV 0.12-0.14)
    engine = Engine(target, random_tiny_draft(block=3, seed=4, vocab=VOCAB), max_batch=64, max_seq_len=32,
                    quantization="fp8")
    n = 4000
    params = [SamplingParams(max_new_tokens=3, stop_token_ids=[], seed=1000 + i, **FILTERED) for i in range(n)]
    counts = np.zeros((VOCAB, VOCAB))
    for o in engine.generate([PROMPT] * n, params):
        counts[o.token_ids[1], o.token_ids[2]] += 1
    assert chi_square_pvalue(counts.ravel(), probs) > 1e-3
    assert chi_square_pvalue(counts.ravel(), full_probs) < 1e-6     # and not the model dtype's


def test_draft_is_far_from_target_so_the_test_has_power():
    """The drafts above disagree with the target: without a correct residual the samples would be
    drawn from a visibly different distribution (total variation well above sampling noise)."""
    target = random_tiny_target(seed=3, vocab=VOCAB)
    draft = random_tiny_draft(block=3, seed=4, vocab=VOCAB)
    params = SamplingParams(max_new_tokens=3, stop_token_ids=[], temperature=1.0, seed=0)
    engine = Engine(target, draft, max_batch=64, max_seq_len=32)
    outs = engine.generate([PROMPT] * 200, [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(200)])
    taus = [o.stats.tau for o in outs]
    assert 1.0 < np.mean(taus) < 3.0          # some drafts accepted, many rejected (residual draws happen)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    target = random_tiny_target(seed=3, vocab=VOCAB)
    draft = random_tiny_draft(block=3, seed=4, vocab=VOCAB)
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=77, stop_token_ids=[])
    alone = Engine(target, draft, max_batch=4, max_seq_len=64).generate([PROMPT], p)[0].token_ids
    others = [SamplingParams(max_new_tokens=12, temperature=0.9, seed=s, stop_token_ids=[]) for s in (1, 2)]
    batched = Engine(target, draft, max_batch=4, max_seq_len=64).generate([[3, 3], PROMPT, [4]],
                                                                            [others[0], p, others[1]])
    assert batched[1].token_ids == alone
