"""``lfmspark bench sampling``: what sampling costs a speculative round.

The settings users run, from the model cards and the OpenAI clients: LFM2.5-1.2B-Instruct's
(temperature 0.1, top_k 50, top_p 0.1, repetition_penalty 1.05), LFM2.5-8B-A1B's (temperature 0.2,
top_k 80, repetition_penalty 1.05), the JP / Base / VL cards' min-p (temperature 0.3, min_p 0.15,
repetition_penalty 1.05) and OpenAI-style top-p (temperature 0.7, top_p 0.9). This scenario measures
the per-request TPOT of the speculative engine with each against greedy decoding, and the
target-only engine with the same settings, on one set of weights, at each batch size. It tells how
much of speculation's gain survives sampling, and whether the filter (runtime/distributions.py) or
the rest of the sampled round bounds it.

Each engine is warmed up in every sampling mode, then per batch size and setting: one untimed batch,
then the median per-request TPOT (first to last token over the tokens after the first) of ``runs``
batches of ``prompt_len``-token prompts and ``output_len`` new tokens. With ``profile_dir`` the
speculative engine's costliest kernels are written there for one greedy and one model-card batch
of each batch size (per round: what the sampled round adds to the greedy one).

The report (``--json``): ``scenario``, ``environment`` (as the latency benchmark's: date, command,
versions, device, commit), ``config`` (as given), ``engine_config`` (as fitted), ``models``,
``settings`` (each setting's sampling fields), ``warmup_s`` (per engine), ``results``: one row per
engine, batch size and setting with ``engine`` (``speculative`` / ``target_only``), ``batch``,
``setting``, ``tpot_ms_p50``, ``imposed_acceptance`` (the rates, or null) and, for the speculative
engine, ``rounds_by_width``; ``profiles`` (the profile files) with ``profile_dir``.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...runtime.engine import Engine
from ...runtime.loader import load_models
from ...runtime.sampling import SamplingParams
from .common import (ScenarioConfig, free_device_memory, labelled, median_tpot_ms, new_report, random_prompts,
                     require_slots, rounds_by_width, rounds_since, seq_len_for, speculative_and_target_only,
                     write_report)

log = logging.getLogger("lfmspark")

NAME = "sampling"
SUMMARY = "speculative TPOT with the model card's sampling settings against greedy, top-p and target-only"
# the shared bench flags this scenario reads, with its defaults (None: no default)
SHARED = {"batch_sizes": [1, 8], "prompt_len": 128, "output_len": 256, "runs": 2, "json": None, "profile_dir": None}

# the settings compared: SamplingParams fields ("model-card": LFM2.5-1.2B-Instruct's, "moe-card":
# LFM2.5-8B-A1B's, "min-p": the JP / Base / VL cards', "top-p": OpenAI clients' usual)
SETTINGS: dict[str, dict] = {
    "greedy": {},
    "model-card": {"temperature": 0.1, "top_k": 50, "top_p": 0.1, "repetition_penalty": 1.05},
    "moe-card": {"temperature": 0.2, "top_k": 80, "repetition_penalty": 1.05},
    "min-p": {"temperature": 0.3, "min_p": 0.15, "repetition_penalty": 1.05},
    "top-p": {"temperature": 0.7, "top_p": 0.9},
}


@dataclass
class SamplingConfig(ScenarioConfig):
    batch_sizes: list[int] = field(default_factory=lambda: list(SHARED["batch_sizes"]))
    prompt_len: int = SHARED["prompt_len"]
    output_len: int = SHARED["output_len"]
    runs: int = SHARED["runs"]
    settings: list[str] = field(default_factory=lambda: list(SETTINGS))
    profile_dir: str | None = None

    def __post_init__(self) -> None:
        unknown = [s for s in self.settings if s not in SETTINGS]
        if unknown or not self.settings:
            raise ValueError(f"sampling scenario: unknown settings {unknown or self.settings}: use "
                             f"{', '.join(SETTINGS)}")


def add_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """The scenario's own flags; returns their destinations."""
    g = parser.add_argument_group("sampling scenario (lfmspark bench sampling)")
    return [g.add_argument("--settings", type=_setting_list, default=None, metavar="NAMES",
                           help=f"comma-separated sampling settings to time (default: all of {', '.join(SETTINGS)})"
                           ).dest]


def _setting_list(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown settings {unknown or text!r}: use {', '.join(SETTINGS)}")
    return names


def config(args: argparse.Namespace, **common) -> SamplingConfig:
    return SamplingConfig(batch_sizes=args.batch_sizes, prompt_len=args.prompt_len, output_len=args.output_len,
                          runs=args.runs, settings=args.settings or list(SETTINGS), profile_dir=args.profile_dir,
                          json_path=args.json, **common)


def params(setting: str, max_new_tokens: int, seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, seed=seed, **SETTINGS[setting])


def run(cfg: SamplingConfig) -> dict:
    models = load_models(cfg.engine)
    block = models.draft.config.block_size if models.draft is not None else 0
    engine_cfg = cfg.engine_config(max_batch=max(cfg.batch_sizes), batch_sizes=sorted(set(cfg.batch_sizes)),
                                   max_seq_len=seq_len_for(cfg.prompt_len + cfg.output_len, block))
    require_slots(engine_cfg, cfg.batch_sizes, NAME)
    report = new_report(NAME, cfg, models, engine_cfg)
    report["settings"] = {name: SETTINGS[name] for name in cfg.settings}
    report["warmup_s"], report["results"] = {}, []
    seed = cfg.engine.seed
    for kind, engine_config, engine_models in speculative_and_target_only(engine_cfg, models):
        engine = Engine.from_config(engine_config, engine_models)
        t0 = time.perf_counter()
        engine.warmup(progress=True)                  # every sampling mode
        report["warmup_s"][kind] = time.perf_counter() - t0
        vocab = engine.model_config.vocab_size
        for batch in cfg.batch_sizes:
            prompts = random_prompts(batch, cfg.prompt_len, vocab, seed + batch)
            for setting in cfg.settings:
                log.info("%s, batch %d: %s", kind, batch, setting)
                before = rounds_by_width(engine)
                tpot = median_tpot_ms(engine, prompts, lambda r, i, s=setting: params(
                    s, cfg.output_len, seed + 1000 * (r + 1) + i), cfg.runs)
                row = {"engine": kind, "batch": batch, "setting": setting, "tpot_ms_p50": tpot,
                       "imposed_acceptance": list(engine_config.imposed_acceptance or []) or None}
                if kind == "speculative":
                    row["rounds_by_width"] = rounds_since(engine, before)
                report["results"].append(row)
                write_report(report, cfg.json_path)
        if cfg.profile_dir and kind == "speculative":
            report["profiles"] = []
            for batch in cfg.batch_sizes:
                for setting in ("greedy", "model-card"):
                    path = Path(cfg.profile_dir) / f"profile_sampling_{setting}_bs{batch}.txt"
                    profile_batch(engine, random_prompts(batch, cfg.prompt_len, vocab, seed + batch), setting,
                                  cfg.output_len, path)
                    report["profiles"].append(str(path))
        del engine
        free_device_memory(engine_cfg.torch_device())
    write_report(report, cfg.json_path)
    return report


def profile_batch(engine: Engine, prompts: list[list[int]], setting: str, output_len: int, path: Path) -> None:
    """The kernels of one batch of ``prompts`` sampled with ``setting``, costliest first, per round
    (on a CPU the profiler's host ops, which leave the table empty)."""
    from torch.profiler import ProfilerActivity, profile

    batch = [params(setting, output_len, i + 1) for i in range(len(prompts))]
    engine.generate(prompts, batch)
    activity = ProfilerActivity.CUDA if engine.device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        outs = engine.generate(prompts, batch)
    rounds = max(max(o.stats.rounds for o in outs), 1)
    tokens = sum(len(o.token_ids) for o in outs)
    events = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    lines = [f"{setting}, batch {len(prompts)}: {total / rounds:.1f} us of kernel time per round, {rounds} rounds, "
             f"{tokens} tokens", f"{'us/round':>10} {'n/round':>8}  kernel"]
    lines += [f"{e.device_time_total / rounds:10.2f} {e.count / rounds:8.1f}  {e.key[:150]}" for e in events]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    log.info("kernel profile written to %s", path)


def table(report: dict) -> str:
    from tabulate import tabulate

    rows = []
    greedy = {(r["engine"], r["batch"]): r["tpot_ms_p50"] for r in report["results"] if r["setting"] == "greedy"}
    target = {(r["batch"], r["setting"]): r["tpot_ms_p50"] for r in report["results"] if r["engine"] == "target_only"}
    for r in report["results"]:
        base = greedy.get((r["engine"], r["batch"]))
        vs_target = target.get((r["batch"], r["setting"])) if r["engine"] == "speculative" else None
        rows.append([labelled(r["engine"], r["imposed_acceptance"]), r["batch"], r["setting"],
                     f"{r['tpot_ms_p50']:.3f}", f"{r['tpot_ms_p50'] / base:.2f}x" if base else "",
                     f"{vs_target / r['tpot_ms_p50']:.2f}x" if vs_target else ""])
    text = tabulate(rows, headers=["engine", "batch", "setting", "TPOT p50 ms", "vs greedy", "speed-up vs target-only"])
    for kind, seconds in report["warmup_s"].items():
        text += f"\nwarm-up {kind}: {seconds:.1f} s (every sampling mode)"
    for path in report.get("profiles", []):
        text += f"\nkernel profile: {path}"
    return text

