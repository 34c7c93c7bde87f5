"""``lfmspark bench structured``: what a structured-output constraint costs a speculative round.

A batch holding a constrained request runs its rounds in phases, uncaptured, with the drafts on the
host between the draft and the verify and the tokens collected before the next round
(docs/design.md, "Structured output"). This scenario measures that cost on the speculative engine:
per batch size, the median per-request TPOT of unconstrained requests, of requests that all carry a
20-property JSON schema, and, at batch sizes above one, of a batch with one constrained request
among unconstrained ones (the row's TPOT is the unconstrained requests'; the constrained one's is
beside it). Every request runs ``output_len`` tokens (``ignore_eos``: a constrained one that ends
its JSON goes on with the only token its ended grammar allows). It also times the schema's
compilation, first and cached, and building the grammar engine's view of the tokenizer.

Random-weight presets have no tokenizer but the tiny ones; the others get the tiny presets' byte
tokenizer here (the grammar then runs over the vocabulary's 264 byte-level ids, the rest masked),
and the report says so (``tokenizer``).

The report (``--json``): ``scenario``, ``environment``, ``config``, ``engine_config``, ``models``,
``tokenizer`` (``checkpoint`` or ``byte``), ``compile_ms`` (``tokenizer``, ``first``, ``cached``),
``warmup_s``, ``results``: one row per batch size and case with ``batch``, ``case``
(``unconstrained``, ``constrained``, ``one-constrained``), ``tpot_ms_p50``, ``constrained_tpot_ms_p50``
(the one constrained request's, for ``one-constrained``), ``imposed_acceptance`` and
``rounds_by_width``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass, field, replace

from ...runtime.byte_tokenizer import byte_tokenizer
from ...runtime.engine import Engine
from ...runtime.loader import load_models
from ...runtime.sampling import SamplingParams
from ...runtime.structured import GrammarCache, StructuredOutputsParams
from .common import (ScenarioConfig, free_device_memory, imposed_rates, labelled, new_report, random_prompts,
                     require_slots, rounds_by_width, rounds_since, seq_len_for, tpot_ms, write_report)

log = logging.getLogger("lfmspark")

NAME = "structured"
SUMMARY = "speculative TPOT of JSON-schema requests against unconstrained ones, and the schema's compile time"
SHARED = {"batch_sizes": [1, 8], "prompt_len": 128, "output_len": 128, "runs": 2, "json": None}

# 20 properties of mixed kinds, each bounded so that a random-weight model ends its object
SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {**{f"s{i}": {"type": "string", "maxLength": 6} for i in range(6)},
                         **{f"i{i}": {"type": "integer", "minimum": 0, "maximum": 999} for i in range(5)},
                         **{f"b{i}": {"type": "boolean"} for i in range(3)},
                         **{f"e{i}": {"enum": ["red", "green", "blue"]} for i in range(4)},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                         "point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                   "properties": {"x": {"type": "integer", "maximum": 99, "minimum": 0},
                                                  "y": {"type": "integer", "maximum": 99, "minimum": 0}}}}}
SCHEMA["required"] = sorted(SCHEMA["properties"])


@dataclass
class StructuredConfig(ScenarioConfig):
    batch_sizes: list[int] = field(default_factory=lambda: list(SHARED["batch_sizes"]))
    prompt_len: int = SHARED["prompt_len"]
    output_len: int = SHARED["output_len"]
    runs: int = SHARED["runs"]


def add_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """The scenario has no flags of its own."""
    return []


def config(args: argparse.Namespace, **common) -> StructuredConfig:
    return StructuredConfig(batch_sizes=args.batch_sizes, prompt_len=args.prompt_len, output_len=args.output_len,
                            runs=args.runs, json_path=args.json, **common)


def params(constrained: bool, output_len: int, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=output_len, ignore_eos=True, seed=seed,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA) if constrained else None)


def run(cfg: StructuredConfig) -> dict:
    models = load_models(cfg.engine)
    if models.draft is None:
        raise ValueError("structured scenario: it measures the speculative engine, and this run has no draft "
                         "(drop --draft-preset none, or give --draft)")
    tokenizer = "checkpoint" if models.tokenizer is not None else "byte"
    if models.tokenizer is None:
        models = replace(models, tokenizer=byte_tokenizer())
    engine_cfg = cfg.engine_config(max_batch=max(cfg.batch_sizes), batch_sizes=sorted(set(cfg.batch_sizes)),
                                   max_seq_len=seq_len_for(cfg.prompt_len + cfg.output_len,
                                                           models.draft.config.block_size))
    require_slots(engine_cfg, cfg.batch_sizes, NAME)
    engine_cfg = engine_cfg.replace(imposed_acceptance=imposed_rates(engine_cfg, models))
    report = new_report(NAME, cfg, models, engine_cfg)
    report["tokenizer"] = tokenizer
    report["compile_ms"] = compile_times(models.tokenizer, models.target.config.vocab_size, models.stop_token_ids)
    engine = Engine.from_config(engine_cfg, models)
    t0 = time.perf_counter()
    engine.warmup(progress=True, sampling=False)        # every request here is greedy
    report["warmup_s"], report["results"] = time.perf_counter() - t0, []
    vocab, seed = engine.model_config.vocab_size, cfg.engine.seed
    for batch in cfg.batch_sizes:
        prompts = random_prompts(batch, cfg.prompt_len, vocab, seed + batch)
        cases = ["unconstrained", "constrained"] + (["one-constrained"] if batch > 1 else [])
        for case in cases:
            log.info("batch %d: %s", batch, case)
            before = rounds_by_width(engine)
            flags = [case == "constrained" or (case == "one-constrained" and i == 0) for i in range(batch)]
            free, held = [], []
            for r in range(-1, cfg.runs):         # run -1: untimed
                outputs = engine.generate(prompts, [params(c, cfg.output_len, seed + 1000 * (r + 2) + i)
                                                    for i, c in enumerate(flags)])
                if r >= 0:
                    for c, o in zip(flags, outputs):
                        (held if c else free).append(tpot_ms(o))
            row = {"batch": batch, "case": case,
                   "tpot_ms_p50": statistics.median(free if case == "one-constrained" else free + held),
                   "constrained_tpot_ms_p50": statistics.median(held) if case == "one-constrained" else None,
                   "imposed_acceptance": list(engine_cfg.imposed_acceptance or []) or None,
                   "rounds_by_width": rounds_since(engine, before)}
            report["results"].append(row)
            write_report(report, cfg.json_path)
    del engine
    free_device_memory(engine_cfg.torch_device())
    write_report(report, cfg.json_path)
    return report


def compile_times(tokenizer, vocab_size: int, eos: tuple[int, ...]) -> dict[str, float]:
    """Milliseconds to build the grammar engine's tokenizer, then to compile :data:`SCHEMA` the first
    time and again (cached), on a cache of their own."""
    cache = GrammarCache(tokenizer, vocab_size, eos)
    schema = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    cache.tokenizer
    t1 = time.perf_counter()
    cache.matcher(schema)
    t2 = time.perf_counter()
    cache.matcher(schema)
    t3 = time.perf_counter()
    return {"tokenizer": (t1 - t0) * 1e3, "first": (t2 - t1) * 1e3, "cached": (t3 - t2) * 1e3}


def table(report: dict) -> str:
    from tabulate import tabulate

    free = {r["batch"]: r["tpot_ms_p50"] for r in report["results"] if r["case"] == "unconstrained"}
    rows = []
    for r in report["results"]:
        base = free.get(r["batch"])
        rows.append([labelled("speculative", r["imposed_acceptance"]), r["batch"], r["case"],
                     f"{r['tpot_ms_p50']:.3f}", f"{r['tpot_ms_p50'] / base:.2f}x" if base else "",
                     f"{r['constrained_tpot_ms_p50']:.3f}" if r["constrained_tpot_ms_p50"] is not None else ""])
    text = tabulate(rows, headers=["engine", "batch", "case", "TPOT p50 ms", "vs unconstrained",
                                   "the constrained one's TPOT ms"])
    c = report["compile_ms"]
    text += (f"\n20-property schema: compiled in {c['first']:.1f} ms, {c['cached']:.2f} ms cached (the grammar "
             f"engine's tokenizer: {c['tokenizer']:.1f} ms); tokenizer: {report['tokenizer']}")
    text += f"\nwarm-up: {report['warmup_s']:.1f} s"
    return text
