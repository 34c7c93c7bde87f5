"""Where a generation step's time goes at one batch size (issue 36's width-1 rounds at batch 128):
per step, the host time to launch, the wait for the GPU in the collect, and the host time to hand
out the tokens, with the kernel time per step from the profiler; for a target-only engine and a
speculative one held at given verify widths, in one process.

    python scripts/loop_probe.py --batch 128 --widths 1 --json loop.json

If the collect's wait is near zero the loop is host-bound (the host work per step outlasts the GPU's);
if it is most of the step the GPU bounds it, and the kernel table says which kernels.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from lfmspark import Engine, SamplingParams
from lfmspark.models.presets import DEFAULT_DRAFT, draft_preset


def timed(engine: Engine, name: str, sink: dict[str, list[float]]) -> None:
    """Wrap ``engine.<name>`` to record its host time per call."""
    inner = getattr(engine, name)

    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kw)
        finally:
            sink[name].append(time.perf_counter() - t0)

    setattr(engine, name, wrapper)


def probe(engine: Engine, batch: int, new_tokens: int, label: str) -> dict:
    high = min(60000, engine.model_config.vocab_size)
    prompts = [torch.randint(high // 10, high, (128,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(batch)]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, params)                       # untimed
    sink: dict[str, list[float]] = {"_launch": [], "_collect": [], "_admit": [], "wait": []}
    for name in ("_launch", "_collect", "_admit"):
        timed(engine, name, sink)
    original_sync = torch.cuda.Event.synchronize

    def sync(event):
        t0 = time.perf_counter()
        original_sync(event)
        sink["wait"].append(time.perf_counter() - t0)

    torch.cuda.Event.synchronize = sync
    try:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        # CUDA kernels on the device; on CPU (a smoke run) the host ops
        activity = ProfilerActivity.CUDA if engine.device.type == "cuda" else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            engine.generate(prompts, params)
    finally:
        torch.cuda.Event.synchronize = original_sync
    steps = len(sink["_launch"]) // 2                   # the timed generate's share (the profiled one ran the same)
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: -e.device_time_total)
    kernel_us = sum(e.device_time_total for e in kernels) / max(steps, 1)
    med = {k: statistics.median(v[: len(v) // 2] or [0.0]) * 1e3 for k, v in sink.items()}
    tpot = statistics.median(o.stats.decode_s / (len(o.token_ids) - 1) for o in outs) * 1e3
    result = {"label": label, "batch": batch, "steps": steps, "wall_ms_per_step": wall / steps * 1e3,
              "tpot_ms": tpot, "kernel_us_per_step": kernel_us,
              "host_ms_median": {k: round(v, 4) for k, v in med.items()},
              "top_kernels_us_per_step": [(e.key[:90], round(e.device_time_total / steps, 1), e.count / steps)
                                          for e in kernels[:12]]}
    print(f"{label}: tpot {tpot:.4f} ms, wall/step {result['wall_ms_per_step']:.4f} ms, kernels/step "
          f"{kernel_us:.1f} us; host medians (ms) {result['host_ms_median']}", flush=True)
    for key, us, n in result["top_kernels_us_per_step"]:
        print(f"    {us:8.1f} us  {n:5.1f}x  {key}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="lfm2.5-1.2b")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--widths", default="1", help="the speculative engine's verify widths (comma-separated)")
    ap.add_argument("--imposed-acceptance", type=float, default=0.8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kw = dict(max_batch=args.batch, max_seq_len=1024, batch_sizes=[args.batch])
    results = []
    engine = Engine.from_preset(args.preset, None, **kw)
    engine.warmup(progress=False, sampling=False)
    results.append(probe(engine, args.batch, args.new_tokens, "target-only"))
    del engine
    gamma = draft_preset(DEFAULT_DRAFT[args.preset]).block_size
    widths = [int(w) for w in args.widths.split(",")]
    engine = Engine.from_preset(args.preset, imposed_acceptance=[args.imposed_acceptance] * gamma,
                                verify_widths=widths, **kw)
    engine.warmup(progress=False, sampling=False)
    results.append(probe(engine, args.batch, args.new_tokens, f"speculative widths {widths}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
