"""Microbenchmark: one grid barrier against one launch hand-off, the two ways to separate dependent
phases of a step on the H200.

Why: the remaining route to a shorter speculative round is structural (docs/benchmarks.md, sessions
19-20): several dependent products in one persistent launch, separated by grid barriers, instead of
one launch each chained by programmatic dependent launch (PDL). That only pays if a barrier costs
clearly less than a hand-off, which this measures with no weights involved:

- ``barrier``: ``P`` programs (one per SM) run ``R`` rounds; each round every program stores one
  value, passes ``_grid_barrier`` (ops/markov_walk_persistent.py, the persistent walk's) and reads
  all ``P`` values back from L2. Time per round.
- ``pdl`` / ``plain``: ``R`` launches of a ``P``-program kernel, each reading the ``P`` values its
  predecessor wrote and writing its own, captured in one CUDA graph, with PDL (trigger at entry,
  wait before the reads) or without. Time per launch.

Each variant checks every value it reads (a wrong count fails the run).

    python benchmarks/kernels/grid_barrier.py --rounds 64 --json FILE
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lfmspark.ops.markov_walk_persistent import _grid_barrier

try:
    from .common import time_ms
except ImportError:  # run as a script
    from common import time_ms


@triton.jit
def _barrier_rounds_kernel(buf_ptr, sync_ptr, bad_ptr, P, R, BLOCK_P: tl.constexpr, POLL_ASM: tl.constexpr):
    # round k writes buffer k % 2: a program can only write round k + 2 after every program has
    # passed barrier k + 1, i.e. finished reading round k
    j = tl.program_id(0)
    sync_ptr = sync_ptr.to(tl.pointer_type(tl.uint32))
    offs = tl.arange(0, BLOCK_P)
    ok = offs < P
    bad = 0
    for k in range(R):
        tl.store(buf_ptr + (k % 2) * BLOCK_P + j, k * P + j + 1)
        _grid_barrier(sync_ptr, P, POLL_ASM)
        seen = tl.load(buf_ptr + (k % 2) * BLOCK_P + offs, mask=ok, other=0, cache_modifier=".cg")
        bad += tl.sum(((seen != k * P + offs + 1) & ok).to(tl.int32))
    tl.atomic_add(bad_ptr, bad)


@triton.jit
def _phase_kernel(buf_ptr, bad_ptr, P, k, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    # launch k reads launch k - 1's values from buffer (k - 1) % 2 and writes its own to k % 2
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    j = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    ok = offs < P
    if PDL:
        tl.extra.cuda.gdc_wait()
    if k > 0:
        seen = tl.load(buf_ptr + ((k - 1) % 2) * BLOCK_P + offs, mask=ok, other=0, cache_modifier=".cg")
        tl.atomic_add(bad_ptr, tl.sum(((seen != (k - 1) * P + offs + 1) & ok).to(tl.int32)))
    tl.store(buf_ptr + (k % 2) * BLOCK_P + j, k * P + j + 1)


def run_barrier(P: int, R: int, device: torch.device) -> tuple[float, int]:
    """(us per round, wrong reads over all runs) of the persistent variant."""
    block_p = triton.next_power_of_2(P)
    buf = torch.zeros(2 * block_p, dtype=torch.int32, device=device)
    sync = torch.zeros(1, dtype=torch.int32, device=device)
    bad = torch.zeros(1, dtype=torch.int32, device=device)
    interpreted = device.type != "cuda"

    def once():
        _barrier_rounds_kernel[(P,)](buf, sync, bad, P, R, BLOCK_P=block_p, POLL_ASM=not interpreted, num_warps=4)

    if interpreted:
        once()
        return float("nan"), int(bad.item())
    ms = time_ms(once)
    return ms * 1e3 / R, int(bad.item())


def run_launches(P: int, R: int, pdl: bool, device: torch.device) -> tuple[float, int]:
    """(us per launch, wrong reads over all runs) of ``R`` chained launches."""
    block_p = triton.next_power_of_2(P)
    buf = torch.zeros(2 * block_p, dtype=torch.int32, device=device)
    bad = torch.zeros(1, dtype=torch.int32, device=device)
    extra = {"launch_pdl": True} if pdl else {}

    def chain():
        for k in range(R):
            _phase_kernel[(P,)](buf, bad, P, k, BLOCK_P=block_p, PDL=pdl, num_warps=4, **extra)

    if device.type != "cuda":
        chain()
        return float("nan"), int(bad.item())
    ms = time_ms(chain)
    return ms * 1e3 / R, int(bad.item())


def run(P: int | None = None, R: int = 64) -> list[dict]:
    device = torch.device("cuda")
    P = P or torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for name, fn in (("barrier", lambda: run_barrier(P, R, device)),
                     ("pdl", lambda: run_launches(P, R, True, device)),
                     ("plain", lambda: run_launches(P, R, False, device))):
        us, bad = fn()
        rows.append({"variant": name, "programs": P, "rounds": R, "us_each": round(us, 3), "wrong_reads": bad})
    return rows


if __name__ == "__main__":
    import argparse
    import json

    from tabulate import tabulate

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=64)
    ap.add_argument("--programs", type=int, default=None, help="default: one per SM")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = run(args.programs, args.rounds) + run(128, args.rounds)
    print(tabulate(result, headers="keys"))
    if any(r["wrong_reads"] for r in result):
        raise SystemExit("wrong reads: a barrier or a hand-off let a program read too early")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
