"""Device-side sampling pieces: counter-based uniforms, the exponential-race sampler, filtering in
both threshold modes (the THRESHOLD mode's op on its reference and on its Triton kernels), and
which mode a batch runs in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lfmspark.runtime import SamplingParams
from lfmspark.runtime import distributions
from lfmspark.runtime.distributions import SamplingMode, filter_rows, filtered_probs, row_prefix_sums
from lfmspark.runtime.sampling import sampling_mode
from lfmspark.runtime.randomness import draw_key, sample, uniforms
from env_vars import interpret_triton
from sampling_oracles import filtered as reference_filtered


def test_uniforms_are_uniform_and_keyed():
    key = draw_key(torch.tensor([7, 8]), torch.tensor([3, 3]), stream=1)
    u = uniforms(key, 200_000)
    assert u.min() > 0 and u.max() < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    hist = torch.histc(u[0], bins=20, min=0, max=1)
    assert (hist - 10_000).abs().max() < 500                    # ~5 sigma for 10k expected per bin
    assert not torch.equal(u[0], u[1])                          # different seeds differ
    again = uniforms(draw_key(torch.tensor([7]), torch.tensor([3]), stream=1), 200_000)
    assert torch.equal(again[0], u[0])                          # same key, same numbers
    other = uniforms(draw_key(torch.tensor([7]), torch.tensor([3]), stream=2), 1000)
    assert not torch.equal(other[0], u[0, :1000])               # streams are independent draws


def test_sampler_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 40_000
    keys = draw_key(torch.arange(n), torch.zeros(n, dtype=torch.int64), stream=3)
    draws = sample(probs.expand(n, -1), keys)
    freq = torch.bincount(draws, minlength=4).double() / n
    assert torch.allclose(freq, probs.double(), atol=0.01)


def test_row_prefix_sums_match_a_float64_cumsum():
    g = torch.Generator().manual_seed(1)
    for rows, cols in ((1, 1), (2, 255), (3, 256), (2, 257), (4, 1000), (2, 65536)):
        x = torch.rand(rows, cols, generator=g)
        got = row_prefix_sums(x)
        assert got.shape == x.shape and got.dtype == x.dtype
        want = x.double().cumsum(dim=-1)
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6), (rows, cols)


def test_filters_match_an_independent_implementation():
    g = torch.Generator().manual_seed(0)
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.6), (1.0, 1, 1.0)):
        logits = torch.randn(6, 50, generator=g) * 3
        got = filtered_probs(logits, torch.full((6,), temperature), torch.full((6,), top_k, dtype=torch.int64),
                             torch.full((6,), top_p))
        for row in range(6):
            want = reference_filtered(logits[row].numpy(), temperature, top_k, top_p)
            np.testing.assert_allclose(got[row].numpy(), want, atol=1e-6)


def test_greedy_rows_are_one_hot():
    logits = torch.randn(3, 20)
    got = filtered_probs(logits, torch.tensor([0.0, 1.0, 0.0]), torch.zeros(3, dtype=torch.int64), torch.ones(3))
    assert torch.equal(got[0], torch.nn.functional.one_hot(logits[0].argmax(), 20).float())
    assert torch.equal(got[2], torch.nn.functional.one_hot(logits[2].argmax(), 20).float())
    assert (got[1] > 0).all()


def test_top_p_one_keeps_the_whole_large_vocabulary():
    """With 65536 tokens the fp32 cumulative mass reaches 1.0 early; top_p = 1 must still keep all."""
    logits = torch.randn(2, 65536, generator=torch.Generator().manual_seed(1)) * 3
    got = filtered_probs(logits, torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2))
    assert (got > 0).all()
    torch.testing.assert_close(got, torch.softmax(logits, dim=-1))


def reference_kept(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The kept tokens of scaled logits ``x`` (float64), ties kept whole at every threshold: top-k
    keeps what is at least the k-th largest value; top-p walks the kept values largest first and
    keeps each value (with all its ties) while the mass before it is below top_p; min-p keeps
    ``p >= min_p * p_max``."""
    kept = x >= np.sort(x)[::-1][(top_k or len(x)) - 1]
    if top_p < 1:
        p = np.exp(x - x.max()) * kept
        p /= p.sum()
        before, walk = 0.0, np.zeros_like(kept)
        for value in np.unique(x[kept])[::-1]:
            if before >= top_p:
                break
            for i in np.flatnonzero(x == value):      # the sorted order walks a tie's tokens one by one
                if before < top_p:
                    walk |= x == value
                before += p[i]
        kept &= walk
    return kept & (np.exp(x - x.max()) >= min_p)


def _rows(n: int, v: int, seed: int, grid: float | None) -> torch.Tensor:
    """Random logits; on a coarse ``grid`` many of them tie (as bf16 logits do)."""
    x = torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3
    return x if grid is None else (x / grid).round() * grid


CASES = [(1, 1.0, 0.0), (5, 1.0, 0.0), (20, 0.8, 0.0), (50, 0.1, 0.0), (64, 0.95, 0.05), (7, 1.0, 0.3),
         (3, 0.5, 0.2), (64, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.15), (0, 1.0, 0.0), (128, 0.999, 0.0),
         (80, 1.0, 0.0)]


@pytest.mark.parametrize("mode", [SamplingMode.THRESHOLD, SamplingMode.FULL], ids=lambda m: m.value)
@pytest.mark.parametrize("grid", [None, 0.5], ids=["continuous", "ties"])
def test_both_threshold_modes_keep_what_the_reference_keeps(mode, grid):
    """Every row of a 300-token vocabulary: the kept set and the normalised probabilities equal the
    float64 reference, ties included."""
    n = len(CASES)
    logits = _rows(n, 300, seed=2, grid=grid)
    temperature = torch.linspace(0.6, 1.4, n)
    top_k = torch.tensor([c[0] for c in CASES])
    top_p = torch.tensor([c[1] for c in CASES])
    min_p = torch.tensor([c[2] for c in CASES])
    f = filter_rows(logits, temperature, top_k, top_p, min_p, mode)
    probs = f.probs()
    for r, (k, p, m) in enumerate(CASES):
        x = logits[r].double().numpy() / float(temperature[r])
        kept = reference_kept(x, k, float(top_p[r]), float(min_p[r]))
        assert np.array_equal(probs[r].numpy() > 0, kept), (r, mode)
        want = np.exp(x - x.max()) * kept
        np.testing.assert_allclose(probs[r].numpy(), want / want.sum(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("grid", [None, 0.5, 2.0], ids=["continuous", "ties", "many-ties"])
def test_threshold_mode_on_its_kernels_equals_the_sort(monkeypatch, grid):
    """The THRESHOLD mode on the op's Triton kernels (interpreted) against FULL on a 40-token vocabulary
    (coarse grids put ties at every cut; top_k 60 is beyond it): the same thresholds, masses and draws."""
    interpret_triton(monkeypatch)
    n = 24
    logits = _rows(n, 40, seed=5, grid=grid)
    temperature = torch.full((n,), 0.9)
    top_k = torch.tensor([1, 2, 3, 7, 0, 60] * 4)
    top_p = torch.tensor([1.0, 0.3, 0.6, 0.9, 0.99, 0.05] * 4)
    min_p = torch.tensor([0.0] * 12 + [0.1, 0.5] * 6)
    a = filter_rows(logits, temperature, top_k, top_p, min_p, SamplingMode.THRESHOLD)
    b = filter_rows(logits, temperature, top_k, top_p, min_p, SamplingMode.FULL)
    assert torch.equal(a.threshold, b.threshold) and torch.equal(a.top, b.top)
    torch.testing.assert_close(a.z, b.z, rtol=1e-6, atol=0)
    keys = draw_key(torch.arange(n), torch.full((n,), 9), stream=3)
    assert torch.equal(a.sample(keys), b.sample(keys))


def test_filtered_rows_agree_in_every_form():
    """prob(ids) reads probs(); scores() is log-space of the same set; greedy rows are their argmax."""
    logits = _rows(4, 100, seed=7, grid=None)
    f = filter_rows(logits, torch.tensor([0.8, 0.0, 1.2, 0.5]), torch.tensor([10, 0, 0, 3]),
                    torch.tensor([0.9, 1.0, 0.7, 1.0]), torch.tensor([0.0, 0.0, 0.1, 0.0]), SamplingMode.FULL)
    probs = f.probs()
    ids = torch.randint(0, 100, (4, 6), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(f.prob(ids), probs.gather(1, ids))
    scores = f.scores()
    sampled = [0, 2, 3]
    torch.testing.assert_close(torch.softmax(scores[sampled], dim=-1), probs[sampled])
    assert torch.equal(probs[1], torch.nn.functional.one_hot(logits[1].argmax(), 100).float())
    assert f.sample(draw_key(torch.arange(4), torch.zeros(4, dtype=torch.int64), 1))[1] == logits[1].argmax()


def test_a_drafts_tempered_distribution_is_its_plain_softmax():
    """``Filtered.tempered`` (a draft's q): softmax(logits / T), nothing filtered; a greedy row is the
    one-hot of its drawn token."""
    logits = _rows(3, 100, seed=8, grid=None)
    temperature = torch.tensor([0.7, 0.0, 1.5])
    drawn = torch.tensor([5, int(logits[1].argmax()), 9])
    q = distributions.Filtered.tempered(logits, temperature, drawn)
    probs = q.probs()
    torch.testing.assert_close(probs[0], torch.softmax(logits[0].double() / 0.7, -1).float())
    torch.testing.assert_close(probs[2], torch.softmax(logits[2].double() / 1.5, -1).float())
    assert torch.equal(probs[1], torch.nn.functional.one_hot(drawn[1], 100).float())
    ids = torch.tensor([[5, 0], [drawn[1], 3], [9, 99]])
    torch.testing.assert_close(q.prob(ids), probs.gather(1, ids))


def test_the_model_cards_and_plain_sampling_run_without_a_sort():
    """THRESHOLD for every sampled row with top-k off or at most 128: the LFM2.5 card (temperature 0.1,
    top_k 50, top_p 0.1), the LFM2.5-8B-A1B card (temperature 0.2, top_k 80), min_p alone, top_p alone
    and plain temperature sampling; FULL once a sampled row's top_k exceeds 128."""
    greedy = SamplingParams()
    card = SamplingParams(temperature=0.1, top_k=50, top_p=0.1, repetition_penalty=1.05)
    card_8b = SamplingParams(temperature=0.2, top_k=80, repetition_penalty=1.05)
    min_p_only = SamplingParams(temperature=0.2, min_p=0.15)
    top_p_only = SamplingParams(temperature=0.7, top_p=0.9)
    plain = SamplingParams(temperature=1.0)
    penalised_greedy = SamplingParams(repetition_penalty=1.2, top_k=1000)     # greedy: top_k is not read
    wide = SamplingParams(temperature=1.0, top_k=129)
    assert sampling_mode([greedy, greedy], 65536) is SamplingMode.GREEDY
    for p in (card, card_8b, min_p_only, top_p_only, plain, SamplingParams(temperature=0.5, top_k=128)):
        assert sampling_mode([greedy, p, penalised_greedy], 65536) is SamplingMode.THRESHOLD, p
    assert sampling_mode([card, card_8b, min_p_only, top_p_only, plain], 65536) is SamplingMode.THRESHOLD
    assert sampling_mode([card, wide], 65536) is SamplingMode.FULL
    assert sampling_mode([wide], 128) is SamplingMode.THRESHOLD            # top_k covers the whole vocabulary
