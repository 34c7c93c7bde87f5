"""Probe for an open question (docs/benchmarks.md, session 11, item 2): after the prefill bucket
warm-up (graphs/prefill.py ``PrefillRunner.warmup``) every decode step ran ~20 us slower on the
H200, with or without the graphs captured. This runs ``lfmspark bench`` with that warm-up changed:

    python scripts/prefill_warmup_probe.py MODE bench --preset lfm2.5-1.2b --draft-preset none \\
        --batch-sizes 1 --runs 3 --no-hf --no-phase-split --prefill-graph-tokens 1024

MODE: ``used`` (unchanged), ``unused`` (graphs captured, kept alive, never replayed), ``nocapture``
(the eager bucket runs on the warm-up's side stream, no capture), ``currentstream`` (the eager
bucket runs on the current stream, no capture: untested so far), ``skip`` (no bucket warm-up).
Session 11 measured 0.751 ms per token for used / unused / nocapture and 0.731 for skip.
"""

from __future__ import annotations

import sys

import torch

from lfmspark.graphs import prefill
from lfmspark.runtime.cli import main

MODES = ("used", "unused", "nocapture", "currentstream", "skip")
_original = prefill.PrefillRunner.warmup
_kept: list[dict] = []


def _warmup(self: prefill.PrefillRunner, progress: bool = True, capture: bool = True):
    mode = sys.argv[1]
    if mode == "skip" or self.device.type != "cuda":
        return []
    if mode == "currentstream":
        for shape in reversed(self.buckets):
            n_ids, n_row = self._layout(shape)
            inputs = self._unpack(torch.zeros(n_ids + 3 * n_row, dtype=torch.int64, device=self.device), shape)
            inputs[1].fill_(-1)
            inputs[3].fill_(shape[1])
            self.forward(*inputs)
        torch.cuda.synchronize(self.device)
        return []
    entries = _original(self, progress, capture=mode != "nocapture")
    if mode == "unused":
        _kept.append(dict(self._graphs))
        self._graphs.clear()
    return entries


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(MODES)}}} bench ARGS...")
    prefill.PrefillRunner.warmup = _warmup
    sys.exit(main(sys.argv[2:]))
