"""Time to first token of multi-turn chats with the prefix cache on and off (issue 37's figure; GPU).

    python scripts/multiturn_probe.py                       # LFM2.5-1.2B preset + draft, 8 chats x 8 turns
    python scripts/multiturn_probe.py --preset tiny --system-len 40 --turn-len 10 --block 8   # a CPU smoke run

Every chat shares one system prompt (``--system-len`` random tokens); each turn appends a user
message (``--turn-len`` tokens) to the chat so far (previous prompts and replies) and generates
``--reply-len`` tokens. The chats of a turn run together, turn after turn, on one engine with the
prefix cache and one without (same weights, same trace). Between turns the engine finishes its
background work (``--cache-outputs``' cache jobs, which wait for a step where nothing decodes) before
the next messages arrive, as it would while users read the replies; that time is reported
(``between_turns_ms``), not counted in any TTFT. Prints per turn the TTFT p50 of each engine, their
ratio, the prompt tokens the cache supplied, and the decode TPOT p50 of each, then one JSON line.
The cache's budget (``--cache-tokens``) defaults to the whole trace, so that the figure measures
reuse, not eviction.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from lfmspark import Engine, SamplingParams
from lfmspark.models.presets import DEFAULT_DRAFT, draft_preset


def run_chats(engine: Engine, args, vocab: int) -> list[dict]:
    rng = random.Random(args.seed)
    system = [rng.randrange(100, vocab) for _ in range(args.system_len)]
    chats = [list(system) for _ in range(args.chats)]
    turns = []
    params = SamplingParams(max_new_tokens=args.reply_len, ignore_eos=True)
    for _ in range(args.turns):
        for chat in chats:
            chat += [rng.randrange(100, vocab) for _ in range(args.turn_len)]
        outs = engine.generate([list(c) for c in chats], params)
        for chat, out in zip(chats, outs):
            chat += out.token_ids
        t0 = time.perf_counter()
        while not engine.idle:      # the background work a reader's pause leaves time for
            engine.step()
        turns.append({"between_turns_ms": (time.perf_counter() - t0) * 1e3,"ttft_ms_p50": statistics.median(o.stats.ttft_s for o in outs) * 1e3,
                      "tpot_ms_p50": statistics.median(o.stats.decode_s / max(len(o.token_ids) - 1, 1)
                                                       for o in outs) * 1e3,
                      "prompt_tokens": statistics.median(len(c) - len(o.token_ids) for c, o in zip(chats, outs)),
                      "cached_tokens": statistics.median(o.stats.prompt_tokens_cached for o in outs)})
    return turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="lfm2.5-1.2b")
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--turn-len", type=int, default=200)
    ap.add_argument("--reply-len", type=int, default=64)
    ap.add_argument("--block", type=int, default=256, help="Engine(prefix_block=...)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-tokens", type=int, help="Engine(prefix_cache_tokens=...) (default: the whole "
                    "trace's tokens, so nothing is evicted)")
    ap.add_argument("--cache-outputs", action="store_true", help="Engine(prefix_cache_outputs=True): keep the "
                    "finished turns too")
    args = ap.parse_args()
    need = args.system_len + args.turns * (args.turn_len + args.reply_len) + 64
    results = {}
    trace_tokens = args.system_len + args.chats * args.turns * (args.turn_len + args.reply_len)
    for name, tokens in (("cache", args.cache_tokens or trace_tokens), ("no-cache", 0)):
        kw = dict(max_batch=args.chats, max_seq_len=need, prefix_cache_tokens=tokens, prefix_block=args.block,
                  prefix_cache_outputs=args.cache_outputs and tokens != 0)
        draft = DEFAULT_DRAFT.get(args.preset)
        if draft is not None:
            kw["imposed_acceptance"] = [0.8] * draft_preset(draft).block_size
        engine = Engine.from_preset(args.preset, **kw)
        if engine.cuda_graphs:
            engine.warmup(progress=False, sampling=False)
        results[name] = run_chats(engine, args, engine.model_config.vocab_size)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for t, (on, off) in enumerate(zip(results["cache"], results["no-cache"]), start=1):
        print(f"turn {t}: prompt {on['prompt_tokens']:.0f} tokens, {on['cached_tokens']:.0f} cached; TTFT p50 "
              f"{on['ttft_ms_p50']:.2f} ms with the cache, {off['ttft_ms_p50']:.2f} ms without "
              f"({off['ttft_ms_p50'] / on['ttft_ms_p50']:.1f}x); TPOT p50 {on['tpot_ms_p50']:.3f} / "
              f"{off['tpot_ms_p50']:.3f} ms; then {on['between_turns_ms']:.1f} ms of background work")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
