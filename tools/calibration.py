"""Calibrating the draft's confidence head: Sequential Temperature Scaling (reference/dspark.md §4.4).

The verify-width policy (runtime/speculation.py) reads absolute survival values ``a_k = c_1 * ... * c_k``,
and a raw confidence head is overconfident, so each block slot gets a temperature: ``c_k =
sigmoid(z_k / T_k)``. :func:`record_rounds` runs the engine with every round verifying the whole
block (as STS needs: no truncation) and keeps, per row of every round, the raw logits ``z`` and
the drafts accepted ``A``; :func:`fit_sts` then picks ``T_1, T_2, ...`` left to right, each the
grid value minimising the expected calibration error of the running product against the label
``1[A >= k]`` (the prefix of length ``k`` survived), with the earlier temperatures frozen.
``lfmspark calibrate`` does both and writes the temperatures (``sts_temperatures`` in the draft's
config.json, where the engine reads them: models/config.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..runtime.sampling import SamplingParams

log = logging.getLogger("lfmspark")

# the paper gives neither; reference/dspark.md suggests this grid, and the evaluator's 20 bins
GRID = torch.arange(0.25, 5.0 + 1e-9, 0.01, dtype=torch.float64)
BINS = 20


@dataclass
class StsFit:
    temperatures: list[float]
    ece_before: list[float]       # per position, of the running product with every T = 1
    ece_after: list[float]        # the same with the fitted temperatures
    rounds: int                   # rows of rounds fitted on

    def as_dict(self) -> dict:
        return {"sts_temperatures": self.temperatures, "ece_before": self.ece_before, "ece_after": self.ece_after,
                "rounds": self.rounds}


def expected_calibration_error(predicted: torch.Tensor, label: torch.Tensor, bins: int = BINS) -> float:
    """ECE over ``bins`` equal-width bins of ``predicted`` in [0, 1]: the bins' |mean prediction -
    mean label|, weighted by their share of the samples."""
    index = (predicted * bins).long().clamp(0, bins - 1)
    pred_sum = torch.bincount(index, weights=predicted.double(), minlength=bins)
    label_sum = torch.bincount(index, weights=label.double(), minlength=bins)
    return float((pred_sum - label_sum).abs().sum() / max(len(predicted), 1))


def fit_sts(z: torch.Tensor, accepted: torch.Tensor, grid: torch.Tensor = GRID) -> StsFit:
    """Temperatures for raw confidence logits ``z [N, gamma]`` of rounds verified whole, whose rows
    accepted ``accepted [N]`` drafts (see the module doc)."""
    if z.dim() != 2 or accepted.shape != (z.shape[0],):
        raise ValueError(f"expected z [N, gamma] and accepted [N], got {tuple(z.shape)} and {tuple(accepted.shape)}")
    if z.shape[0] == 0:
        raise ValueError("no rounds to fit: record some rounds first (lfmspark calibrate runs the engine for them)")
    z, accepted = z.double(), accepted.long()
    n, gamma = z.shape
    prod_raw = torch.ones(n, dtype=torch.float64)
    prod = torch.ones(n, dtype=torch.float64)
    temps, before, after = [], [], []
    for k in range(gamma):
        label = (accepted >= k + 1).double()
        prod_raw = prod_raw * torch.sigmoid(z[:, k])
        before.append(expected_calibration_error(prod_raw, label))
        scores = [expected_calibration_error(prod * torch.sigmoid(z[:, k] / t), label) for t in grid.tolist()]
        best = min(range(len(scores)), key=scores.__getitem__)
        temps.append(round(float(grid[best]), 4))
        prod = prod * torch.sigmoid(z[:, k] / grid[best])
        after.append(scores[best])
    return StsFit(temps, before, after, n)


def record_rounds(engine, prompts: Sequence, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``prompts`` through ``engine`` (built with ``verify_widths=[block_size + 1]`` and the
    confidence head uncalibrated) and return the raw confidence logits ``[N, gamma]`` and the drafts
    accepted ``[N]`` of every row of every round."""
    if engine.draft is None or engine.draft.confidence_head is None:
        raise ValueError("calibration needs a draft with a confidence head ('enable_confidence_head' in its config)")
    if engine.verify_widths != (engine.block_size + 1,):
        raise ValueError("calibration needs every round verified whole: build the engine with "
                         f"verify_widths=[{engine.block_size + 1}]")
    if engine.draft.confidence_head.temperatures is not None or not engine.model_runner.steps.want_confidence:
        raise ValueError("calibration reads the raw confidences of every round: set "
                         "draft.confidence_head.temperatures = None and model_runner.steps.want_confidence = True "
                         "before warm-up")
    rows: list[tuple[list[float], int]] = []

    def observe(request_id: str, verified: int, accepted: int, confidence: list[float] | None) -> None:
        if confidence is not None and verified == engine.block_size:
            rows.append((confidence, accepted))

    engine.model_runner.round_observer = observe
    try:
        engine.generate(list(prompts), params)
    finally:
        engine.model_runner.round_observer = None
    c = torch.tensor([r[0] for r in rows], dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    return torch.logit(c), torch.tensor([r[1] for r in rows], dtype=torch.int64)
