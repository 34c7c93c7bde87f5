"""Where the first request's TTFT goes: time each prefill shape's first and second request after
warm-up, and list the Triton kernels compiled (in-process cache misses) during each.

    python3 scripts/ttft_probe.py --preset lfm2.5-1.2b --shapes 1x128,1x128,4x128,4x128,1x500,16x128
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import time

import torch
import triton

from lfmspark import Engine, SamplingParams

compiled: list[str] = []


def _hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
    consts = {k: v for k, v in compile["constants"].items() if not isinstance(v, (type(None),))}
    compiled.append(f"{fn.name} {sorted(consts.items(), key=str)[:12]}")
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="lfm2.5-1.2b")
    ap.add_argument("--shapes", default="1x128,1x128,4x128,4x128,1x500,1x500,16x128")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--no-draft", action="store_true")
    ap.add_argument("--prefill-graph-tokens", type=int, default=1024, help="0: eager prefill at each prompt's shape")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    kw = dict(max_batch=max(sizes), max_seq_len=1200, batch_sizes=sizes, prefill_graph_tokens=args.prefill_graph_tokens)
    if args.no_draft:
        engine = Engine.from_preset(args.preset, None, **kw)
    else:
        from lfmspark.models.presets import DEFAULT_DRAFT, draft_preset

        gamma = draft_preset(DEFAULT_DRAFT[args.preset]).block_size
        engine = Engine.from_preset(args.preset, **kw, imposed_acceptance=[0.8] * gamma)
    t0 = time.perf_counter()
    engine.warmup(sampling=False)
    print(f"warmup {time.perf_counter() - t0:.1f}s")
    triton.knobs.runtime.jit_cache_hook = _hook
    rows = []
    for shape in args.shapes.split(","):
        b, t = (int(x) for x in shape.split("x"))
        prompts = [[(7 * i + 3 * j) % 1000 + 10 for j in range(t)] for i in range(b)]
        compiled.clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))
        wall = time.perf_counter() - t0
        ttft = sorted(o.stats.ttft_s for o in outs)
        kernels = collections.Counter(c.split(" ")[0] for c in compiled)
        rows.append({"shape": shape, "wall_ms": wall * 1e3, "ttft_ms_max": ttft[-1] * 1e3,
                     "compiled": list(compiled)})
        print(f"{shape:>8} wall {wall * 1e3:8.1f} ms  ttft max {ttft[-1] * 1e3:8.1f} ms  "
              f"compiled {sum(kernels.values())}: {dict(kernels)}")
        for c in compiled:
            print("      ", c[:220])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
