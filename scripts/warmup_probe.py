"""Warm-up time of an engine at every default batch size, and its decode TPOT after it (issue 35's
warm-up figure and issue 36's scheduled rounds; GPU).

    python scripts/warmup_probe.py --kind speculative --max-batch 64            # cold or warm, as the cache is
    python scripts/warmup_probe.py --kind target-only --batch-sizes 1,8,32,64   # only these sizes captured

Builds the preset (random weights; speculative: its draft with imposed acceptance 0.8), times
``Engine.warmup()`` (prefill kernels and bucket graphs, then the step compiled and captured at every
size in the sampling modes asked for), prints what was compiled and captured, then the median
per-request greedy TPOT (first to last token over the tokens after the first) of two batches of
128-token prompts and 128 new tokens at each ``--tpot-sizes`` size: for a speculative engine with
its verify widths scheduled (runtime/speculation.py) and with the whole block every round, and the
rounds each width got. Runs against an older checkout installed in its place too (without a
scheduler there, only the whole block).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from lfmspark import Engine, SamplingParams
from lfmspark.models.presets import DEFAULT_DRAFT, draft_preset


def tpot_ms(engine: Engine, batch: int) -> float:
    """Median per-request TPOT of two batches (after one untimed)."""
    high = min(60000, engine.model_config.vocab_size)
    prompts = [torch.randint(high // 10, high, (128,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(batch)]
    params = SamplingParams(max_new_tokens=128, ignore_eos=True)
    engine.generate(prompts, params)
    tpots = []
    for _ in range(2):
        tpots += [o.stats.decode_s / (len(o.token_ids) - 1) * 1e3 for o in engine.generate(prompts, params)]
    return statistics.median(tpots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="lfm2.5-1.2b")
    ap.add_argument("--kind", choices=("speculative", "target-only"), default="speculative")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--batch-sizes", default=None, help="sizes to capture (default: every default size)")
    ap.add_argument("--greedy-only", action="store_true", help="capture the greedy mode only")
    ap.add_argument("--tpot-sizes", default="1,8,32,64")
    ap.add_argument("--imposed-acceptance", type=float, default=0.8, help="the draft's imposed per-position rate")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    kw = dict(max_batch=args.max_batch, max_seq_len=1024)
    if args.batch_sizes:
        kw["batch_sizes"] = [int(b) for b in args.batch_sizes.split(",")]
    if args.kind == "speculative":
        gamma = draft_preset(DEFAULT_DRAFT[args.preset]).block_size
        engine = Engine.from_preset(args.preset, imposed_acceptance=[args.imposed_acceptance] * gamma, **kw)
    else:
        engine = Engine.from_preset(args.preset, None, **kw)
    t0 = time.perf_counter()
    report = engine.warmup(progress=True, sampling=not args.greedy_only)
    seconds = time.perf_counter() - t0
    steps = [e for e in report.entries if e.mode != "any"]
    result = {"preset": args.preset, "kind": args.kind, "warmup_s": round(seconds, 1),
              "prefill_warmup_s": round(report.prefill_s, 1), "step_warmup_s": round(report.total_s, 1),
              "step_graphs_captured": len(steps), "sizes": sorted({e.batch_size for e in steps}),
              "modes": sorted({e.mode for e in steps}),
              "region_graphs_compiled": getattr(report, "graphs_compiled", None),
              "fx_cache_hits": getattr(report, "cache_hits", None),
              "fx_cache_misses": getattr(report, "cache_misses", None), "tpot_ms": {}}
    print(f"{args.kind} warm-up {seconds:.1f} s (prefill {report.prefill_s:.1f} s, steps {report.total_s:.1f} s): "
          f"{len(steps)} step graphs, {result['region_graphs_compiled']} region graphs compiled", flush=True)
    scheduler = getattr(engine, "scheduler", None)
    widths = scheduler.widths if scheduler is not None else None
    for b in (int(s) for s in args.tpot_sizes.split(",")):
        if b > args.max_batch:
            continue
        result["tpot_ms"][b] = round(tpot_ms(engine, b), 4)
        print(f"{args.kind} b{b} tpot {result['tpot_ms'][b]} ms", flush=True)
        if widths is not None and len(widths) > 1:
            result.setdefault("rounds_by_width", {})[b] = engine.speculation_stats["rounds_by_width"]
            scheduler.widths = (max(widths),)          # the whole block every round, for comparison
            result.setdefault("tpot_ms_whole_block", {})[b] = round(tpot_ms(engine, b), 4)
            scheduler.widths = widths
            scheduler.stats.rounds_by_width.clear()
            print(f"{args.kind} b{b} tpot whole block {result['tpot_ms_whole_block'][b]} ms; scheduled rounds by "
                  f"width {result['rounds_by_width'][b]}", flush=True)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
