"""Device-side sampling pieces: counter-based uniforms, the exponential-race sampler, filtering."""

from __future__ import annotations

import numpy as np
import torch

from lfmspark.runtime.sampling import draw_key, filtered_probs, row_prefix_sums, sample, uniforms
from test_lossless_sampling import filtered as reference_filtered


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
