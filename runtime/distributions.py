"""The distribution a row draws from, in threshold form, and how it draws from it.

A row's sampling distribution is its transformed logits (runtime/sampling.py
``RowSampling.transform``) at its temperature, ``x``, filtered by top-k, top-p and min-p in HF's
order. Every filter keeps the tokens whose ``x`` is at least some value, so the filtered
distribution is one threshold per row: ``p_i = exp(x_i - top) / z`` where ``x_i >= threshold``,
else 0 (:class:`Filtered`; ``top`` the row's largest ``x``, ``z`` the kept mass). Ties at a
threshold are kept whole, as transformers and vLLM keep them. A greedy row is the one-hot of its
argmax (the first index among equal maxima).

Two ways to the same threshold (:class:`SamplingMode`, chosen per batch on the host):

- ``FULL``: sort each row (any parameters; cub's radix sort of the whole vocabulary).
- ``TOP_K``: from each row's :data:`CANDIDATES` largest values (``lfmspark::top_values``, no sort),
  when every sampled row of the batch has ``1 <= top_k <= CANDIDATES`` (the LFM2.5 model card's
  50) or the vocabulary is no larger. Why it is the same threshold: the k-th largest value is a
  candidate; top-p's kept prefix, in sorted order, ends either inside the candidates (whose
  cumulative mass, over the exact top-k mass ``z_k`` summed across the whole row, decides where)
  or at the k-th value, tied tokens beyond the candidates included; min-p compares with ``top``.
  Every token above the k-th value is a candidate, so a kept set strictly above it has its mass
  from the candidates alone.

The whole-row sums (``z``, and ``z_k`` of the top-k path) run in ``lfmspark::row_mass``, not in
Inductor: fused with the draft walk's other work, Inductor (torch 2.11) fails to generate them.

Drawing: the exponential race ``argmax_i p_i / E_i`` over the whole vocabulary
(runtime/randomness.py), with ``p`` written pointwise from ``x`` and the row's three numbers. The same uniforms at the same token ids as
the sorted path, so both modes draw the same tokens (up to fp32 rounding of the kept mass).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..ops.argmax_rows import argmax_last
from ..ops.row_mass import row_mass
from ..ops.top_values import top_values
from .randomness import sample

# the top-k path's candidates per row: top_k up to this many filters without a sort
CANDIDATES = 64


class SamplingMode(enum.Enum):
    """How a step picks its tokens; one compiled and captured variant of each step per mode."""

    GREEDY = "greedy"     # the argmax of the raw logits (no request transforms them)
    TOP_K = "top-k"       # transformed, filtered distributions, thresholds from the top CANDIDATES values
    FULL = "full"         # the same distributions, thresholds from a full sort (any top_k)

    @property
    def sampling(self) -> bool:
        """Whether the step computes distributions (rather than the plain argmax)."""
        return self is not SamplingMode.GREEDY


@dataclass
class Filtered:
    """``N`` rows' sampling distributions in threshold form (see the module doc)."""

    x: torch.Tensor               # [N, V] fp32: transformed logits at the row's temperature (greedy rows: unscaled)
    threshold: torch.Tensor       # [N] fp32: the kept tokens are x >= threshold (greedy rows: -inf)
    top: torch.Tensor             # [N] fp32: the row's largest x
    z: torch.Tensor               # [N] fp32: the kept mass, sum of exp(x - top) over the kept tokens
    argmax: torch.Tensor          # [N] int64: the first index of the largest x (a greedy row's token)
    greedy: torch.Tensor          # [N] bool

    def probs(self) -> torch.Tensor:
        """``[N, V]``: the distributions (greedy rows: one-hot)."""
        p = torch.exp(self.x - self.top[:, None]) / self.z[:, None] * (self.x >= self.threshold[:, None])
        one_hot = torch.nn.functional.one_hot(self.argmax, self.x.shape[-1]).to(torch.float32)
        return torch.where(self.greedy[:, None], one_hot, p)

    def prob(self, ids: torch.Tensor) -> torch.Tensor:
        """``[N, J]``: the probabilities of token ids ``ids [N, J]``."""
        xs = self.x.gather(1, ids)
        p = torch.exp(xs - self.top[:, None]) / self.z[:, None] * (xs >= self.threshold[:, None])
        return torch.where(self.greedy[:, None], (ids == self.argmax[:, None]).to(torch.float32), p)

    def scores(self) -> torch.Tensor:
        """``[N, V]``: the log-space form, ``x`` with the filtered tokens at ``-inf`` (the "processed"
        logprobs; greedy rows' logits unscaled and unfiltered)."""
        return self.x.masked_fill(self.x < self.threshold[:, None], float("-inf"))

    def sample(self, key: torch.Tensor) -> torch.Tensor:
        """One token per row, drawn with its key ``[N]`` (greedy rows: the argmax)."""
        return torch.where(self.greedy, self.argmax, sample(self.probs(), key))

    def rows(self, index: torch.Tensor) -> "Filtered":
        """The rows ``index [M]``, in that order."""
        return Filtered(self.x[index], self.threshold[index], self.top[index], self.z[index], self.argmax[index],
                        self.greedy[index])

    @staticmethod
    def interleave(parts: list["Filtered"]) -> "Filtered":
        """``G`` batches of ``B`` rows as one of ``B * G`` rows, row ``b * G + g`` from ``parts[g]``."""
        def cat(name: str) -> torch.Tensor:
            t = torch.stack([getattr(f, name) for f in parts], dim=1)
            return t.reshape(-1, *t.shape[2:])
        return Filtered(cat("x"), cat("threshold"), cat("top"), cat("z"), cat("argmax"), cat("greedy"))


def filter_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, mode: SamplingMode) -> Filtered:
    """The distributions of fp32 transformed ``logits [N, V]`` at per-row ``temperature`` (0: greedy)
    with ``top_k`` (0: off), ``top_p`` (1: off) and ``min_p`` (0: off), their thresholds found as
    ``mode`` says (``TOP_K``: every sampled row has ``1 <= top_k <= CANDIDATES``, or ``V <= CANDIDATES``)."""
    greedy = temperature <= 0
    x = logits / torch.where(greedy, 1.0, temperature)[:, None]
    if mode is SamplingMode.TOP_K:
        threshold, top, z = _threshold_from_candidates(x, top_k, top_p, min_p)
    else:
        threshold, top = _threshold_from_sort(x, top_k, top_p, min_p)
        z = None
    threshold = torch.where(greedy, float("-inf"), threshold)
    if z is None:
        z = row_mass(x, top, threshold)
    return Filtered(x, threshold, top, z, argmax_last(x), greedy)


def _threshold_from_sort(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(threshold, top)`` of scaled ``x [N, V]`` from its sorted rows (any parameters)."""
    V = x.shape[-1]
    sorted_x = torch.sort(x, dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    kth = sorted_x.gather(1, (k - 1)[:, None])
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    sorted_p = torch.softmax(sorted_x, dim=-1)
    mass_before = row_prefix_sums(sorted_p) - sorted_p
    keep = (mass_before < top_p[:, None]).sum(dim=-1).clamp(min=1)        # the first token is always kept
    # top_p == 1 keeps everything: the fp32 cumsum reaches 1.0 before the end of a large vocabulary
    keep = torch.where(top_p >= 1.0, V, keep)
    threshold = torch.maximum(sorted_x.gather(1, (keep - 1)[:, None]), kth)[:, 0]
    top = sorted_x[:, 0]
    # min-p: p_i >= min_p * p_max, i.e. x_i >= top + log(min_p) (min_p 0: -inf)
    return torch.maximum(threshold, top + torch.log(min_p)), top


def _threshold_from_candidates(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(threshold, top, z)`` of scaled ``x [N, V]`` from its ``min(CANDIDATES, V)`` largest values
    (see the module doc); ``top_k`` is read as ``min(top_k or V, CANDIDATES)``."""
    V = x.shape[-1]
    m = min(CANDIDATES, V)
    vals = top_values(x, m)                                                  # [N, m], largest first
    top = vals[:, 0]
    k = torch.where(top_k > 0, top_k, V).clamp(min=1, max=m)
    kth = vals.gather(1, (k - 1)[:, None])[:, 0]
    # the exact top-k mass: over the whole row, so tokens tied with the k-th value beyond the candidates count
    z_k = row_mass(x, top, kth)
    e = torch.exp(vals - top[:, None]) * (vals >= kth[:, None])
    # the mass before each candidate as a masked sum over the candidates before it (64 x 64 products per
    # row): it keeps every reduction Inductor generates here a plain sum; a scan fused into the sampling
    # tail can fail its Triton codegen (see row_prefix_sums)
    idx = torch.arange(m, device=x.device)
    mass_before = (e[:, :, None] * (idx[:, None] < idx[None, :])).sum(dim=1) / z_k[:, None]
    # the kept prefix's length; when all m candidates are kept the prefix ends at the k-th value (ties beyond
    # the candidates) or below it, and vals[m - 1] <= kth makes the threshold kth either way
    keep = (mass_before < top_p[:, None]).sum(dim=-1).clamp(min=1)
    threshold = torch.maximum(vals.gather(1, (keep - 1)[:, None])[:, 0], kth)
    threshold = torch.where(top_p >= 1.0, kth, threshold)
    threshold = torch.maximum(threshold, top + torch.log(min_p))
    # above the k-th value every token is a candidate
    z = torch.where(threshold > kth, (e * (vals >= threshold[:, None])).sum(dim=-1), z_k)
    return threshold, top, z


def filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [N, V]`` (fp32) at per-row temperature with what top-k, top-p and min-p filter out
    (HF order) at ``-inf``: the log-space form of the distribution a sampled row draws from. Rows
    with temperature 0 (greedy) come back unscaled and unfiltered (their argmax is what counts)."""
    min_p = torch.zeros_like(top_p) if min_p is None else min_p
    return filter_rows(logits, temperature, top_k, top_p, min_p, SamplingMode.FULL).scores()


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The distributions of :func:`filtered_logits`; rows with temperature 0 get the one-hot of their
    argmax, so greedy and sampled rows share one acceptance rule."""
    min_p = torch.zeros_like(top_p) if min_p is None else min_p
    return filter_rows(logits, temperature, top_k, top_p, min_p, SamplingMode.FULL).probs()


_SCAN_BLOCK = 256


def row_prefix_sums(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums along the last dim of ``x [N, V]``, as ``x.cumsum(-1)``, computed in two
    levels: within blocks of 256 columns, then over the block totals.

    Why not ``cumsum``: over a whole 65536-entry vocabulary with few rows, Inductor (torch 2.11) emits
    a split scan (one scan spread over several programs) and fails to generate it once the sampling
    tail's pointwise ops are fused in (``TypeError`` in ``TritonSymbols.get_block_shape``: the split
    scan's row range has no tensor dimension); every scan here is 256 long, which Inductor keeps in
    one program. The two-level sum also rounds less than one sequential fp32 sum."""
    n, v = x.shape
    pad = -v % _SCAN_BLOCK
    blocks = torch.nn.functional.pad(x, (0, pad)).view(n, -1, _SCAN_BLOCK).cumsum(dim=-1)
    totals = blocks[..., -1]
    before_block = totals.cumsum(dim=-1) - totals
    return (blocks + before_block[..., None]).view(n, -1)[:, :v]
