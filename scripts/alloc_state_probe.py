"""In-process probe of the allocator-state slowdown (docs/benchmarks.md, session 12): on the H200 a
process's batch-1 decode step ran ~20 us slower (0.731 -> 0.751 ms) for good once new small
allocator segments had been created on a stream or pool that had none cached, even 16 MiB of
64 KiB tensors allocated and freed on a fresh side stream, while 1 GiB in one block did not do it.
Session 12 found this by comparing processes; this times one engine's step replay before and after
each allocation pattern in one process, so the next device session can localize the trigger:

    python3 scripts/alloc_state_probe.py --preset lfm2.5-1.2b --actions side:1,side:1,side:2,side:4,side:8,current:8,large:1
    LFMSPARK_PDL=0 python3 scripts/alloc_state_probe.py ...     # does it need PDL?
    python3 scripts/alloc_state_probe.py --micro [--no-pdl]      # does it need lfmspark at all?

``--micro`` times, instead of an engine, a CUDA graph of 100 chained Triton launches shaped like the
decode step's one-row products: each streams 8 MiB of its own weights (requested before its PDL
wait) and adds the predecessor's small output, 800 MiB per replay.

Actions (``name:n``; each allocates, keeps nothing and frees; memory stats after each):
- ``side:n``: ``n`` x 2 MiB of 64 KiB tensors on a fresh side stream (``n`` new small segments);
- ``current:n``: the same on the current stream (reuses cached blocks when there are any);
- ``large:n``: ``n`` x 1 GiB tensors on a fresh side stream (large segments);
- ``capture:n``: a CUDA graph capturing the ``side:n`` allocations, in a private pool of its own;
- ``empty``: ``torch.cuda.empty_cache()``;
- ``raw:m`` / ``rawfree:m``: ``m`` MiB from the driver (``cuMemAlloc``, no PyTorch, no stream), kept / freed;
- ``stream``: a kernel on a fresh side stream into an existing tensor (a new stream, no allocation);
- ``sideempty:n``: ``side:n`` without the fill kernels (``torch.empty``: allocations only);
- ``sidealloc_curfill:n`` / ``curalloc_sidefill:n``: allocated on a fresh side stream and filled on the current
  one, or the reverse (which stream's kernel writes the new memory first?);
- ``capreplay:n``: ``capture:n``, then one replay of that graph on the current stream;
- ``mmcur`` / ``mmside`` / ``capmm``: a cuBLAS product into an existing output on the current stream, on a fresh
  side stream, or captured on a fresh side stream and replayed on the current one (cuBLAS takes a workspace per
  stream);
- ``recapture``: capture and instantiate the chain graph, or the engine's step graphs, again (the former
  graph is destroyed);
- ``capkeep`` (``--micro``): capture the chain again into a new graph and keep the former ones alive.

``--pre`` runs actions before the engine or chain is built (does the order matter?).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import statistics

import torch
import triton
import triton.language as tl

from lfmspark import Engine, SamplingParams
from lfmspark.runtime.bench import time_replays


@triton.jit
def _chain_kernel(w_ptr, x_ptr, y_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # one link of --micro's chain: this program's weight block first (it depends on no kernel), then
    # the predecessor's output, as lfmspark's products do under PDL (ops/_dispatch.py)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    w = tl.load(w_ptr + pid * BLOCK + tl.arange(0, BLOCK))
    if PDL:
        tl.extra.cuda.gdc_wait()
    tl.store(y_ptr + pid, tl.sum(w.to(tl.float32)) + tl.load(x_ptr + pid))


class MicroChain:
    """``launches`` chained weight-streaming kernels captured in one CUDA graph (``--micro``)."""

    BLOCK = 4096  # bf16 elements per program: 8 KiB

    def __init__(self, launches: int, mib_per_launch: int, pdl: bool):
        programs = mib_per_launch * 2**20 // (2 * self.BLOCK)
        self.weights = [torch.randn(programs * self.BLOCK, device="cuda").to(torch.bfloat16) for _ in range(launches)]
        self.vectors = [torch.zeros(programs, device="cuda") for _ in range(2)]
        self.pdl, self.programs = pdl, programs
        self.kept: list[torch.cuda.CUDAGraph] = []
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            self._run()
        torch.cuda.synchronize()
        self.capture()

    def capture(self, keep: bool = False) -> None:
        if keep:
            self.kept.append(self.graph)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            self._run()
        torch.cuda.synchronize()

    def _run(self) -> None:
        for i, w in enumerate(self.weights):
            x, y = self.vectors[i % 2], self.vectors[1 - i % 2]
            _chain_kernel[(self.programs,)](w, x, y, BLOCK=self.BLOCK, PDL=self.pdl, num_warps=4, launch_pdl=self.pdl)

    def time_ms(self, iters: int) -> float:
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


_LIBCUDA = None
_KEPT: list[ctypes.c_uint64] = []  # raw:m allocations live to the end of the process


def _driver_alloc(mib: int, free: bool) -> None:
    global _LIBCUDA
    if _LIBCUDA is None:
        _LIBCUDA = ctypes.CDLL("libcuda.so.1")
    torch.cuda.synchronize()  # a runtime call that makes the primary context current on this thread
    ptr = ctypes.c_uint64()
    rc = _LIBCUDA.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20))
    if rc != 0:
        raise SystemExit(f"cuMemAlloc_v2({mib} MiB) failed with CUresult {rc}")
    if free:
        _LIBCUDA.cuMemFree_v2(ptr)
    else:
        _KEPT.append(ptr)


_SCRATCH: torch.Tensor | None = None


def _allocate(action: str, chain: "MicroChain | None" = None, engine: Engine | None = None) -> None:
    global _SCRATCH
    name, _, count = action.partition(":")
    n = int(count or 1)
    if name == "empty":
        torch.cuda.empty_cache()
        return
    if name in ("raw", "rawfree"):
        _driver_alloc(n, free=name == "rawfree")
        return
    if name == "stream":
        if _SCRATCH is None:
            _SCRATCH = torch.zeros(16384, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            _SCRATCH.add_(1.0)
        torch.cuda.synchronize()
        return
    if name == "capkeep":
        if chain is None:
            raise SystemExit("capkeep needs --micro")
        chain.capture(keep=True)
        return
    if name == "recapture":
        if chain is not None:
            chain.capture()
        else:
            engine.runner._graphs.clear()
            engine.runner.warmup([engine.step_kind], progress=False, sampling_modes=(False,))
        return
    if name in ("sidealloc_curfill", "curalloc_sidefill"):
        side = torch.cuda.Stream()
        alloc_stream, fill_stream = ((side, torch.cuda.current_stream()) if name == "sidealloc_curfill"
                                     else (torch.cuda.current_stream(), side))
        with torch.cuda.stream(alloc_stream):
            blocks = [torch.empty(16384, device="cuda") for _ in range(32 * n)]
        torch.cuda.synchronize()
        with torch.cuda.stream(fill_stream):
            for block in blocks:
                block.fill_(1.0)
        torch.cuda.synchronize()
        blocks.clear()
        return
    if name in ("mmcur", "mmside", "capmm"):
        a = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(256, 2048, device="cuda", dtype=torch.bfloat16)
        torch.mm(a, b, out=out)  # written once by the current stream, so the new memory is not first touched below
        torch.cuda.synchronize()
        if name == "capmm":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
                torch.mm(a, b, out=out)
            graph.replay()
            torch.cuda.synchronize()
            del graph
        else:
            stream = torch.cuda.current_stream() if name == "mmcur" else torch.cuda.Stream()
            with torch.cuda.stream(stream):
                torch.mm(a, b, out=out)
            torch.cuda.synchronize()
        return
    if name == "capreplay":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            blocks = [torch.ones(16384, device="cuda") for _ in range(32 * n)]
        graph.replay()
        torch.cuda.synchronize()
        blocks.clear()
        del graph
        return
    if name == "sideempty":
        with torch.cuda.stream(torch.cuda.Stream()):
            blocks = [torch.empty(16384, device="cuda") for _ in range(32 * n)]
        torch.cuda.synchronize()
        blocks.clear()
        return
    if name not in ("side", "current", "large", "capture"):
        raise SystemExit(f"unknown action {action!r}: use side:N, sideempty:N, current:N, large:N, capture:N, "
                         "capreplay:N, mmcur, mmside, capmm, sidealloc_curfill:N, curalloc_sidefill:N, raw:MiB, "
                         "rawfree:MiB, stream, recapture, capkeep or empty")
    if name == "capture":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            blocks = [torch.ones(16384, device="cuda") for _ in range(32 * n)]
        blocks.clear()
        del graph
        return
    stream = torch.cuda.current_stream() if name == "current" else torch.cuda.Stream()
    with torch.cuda.stream(stream):
        if name == "large":
            blocks = [torch.ones(1 << 28, device="cuda") for _ in range(n)]
        else:
            blocks = [torch.ones(16384, device="cuda") for _ in range(32 * n)]  # 32 x 64 KiB fill one 2 MiB small segment
    torch.cuda.synchronize()
    blocks.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="lfm2.5-1.2b")
    ap.add_argument("--draft", action="store_true", help="time the speculative round (imposed 0.8) instead")
    ap.add_argument("--actions", default="side:1,side:1,side:2,side:4,side:8,current:8,large:1,capture:1")
    ap.add_argument("--pre", default="", help="actions to run before the engine or chain is built")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--micro", action="store_true", help="time a synthetic PDL chain graph instead of an engine")
    ap.add_argument("--no-pdl", action="store_true", help="with --micro: launch the chain without PDL")
    ap.add_argument("--launches", type=int, default=100, help="with --micro: the chain's length")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("alloc_state_probe needs a CUDA device")
    for action in filter(None, args.pre.split(",")):
        _allocate(action)
    chain = engine = None
    if args.micro:
        chain = MicroChain(launches=args.launches, mib_per_launch=8, pdl=not args.no_pdl)

        def replay_ms() -> float:
            return chain.time_ms(args.iters)
    else:
        kw = dict(max_batch=1, max_seq_len=1200, batch_sizes=[1])
        if args.draft:
            from lfmspark.models.presets import DEFAULT_DRAFT, draft_preset

            gamma = draft_preset(DEFAULT_DRAFT[args.preset]).block_size
            engine = Engine.from_preset(args.preset, **kw, imposed_acceptance=[0.8] * gamma)
        else:
            engine = Engine.from_preset(args.preset, None, **kw)
        engine.warmup(sampling=False)
        engine.generate([[5 + i % 1000 for i in range(128)]], SamplingParams(max_new_tokens=128, ignore_eos=True))

        def replay_ms() -> float:
            return time_replays(engine, 1, args.iters, sampling=False) * 1e3

    def measure(label: str) -> dict:
        stats = torch.cuda.memory_stats()
        row = {"after": label, "step_ms": replay_ms(),
               "device_mallocs": stats.get("num_device_alloc"), "small_segments": stats.get("segment.small_pool.current"),
               "reserved_mib": torch.cuda.memory_reserved() / 2**20}
        print(f"{label:>14}  step {row['step_ms']:.4f} ms  device mallocs {row['device_mallocs']}  "
              f"small segments {row['small_segments']}  reserved {row['reserved_mib']:.0f} MiB", flush=True)
        return row

    rows = [measure("start"), measure("start again")]
    for action in args.actions.split(","):
        _allocate(action, chain, engine)
        rows.append(measure(action))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": None if args.micro else args.preset, "draft": args.draft, "micro": args.micro,
                       "pre": args.pre, "actions": args.actions,
                       "pdl": not args.no_pdl if args.micro else None, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
