"""``lfmspark bench warmup``: how long an engine takes to get ready, and how fast it decodes after.

A server warms up before taking traffic (``Engine.warmup()``: the prefill kernels and bucket graphs,
then the step compiled and captured at every captured batch size, in every sampling mode or greedy
only). This scenario times that warm-up as a deployment runs it, at every default batch size up to
``max_batch`` (or the ``--cuda-graph-sizes`` given), with the loading and the engine's construction
before it, and says whether the compile caches were cold (empty) or warm (filled by an earlier
process: run the command twice with the same ``LFMSPARK_CACHE_DIR``), with what was compiled and
captured. The caches are two: Inductor's (``TORCHINDUCTOR_CACHE_DIR``: FX graphs, its generated
kernels) and Triton's (``TRITON_CACHE_DIR``: the lfmspark ops' compiled kernels); a warm start needs
both, and one without the other is reported as partly warm. Then, at each batch size, the median
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
``files_before``, ``files_after``: Inductor's, its Triton folder left out; ``triton_dir``,
``triton_files_before``, ``triton_files_after``; ``state``: cold, warm, partly warm (naming the
cache that was filled), or unused by an eager engine), ``startup`` (``load_s``, ``build_s``,
``warmup_s``, ``total_s``: loading the models, building the engine, its warm-up, their sum),
``warmup`` (``seconds``, ``prefill_s``, ``steps_s``, ``profile_s``, ``mode``, ``step_graphs``,
``prefill_graphs``, ``sizes``, ``modes``, ``widths``, ``graphs_compiled``, ``fx_cache_hits``,
``fx_cache_misses``) and ``results``:
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

from ...environment import cache_dir, triton_cache_dir
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


def triton_cache() -> Path:
    """Where the ops' Triton kernels are cached: ``TRITON_CACHE_DIR``, which importing lfmspark points
    at ``LFMSPARK_CACHE_DIR``'s ``triton`` folder unless it is set."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or triton_cache_dir())


def count_files(path: Path, leave_out: Path | None = None) -> int:
    """The files under ``path``, those under ``leave_out`` not counted (a cache inside another's folder)."""
    if not path.is_dir():
        return 0
    left_out = leave_out.resolve() if leave_out is not None else None
    return sum(len(files) for root, _, files in os.walk(path)
               if left_out is None or not Path(root).resolve().is_relative_to(left_out))


def cache_state(inductor_files: int, triton_files: int) -> str:
    """cold, warm, or partly warm: which of the two caches held files before the warm-up."""
    if inductor_files and triton_files:
        return "warm"
    if inductor_files or triton_files:
        return f"partly warm ({'Inductor' if inductor_files else 'Triton'}'s cache only)"
    return "cold"


def run(cfg: WarmupConfig) -> dict:
    t0 = time.perf_counter()
    models = load_models(cfg.engine)
    load_s = time.perf_counter() - t0
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
    cache, triton = compile_cache(), triton_cache()
    files_before, triton_before = count_files(cache, leave_out=triton), count_files(triton)
    warm = engine.warmup(progress=True, sampling=not cfg.greedy_only)
    steps = [e for e in warm.entries if e.mode != "any"]          # prefill buckets are "any"
    report["compile_cache"] = {"dir": str(cache), "files_before": files_before,
                               "files_after": count_files(cache, leave_out=triton), "triton_dir": str(triton),
                               "triton_files_before": triton_before, "triton_files_after": count_files(triton),
                               "state": "unused (eager)" if warm.mode == "eager" else cache_state(files_before,
                                                                                                 triton_before)}
    build_s = engine.startup.build_s
    report["startup"] = {"load_s": load_s, "build_s": build_s, "warmup_s": warm.seconds,
                         "total_s": load_s + build_s + warm.seconds}
    report["warmup"] = {"seconds": warm.seconds, "prefill_s": warm.prefill_s, "steps_s": warm.total_s,
                        "profile_s": warm.profile_s,
                        "mode": warm.mode, "step_graphs": len(steps), "prefill_graphs": len(warm.entries) - len(steps),
                        "sizes": sorted({e.batch_size for e in steps}), "modes": sorted({e.mode for e in steps}),
                        "widths": list(engine.verify_widths) if kind == "speculative" else [],
                        "graphs_compiled": warm.graphs_compiled, "fx_cache_hits": warm.cache_hits,
                        "fx_cache_misses": warm.cache_misses}
    log.info("load %.1f s, build %.1f s, warm-up %.1f s (prefill %.1f s, steps %.1f s): %d step graphs", load_s,
             build_s, warm.seconds, warm.prefill_s, warm.total_s, len(steps))
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
    start = report["startup"]
    text += (f"\nready in {start['total_s']:.1f} s: load {start['load_s']:.1f} s, build {start['build_s']:.1f} s, "
             f"warm-up {start['warmup_s']:.1f} s")
    text += (f"\ncompile cache {cache['state']}: Inductor's {cache['files_before']} files in {cache['dir']} before, "
             f"{cache['files_after']} after; Triton's {cache['triton_files_before']} files in {cache['triton_dir']} "
             f"before, {cache['triton_files_after']} after")
    return text
