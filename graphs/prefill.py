"""Prefill at bucket shapes, replayed from CUDA graphs when captured (the TTFT path).

Why: an eager prefill launches each of its kernels from Python. For LFM2.5-1.2B on a GPU a
128-token prompt takes 14-21 ms that way, most of it host-side launch work, while the GPU needs a
fraction of that: below a few hundred tokens a prefill is bound by reading the weights once, like
a decode step. A captured graph replays the same kernels without the host in the loop.

Buckets: a graph has fixed shapes, so a chunk of ``rows`` prompts of up to ``width`` tokens runs at
the smallest bucket ``(R, W)`` that holds it (:func:`prefill_buckets`, :meth:`PrefillRunner.bucket`):
the extra rows are padding rows (slot ``-1``: they write no cache, state or context) and the columns
past a row's length are padding columns (only the first ``lens[b]`` tokens of a row are real:
models/lfm2.py), which the model already handles for ragged batches. The buckets double in width
up to 256 tokens, where a prefill is still bound by the weight reads so padding costs little, then
grow by half; they cover ``R * W <= token_budget`` tokens. A chunk that fits no bucket (or whose
padding columns would run past the cache) runs eagerly at its own shape.

With buckets on, an engine pads the same way with or without graphs (on CPU too), so one that
replays graphs computes the same shapes with the same kernels as one that does not: identical
results. Each bucket's graph is captured once at warm-up (:meth:`PrefillRunner.warmup`, largest first,
into one pool of its own) with every row a padding row, so capture changes no state; its inputs
are one static device buffer per bucket, refilled by one host-to-device copy per chunk. Only the
forward is captured (:meth:`lfmspark.runtime.steps.Steps.prefill_logits`); picking the first token
and writing the slot state stay eager (a few kernels), so greedy and sampling share the graphs.

On by default (``Engine(prefill_graph_tokens=1024)``; ``0`` runs every chunk eagerly at its own
shape). The buckets take the TTFT of a 128-token prompt from 12-20 ms to 2.3-2.5 ms
(LFM2.5-1.2B; docs/benchmarks.md, "TTFT"). Captured after the step graphs, they would leave every
later decode step ~20 us slower (batch 1: 0.731 -> 0.752 ms per token; docs/decisions.md, "Prefill,
warm-up and the allocator"): a driver-level state of CUDA graphs with PDL edges, in which a
synthetic chain of PDL launches replays ~12% slower for good once the process has captured its
fourth graph, or once a kernel on a side stream has been the first to write newly allocated memory.
Captured *before* the step graphs, the buckets cost the decode nothing (0.731 ms), so
:meth:`Engine.warmup` warms and captures the prefill first, and the eager bucket runs stay on the
current stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from ..models.lfm2 import ConvSnapshots
from .runner import WarmupEntry

log = logging.getLogger("lfmspark")

# (ids [R, W], slots [R], start [R], lens [R]) -> logits [R, V] of each row's last real token
PrefillForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

MIN_WIDTH = 16          # the narrowest bucket: one- to 16-token prompts share it
DOUBLING_UNTIL = 256    # widths double up to here, then grow by half (padding costs compute beyond it)


def bucket_widths(max_width: int) -> list[int]:
    """16, 32, ..., 256, 384, 512, 768, 1024, ... up to ``max_width`` (which ends the list when it
    falls between two steps)."""
    widths, w = [], MIN_WIDTH
    while w < max_width:
        widths.append(w)
        if w < DOUBLING_UNTIL:
            w *= 2
        else:               # 256 -> 384 -> 512 -> 768 -> 1024: a power of two grows by half, the others to the next
            w = w * 3 // 2 if w & (w - 1) == 0 else w * 4 // 3
    return widths + [max_width] if max_width >= 1 else widths


def prefill_buckets(max_batch: int, max_width: int, token_budget: int) -> list[tuple[int, int]]:
    """The ``(rows, width)`` bucket shapes: rows 1, 2, 4, ... and ``max_batch``, widths from
    :func:`bucket_widths`, every bucket at most ``token_budget`` tokens (``0``: no buckets, every
    chunk runs at its own shape)."""
    if token_budget <= 0:
        return []
    rows = sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch})
    widths = bucket_widths(min(max_width, token_budget))
    return [(r, w) for r in rows for w in widths if r * w <= token_budget]


class PrefillRunner:
    """Runs prefill chunks at bucket shapes (see the module doc): a captured graph's replay when
    the bucket has one, else ``forward`` at the padded shape (or at the chunk's own shape when no
    bucket fits)."""

    def __init__(self, forward: PrefillForward, device: torch.device, buckets: Sequence[tuple[int, int]],
                 max_seq_len: int, snapshots: ConvSnapshots | None = None):
        """``snapshots``: where the forward copies the prefix cache's conv snapshots (models/lfm2.py
        ``ConvSnapshots``), whose index :meth:`run` fills for each chunk; None without a prefix cache."""
        self.forward, self.device, self.max_seq_len = forward, device, max_seq_len
        self.snapshots = snapshots
        self._snapshot_rows = 0          # index rows the last set_snapshot_rows filled
        self.buckets = sorted(set(buckets), key=lambda b: (b[0] * b[1], b))   # smallest first
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def bucket(self, rows: int, width: int, start: int) -> tuple[int, int] | None:
        """The smallest bucket holding ``rows x width`` whose padding columns stay inside the cache
        (positions ``start .. start + W - 1``, ``start`` the rows' furthest), or None."""
        for r, w in self.buckets:
            if r >= rows and w >= width and start + w <= self.max_seq_len:
                return r, w
        return None

    @staticmethod
    def _layout(shape: tuple[int, int]) -> tuple[int, int]:
        """``(ids, per_row)``: the int64 elements the ids and each per-row vector occupy in a packed
        buffer, rounded up to even so that every part starts 16 bytes into a 16-byte multiple. Triton
        specializes a kernel on whether its pointers are 16-byte aligned: a misaligned ``start`` would
        compile (and, before capture, be warmed as) a variant of its own."""
        R, W = shape
        return (R * W + 1) // 2 * 2, (R + 1) // 2 * 2

    @classmethod
    def _pack(cls, chunks: Sequence[Sequence[int]], slots: Sequence[int], starts: Sequence[int],
              shape: tuple[int, int]) -> torch.Tensor:
        """One int64 host tensor holding ``ids | slots | start | lens`` (:meth:`_layout`), padded to
        ``shape``: padding rows have slot ``-1`` and length 0, padding tokens are 0."""
        R, W = shape
        n_ids, n_row = cls._layout(shape)
        flat = torch.zeros(n_ids + 3 * n_row, dtype=torch.int64)
        ids = flat[:R * W].view(R, W)
        for i, chunk in enumerate(chunks):
            ids[i, :len(chunk)] = torch.tensor(chunk, dtype=torch.int64)
        per_row = flat[n_ids:].view(3, n_row)
        per_row[0] = -1
        per_row[0, :len(slots)] = torch.tensor(list(slots), dtype=torch.int64)
        per_row[1, :len(starts)] = torch.tensor(list(starts), dtype=torch.int64)
        per_row[2, :len(chunks)] = torch.tensor([len(c) for c in chunks], dtype=torch.int64)
        return flat

    @classmethod
    def _unpack(cls, flat: torch.Tensor, shape: tuple[int, int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids [R, W], slots [R], start [R], lens [R])``: views of a packed buffer."""
        R, W = shape
        n_ids, n_row = cls._layout(shape)
        slots, start, lens = flat[n_ids:].view(3, n_row)[:, :R]
        return flat[:R * W].view(R, W), slots, start, lens

    def padding_inputs(self, shape: tuple[int, int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """A packed device buffer for ``shape`` whose rows are all padding rows (slot ``-1``, every
        column counted, zero ids, start 0), and its :meth:`_unpack` views: what warm-up runs and
        captures, changing no state."""
        n_ids, n_row = self._layout(shape)
        flat = torch.zeros(n_ids + 3 * n_row, dtype=torch.int64, device=self.device)
        inputs = self._unpack(flat, shape)
        inputs[1].fill_(-1)
        inputs[3].fill_(shape[1])
        return flat, inputs

    def set_snapshot_rows(self, snapshot_rows: Sequence[Sequence[int]] | None) -> None:
        """Before a forward: row ``i``'s conv snapshots go to the conv pool rows ``snapshot_rows[i]``
        (models/lfm2.py ``ConvSnapshots``; None: nowhere), every other entry of the index (padding
        rows, multiples nothing stores) to the scratch row. The index is a fixed buffer the forward
        reads, so a graph replays it; the rows the last call filled are reset with it."""
        sink = self.snapshots
        if sink is None:
            return
        rows = list(snapshot_rows or ())
        n = max(len(rows), self._snapshot_rows)
        if n == 0:
            return
        host = torch.full((n, sink.index.shape[1]), sink.scratch, dtype=torch.int64)
        for i, entries in enumerate(rows):
            entries = list(entries)[:sink.index.shape[1]]
            host[i, :len(entries)] = torch.tensor(entries, dtype=torch.int64)
        if self.device.type == "cuda":        # through pinned memory: queued, no wait for the stream (runtime/transfer.py)
            host = host.pin_memory()
        sink.index[:n].copy_(host.to(self.device, non_blocking=True))
        self._snapshot_rows = len(rows)

    def run(self, chunks: Sequence[Sequence[int]], slots: Sequence[int], starts: Sequence[int]) -> torch.Tensor:
        """The logits ``[len(chunks), V]`` of each chunk's last token, after running the chunks (row
        ``i``: ``chunks[i]`` at positions ``starts[i] ..`` of slot ``slots[i]``; its conv snapshots
        where :meth:`set_snapshot_rows` said)."""
        rows, width = len(chunks), max(len(c) for c in chunks)
        shape = self.bucket(rows, width, max(starts)) or (rows, width)
        flat = self._pack(chunks, slots, starts, shape)
        if shape in self._graphs:
            graph, logits = self._graphs[shape]
            self._inputs[shape].copy_(flat, non_blocking=True)
            graph.replay()
            return logits[:rows]
        return self.forward(*self._unpack(flat.to(self.device, non_blocking=True), shape))[:rows]

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)

    def warmup(self, progress: bool = True, capture: bool = True,
               capture_stream: torch.cuda.Stream | None = None) -> list[WarmupEntry]:
        """Run every bucket once (CUDA only: on CPU nothing compiles), largest first, on the current
        stream, which compiles any Triton variant it needs; with ``capture``, then capture its graph
        on ``capture_stream`` (the step graphs' capture stream, so that the engine captures on one side
        stream; a new one if None), all into one pool. Every row is a padding row, so nothing in the
        engine's state changes.

        Why the eager runs are on the current stream: a kernel on a side stream that is the first to
        write new memory makes every later decode step 20 us slower (module doc)."""
        if self.device.type != "cuda":
            return []
        if capture and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if capture and capture_stream is None:
            capture_stream = torch.cuda.Stream(self.device)
        entries = []
        todo = [b for b in reversed(self.buckets) if b not in self._graphs]
        for i, shape in enumerate(todo):
            R, W = shape
            flat, inputs = self.padding_inputs(shape)
            t0 = time.perf_counter()
            self.forward(*inputs)
            torch.cuda.synchronize(self.device)
            t1 = time.perf_counter()
            entry = WarmupEntry(f"prefill {R}x{W}", "any", R, compile_s=t1 - t0)
            if capture:
                torch.cuda.empty_cache()     # as graphs/capture.py: so the pool's growth is not negative
                before = torch.cuda.memory_reserved(self.device)
                graph = torch.cuda.CUDAGraph()
                capture_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.graph(graph, pool=self._pool, stream=capture_stream):
                    logits = self.forward(*inputs)
                torch.cuda.synchronize(self.device)
                entry.capture_s = time.perf_counter() - t1
                entry.graph_bytes = torch.cuda.memory_reserved(self.device) - before
                self._inputs[shape], self._graphs[shape] = flat, (graph, logits)
            entries.append(entry)
            if progress:
                log.info("[%d/%d] prefill %dx%d: warm run %.2fs%s", i + 1, len(todo), R, W, entry.compile_s,
                         f", capture {entry.capture_s:.3f}s" if capture else "")
        return entries
