"""Probe for the prefill bucket warm-up's cost to later steps (docs/benchmarks.md, sessions 11 and
12): run ``lfmspark bench`` with ``PrefillRunner.warmup`` (graphs/prefill.py) changed.

    python scripts/prefill_warmup_probe.py MODE bench --preset lfm2.5-1.2b --draft-preset none \\
        --batch-sizes 1 --runs 3 --no-hf --no-phase-split --prefill-graph-tokens 1024

MODE (``side``: a fresh ``torch.cuda.Stream``, as the warm-up used until session 12; ``small``: the
buckets of at most 128 tokens):
- ``used``: unchanged (eager runs on the current stream, captures on the step graphs' stream);
- ``skip``: no bucket warm-up (prefill then runs eagerly at bucket shapes);
- ``sidefresh``: the former warm-up: the eager runs and the captures on a side stream;
- ``freshcapture``: unchanged eager runs, captures on a side stream;
- ``side16`` / ``side32`` / ``side128``: one eager run of the 1 x W bucket on a side stream, no capture;
- ``sidenopdl``: the small buckets on a side stream with ``LFMSPARK_PDL=0``, no capture;
- ``runnerstream``: the small buckets on the step graphs' capture stream, no capture;
- ``currentstream``: every bucket on the current stream, no capture;
- ``destroyed``: unchanged, then the graphs deleted and ``torch.cuda.empty_cache()``;
- ``emptyonly``: no bucket warm-up; ``gc.collect()``, ``torch.cuda.empty_cache()`` (what entering a capture does);
- ``sharedpool``: unchanged, but the graphs captured into the step graphs' memory pool;
- ``tinyalloc``: no forward; 256 tensors of 64 KiB allocated and freed on a side stream;
- ``stepsfirst``: unchanged, but in session 12's order: the step graphs captured before the whole prefill
  warm-up (eager shapes, bucket runs, captures); ``Engine.warmup`` now runs the prefill first (session 13,
  where this mode's A/B ran as ``used`` against ``prefillfirst``, today's ``used``);
- ``onebucket``: unchanged, but only the 1 x 128 bucket (one graph instead of one per bucket; session 13
  ran it in the former order, after the step graphs).
"""

from __future__ import annotations

import gc
import os
import sys

import torch

from lfmspark.graphs import prefill
from lfmspark.runtime import engine
from lfmspark.runtime.cli import main

MODES = ("used", "skip", "sidefresh", "freshcapture", "side16", "side32", "side128", "sidenopdl", "runnerstream",
         "currentstream", "destroyed", "emptyonly", "sharedpool", "tinyalloc", "stepsfirst", "onebucket")
_original = prefill.PrefillRunner.warmup
_original_engine_warmup = engine.Engine.warmup


def _eager(self: prefill.PrefillRunner, shapes, stream: torch.cuda.Stream) -> None:
    for shape in shapes:
        _, inputs = self.padding_inputs(shape)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.forward(*inputs)
        torch.cuda.synchronize(self.device)


def _warmup(self: prefill.PrefillRunner, progress: bool = True, capture: bool = True, capture_stream=None):
    mode = sys.argv[1]
    if mode == "skip" or self.device.type != "cuda":
        return []
    largest_first = list(reversed(self.buckets))
    small = [b for b in largest_first if b[0] * b[1] <= 128]
    if mode in ("used", "sharedpool", "stepsfirst"):
        return _original(self, progress, capture, capture_stream)
    if mode == "onebucket":
        self.buckets = [b for b in self.buckets if b == (1, 128)]
        return _original(self, progress, capture, capture_stream)
    if mode == "destroyed":
        _original(self, progress, capture, capture_stream)
        self._graphs.clear()
        self._inputs.clear()
        gc.collect()
        torch.cuda.empty_cache()
        return []
    if mode == "emptyonly":
        gc.collect()
        torch.cuda.empty_cache()
        return []
    if mode == "tinyalloc":
        with torch.cuda.stream(torch.cuda.Stream(self.device)):
            blocks = [torch.ones(16384, device=self.device) for _ in range(256)]
            blocks.clear()
        torch.cuda.synchronize(self.device)
        return []
    if mode == "sidefresh":
        side = torch.cuda.Stream(self.device)
        _eager(self, largest_first, side)
        return _original(self, progress, capture, side)
    if mode == "freshcapture":
        return _original(self, progress, capture, torch.cuda.Stream(self.device))
    if mode in ("side16", "side32", "side128"):
        _eager(self, [(1, int(mode[4:]))], torch.cuda.Stream(self.device))
    elif mode == "sidenopdl":
        os.environ["LFMSPARK_PDL"] = "0"
        try:
            _eager(self, small, torch.cuda.Stream(self.device))
        finally:
            os.environ["LFMSPARK_PDL"] = "1"
    elif mode == "runnerstream":
        _eager(self, small, capture_stream)
    elif mode == "currentstream":
        _eager(self, largest_first, torch.cuda.current_stream(self.device))
    return []


def _engine_warmup_shared_pool(self: engine.Engine, progress: bool = True, sampling: bool = True):
    self.prefill_runner._pool = getattr(self.runner, "_pool", None)
    return _original_engine_warmup(self, progress, sampling)


def _engine_warmup_steps_first(self: engine.Engine, progress: bool = True, sampling: bool = True):
    report = self.runner.warmup([self.step_kind], progress=progress,
                                sampling_modes=(False, True) if sampling else (False,))
    self._warm_prefill(sampling)
    report.entries += self.prefill_runner.warmup(progress, capture=self.cuda_graphs,
                                                 capture_stream=self.runner.capture_stream)
    return report


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in MODES:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(MODES)}}} bench ARGS...")
    prefill.PrefillRunner.warmup = _warmup
    if sys.argv[1] == "sharedpool":
        engine.Engine.warmup = _engine_warmup_shared_pool
    if sys.argv[1] == "stepsfirst":
        engine.Engine.warmup = _engine_warmup_steps_first
    sys.exit(main(sys.argv[2:]))
