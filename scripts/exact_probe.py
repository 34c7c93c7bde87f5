"""Exact mode against the default mode on one preset (issue 39's figures; GPU).

    python scripts/exact_probe.py --preset lfm2.5-1.2b --prompts 200 --tokens 256 --json out.json

Identity: greedy speculative vs greedy target-only output (the preset's random-weight draft, nothing
imposed, the whole block verified every round) for ``--prompts`` prompts in batches of 32, in each mode: the share of prompts whose outputs
are identical and of tokens before the first difference. Cost: TPOT p50 (two batches of 128-token
prompts and ``--tokens`` new tokens) of target-only and speculative engines (imposed acceptance 0.8,
labelled, so its tokens are not the identity run's) at batch 1 and 8, in each mode, and the
exact/default ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from lfmspark import Engine, SamplingParams
from lfmspark.models.presets import DEFAULT_DRAFT, draft_preset


def prompts(n: int, vocab: int, length: int | None = None, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab // 10, vocab, (length or int(torch.randint(8, 64, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def outputs(engine: Engine, batch: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    out = []
    for i in range(0, len(batch), 32):
        out += [o.token_ids for o in engine.generate(batch[i:i + 32], params)]
    return out


def identity(a: list[list[int]], b: list[list[int]]) -> dict:
    same_prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
    return {"identical_prompts": sum(p == q for p, q in zip(a, b)) / len(a),
            "tokens_before_first_difference": sum(same_prefix) / sum(len(p) for p in a)}


def tpot_ms(engine: Engine, batch: int, tokens: int) -> float:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    ps = prompts(batch, engine.model_config.vocab_size, length=128, seed=7)
    engine.generate(ps, params)
    return statistics.median(o.stats.decode_s / (len(o.token_ids) - 1) * 1e3
                             for _ in range(2) for o in engine.generate(ps, params))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="lfm2.5-1.2b")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gamma = draft_preset(DEFAULT_DRAFT[args.preset]).block_size
    kw = dict(max_batch=32, max_seq_len=args.tokens + 256, batch_sizes=[1, 8, 32])
    result: dict = {"preset": args.preset, "prompts": args.prompts, "tokens": args.tokens}
    for exact in (False, True):
        mode = "exact" if exact else "default"
        outs = {}
        for kind, draft in (("speculative", "default"), ("target-only", None)):
            # the whole block every round: a rarely accepted draft would otherwise fall back to width 1
            widths = [gamma + 1] if draft else None
            engine = Engine.from_preset(args.preset, draft, exact=exact, verify_widths=widths, **kw)
            engine.warmup(progress=False, sampling=False)
            outs[kind] = outputs(engine, prompts(args.prompts, engine.model_config.vocab_size), args.tokens)
            if draft is not None:     # the cost of a round: imposed acceptance 0.8 (labelled), its own engine
                del engine
                engine = Engine.from_preset(args.preset, draft, exact=exact, imposed_acceptance=[0.8] * gamma,
                                            verify_widths=widths, **kw)
                engine.warmup(progress=False, sampling=False)
            result.setdefault(mode, {})[f"tpot_ms_{kind}"] = {b: round(tpot_ms(engine, b, args.tokens), 4)
                                                             for b in (1, 8)}
            del engine
            torch.cuda.empty_cache()
        result[mode]["identity"] = identity(outs["speculative"], outs["target-only"])
        print(mode, json.dumps(result[mode]), flush=True)
    result["exact_over_default"] = {kind: {b: round(result["exact"][f"tpot_ms_{kind}"][b]
                                                     / result["default"][f"tpot_ms_{kind}"][b], 3) for b in (1, 8)}
                                    for kind in ("speculative", "target-only")}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
