"""Step runners: how the engine executes one decode step or speculative round for a batch.

The engine hands a runner the slots of the rows to advance; the runner builds (or refills) the
``slots`` tensor, runs the step and returns its device outputs, ``len(slots)`` rows or more (the
extra rows are padding). :class:`EagerRunner` calls the step functions directly, optionally
through ``torch.compile``; :class:`lfmspark.graphs.capture.CudaGraphRunner` replays captured graphs.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..runtime.distributions import SamplingMode
from .compile import compile_regions

log = logging.getLogger("lfmspark")


# Uncompiled steps dispatch each op below autograd and ADInplaceOrView: the engine never
# differentiates (its parameters do not require grad, the steps run under no_grad), and those two
# layers only record autograd history and bump version counters. On a CPU, where a step of a small
# model is a few hundred small ops, they cost a third of the step: torch's Python
# ADInplaceOrView kernel alone takes ~0.1 ms a call of a custom op that mutates an argument (each
# attention and ShortConv layer's cache write; torch._library.utils.fill_defaults). On a 2-core CPU
# the tiny preset's decode step takes 2.4 ms below them, 3.6 ms through them (medians of 20).
# Tensors made under the guard are ordinary tensors (inference_mode's would be inference tensors).
# The guard is private to torch; without it, inference_mode (below autograd only).
_below_autograd = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", torch.inference_mode)


def default_batch_sizes(max_batch: int) -> list[int]:
    """Every size up to 8, then steps of 2 to 16, of 4 to 32, of 8 to 64, of 16 beyond; always max_batch."""
    sizes = []
    for lo, hi, step in ((1, 8, 1), (10, 16, 2), (20, 32, 4), (40, 64, 8), (80, 4096, 16)):
        sizes += [b for b in range(lo, hi + 1, step) if b <= max_batch]
    return sorted(set(sizes + [max_batch]))


class StepKind(enum.Enum):
    DECODE = "decode"          # target-only: one token per row
    ROUND = "round"            # DSpark speculative round


@dataclass
class WarmupEntry:
    kind: str
    mode: str                             # SamplingMode.value ("any": a prefill graph, logits only)
    batch_size: int
    compile_s: float
    capture_s: float = 0.0
    graph_bytes: int = 0
    width: int = 0                        # a round's verify width (0: a decode step or prefill graph)


@dataclass
class WarmupReport:
    entries: list[WarmupEntry] = field(default_factory=list)
    total_s: float = 0.0                  # the steps: compiled and captured at every size, mode and width
    mode: str = "eager"                   # "eager", "compiled" or "cuda-graphs"
    prefill_s: float = 0.0                # the engine's prefill warm-up (runtime/engine.py)
    graphs_compiled: int = 0              # Dynamo graphs compiled for the steps' regions (graphs/compile.py)
    cache_hits: int = 0                   # Inductor FX graph cache hits and misses of those compiles
    cache_misses: int = 0
    profile_s: float = 0.0                # measuring the round costs the width policy reads (graphs/capture.py)
    seconds: float = 0.0                  # the whole Engine.warmup(): prefill, steps, profile

    def as_dict(self) -> dict:
        return {"mode": self.mode, "seconds": self.seconds, "total_s": self.total_s, "prefill_s": self.prefill_s,
                "graphs_compiled": self.graphs_compiled, "cache_hits": self.cache_hits,
                "cache_misses": self.cache_misses, "profile_s": self.profile_s,
                "entries": [e.__dict__ for e in self.entries]}

    def table(self) -> str:
        from tabulate import tabulate

        rows = [[e.kind, e.mode, e.batch_size, e.width or "", f"{e.compile_s:.2f}", f"{e.capture_s:.3f}",
                 f"{e.graph_bytes / 2**20:.1f}"] for e in self.entries]
        return tabulate(rows, headers=["step", "mode", "batch", "width", "compile s", "capture s", "graph MiB"])


class StepRunner(Protocol):
    costs: dict[tuple[SamplingMode, int, int], float]     # seconds per round (mode, batch size, width), if measured

    def padded_size(self, n: int) -> int: ...

    def run(self, kind: StepKind, slots: list[int], mode: SamplingMode, width: int | None = None): ...

    def warmup(self, kinds: list[StepKind], progress: bool = True,
               modes: Sequence[SamplingMode] = tuple(SamplingMode)) -> WarmupReport: ...


class EagerRunner:
    """Runs the step functions as they are, or with their regions compiled (graphs/compile.py);
    compiled batches are padded with ``-1`` rows to the next bucket so the number of compiled
    variants stays bounded (one per bucket and sampling mode)."""

    def __init__(self, steps, device: torch.device, compile: bool = False, max_batch: int = 1,
                 widths: Sequence[int] = (0,)):
        self.steps, self.device, self.compiled = steps, device, compile
        self.widths = tuple(widths)            # a round's verify widths (decode: (0,), unused)
        self.buckets = default_batch_sizes(max_batch) if compile else []
        if compile:
            compile_regions(steps, len(self.buckets))
        self.costs: dict[tuple[SamplingMode, int, int], float] = {}   # nothing measured (graphs/capture.py does)

    def padded_size(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n) if self.buckets else n

    def run(self, kind: StepKind, slots: list[int], mode: SamplingMode, width: int | None = None):
        size = self.padded_size(len(slots))
        slots = list(slots) + [-1] * (size - len(slots))
        slots_t = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        with contextlib.nullcontext() if self.compiled else _below_autograd():
            if kind is StepKind.ROUND:
                return self.steps.spec_round(slots_t, mode, width)
            return self.steps.decode(slots_t, mode)

    def warmup(self, kinds: list[StepKind], progress: bool = True,
               modes: Sequence[SamplingMode] = tuple(SamplingMode)) -> WarmupReport:
        """Nothing to capture; when compiling, compile batch size 1 of each step (a round at each
        verify width) up front (with every row a padding row, so no slot state changes)."""
        report = WarmupReport(mode="compiled" if self.compiled else "eager")
        if not self.compiled:
            return report
        t_all = time.perf_counter()
        for kind in kinds:
            for mode in modes:
                for width in self.widths if kind is StepKind.ROUND else (0,):
                    t0 = time.perf_counter()
                    self.run(kind, [-1], mode, width or None)
                    report.entries.append(WarmupEntry(kind.value, mode.value, 1, time.perf_counter() - t0,
                                                      width=width))
                    if progress:
                        log.info("compiled %s (%s%s)", kind.value, mode.value, f", width {width}" if width else "")
        report.total_s = time.perf_counter() - t_all
        return report
