"""What the scenarios of ``lfmspark bench`` share: their config's common fields, random prompts, the
per-request TPOT they report, the imposed acceptance of random-weight drafts and the report's
frame (the same ``environment`` block as the latency benchmark's, so every row names its commit).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...runtime.config import EngineConfig
from ...runtime.engine import Engine
from ...runtime.loader import LoadedModels
from ...runtime.outputs import GenerationOutput
from ...runtime.sampling import SamplingParams
from ..bench import DEFAULT_IMPOSED_RATE, environment

# the engine fields a scenario sizes to what it measures, unless the command line sets them
FITTED_FIELDS = ("max_batch", "max_seq_len", "batch_sizes")


@dataclass
class ScenarioConfig:
    """The fields every scenario has. ``engine`` names the models and the engine options;
    ``fit`` lists the engine fields the scenario may size to its own batches and lengths (a field
    left out is used as ``engine`` gives it)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    fit: tuple[str, ...] = FITTED_FIELDS
    json_path: str | None = None
    command: str | None = None          # recorded in the report (None: this process's command line)

    def engine_config(self, **fitted: Any) -> EngineConfig:
        """``engine`` with the scenario's sizes for the fields it may fit."""
        return self.engine.replace(**{name: value for name, value in fitted.items() if name in self.fit})


def require_slots(cfg: EngineConfig, batch_sizes: Sequence[int], scenario: str) -> None:
    """Refuse batch sizes the engine's slots cannot run at once (a given ``--max-batch`` below them)."""
    if max(batch_sizes) > cfg.max_batch:
        raise ValueError(f"{scenario} scenario: --max-batch {cfg.max_batch} is below the largest batch size "
                         f"measured ({max(batch_sizes)})")


def seq_len_for(tokens: int, block_size: int) -> int:
    """A ``max_seq_len`` for requests of ``tokens`` prompt and output tokens: room for the verify
    window of the round that rides along after a request's last token, and some slack."""
    return tokens + 2 * (block_size + 1) + 64


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn above the vocabulary's first tenth (where the
    special tokens of a real vocabulary sit)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(vocab // 10, vocab, (n, length), generator=gen).tolist()


def tpot_ms(output: GenerationOutput) -> float:
    """A request's TPOT: first to last token over the tokens after the first, in milliseconds."""
    return output.stats.decode_s / max(len(output.token_ids) - 1, 1) * 1e3


def median_tpot_ms(engine: Engine, prompts: list[list[int]], params: Callable[[int, int], SamplingParams],
                   runs: int) -> float:
    """The median per-request TPOT of ``runs`` batches of ``prompts``, after one batch untimed.
    ``params(run, i)`` gives request ``i`` of run ``run`` its parameters (run -1: the untimed one);
    a seed per request keeps imposed acceptance draws of different rows apart."""
    engine.generate(prompts, [params(-1, i) for i in range(len(prompts))])
    tpots = []
    for run in range(runs):
        outputs = engine.generate(prompts, [params(run, i) for i in range(len(prompts))])
        tpots += [tpot_ms(o) for o in outputs]
    return statistics.median(tpots)


def rounds_by_width(engine: Engine) -> dict[int, int]:
    """The rounds the engine has run at each verify width so far (empty without a draft)."""
    return dict(engine.speculation_stats.get("rounds_by_width", {}))


def rounds_since(engine: Engine, before: dict[int, int]) -> dict[int, int]:
    """The rounds at each verify width since :func:`rounds_by_width` gave ``before``."""
    return {w: n - before.get(w, 0) for w, n in rounds_by_width(engine).items() if n > before.get(w, 0)}


def imposed_rates(engine: EngineConfig, models: LoadedModels) -> tuple[float, ...] | None:
    """The imposed acceptance of the speculative engines: the config's, else for a random-weight
    draft the latency benchmark's default rate (outputs are labelled); None for a checkpoint's draft
    (real acceptance) or without a draft (where rates given are refused, as the latency benchmark
    refuses them)."""
    if models.draft is None:
        if engine.imposed_acceptance is not None:
            raise ValueError("--imposed-acceptance needs a draft (it sets the draft's acceptance), and this run has "
                             "none: drop it, or give a draft (--draft-preset, --draft)")
        return None
    if engine.imposed_acceptance is not None:
        return engine.imposed_acceptance
    return (DEFAULT_IMPOSED_RATE,) if engine.target is None else None


def speculative_and_target_only(cfg: EngineConfig, models: LoadedModels
                                ) -> list[tuple[str, EngineConfig, LoadedModels]]:
    """The engines a scenario compares, as (kind, config, models) sharing one set of weights: the
    speculative engine (where there is a draft, with :func:`imposed_rates`), then target-only."""
    engines = []
    rates = imposed_rates(cfg, models)
    if models.draft is not None:
        engines.append(("speculative", cfg.replace(imposed_acceptance=rates), models))
    engines.append(("target_only", cfg.replace(imposed_acceptance=None, verify_widths=None), models.without_draft()))
    return engines


def free_device_memory(device: torch.device) -> None:
    """Hand a dropped engine's caches back to the device before the next one is built."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def new_report(name: str, cfg: ScenarioConfig, models: LoadedModels, engine: EngineConfig) -> dict:
    """The frame every scenario's report shares: its name, the environment (commit included), the
    config as given, the models and ``engine``, the engines' config as fitted (each engine may
    change its draft's options: the scenario says which)."""
    return {"scenario": name, "environment": environment(cfg.engine.torch_device(), cfg.command),
            "config": asdict(cfg), "models": models.source, "engine_config": engine.as_dict()}


def write_report(report: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=2, default=str)


def labelled(kind: str, rates: Sequence[float] | None) -> str:
    """An engine's name in a table: ``DSpark (imposed 0.8)`` for imposed acceptance."""
    if kind != "speculative":
        return "target-only"
    if not rates:
        return "DSpark"
    return f"DSpark (imposed {rates[0]:g})" if len(set(rates)) == 1 else "DSpark (imposed profile)"
