"""``lfmspark bench warmup``: how long an engine takes to get ready, and how fast it decodes after.

A server warms up before taking traffic (``Engine.warmup()``: the prefill kernels and bucket graphs,
then the step compiled and captured at every captured batch size, in every sampling mode or greedy
only). This scenario times that warm-up as a deployment runs it, at every default batch size up to
``max_batch`` (or the ``--cuda-graph-sizes`` given), and says whether the compile cache was cold
(empty) or warm (filled by an earlier process: run the command twice with the same
``LFMSPARK_CACHE_DIR``), with what was compiled and captured. Then, at each batch size, the median
per-request greedy TPOT of ``runs`` batches of ``prompt_len``-token prompts and ``output_len`` new
tokens: what the warmed engine delivers. For a speculative engine with several verify widths it
also records the rounds the width policy ran at each width (runtime/speculation.py) and the TPOT
with the whole block verified every round, so that the width policy's choice is measured against the
fixed whole-block round on the same captured graphs.

A target-only engine: ``--draft-preset none``. A random-weight draft runs an imposed acceptance
(labelled).

The report (``--json``): ``scenario``, ``environment`` (as the latency benchmark's: date, command,
versions, device, commit), ``config`` (as given), ``engine_config`` (as fitted), ``models``,
``engine`` (``speculative`` / ``target_only``), ``imposed_acceptance``, ``compile_cache`` (``dir``,
``files_before``, ``files_after``, ``state``: cold, warm, or unused by an eager engine), ``warmup``
(``seconds``, ``prefill_s``, ``steps_s``, ``mode``, ``step_graphs``, ``prefill_graphs``, ``sizes``,
``modes``, ``widths``, ``graphs_compiled``, ``fx_cache_hits``, ``fx_cache_misses``) and ``results``:
one row per batch size with ``batch``, ``tpot_ms_p50`` and, with several verify widths,
``rounds_by_width`` and ``tpot_ms_p50_whole_block``.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...environment import cache_dir
from ...runtime.engine import Engine
from ...runtime.loader import load_models
from ...runtime.sampling import SamplingParams
from .common import (ScenarioConfig, imposed_rates, labelled, median_tpot_ms, new_report, random_prompts,
                     require_slots, rounds_by_width, rounds_since, seq_len_for, write_report)

log = logging.getLogger("lfmspark")

NAME = "warmup"
SUMMARY = "warm-up time at every default batch size, cold or warm compile cache, and the TPOT after it"
SHARED = {"batch_sizes": [1, 8, 32, 64], "prompt_len": 128, "output_len": 128, "runs": 2, "json": None}


@dataclass
class WarmupConfig(ScenarioConfig):
    # the captured sizes are the engine's own (every default size up to max_batch, or the ones given)
    fit: tuple[str, ...] = ("max_batch", "max_seq_len")
    batch_sizes: list[int] = field(default_factory=lambda: list(SHARED["batch_sizes"]))   # TPOT measured at
    prompt_len: int = SHARED["prompt_len"]
    output_len: int = SHARED["output_len"]
    runs: int = SHARED["runs"]
    greedy_only: bool = False          # warm up the greedy mode only (the default: every sampling mode)


def add_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """The scenario's own flags; returns their destinations."""
    g = parser.add_argument_group("warmup scenario (lfmspark bench warmup; --batch-sizes: the TPOT sizes, "
                                  "--cuda-graph-sizes: the captured ones)")
    return [g.add_argument("--greedy-only", action="store_true", help="warm up the greedy mode only (default: "
                           "every sampling mode, as a server does)").dest]


def config(args: argparse.Namespace, **common) -> WarmupConfig:
    common["fit"] = tuple(f for f in common.get("fit", WarmupConfig.fit) if f != "batch_sizes")
    return WarmupConfig(batch_sizes=args.batch_sizes, prompt_len=args.prompt_len, output_len=args.output_len,
                        runs=args.runs, greedy_only=args.greedy_only, json_path=args.json, **common)


def compile_cache() -> Path:
    """Where this process's compiles are cached: Inductor's directory (``TORCHINDUCTOR_CACHE_DIR``,
    which importing lfmspark points at ``LFMSPARK_CACHE_DIR`` unless it is set)."""
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or cache_dir())


def count_files(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path)) if path.is_dir() else 0


def run(cfg: WarmupConfig) -> dict:
    models = load_models(cfg.engine)
    block = models.draft.config.block_size if models.draft is not None else 0
    engine_cfg = cfg.engine_config(max_batch=max(cfg.batch_sizes),
                                   max_seq_len=seq_len_for(cfg.prompt_len + cfg.output_len, block))
    engine_cfg = engine_cfg.replace(imposed_acceptance=imposed_rates(engine_cfg, models))
    require_slots(engine_cfg, cfg.batch_sizes, NAME)
    kind = "speculative" if models.draft is not None else "target_only"
    report = new_report(NAME, cfg, models, engine_cfg)
    report["engine"] = kind
    report["imposed_acceptance"] = list(engine_cfg.imposed_acceptance) if engine_cfg.imposed_acceptance else None
    engine = Engine.from_config(engine_cfg, models)
    cache = compile_cache()
    files_before = count_files(cache)
    t0 = time.perf_counter()
    warm = engine.warmup(progress=True, sampling=not cfg.greedy_only)
    seconds = time.perf_counter() - t0
    steps = [e for e in warm.entries if e.mode != "any"]          # prefill buckets are "any"
    report["compile_cache"] = {"dir": str(cache), "files_before": files_before, "files_after": count_files(cache),
                               "state": "unused (eager)" if warm.mode == "eager" else "warm" if files_before else "cold"}
    report["warmup"] = {"seconds": seconds, "prefill_s": warm.prefill_s, "steps_s": warm.total_s,
                        "mode": warm.mode, "step_graphs": len(steps), "prefill_graphs": len(warm.entries) - len(steps),
                        "sizes": sorted({e.batch_size for e in steps}), "modes": sorted({e.mode for e in steps}),
                        "widths": list(engine.verify_widths) if kind == "speculative" else [],
                        "graphs_compiled": warm.graphs_compiled, "fx_cache_hits": warm.cache_hits,
                        "fx_cache_misses": warm.cache_misses}
    log.info("warm-up %.1f s (prefill %.1f s, steps %.1f s): %d step graphs", seconds, warm.prefill_s, warm.total_s,
             len(steps))
    report["results"] = []
    write_report(report, cfg.json_path)
    for batch in cfg.batch_sizes:
        report["results"].append(measure(engine, cfg, batch))
        write_report(report, cfg.json_path)
    return report


def measure(engine: Engine, cfg: WarmupConfig, batch: int) -> dict:
    """One batch size's row: the greedy TPOT as the engine runs it (for a speculative engine with
    several widths: the rounds at each width, and the TPOT with the whole block every round)."""
    prompts = random_prompts(batch, cfg.prompt_len, engine.model_config.vocab_size, cfg.engine.seed + batch)
    seed = cfg.engine.seed

    def params(run: int, i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=cfg.output_len, ignore_eos=True, seed=seed + 1000 * (run + 1) + i)

    log.info("batch %d: TPOT", batch)
    before = rounds_by_width(engine)
    row: dict = {"batch": batch, "tpot_ms_p50": median_tpot_ms(engine, prompts, params, cfg.runs)}
    policy = engine.model_runner.width_policy
    if policy is not None and len(policy.widths) > 1:
        row["rounds_by_width"] = rounds_since(engine, before)
        widths = policy.widths
        policy.widths = (max(widths),)             # the whole block every round, on the same graphs
        try:
            log.info("batch %d: TPOT, the whole block every round", batch)
            row["tpot_ms_p50_whole_block"] = median_tpot_ms(engine, prompts, params, cfg.runs)
        finally:
            policy.widths = widths
    return row


def table(report: dict) -> str:
    from tabulate import tabulate

    w, cache = report["warmup"], report["compile_cache"]
    rows = []
    for r in report["results"]:
        counts = r.get("rounds_by_width") or {}
        total = sum(counts.values())
        rows.append([labelled(report["engine"], report["imposed_acceptance"]), r["batch"], f"{r['tpot_ms_p50']:.3f}",
                     f"{r['tpot_ms_p50_whole_block']:.3f}" if "tpot_ms_p50_whole_block" in r else "",
                     ", ".join(f"{k}: {100 * n / total:.0f}%" for k, n in sorted(counts.items())) if total else ""])
    text = tabulate(rows, headers=["engine", "batch", "TPOT p50 ms", "whole block every round", "rounds by width"])
    text += (f"\nwarm-up {w['seconds']:.1f} s ({w['mode']}; prefill {w['prefill_s']:.1f} s, steps {w['steps_s']:.1f} s):"
             f" {w['step_graphs']} step graphs at sizes {w['sizes']} in modes {', '.join(w['modes']) or '-'}"
             + (f", widths {w['widths']}" if w["widths"] else "")
             + f", {w['prefill_graphs']} prefill graphs, {w['graphs_compiled']} region graphs compiled"
             f" (FX cache {w['fx_cache_hits']} hits, {w['fx_cache_misses']} misses)")
    text += (f"\ncompile cache {cache['state']}: {cache['files_before']} files in {cache['dir']} before, "
             f"{cache['files_after']} after")
    return text
