"""The distribution a row draws from, in threshold form, and how it draws from it.

A row's sampling distribution is its transformed logits (runtime/sampling.py
``RowSampling.transform``) at its temperature, ``x``, filtered by top-k, top-p and min-p in HF's
order. Every filter keeps the tokens whose ``x`` is at least some value, so the filtered
distribution is one threshold per row: ``p_i = exp(x_i - top) / z`` where ``x_i >= threshold``,
else 0 (:class:`Filtered`; ``top`` the row's largest ``x``, ``z`` the kept mass). Ties at a
threshold are kept whole, as transformers and vLLM keep them. A greedy row is the one-hot of its
argmax (the first index among equal maxima).

Two ways to the same threshold (:class:`SamplingMode`, chosen per batch on the host):

- ``THRESHOLD``: ``lfmspark::threshold_filter`` (no sort): counts and masses at pivots bracket each
  cut, which is then resolved among at most 256 gathered values (or by refining the bracket), in a
  fixed number of launches. It takes any parameters exactly, ties kept whole; it is chosen when
  every sampled row has top-k off or ``top_k <= MAX_THRESHOLD_TOP_K`` (128: the LFM2.5 cards' 50
  and 80), or the vocabulary is no larger: the model cards, top-p alone, min-p alone and plain
  temperature sampling. Beyond that top-k's cut sits among more values than one gather holds, and
  the op would refine it over extra passes.
- ``FULL``: sort each row (cub's radix sort of the whole vocabulary), for the rest. The kept mass
  ``z`` is summed in ``lfmspark::row_mass``, not in Inductor: fused with the draft walk's other
  work, Inductor (torch 2.11) fails to generate it. Its top-p walk is one fp32 cumulative sum over
  the row: on a dense tail (``top_p = 0.999`` over 65536 tokens) its cut lands tens of tokens from
  the float64 one, ``THRESHOLD``'s (shorter fp32 sums) a few tokens; elsewhere the two modes agree
  wherever a cut is not within fp32 rounding of ``top_p``.

Drawing: the exponential race ``argmax_i p_i / E_i`` over the whole vocabulary
(runtime/randomness.py), with ``p`` written pointwise from ``x`` and the row's three numbers: the
same uniforms at the same token ids in both modes, so both draw the same tokens (up to fp32
rounding of the kept mass).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..ops.argmax_rows import argmax_last
from ..ops.row_mass import row_mass
from ..ops.threshold_filter import threshold_filter
from .randomness import sample

# the largest top_k the THRESHOLD mode takes: its top-k bracket is gathered in one pass (at most 256 values)
MAX_THRESHOLD_TOP_K = 128


class SamplingMode(enum.Enum):
    """How a step picks its tokens; one compiled and captured variant of each step per mode."""

    GREEDY = "greedy"           # the argmax of the raw logits (no request transforms them)
    THRESHOLD = "threshold"     # transformed, filtered distributions, thresholds without a sort (top_k <= 128)
    FULL = "full"               # the same distributions, thresholds from a full sort (any top_k)

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
    def tempered(logits: torch.Tensor, temperature: torch.Tensor, drawn: torch.Tensor) -> "Filtered":
        """A draft's distributions: ``softmax(logits / T)`` of fp32 ``logits [N, V]`` at per-row
        ``temperature [N]``, nothing filtered, what the draft's walk draws its tokens ``drawn [N]``
        from (models/dspark.py ``DSparkDraft.walk``); greedy rows (``T = 0``) are the one-hot of
        their drawn token, the argmax of their logits."""
        greedy = temperature <= 0
        x = logits / torch.where(greedy, 1.0, temperature)[:, None]
        top = x.amax(dim=-1)
        z = torch.exp(x - top[:, None]).sum(dim=-1)
        return Filtered(x, torch.full_like(top, float("-inf")), top, z, drawn, greedy)


def filter_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, mode: SamplingMode) -> Filtered:
    """The distributions of fp32 transformed ``logits [N, V]`` at per-row ``temperature`` (0: greedy)
    with ``top_k`` (0: off), ``top_p`` (1: off) and ``min_p`` (0: off), their thresholds found as
    ``mode`` says (both modes take any parameters; the module doc says which is faster when)."""
    greedy = temperature <= 0
    x = logits / torch.where(greedy, 1.0, temperature)[:, None]
    if mode is SamplingMode.THRESHOLD:
        threshold, top, z = threshold_filter(x, top_k, top_p, min_p)
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
