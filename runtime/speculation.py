"""Adaptive speculation: how many columns each round verifies (DSpark's confidence-scheduled
verification, reference/dspark.md §6, in a form CUDA graphs can replay).

A round verifies a window of ``width`` columns for every row of the batch: the anchor and the
first ``width - 1`` drafts of the block. Width 1 drafts nothing: the round is a target decode step
that still writes the draft's context, so speculation can resume at any round. The engine captures
a round at each width of a small set (``Engine(verify_widths=...)``; by default 1, 3, 5 and the
whole block: :func:`default_verify_widths`) and picks one per round here. A narrower round costs
less than the whole block: its verify runs ``width`` columns, and the draft's layers run the whole
block (its attention is bidirectional) but its final norm, LM head, Markov walk and confidence
head only the ``width - 1`` slots verified (runtime/steps.py ``finish_draft``).

**The choice** maximises expected committed tokens per second, ``Θ(W) = τ(W) / cost(B, W)``:
``τ(W) = Σ_r (1 + Σ_{j < min(W, 1 + limit_r)} a_{r,j})`` with ``a_{r,j}`` request ``r``'s estimated
chance that drafts ``1..j`` all survive (``limit_r``: its ``max_speculative_tokens``), and
``cost(B, W)`` the replay time of the captured round at the padded batch size, measured at warm-up
(graphs/capture.py ``profile_rounds``). Without measurements (eager or CPU engines) every width
costs the same and the whole block wins, as in an engine with one verify width. Width 1
wins where drafting and verifying cost more than they return (large batches, poor drafts), and the
engine then runs at target-only speed.

**Why it stays lossless.** The width of round ``r + 1`` is chosen on the host from what rounds up
to ``r - 1`` returned (the loop is pipelined: runtime/engine.py), so it cannot depend on any token
round ``r + 1`` drafts. That is DeepSeek's production form of Algorithm 1 (§6.4: a capacity from
confidences two steps old). The peeking alternative, a width chosen from the current block's own
confidences, changes the output distribution (the paper's Appendix A; tests/runtime/test_speculation.py).

**The survival estimates** ``a_{r,j}``: the cumulative product of the conditional confidences
``c_k`` the draft's confidence head gave request ``r`` (``c_k`` reads ``x_{k-1}``, never ``x_k``;
with STS temperatures from the checkpoint, reference/dspark.md §4.4), or, for a draft without a
confidence head, the engine's observed per-position acceptance. Imposed acceptance (benchmarks on
random weights) imposes the matching confidences, ``c_k`` = the imposed rate. A round of width
``W`` computes the confidences of the ``W - 1`` slots it verifies only (runtime/steps.py
``finish_draft``): each position keeps the request's latest computed ``c_k``, so a narrow round
renews the first positions and the later ones stay those of its last wider round. Positions a
request never had computed take the engine-wide rates: by position, a decayed average of the
conditional confidences every round computed there, optimistic at first (every draft survives), so
new traffic starts speculating and the first rounds correct it.

**Probing.** While width 1 wins, no draft runs and the estimates stop changing. Every so many
rounds at width 1 one round runs at the best wider width, so that a draft that became useful is
noticed; the interval keeps the probes' extra cost near 1% of the time at width 1.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from .distributions import SamplingMode

# the probes' share of the time spent at width 1 (see the module doc)
PROBE_OVERHEAD = 0.01
# how fast the engine-wide estimates forget: each observation weighs this much against the past
ESTIMATE_DECAY = 0.02


def default_verify_widths(gamma: int) -> tuple[int, ...]:
    """1 (no draft), 3, 5 and the whole block ``gamma + 1`` (those of 3 and 5 that fit it).

    Why these: near its best width, the rate ``τ(W) / cost(W)`` changes slowly, so widths spaced by
    less than a factor of two lose little against every width. With survivals ``p^j`` and a round
    costing ``1 + d + k (W - 1)`` decode steps (``d`` the draft's share, ``k`` each verified column's:
    the verify's and the draft's tail per slot), over ``p`` 0.3-0.9, ``d`` 0.05-0.5 and ``k`` 0-1 at
    ``gamma = 9``: the best of 1 and 10 alone gives up to 27% fewer tokens per second than the best
    of all ten widths (4% on average), 1, 3, 5, 10 at most 4% (0.4%). Adding 2 takes that to 3.6%
    (0.3%) but costs the most warm-up of any width: its rounds verify one draft, a size-1 dimension
    that Dynamo specialises, so the draft's tail and the commit compile graphs of their own at every
    batch range and sampling mode (graphs/compile.py; the widths from 3 share one graph). Each width
    is still a captured round at every batch size and mode. ``Engine(verify_widths=[1, 2, 3, 5, 10])``
    adds 2; ``[1, gamma + 1]`` keeps the whole block and the fallback only."""
    return tuple(w for w in (1, 3, 5) if w < gamma + 1) + (gamma + 1,)


def survival(confidence: ArrayLike) -> np.ndarray:
    """``a_j = c_1 * ... * c_j`` along the last axis: the chance that drafts ``1..j`` all survive, from
    conditional rates (clamped to [0, 1])."""
    return np.cumprod(np.clip(np.asarray(confidence, dtype=np.float64), 0.0, 1.0), axis=-1)


def _survival_sums(survivals: ArrayLike) -> np.ndarray:
    """``[n, gamma + 1]``: column ``j`` is each row's ``a_1 + ... + a_j`` (column 0: nothing verified)."""
    a = np.asarray(survivals, dtype=np.float64).reshape(len(survivals), -1)
    return np.concatenate([np.zeros((a.shape[0], 1)), np.cumsum(a, axis=1)], axis=1)


def _expected(sums: np.ndarray, limits: np.ndarray, width: int) -> float:
    verified = np.clip(np.minimum(width - 1, limits), 0, sums.shape[1] - 1)
    return float(sums.shape[0] + sums[np.arange(sums.shape[0]), verified].sum())


def expected_tokens(survivals: ArrayLike, limits: ArrayLike, width: int) -> float:
    """``τ(W)``: the tokens a round of ``width`` columns is expected to commit over its rows (one each for
    sure, plus each verified draft's survival chance; row ``r`` verifies at most ``limits[r]`` drafts)."""
    return _expected(_survival_sums(survivals), np.asarray(limits), width)


def choose_width(survivals: ArrayLike, limits: ArrayLike, widths: Sequence[int], cost: Mapping[int, float]) -> int:
    """The width of ``widths`` with the most expected tokens per second (:func:`expected_tokens` over
    ``cost[width]`` seconds); ties go to the narrower width. Array work over the rows: it runs on the
    host every round, and at 128 rows a loop per row outlasts the GPU's round (docs/decisions.md,
    "Speculation scheduling")."""
    sums, limits = _survival_sums(survivals), np.asarray(limits)
    best, best_rate = widths[0], -1.0
    for w in sorted(widths):
        rate = _expected(sums, limits, w) / cost[w]
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = w, rate
    return best


def _decayed(estimate: np.ndarray, total: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``estimate`` after ``count`` observations summing to ``total`` (per position), each weighing
    :data:`ESTIMATE_DECAY`: moved ``1 - (1 - d)^count`` of the way to their mean (not at all where
    ``count`` is 0)."""
    mean = np.divide(total, count, out=np.zeros_like(estimate), where=count > 0)
    return estimate + (1.0 - (1.0 - ESTIMATE_DECAY) ** count) * (mean - estimate)


@dataclass
class SpeculationStats:
    """Engine-wide speculation counters (``Engine.speculation_stats``; the server's metrics)."""

    rounds_by_width: Counter = field(default_factory=Counter)   # rounds run at each verify width
    probes: int = 0                  # rounds at a wider width chosen to refresh the estimates (module doc)
    drafts_verified: int = 0         # draft tokens offered to the target (summed over rows)
    drafts_accepted: int = 0         # of those, accepted
    reached: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per position k: rows that verified
    #                                                   draft k+1 with 1..k accepted
    passed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # per position: of those, rows that
    #                                                   accepted draft k+1

    @property
    def fallback_rounds(self) -> int:
        """Rounds that drafted nothing (width 1: target-only speed)."""
        return self.rounds_by_width.get(1, 0)

    def as_dict(self) -> dict:
        rates = [p / r if r else float("nan") for p, r in zip(self.passed.tolist(), self.reached.tolist())]
        return {"rounds_by_width": dict(sorted(self.rounds_by_width.items())), "fallback_rounds": self.fallback_rounds,
                "probes": self.probes, "drafts_verified": self.drafts_verified,
                "drafts_accepted": self.drafts_accepted, "acceptance_per_position": rates}


class WidthPolicy:
    """Picks each round's verify width (see the module doc) and keeps the estimates it reads, per slot
    (the request holding it) and engine-wide. Every per-round method works on arrays over the
    round's rows: it runs on the host each round, beside the GPU's round, and must stay shorter."""

    def __init__(self, widths: Sequence[int], gamma: int, confidences: bool, slots: int):
        self.widths = tuple(sorted(widths))
        self.gamma = gamma
        self.confidences = confidences   # rounds return confidences (a head, or imposed rates): estimates from them
        # per slot: its request's latest conditional confidence at each position (NaN: none computed
        # yet) and the most drafts it may verify (SamplingParams.max_speculative_tokens)
        self._conditional = np.full((slots, gamma), np.nan)
        self._limit = np.full(slots, gamma, dtype=np.int64)
        # engine-wide estimates by position: conditional confidence (from the rounds' confidences) and
        # conditional acceptance (observed), each a decayed average; optimistic until something is observed
        self.prior = np.ones(gamma)
        self._acceptance = np.ones(gamma)
        self._at_one = 0                 # consecutive rounds chosen at width 1
        self.stats = SpeculationStats(reached=np.zeros(gamma, np.int64), passed=np.zeros(gamma, np.int64))

    def admit(self, slot: int, limit: int) -> None:
        """A request took ``slot``: no estimate of its own yet, at most ``limit`` drafts a round."""
        self._conditional[slot] = np.nan
        self._limit[slot] = min(limit, self.gamma)

    def choose(self, slots: np.ndarray, batch: int, mode: SamplingMode,
               costs: Mapping[tuple[SamplingMode, int, int], float]) -> int:
        """The width of the next round of the requests in ``slots`` (each with its own estimate:
        :meth:`estimate`), ``batch`` the padded size it runs at, ``costs`` the measured table."""
        if len(self.widths) == 1:
            return self.widths[0]
        cost = self._costs(batch, mode, costs)
        if cost is None:
            return self.widths[-1]
        est = self.estimate(slots)
        limits = self._limit[slots]
        width = choose_width(est, limits, self.widths, cost)
        if width == 1 and self.widths[1:]:
            wider = choose_width(est, limits, self.widths[1:], cost)
            # after `interval` rounds at width 1, one at `wider`: its extra cost is PROBE_OVERHEAD of theirs
            interval = math.ceil(round((cost[wider] - cost[1]) / (PROBE_OVERHEAD * cost[1]), 6))
            if self._at_one >= max(interval, 1):
                self._at_one = 0
                self.stats.probes += 1
                return wider
            self._at_one += 1
        else:
            self._at_one = 0
        return width

    def estimate(self, slots: np.ndarray) -> np.ndarray:
        """``[n, gamma]``: the survival estimates of the requests in ``slots`` (see the module doc): their
        own conditional confidences where computed, the engine-wide rates elsewhere (all of them
        for a draft without confidences: the observed acceptance)."""
        if not self.confidences:
            return np.broadcast_to(survival(self._acceptance), (len(slots), self.gamma))
        own = self._conditional[slots]
        return survival(np.where(np.isnan(own), self.prior[None, :], own))

    def _costs(self, batch: int, mode: SamplingMode, costs: Mapping[tuple[SamplingMode, int, int], float]
               ) -> dict[int, float] | None:
        """``{width: seconds}`` at this batch size in this mode (the greedy rounds' where this mode was
        not measured), or None where any width lacks a measurement."""
        for m in (mode, SamplingMode.GREEDY):
            cost = {w: costs.get((m, batch, w)) for w in self.widths}
            if all(c is not None and c > 0 for c in cost.values()):
                return cost
        return None

    def observe(self, slots: np.ndarray, width: int, committed: np.ndarray, confidence: np.ndarray | None
                ) -> np.ndarray:
        """A finished round of width ``width`` for the requests in ``slots``: ``committed[r]`` tokens each
        (its accepted drafts plus one), ``confidence[r]`` the round's confidences for it (NaN at the
        positions none were computed: all of them without a head, those past ``width - 1`` in a
        narrower round; or None). Returns the drafts each row was offered."""
        verified = np.minimum(width - 1, self._limit[slots])
        accepted = np.asarray(committed, dtype=np.int64) - 1
        self.stats.drafts_verified += int(verified.sum())
        self.stats.drafts_accepted += int(accepted.sum())
        k = np.arange(self.gamma)[None, :]
        reached = k < np.minimum(verified, accepted + 1)[:, None]     # drafts 1..k accepted, k+1 offered
        passed = k < accepted[:, None]                                 # ... and k+1 accepted
        n_reached, n_passed = reached.sum(axis=0), passed.sum(axis=0)
        self.stats.reached += n_reached
        self.stats.passed += n_passed
        self._acceptance = _decayed(self._acceptance, n_passed, n_reached)
        if confidence is not None:
            c = np.asarray(confidence, dtype=np.float64)
            computed = ~np.isnan(c)
            if computed.any():
                # each position takes the round's c_k where it computed one and keeps the last otherwise
                self._conditional[slots] = np.where(computed, c, self._conditional[slots])
                self.prior = _decayed(self.prior, np.where(computed, c, 0.0).sum(axis=0), computed.sum(axis=0))
        return verified

    def count_round(self, width: int) -> None:
        self.stats.rounds_by_width[width] += 1
