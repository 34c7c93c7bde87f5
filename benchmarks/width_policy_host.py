"""Host time of the verify-width policy's per-round work (runtime/speculation.py), by batch size.

    python benchmarks/width_policy_host.py --batch-sizes 1,8,64,128

Each speculative round the engine, on the host, chooses the next round's width (``choose``) and books
the finished round (``observe``): this work overlaps the GPU's round only while it is shorter than the
round (at batch 128 a width-1 round replays in ~1.6 ms on a GPU: docs/decisions.md, "Speculation
scheduling"). ``WidthPolicy`` with random confidences and accept lengths, widths 1 and 10, a block
of 9; prints microseconds per round (choose + observe).
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np

from lfmspark.runtime.distributions import SamplingMode
from lfmspark.runtime.speculation import WidthPolicy


def per_round_us(batch: int, gamma: int = 9, rounds: int = 500) -> float:
    rng = np.random.default_rng(0)
    confidence = rng.uniform(0.6, 0.95, (batch, gamma)).astype(np.float32)
    committed = rng.integers(1, gamma + 2, batch)
    costs = {(SamplingMode.GREEDY, batch, 1): 1.5e-3, (SamplingMode.GREEDY, batch, gamma + 1): 8e-3}
    scheduler = WidthPolicy((1, gamma + 1), gamma, confidences=True, slots=batch)
    slots = np.arange(batch)
    for slot in slots:
        scheduler.admit(int(slot), gamma)

    def one_round() -> None:
        width = scheduler.choose(slots, batch, SamplingMode.GREEDY, costs)
        scheduler.observe(slots, width, committed, confidence)

    return timeit.timeit(one_round, number=rounds) / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,32,64,128")
    args = ap.parse_args()
    for b in (int(x) for x in args.batch_sizes.split(",")):
        print(f"batch {b:4d}: {per_round_us(b):7.1f} us per round (choose + observe)")


if __name__ == "__main__":
    main()
