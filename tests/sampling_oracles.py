"""The sampling oracles of the distribution tests: the exact filtered distribution of a row of
logits (numpy, written from the definitions, not from the engine's code), the exact joint of a
tiny target's next two tokens, and a chi-square p-value."""

from __future__ import annotations

import numpy as np
import torch

from lfmspark.models.cache import TargetCache
from lfmspark.models.lfm2 import ForwardMode

VOCAB = 8
PROMPT = [1, 5, 2]


def filtered(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Reference sampling distribution (HF order: temperature, top-k, top-p)."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x)
    keep = np.zeros_like(x, dtype=bool)
    keep[order[: top_k if top_k > 0 else len(x)]] = True
    p = np.exp(x - x.max()) * keep
    p /= p.sum()
    mass = 0.0
    kept = np.zeros_like(keep)
    for i in order:
        if not keep[i] or mass >= top_p:
            break
        kept[i] = True
        mass += p[i]
    p = p * kept
    return p / p.sum()


@torch.no_grad()
def exact_joint(target, temperature, top_k, top_p) -> np.ndarray:
    """P(t2, t3 | prompt), marginalising the 1st token, from full-sequence target forwards."""

    def next_dist(tokens):
        cache = TargetCache.allocate(target.config, 1, 32, 2, torch.float32, "cpu")
        z = torch.zeros(1, dtype=torch.int64)
        out = target(torch.tensor([tokens]), cache, z, z, torch.tensor([len(tokens)]), ForwardMode.PREFILL)
        return filtered(out.logits[0, -1].numpy(), temperature, top_k, top_p)

    joint = np.zeros((VOCAB, VOCAB))
    p1 = next_dist(PROMPT)
    for t1 in range(VOCAB):
        if p1[t1] == 0:
            continue
        p2 = next_dist(PROMPT + [t1])
        for t2 in range(VOCAB):
            if p2[t2] == 0:
                continue
            joint[t2] += p1[t1] * p2[t2] * next_dist(PROMPT + [t1, t2])
    return joint


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; cells expected below 5 are pooled into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
