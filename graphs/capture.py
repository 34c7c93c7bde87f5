"""CUDA graph capture of the step functions, one graph per batch size (DESIGN §5).

Each step (``decode`` or the speculative ``round``, a variant per sampling mode: runtime/distributions.py) runs its regions
compiled with ``torch.compile(fullgraph=True, dynamic=None)``, the batch dimension symbolic from
batch 2 on (Inductor without its own cudagraphs; graphs/compile.py says which regions, and how one
graph per region serves every size of two or more). It runs on a side stream to warm up
(compilation, Triton autotuning, cuBLAS handles happen there, never during capture), then is
captured into a ``torch.cuda.CUDAGraph``, largest batch first, into one shared memory pool (the
smallest size is compiled before them, so that the symbolic graph is compiled at the largest). Warm-up
and capture run with every row a padding row (slot ``-1``), so they change no state. At run time a
batch is padded with ``-1`` rows up to the next captured size, the slots are copied into that
size's static input buffer (only when they changed), and the graph replays: no allocation, no host
sync, no recompilation.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from ..runtime.distributions import SamplingMode
from .compile import compile_regions
from .runner import StepKind, WarmupEntry, WarmupReport, default_batch_sizes

log = logging.getLogger("lfmspark")


class _Captured:
    """A captured step and its static outputs (as ``runtime.steps.StepOutput``: tokens, n_new, scores,
    confidence)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: tuple[torch.Tensor, ...]):
        self.graph, self.tokens, self.n_new, self.scores, self.confidence = graph, *outputs


class CudaGraphRunner:
    def __init__(self, steps, device: torch.device, max_batch: int, batch_sizes: Sequence[int] | None = None,
                 compile: bool = True, widths: Sequence[int] = (0,)):
        self.steps, self.device = steps, device
        self.widths = tuple(widths)            # the verify widths a round is captured at (decode: (0,), unused)
        self.batch_sizes = sorted(set(batch_sizes or default_batch_sizes(max_batch)))
        if self.batch_sizes[-1] < max_batch:
            raise ValueError(f"captured batch sizes {self.batch_sizes} do not cover max_batch {max_batch}")
        self.compiled = compile
        if compile:
            compile_regions(steps, len(self.batch_sizes))
        self._fns = {StepKind.DECODE: self._decode, StepKind.ROUND: self._round}
        # static inputs: one slots buffer per batch size, plus two pinned staging buffers (the
        # next launch may refill one while the previous copy is still queued on the stream)
        self._slots = {b: torch.full((b,), -1, dtype=torch.int64, device=device) for b in self.batch_sizes}
        self._last: dict[int, list[int]] = {b: [-1] * b for b in self.batch_sizes}
        self._staging = [torch.empty(self.batch_sizes[-1], dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._flip = 0
        self._graphs: dict[tuple[StepKind, SamplingMode, int, int], _Captured] = {}   # (kind, mode, size, width)
        # seconds per replay of each captured round (kind, mode, size, width), measured by profile_rounds()
        self.costs: dict[tuple[SamplingMode, int, int], float] = {}
        self._pool = torch.cuda.graph_pool_handle()
        # every warm-up run and capture of the steps runs here; the engine captures its prefill graphs here
        # too (graphs/prefill.py says why it avoids other side streams)
        self.capture_stream = torch.cuda.Stream(device)

    # step bodies returning plain tensors (what a graph can hold)
    def _decode(self, slots: torch.Tensor, mode: SamplingMode, width: int) -> tuple[torch.Tensor, ...]:
        out = self.steps.decode(slots, mode)
        return out.tokens, out.n_new, out.scores, out.confidence

    def _round(self, slots: torch.Tensor, mode: SamplingMode, width: int) -> tuple[torch.Tensor, ...]:
        out = self.steps.spec_round(slots, mode, width)
        return out.tokens, out.n_new, out.scores, out.confidence

    # -- capture ----------------------------------------------------------------------------
    def _capture(self, kind: StepKind, mode: SamplingMode, bs: int, width: int) -> WarmupEntry:
        fn, slots = self._fns[kind], self._slots[bs]
        slots.fill_(-1)
        self._last[bs] = [-1] * bs
        self.capture_stream.wait_stream(torch.cuda.current_stream())
        t0 = time.perf_counter()
        with torch.cuda.stream(self.capture_stream):
            for _ in range(2):                  # the first call compiles; the second is a clean warm run
                fn(slots, mode, width)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        # the pool's growth: release cached blocks first, or the capture may recycle them and the
        # difference comes out negative
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self.capture_stream):
            outputs = fn(slots, mode, width)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        self._graphs[(kind, mode, bs, width)] = _Captured(graph, outputs)
        return WarmupEntry(kind.value, mode.value, bs, compile_s=t1 - t0, capture_s=t2 - t1,
                           graph_bytes=torch.cuda.memory_reserved(self.device) - before, width=width)

    def _widths(self, kind: StepKind) -> tuple[int, ...]:
        return self.widths if kind is StepKind.ROUND else (0,)

    def warmup(self, kinds: list[StepKind], progress: bool = True,
               modes: Sequence[SamplingMode] = tuple(SamplingMode)) -> WarmupReport:
        """Compile and capture each step kind in each sampling mode at every batch size (a round at
        each of its verify widths). The smallest size is compiled first and the largest captured next
        (graphs/compile.py: the regions compile symbolic in the batch at the first size of two or
        more, with that size as its hint), then the rest, largest first, so the smaller graphs reuse
        the shared pool's memory. Then the rounds' replay times are measured (:meth:`profile_rounds`), when
        there is a choice of width for the width policy to make."""
        from torch._dynamo.utils import counters

        report = WarmupReport(mode="cuda-graphs")
        watched = ("fxgraph_cache_hit", "fxgraph_cache_miss")
        before = {k: counters["inductor"][k] for k in watched}
        graphs_before = counters["stats"]["unique_graphs"]
        t_all = time.perf_counter()
        todo = [(k, m, b, w) for k in kinds for m in modes for w in reversed(self._widths(k))
                for b in reversed(self.batch_sizes)]
        for i, (kind, mode, bs, width) in enumerate(todo):
            if (kind, mode, bs, width) in self._graphs:
                continue
            if bs == self.batch_sizes[-1] and self.compiled:
                self._compile_smallest(kind, mode, width)
            entry = self._capture(kind, mode, bs, width)
            report.entries.append(entry)
            if progress:
                log.info("[%d/%d] %s %s bs=%d%s: compile %.2fs, capture %.3fs, %.1f MiB", i + 1, len(todo),
                         kind.value, mode.value, bs, f" width={width}" if width else "", entry.compile_s,
                         entry.capture_s, entry.graph_bytes / 2**20)
        report.total_s = time.perf_counter() - t_all
        # the counters are per process: this warm-up's share
        report.graphs_compiled = counters["stats"]["unique_graphs"] - graphs_before
        report.cache_hits, report.cache_misses = (counters["inductor"][k] - before[k] for k in watched)
        if progress:
            log.info("warm-up %.1fs: %d graphs captured, %d region graphs compiled (Inductor FX graph cache: "
                     "%d hits, %d misses)", report.total_s, len(report.entries), report.graphs_compiled,
                     report.cache_hits, report.cache_misses)
        if StepKind.ROUND in kinds and len(self.widths) > 1:
            t0 = time.perf_counter()
            self.profile_rounds(modes)
            report.profile_s = time.perf_counter() - t0
            if progress:
                log.info("round costs measured in %.1fs (%d graphs)", report.profile_s, len(self.costs))
        return report

    def _compile_smallest(self, kind: StepKind, mode: SamplingMode, width: int) -> None:
        """Run ``kind`` in ``mode`` once at the smallest captured size, all padding rows (it changes no
        state), so that the regions' batch-1 graphs come first and the largest size compiles next."""
        slots = self._slots[self.batch_sizes[0]]
        slots.fill_(-1)
        self._last[self.batch_sizes[0]] = [-1] * self.batch_sizes[0]
        self.capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.capture_stream):
            self._fns[kind](slots, mode, width)
        torch.cuda.synchronize()

    def profile_rounds(self, modes: Sequence[SamplingMode], replays: int = 7) -> None:
        """Measure each captured round's replay time (the median of ``replays``, padding rows only:
        the same kernels a full batch runs, and no state changes) into :attr:`costs`: the width policy's
        cost table (runtime/speculation.py), per sampling mode, batch size and verify width."""
        stream = torch.cuda.current_stream(self.device)
        for (kind, mode, bs, width), captured in self._graphs.items():
            if kind is not StepKind.ROUND or mode not in modes:
                continue
            self._slots[bs].fill_(-1)
            self._last[bs] = [-1] * bs
            captured.graph.replay()                       # once unmeasured: the first replay uploads the graph
            times = []
            for _ in range(replays):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                captured.graph.replay()
                end.record(stream)
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            self.costs[(mode, bs, width)] = sorted(times)[len(times) // 2]

    # -- replay -----------------------------------------------------------------------------
    def padded_size(self, n: int) -> int:
        """The captured batch size a batch of ``n`` rows runs at."""
        i = bisect.bisect_left(self.batch_sizes, n)
        if i == len(self.batch_sizes):
            raise ValueError(f"batch of {n} rows exceeds the largest captured size {self.batch_sizes[-1]}")
        return self.batch_sizes[i]

    def run(self, kind: StepKind, slots: list[int], mode: SamplingMode, width: int | None = None):
        bs = self.padded_size(len(slots))
        width = (max(self.widths) if width is None else width) if kind is StepKind.ROUND else 0
        key = (kind, mode, bs, width)
        if key not in self._graphs:
            log.warning("capturing %s %s bs=%d width=%d on first use: call Engine.warmup() before taking traffic",
                        kind.value, mode.value, bs, width)
            self._capture(kind, mode, bs, width)
        padded = list(slots) + [-1] * (bs - len(slots))
        if padded != self._last[bs]:
            self._flip ^= 1
            staging = self._staging[self._flip][:bs]
            staging.copy_(torch.tensor(padded, dtype=torch.int64))
            self._slots[bs].copy_(staging, non_blocking=True)
            self._last[bs] = padded
        captured = self._graphs[key]
        captured.graph.replay()
        return captured
