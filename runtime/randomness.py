"""Graph-safe, device-side random draws for sampling.

Randomness is counter-based: a uniform is a hash of ``(request seed, sequence position, stream,
vocabulary index)`` computed with integer tensor ops (no generator state, no ``multinomial``, no
host sync), so a sampling round can live inside a CUDA graph and a seeded request draws the same
numbers whatever batch it shares. Each draw has its own stream so the draft proposal, the
acceptance test and the correction/bonus draw at one position are independent. Reusing a
position's numbers in a later round is harmless: draws that did not decide a committed token are
never looked at again (rejection sampling stays exact).

Sampling picks ``argmax(p / E)`` with ``E = -log(u)`` exponential noise, which draws from ``p``
(the exponential-race form of the Gumbel-max trick, as in gpt-fast); the argmax over the
vocabulary runs in ``lfmspark::argmax_rows``, split over many programs per row.
"""

from __future__ import annotations

import torch

from ..ops.argmax_rows import argmax_last

_MASK32 = 0xFFFFFFFF

# random streams: one per kind of draw at a position
STREAM_DRAFT = 1      # the draft's Markov walk samples x_k
STREAM_ACCEPT = 2     # acceptance test of x_k
STREAM_TOKEN = 3      # the token the target commits itself (correction, bonus, plain decode, first token)
STREAM_IMPOSED = 4    # benchmark mode: imposed acceptance draws


def _mulmod32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for ``0 <= x < 2^32`` without int64 overflow (two 16-bit halves of c)."""
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (hi + x * (c & 0xFFFF)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Chris Wellons' integer hash search): a well-mixed bijection on 32-bit values."""
    x = x ^ (x >> 16)
    x = _mulmod32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mulmod32(x, 0x846CA68B)
    return x ^ (x >> 16)


def draw_key(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """A 32-bit key per draw (int64 tensor) from the request seed, the sequence position and the stream."""
    k = _hash32(seed & _MASK32)
    k = _hash32((k + (position & _MASK32)) & _MASK32)
    return _hash32((k + stream * 0x3C6EF372) & _MASK32)


def uniforms(key: torch.Tensor, n: int) -> torch.Tensor:
    """``[*key.shape, n]`` fp32 uniforms in (0, 1), element ``i`` hashed from ``(key, i)``."""
    idx = torch.arange(n, device=key.device, dtype=torch.int64)
    x = _hash32((key[..., None] + _mulmod32(idx, 0x9E3779B9)) & _MASK32)
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def uniform(key: torch.Tensor) -> torch.Tensor:
    """One uniform per key."""
    return uniforms(key, 1)[..., 0]


def gumbel(key: torch.Tensor, n: int) -> torch.Tensor:
    """``[*key.shape, n]`` fp32 Gumbel draws ``-log(-log(u))`` from :func:`uniforms` (finite: ``u``
    stays 2^-25 from 0 and 1). ``argmax(x / T + g)`` draws from ``softmax(x / T)``, and it is the
    token :func:`sample` draws from those probabilities with the same key: the log of its
    exponential race, ``log p - log E``."""
    return -torch.log(-torch.log(uniforms(key, n)))


def sample(probs: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Draw an index from each row of ``probs [..., V]`` (unnormalised is fine) with its key."""
    noise = -torch.log(uniforms(key, probs.shape[-1]))
    return argmax_last(probs / noise)
