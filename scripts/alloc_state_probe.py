"""In-process probe of the allocator-state slowdown (docs/benchmarks.md, session 12): on the H200 a
process's batch-1 decode step ran ~20 us slower (0.731 -> 0.751 ms) for good once new small
allocator segments had been created on a stream or pool that had none cached, even 16 MiB of
64 KiB tensors allocated and freed on a fresh side stream, while 1 GiB in one block did not do it.
Session 12 found this by comparing processes; this times one engine's step replay before and after
each allocation pattern in one process, so the next device session can localize the trigger:

    python3 scripts/alloc_state_probe.py --preset lfm2.5-1.2b --actions side:1,side:1,side:2,side:4,side:8,current:8,large:1
    LFMSPARK_PDL=0 python3 scripts/alloc_state_probe.py ...     # does it need PDL?

Actions (``name:n``; each allocates, keeps nothing and frees; memory stats after each):
- ``side:n``: ``n`` x 2 MiB of 64 KiB tensors on a fresh side stream (``n`` new small segments);
- ``current:n``: the same on the current stream (reuses cached blocks when there are any);
- ``large:n``: ``n`` x 1 GiB tensors on a fresh side stream (large segments);
- ``capture:n``: a CUDA graph capturing the ``side:n`` allocations, in a private pool of its own;
- ``empty``: ``torch.cuda.empty_cache()``.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch

from lfmspark import Engine, SamplingParams
from lfmspark.runtime.bench import time_replays


def _allocate(action: str) -> None:
    name, _, count = action.partition(":")
    n = int(count or 1)
    if name == "empty":
        torch.cuda.empty_cache()
        return
    if name not in ("side", "current", "large", "capture"):
        raise SystemExit(f"unknown action {action!r}: use side:N, current:N, large:N, capture:N or empty")
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
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("alloc_state_probe needs a CUDA device")
    kw = dict(max_batch=1, max_seq_len=1200, batch_sizes=[1])
    if args.draft:
        from lfmspark.models.presets import DEFAULT_DRAFT, draft_preset

        gamma = draft_preset(DEFAULT_DRAFT[args.preset]).block_size
        engine = Engine.from_preset(args.preset, **kw, imposed_acceptance=[0.8] * gamma)
    else:
        engine = Engine.from_preset(args.preset, None, **kw)
    engine.warmup(sampling=False)
    engine.generate([[5 + i % 1000 for i in range(128)]], SamplingParams(max_new_tokens=128, ignore_eos=True))

    def measure(label: str) -> dict:
        stats = torch.cuda.memory_stats()
        row = {"after": label, "step_ms": time_replays(engine, 1, args.iters, sampling=False) * 1e3,
               "device_mallocs": stats.get("num_device_alloc"), "small_segments": stats.get("segment.small_pool.current"),
               "reserved_mib": torch.cuda.memory_reserved() / 2**20}
        print(f"{label:>14}  step {row['step_ms']:.4f} ms  device mallocs {row['device_mallocs']}  "
              f"small segments {row['small_segments']}  reserved {row['reserved_mib']:.0f} MiB", flush=True)
        return row

    rows = [measure("start"), measure("start again")]
    for action in args.actions.split(","):
        _allocate(action)
        rows.append(measure(action))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "draft": args.draft, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
