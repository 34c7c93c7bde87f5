"""The models an :class:`EngineConfig` names: a checkpoint (target, optional DSpark draft, tokenizer,
stop ids, the checkpoint's sampling defaults) or a preset of random weights with a real model's shapes.

The tiny presets come with a byte-level tokenizer (runtime/byte_tokenizer.py), so text and chat
work on them too. A checkpoint is a local directory or a Hugging Face Hub id (``LiquidAI/LFM2.5-1.2B-Instruct``),
resolved through ``huggingface_hub``: its local cache first, the Hub where it is reachable
(``HF_HUB_OFFLINE=1`` keeps to the cache), at ``EngineConfig.revision``. The tokenizer comes from
the target unless ``EngineConfig.tokenizer`` names another directory or id; ``chat_template``
replaces the tokenizer's template (a file, or the template itself); ``generation_config`` says where
the sampling defaults come from (``auto``: the target's generation_config.json, ``vllm``: none, or
a directory), as vLLM's flags of those names do.

``load_models`` is the one place models are built from a config; ``Engine.from_config`` calls it,
and a benchmark that runs several engines on one set of weights loads once and hands the result to
each (``Engine.from_config(cfg, models)``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..models.config import DraftConfig
from ..models.dspark import DSparkDraft
from ..models.lfm2 import Lfm2ForCausalLM
from ..models.lfm2_moe import quantize_target
from ..models.loading import load_draft, load_target
from ..models.presets import DEFAULT_DRAFT, draft_preset, random_draft, random_target, target_preset
from ..models.loading import CheckpointError
from .byte_tokenizer import byte_tokenizer
from .config import EngineConfig
from .prompts import default_stop_ids, generation_defaults, load_tokenizer

log = logging.getLogger("lfmspark")

# presets that come with the byte tokenizer (their vocabulary is its): the others' random weights serve
# token-id prompts, the benchmarks' (which would otherwise pay for detokenizing every token)
BYTE_TOKENIZER_PRESETS = ("tiny", "tiny-moe")


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


def resolve_checkpoint(name: str, revision: str | None = None, what: str = "target") -> Path:
    """The local directory of a checkpoint given as a directory or a Hub id (module doc)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name.count("/") != 1 or name.startswith(("/", ".", "~")):
        raise CheckpointError(f"{what} {name!r}: not a checkpoint directory, nor a Hugging Face Hub id "
                              "(organisation/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        local = snapshot_download(name, revision=revision)
    except LocalEntryNotFoundError as e:
        raise CheckpointError(f"{what} {name!r}{f' at revision {revision!r}' if revision else ''} is not in the "
                              "local Hugging Face cache and the Hub cannot be reached (HF_HUB_OFFLINE set, or no "
                              "network): download it where there is network (huggingface-cli download "
                              f"{name}) or give a local directory") from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(f"{what} {name!r}: could not be fetched from the Hugging Face Hub: {e}") from e
    log.info("%s %s -> %s", what, name, local)
    return Path(local)


def _tokenizer(config: EngineConfig, target_dir: Path):
    tokenizer = load_tokenizer(resolve_checkpoint(config.tokenizer, config.revision, "tokenizer")
                               if config.tokenizer else target_dir)
    if config.chat_template is not None:
        if tokenizer is None:
            raise CheckpointError("chat_template needs a tokenizer, and this checkpoint has none: give one with "
                                  "tokenizer")
        template = Path(config.chat_template).expanduser()
        tokenizer.chat_template = template.read_text() if template.is_file() else config.chat_template
    return tokenizer


def _sampling_defaults(config: EngineConfig, target_dir: Path) -> dict:
    if config.generation_config == "vllm":
        return {}
    source = target_dir if config.generation_config == "auto" else Path(config.generation_config).expanduser()
    if config.generation_config != "auto" and not (source / "generation_config.json").is_file():
        raise CheckpointError(f"generation_config {config.generation_config!r}: no generation_config.json there")
    return generation_defaults(source)


def load_models(config: EngineConfig) -> LoadedModels:
    device, dtype = config.torch_device(), config.torch_dtype()
    if config.target is not None:
        target_dir = resolve_checkpoint(config.target, config.revision)
        target = load_target(target_dir, dtype=dtype, device=device, quantization=config.quantization)
        draft = None
        if config.draft is not None:
            draft_dir = resolve_checkpoint(config.draft, config.revision, "draft")
            draft_cfg = None
            if config.draft_rope_is_neox_style is not None:
                draft_cfg = DraftConfig.from_pretrained(
                    draft_dir, overrides={"rope_is_neox_style": config.draft_rope_is_neox_style})
            draft = load_draft(draft_dir, target.config, dtype=dtype, device=device, cfg=draft_cfg)
        return LoadedModels(target, draft, _tokenizer(config, target_dir),
                            default_stop_ids(target_dir, target.config.eos_token_ids),
                            _sampling_defaults(config, target_dir), f"checkpoint {config.target}")
    name = preset_name(config)
    cfg = target_preset(name)
    target = random_target(cfg, dtype, device, config.seed)
    if config.quantization == "fp8":
        quantize_target(target)
    draft_name = draft_preset_name(config)
    draft = None
    if draft_name is not None:
        draft = random_draft(draft_preset(draft_name), cfg.hidden_size, dtype, device, config.seed + 1)
    tokenizer = byte_tokenizer() if name in BYTE_TOKENIZER_PRESETS else None
    return LoadedModels(target, draft, tokenizer, tuple(cfg.eos_token_ids), {},
                        f"preset {name}" + (f" + {draft_name}" if draft_name else "")
                        + (f" ({config.quantization})" if config.quantization else ""))
