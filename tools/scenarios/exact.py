"""``lfmspark bench exact``: what exact mode buys and what it costs, against the default mode.

Exact mode (``--exact``, docs/design.md) routes the target's products, norms and attention to
batch-invariant kernels, so that a token's results are the same bits in a decode step or a verify
window, alone or batched, and greedy speculative output equals target-only output on the GPU too.
This scenario measures both sides of that trade, in each mode:

- **identity**: greedy speculative against greedy target-only output for ``num_prompts`` prompts of
  8-64 random tokens (``output_len`` new tokens, in batches of ``max_batch``), with the draft's own
  acceptance (nothing imposed) and the whole block verified every round (a rarely accepted
  random-weight draft would otherwise have the width policy fall back to width 1, which verifies
  nothing): the share of prompts whose outputs are identical and of tokens before the first
  difference;
- **cost**: the median per-request TPOT of target-only and speculative engines (a random-weight
  draft at an imposed acceptance, labelled, so its tokens are not the identity run's) at each batch
  size, ``runs`` batches of ``prompt_len``-token prompts and ``output_len`` new tokens after one
  untimed, and the exact / default ratio.

The figure is a GPU one: on a CPU the default mode's outputs are usually identical as well.

The report (``--json``): ``scenario``, ``environment`` (as the latency benchmark's: date, command,
versions, device, commit), ``config`` (as given), ``engine_config`` (as fitted), ``models``,
``imposed_acceptance`` (the cost engines'), ``identity``: one row per mode with ``mode``,
``prompts``, ``identical_prompts`` and ``tokens_before_first_difference`` (shares); ``results``: one
row per mode, engine and batch size with ``mode``, ``engine``, ``batch``, ``tpot_ms_p50``,
``imposed_acceptance``; ``exact_over_default``: one row per engine and batch size with ``engine``,
``batch``, ``ratio``.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

import torch

from ...runtime.config import EngineConfig
from ...runtime.engine import Engine
from ...runtime.loader import LoadedModels, draft_preset_name, load_models
from ...runtime.sampling import SamplingParams
from .common import (ScenarioConfig, free_device_memory, imposed_rates, labelled, median_tpot_ms, new_report,
                     random_prompts, require_slots, seq_len_for, write_report)

log = logging.getLogger("lfmspark")

NAME = "exact"
SUMMARY = "exact mode's identity rates (speculative vs target-only output) and TPOT cost against the default mode"
SHARED = {"batch_sizes": [1, 8], "prompt_len": 128, "output_len": 256, "runs": 2, "num_prompts": 200, "json": None}
MODES = ("default", "exact")
IDENTITY_BATCH = 32        # the identity run's batches when max_batch is not given
NO_DRAFT = ("exact scenario: it compares speculative with target-only output and needs a draft (drop "
            "--draft-preset none, or give --draft)")


@dataclass
class ExactConfig(ScenarioConfig):
    batch_sizes: list[int] = field(default_factory=lambda: list(SHARED["batch_sizes"]))
    prompt_len: int = SHARED["prompt_len"]
    output_len: int = SHARED["output_len"]
    runs: int = SHARED["runs"]
    num_prompts: int = SHARED["num_prompts"]      # the identity run's prompts

    def __post_init__(self) -> None:
        if self.engine.exact:
            raise ValueError("exact scenario: it runs the default mode and exact mode in turn; drop --exact")
        no_draft = self.engine.draft is None if self.engine.target is not None else draft_preset_name(self.engine) is None
        if no_draft:
            raise ValueError(NO_DRAFT)


def add_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """No flags of its own: a group that says which shared flags it reads."""
    parser.add_argument_group("exact scenario (lfmspark bench exact)", "no flags of its own: --num-prompts sets the "
                              "identity run's prompts, --verify-widths the rounds' widths (default: the whole block "
                              "every round), --max-batch the identity run's batches (default: 32)")
    return []


def config(args: argparse.Namespace, **common) -> ExactConfig:
    return ExactConfig(batch_sizes=args.batch_sizes, prompt_len=args.prompt_len, output_len=args.output_len,
                       runs=args.runs, num_prompts=args.num_prompts, json_path=args.json, **common)


def identity_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of 8-64 random tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 65, (n,), generator=gen).tolist()
    return [torch.randint(vocab // 10, vocab, (length,), generator=gen).tolist() for length in lengths]


def greedy_outputs(engine: Engine, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    out: list[list[int]] = []
    for i in range(0, len(prompts), engine.max_batch):
        out += [o.token_ids for o in engine.generate(prompts[i:i + engine.max_batch], params)]
    return out


def identity(speculative: list[list[int]], target_only: list[list[int]]) -> dict:
    """The share of prompts with identical outputs, and of tokens before each output's first difference."""
    same_prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p))
                   for p, q in zip(speculative, target_only)]
    return {"prompts": len(speculative),
            "identical_prompts": sum(p == q for p, q in zip(speculative, target_only)) / len(speculative),
            "tokens_before_first_difference": sum(same_prefix) / sum(len(p) for p in speculative)}


def run(cfg: ExactConfig) -> dict:
    models = load_models(cfg.engine)
    if models.draft is None:
        raise ValueError(NO_DRAFT)
    block = models.draft.config.block_size
    max_batch = max(max(cfg.batch_sizes), IDENTITY_BATCH) if "max_batch" in cfg.fit else cfg.engine.max_batch
    base = cfg.engine_config(max_batch=max_batch, batch_sizes=sorted(set(cfg.batch_sizes) | {max_batch}),
                             max_seq_len=seq_len_for(max(cfg.prompt_len, 64) + cfg.output_len, block))
    require_slots(base, cfg.batch_sizes, NAME)
    if base.verify_widths is None:      # the whole block every round (module doc)
        base = base.replace(verify_widths=[block + 1])
    report = new_report(NAME, cfg, models, base)
    report["imposed_acceptance"] = list(imposed_rates(base, models) or []) or None
    report["identity"], report["results"] = [], []
    vocab = models.target.config.vocab_size
    prompts = identity_prompts(cfg.num_prompts, vocab, cfg.engine.seed)
    for mode in MODES:
        outputs = {}
        for kind, roles, engine_cfg, engine_models in engines(base.replace(exact=mode == "exact"), models):
            engine = Engine.from_config(engine_cfg, engine_models)
            engine.warmup(progress=False, sampling=False)
            if "identity" in roles:
                log.info("%s mode, %s: %d identity prompts", mode, kind, len(prompts))
                outputs[kind] = greedy_outputs(engine, prompts, cfg.output_len)
            if "cost" in roles:
                for batch in cfg.batch_sizes:
                    log.info("%s mode, %s: TPOT at batch %d", mode, kind, batch)
                    report["results"].append({"mode": mode, "engine": kind, "batch": batch,
                                              "tpot_ms_p50": tpot(engine, cfg, batch),
                                              "imposed_acceptance": list(engine_cfg.imposed_acceptance or []) or None})
            del engine
            free_device_memory(base.torch_device())
        report["identity"].append({"mode": mode, **identity(outputs["speculative"], outputs["target_only"])})
        write_report(report, cfg.json_path)
    report["exact_over_default"] = ratios(report["results"])
    write_report(report, cfg.json_path)
    return report


def engines(cfg: EngineConfig, models: LoadedModels
            ) -> list[tuple[str, tuple[str, ...], EngineConfig, LoadedModels]]:
    """The engines of one mode, built in turn on the same weights, as (kind, roles, config, models):
    the identity run's speculative engine (nothing imposed), a twin for the cost where acceptance is
    imposed (a random-weight draft), and target-only, which serves both."""
    rates = imposed_rates(cfg, models)
    if rates is None:
        out = [("speculative", ("identity", "cost"), cfg, models)]
    else:
        out = [("speculative", ("identity",), cfg.replace(imposed_acceptance=None), models),
               ("speculative", ("cost",), cfg.replace(imposed_acceptance=rates), models)]
    out.append(("target_only", ("identity", "cost"), cfg.replace(imposed_acceptance=None, verify_widths=None),
                models.without_draft()))
    return out


def tpot(engine: Engine, cfg: ExactConfig, batch: int) -> float:
    prompts = random_prompts(batch, cfg.prompt_len, engine.model_config.vocab_size, cfg.engine.seed + 7)
    seed = cfg.engine.seed
    return median_tpot_ms(engine, prompts, lambda run, i: SamplingParams(
        max_new_tokens=cfg.output_len, ignore_eos=True, seed=seed + 1000 * (run + 1) + i), cfg.runs)


def ratios(results: list[dict]) -> list[dict]:
    """Exact mode's TPOT over the default mode's, per engine and batch size."""
    default = {(r["engine"], r["batch"]): r["tpot_ms_p50"] for r in results if r["mode"] == "default"}
    return [{"engine": r["engine"], "batch": r["batch"], "ratio": r["tpot_ms_p50"] / default[r["engine"], r["batch"]]}
            for r in results if r["mode"] == "exact" and (r["engine"], r["batch"]) in default]


def table(report: dict) -> str:
    from tabulate import tabulate

    default = {(r["engine"], r["batch"]): r["tpot_ms_p50"] for r in report["results"] if r["mode"] == "default"}
    rows = [[labelled(r["engine"], r["imposed_acceptance"]), r["batch"], f"{default[r['engine'], r['batch']]:.3f}",
             f"{r['tpot_ms_p50']:.3f}", f"{r['tpot_ms_p50'] / default[r['engine'], r['batch']]:.3f}x"]
            for r in report["results"] if r["mode"] == "exact" and (r["engine"], r["batch"]) in default]
    text = tabulate(rows, headers=["engine", "batch", "default TPOT p50 ms", "exact TPOT p50 ms", "exact / default"])
    for r in report["identity"]:
        text += (f"\nidentity, {r['mode']} mode: {r['identical_prompts']:.0%} of {r['prompts']} prompts identical "
                 f"(speculative vs target-only, greedy), {r['tokens_before_first_difference']:.1%} of tokens before "
                 "the first difference")
    return text
