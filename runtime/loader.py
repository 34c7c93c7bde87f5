"""The models an :class:`EngineConfig` names: a checkpoint (target, optional DSpark draft, tokenizer,
stop ids, the checkpoint's sampling defaults) or a preset of random weights with a real model's shapes.

``load_models`` is the one place models are built from a config; ``Engine.from_config`` calls it,
and a benchmark that runs several engines on one set of weights loads once and hands the result to
each (``Engine.from_config(cfg, models)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..models.config import DraftConfig
from ..models.dspark import DSparkDraft
from ..models.lfm2 import Lfm2ForCausalLM
from ..models.loading import load_draft, load_target
from ..models.presets import DEFAULT_DRAFT, draft_preset, random_draft, random_target, target_preset
from .config import EngineConfig
from .prompts import default_stop_ids, generation_defaults, load_tokenizer


@dataclass
class LoadedModels:
    target: Lfm2ForCausalLM
    draft: DSparkDraft | None = None
    tokenizer: object | None = None        # an HF tokenizer, or None (presets; checkpoints without one)
    stop_token_ids: tuple[int, ...] = ()
    sampling_defaults: dict = field(default_factory=dict)   # from generation_config.json
    source: str = ""                       # what was loaded, for reports ("checkpoint DIR", "preset NAME + DRAFT")

    def without_draft(self) -> LoadedModels:
        """The same target (shared, not copied) served target-only."""
        return replace(self, draft=None)


def preset_name(config: EngineConfig) -> str:
    """The preset a config without a checkpoint runs: its own, else the tiny one on a CPU and the
    LFM2.5-1.2B shape on a GPU."""
    return config.preset or ("lfm2.5-1.2b" if config.torch_device().type == "cuda" else "tiny")


def draft_preset_name(config: EngineConfig) -> str | None:
    """The draft preset a preset config runs (None: target-only)."""
    if config.draft_preset == "default":
        return DEFAULT_DRAFT.get(preset_name(config))
    return config.draft_preset


def load_models(config: EngineConfig) -> LoadedModels:
    device, dtype = config.torch_device(), config.torch_dtype()
    if config.target is not None:
        target = load_target(config.target, dtype=dtype, device=device)
        draft = None
        if config.draft is not None:
            draft_cfg = None
            if config.draft_rope_is_neox_style is not None:
                draft_cfg = DraftConfig.from_pretrained(
                    config.draft, overrides={"rope_is_neox_style": config.draft_rope_is_neox_style})
            draft = load_draft(config.draft, target.config, dtype=dtype, device=device, cfg=draft_cfg)
        return LoadedModels(target, draft, load_tokenizer(config.target),
                            default_stop_ids(config.target, target.config.eos_token_ids),
                            generation_defaults(config.target), f"checkpoint {config.target}")
    name = preset_name(config)
    cfg = target_preset(name)
    target = random_target(cfg, dtype, device, config.seed)
    draft_name = draft_preset_name(config)
    draft = None
    if draft_name is not None:
        draft = random_draft(draft_preset(draft_name), cfg.hidden_size, dtype, device, config.seed + 1)
    return LoadedModels(target, draft, None, tuple(cfg.eos_token_ids), {},
                        f"preset {name}" + (f" + {draft_name}" if draft_name else ""))
