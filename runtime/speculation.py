"""Adaptive speculation: how many columns each round verifies (DSpark's confidence-scheduled
verification, reference/dspark.md §6, in a form CUDA graphs can replay).

A round verifies a window of ``width`` columns for every row of the batch: the anchor and the
first ``width - 1`` drafts of the block. Width 1 drafts nothing: the round is a target decode step
that still writes the draft's context, so speculation can resume at any round. The engine captures
a round at each width of a small set (``Engine(verify_widths=...)``, by default 1 and the whole
block; any widths in between may be added) and picks one per round here.

**The choice** maximises expected committed tokens per second, ``Θ(W) = τ(W) / cost(B, W)``:
``τ(W) = Σ_r (1 + Σ_{j < min(W, 1 + limit_r)} a_{r,j})`` with ``a_{r,j}`` request ``r``'s estimated
chance that drafts ``1..j`` all survive (``limit_r``: its ``max_speculative_tokens``), and
``cost(B, W)`` the replay time of the captured round at the padded batch size, measured at warm-up
(graphs/capture.py ``profile_rounds``). Without measurements (eager or CPU engines) every width
costs the same and the whole block wins, which is what the engine did before the scheduler. Width 1
wins where drafting and verifying cost more than they return (large batches, poor drafts), and the
engine then runs at target-only speed.

**Why it stays lossless.** The width of round ``r + 1`` is chosen on the host from what rounds up
to ``r - 1`` returned (the loop is pipelined: runtime/engine.py), so it cannot depend on any token
round ``r + 1`` drafts. That is DeepSeek's production form of Algorithm 1 (§6.4: a capacity from
confidences two steps old). The peeking alternative, a width chosen from the current block's own
confidences, changes the output distribution (the paper's Appendix A; tests/test_speculation.py).

**The survival estimates** ``a_{r,j}``: the cumulative product of the confidences the draft's
confidence head gave request ``r`` in its last drafted round (``c_k`` reads ``x_{k-1}``, never
``x_k``; with STS temperatures from the checkpoint, reference/dspark.md §4.4), or, for a draft
without a confidence head, the engine's observed per-position acceptance. Imposed acceptance
(benchmarks on random weights) imposes the matching confidences, ``c_k`` = the imposed rate. A
request without an estimate yet takes the engine-wide one, which starts optimistic (every draft
survives), so new traffic starts speculating and the first rounds correct it.

**Probing.** While width 1 wins, no draft runs and the estimates stop changing. Every so many
rounds at width 1 one round runs at the best wider width, so that a draft that became useful is
noticed; the interval keeps the probes' extra cost near 1% of the time at width 1.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .distributions import SamplingMode

# the probes' share of the time spent at width 1 (see the module doc)
PROBE_OVERHEAD = 0.01
# how fast the engine-wide estimates forget: each observation weighs this much against the past
ESTIMATE_DECAY = 0.02


def default_verify_widths(gamma: int) -> tuple[int, ...]:
    """1 (no draft) and the whole block ``gamma + 1``. Why not the widths between: a round pays the
    whole draft forward at every width, so a narrower verify saves only part of the round; on the
    H100 at imposed acceptance 0.8 the scheduler never chose 3 or 5 over the whole block at batch
    1-64 (docs/benchmarks.md, session 28), and each width is another captured variant of the round
    at every batch size and sampling mode (warm-up time). ``Engine(verify_widths=[1, 3, 5, 10])``
    adds them."""
    return (1, gamma + 1)


def survival(confidence: Sequence[float]) -> list[float]:
    """``a_j = c_1 * ... * c_j``: the chance that drafts ``1..j`` all survive, from conditional rates."""
    out, acc = [], 1.0
    for c in confidence:
        acc *= min(max(float(c), 0.0), 1.0)
        out.append(acc)
    return out


def expected_tokens(survivals: Sequence[Sequence[float]], limits: Sequence[int], width: int) -> float:
    """``τ(W)``: the tokens a round of ``width`` columns is expected to commit over its rows (one each for
    sure, plus each verified draft's survival chance; row ``r`` verifies at most ``limits[r]`` drafts)."""
    return sum(1.0 + sum(a[:max(0, min(width - 1, lim))]) for a, lim in zip(survivals, limits, strict=True))


def choose_width(survivals: Sequence[Sequence[float]], limits: Sequence[int], widths: Sequence[int],
                 cost: Mapping[int, float]) -> int:
    """The width of ``widths`` with the most expected tokens per second (:func:`expected_tokens` over
    ``cost[width]`` seconds); ties go to the narrower width."""
    best, best_rate = widths[0], -1.0
    for w in sorted(widths):
        rate = expected_tokens(survivals, limits, w) / cost[w]
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = w, rate
    return best


@dataclass
class SpeculationStats:
    """Engine-wide speculation counters (``Engine.speculation_stats``; the server's metrics)."""

    rounds_by_width: Counter = field(default_factory=Counter)   # rounds run at each verify width
    probes: int = 0                  # rounds at a wider width chosen to refresh the estimates (module doc)
    drafts_verified: int = 0         # draft tokens offered to the target (summed over rows)
    drafts_accepted: int = 0         # of those, accepted
    reached: list[int] = field(default_factory=list)    # per position: rows that verified draft k+1 with 1..k accepted
    passed: list[int] = field(default_factory=list)     # per position: of those, rows that accepted draft k+1

    @property
    def fallback_rounds(self) -> int:
        """Rounds that drafted nothing (width 1: target-only speed)."""
        return self.rounds_by_width.get(1, 0)

    def as_dict(self) -> dict:
        rates = [p / r if r else float("nan") for p, r in zip(self.passed, self.reached)]
        return {"rounds_by_width": dict(sorted(self.rounds_by_width.items())), "fallback_rounds": self.fallback_rounds,
                "probes": self.probes, "drafts_verified": self.drafts_verified,
                "drafts_accepted": self.drafts_accepted, "acceptance_per_position": rates}


class VerifyScheduler:
    """Picks each round's verify width (see the module doc) and keeps the estimates it reads."""

    def __init__(self, widths: Sequence[int], gamma: int, confidences: bool):
        self.widths = tuple(sorted(widths))
        self.gamma = gamma
        self.confidences = confidences   # rounds return confidences (a head, or imposed rates): estimates from them
        # engine-wide estimates: survival by position (from confidences) and conditional acceptance by
        # position (observed), each a decayed average; optimistic until something is observed
        self.prior = [1.0] * gamma
        self._acceptance = [1.0] * gamma
        self._at_one = 0                 # consecutive rounds chosen at width 1
        self.stats = SpeculationStats(reached=[0] * gamma, passed=[0] * gamma)

    def choose(self, survivals: Sequence[Sequence[float] | None], limits: Sequence[int], batch: int,
               mode: SamplingMode, costs: Mapping[tuple[SamplingMode, int, int], float]) -> int:
        """The width of the next round of these rows (``survivals[r]``: the request's estimate, None for
        the engine-wide one), ``batch`` the padded size it runs at, ``costs`` the measured table."""
        if len(self.widths) == 1:
            return self.widths[0]
        cost = self._costs(batch, mode, costs)
        if cost is None:
            return self.widths[-1]
        fallback = self.prior if self.confidences else survival(self._acceptance)
        est = [a if a is not None else fallback for a in survivals]
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

    def _costs(self, batch: int, mode: SamplingMode, costs: Mapping[tuple[SamplingMode, int, int], float]
               ) -> dict[int, float] | None:
        """``{width: seconds}`` at this batch size in this mode (the greedy rounds' where this mode was
        not measured), or None where any width lacks a measurement."""
        for m in (mode, SamplingMode.GREEDY):
            cost = {w: costs.get((m, batch, w)) for w in self.widths}
            if all(c is not None and c > 0 for c in cost.values()):
                return cost
        return None

    def observe(self, width: int, verified: int, accepted: int, confidence: Sequence[float] | None) -> None:
        """One row of a finished round: ``verified`` drafts offered, ``accepted`` of them taken, and the
        round's confidences for it (None when none were computed)."""
        if verified:
            self.stats.drafts_verified += verified
            self.stats.drafts_accepted += accepted
        for k in range(min(verified, accepted + 1)):       # drafts 1..k accepted, k+1 offered
            ok = k < accepted
            self.stats.reached[k] += 1
            self.stats.passed[k] += ok
            self._acceptance[k] += ESTIMATE_DECAY * (ok - self._acceptance[k])
        if confidence is not None:
            for k, a in enumerate(survival(confidence)):
                self.prior[k] += ESTIMATE_DECAY * (a - self.prior[k])

    def count_round(self, width: int) -> None:
        self.stats.rounds_by_width[width] += 1
