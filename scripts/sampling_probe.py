"""Speculative TPOT with the LFM2.5 model card's sampling settings (temperature 0.1, top_k 50, top_p 0.1,
repetition_penalty 1.05: the sort-free TOP_K mode) against greedy, against OpenAI-style top-p sampling
(temperature 0.7, top_p 0.9, no top_k: the FULL mode's sort) and against target-only (issue 34's figure; GPU).

    python scripts/sampling_probe.py          # LFM2.5-1.2B preset + draft, imposed acceptance 0.8
    python scripts/sampling_probe.py --profile 30   # also the 30 costliest kernels of a batch-1 card-sampling run

Per engine: warm up the captured sizes 1 and 8, one untimed generate, then the median per-request
TPOT (first to last token over the tokens after the first) of two runs of 256 tokens each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lfmspark import Engine, SamplingParams
from lfmspark.models.presets import DEFAULT_DRAFT, draft_preset

PRESET = "lfm2.5-1.2b"


def params(name: str, seed: int) -> SamplingParams:
    if name == "greedy":
        return SamplingParams(max_new_tokens=256, ignore_eos=True)
    if name == "top-p":
        return SamplingParams(max_new_tokens=256, ignore_eos=True, temperature=0.7, top_p=0.9, seed=seed)
    return SamplingParams(max_new_tokens=256, ignore_eos=True, temperature=0.1, top_k=50, top_p=0.1,
                          repetition_penalty=1.05, seed=seed)


def tpot_ms(engine: Engine, prompt: list[int], batch: int, name: str) -> float:
    engine.generate([prompt] * batch, [params(name, i) for i in range(batch)])
    tpots = []
    for run in range(2):
        outs = engine.generate([prompt] * batch, [params(name, 100 * run + i) for i in range(batch)])
        tpots += [o.stats.decode_s / (len(o.token_ids) - 1) * 1e3 for o in outs]
    return statistics.median(tpots)


def kernel_table(engine: Engine, prompt: list[int], top: int) -> None:
    """The costliest kernels (device time per committed token) of one batch-1 card-sampling request:
    what bounds the sampled round."""
    from torch.profiler import ProfilerActivity, profile

    engine.generate([prompt], [params("card", 1)])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = engine.generate([prompt], [params("card", 2)])[0]
    tokens = len(out.token_ids)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    print(f"profile: {total / tokens:.1f} us of kernel time per token, {out.stats.rounds} rounds, {tokens} tokens")
    for e in events[:top]:
        print(f"  {e.device_time_total / tokens:8.2f} us/token {e.count / out.stats.rounds:7.1f} /round  {e.key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", type=int, default=0, help="print this many of the costliest kernels")
    args = parser.parse_args()
    torch.manual_seed(0)
    prompt = torch.randint(100, 60000, (128,)).tolist()
    results = {}
    for kind in ("speculative", "target-only"):
        if kind == "speculative":
            rates = [0.8] * draft_preset(DEFAULT_DRAFT[PRESET]).block_size
            engine = Engine.from_preset(PRESET, max_batch=8, batch_sizes=[1, 8], max_seq_len=1024,
                                        imposed_acceptance=rates)
        else:
            engine = Engine.from_preset(PRESET, draft=None, max_batch=8, batch_sizes=[1, 8], max_seq_len=1024)
        t0 = time.perf_counter()
        engine.warmup(progress=False)
        print(kind, "warm-up", round(time.perf_counter() - t0, 1), "s", flush=True)
        for batch in (1, 8) if kind == "speculative" else (1,):
            for name in ("greedy", "card", "top-p") if kind == "speculative" and batch == 1 else ("greedy", "card"):
                key = f"{kind} b{batch} {name}"
                results[key] = round(tpot_ms(engine, prompt, batch, name), 4)
                print(key, results[key], "ms", flush=True)
        if args.profile and kind == "speculative":
            kernel_table(engine, prompt, args.profile)
        del engine
        torch.cuda.empty_cache()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
