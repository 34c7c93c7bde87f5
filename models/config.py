"""Typed model configs parsed from Hugging Face ``config.json`` files.

``TargetConfig`` covers ``lfm2`` (dense LFM2 / LFM2.5) and ``lfm2_moe`` (LFM2-MoE) with the rules of
reference/lfm2.md §2: ``block_ff_dim`` overrides ``intermediate_size``; the 2/3 + round-up FFN rule
applies to dense ``lfm2`` only; the layer schedule comes from ``layer_types`` or ``full_attn_idxs``
(one is required; ``lfm2_moe`` needs ``layer_types``); RoPE theta from ``rope_parameters`` or
``rope_theta``; ``tie_embedding`` aliases ``tie_word_embeddings``; ``head_dim`` defaults to
``hidden_size // num_attention_heads``. ``DraftConfig`` covers DSpark drafts (reference/dspark.md §8).

A config that cannot be served raises :class:`ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ATTENTION = "full_attention"
CONV = "conv"
DEFAULT_ROPE_THETA = 1_000_000.0


class ConfigError(ValueError):
    """A model config that cannot be served; the message names the field."""


def read_json_object(path: Path, error: type[ValueError] | None = None) -> dict[str, Any]:
    """The JSON object in ``path``; a file that cannot be read, is not JSON or holds something else
    than an object raises ``error`` (default :class:`ConfigError`) naming the file and the problem.
    Every JSON file of a checkpoint is read here (config, index, generation config, draft config)."""
    error = error or ConfigError
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e}); the file is damaged or incomplete: download it again") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, got a {type(value).__name__}")
    return value


def _read_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}: point to a Hugging Face model directory")
    return read_json_object(path)


def _from_file(parse, path: str | Path):
    """``parse(config dict)``, with a field of the wrong type (an int where a list belongs, a string
    where a number does) raised as :class:`ConfigError` naming the file rather than as a bare
    TypeError / ValueError from deep inside."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    raw = _read_json(path)
    try:
        return parse(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (TypeError, ValueError, AttributeError, KeyError) as e:
        raise ConfigError(f"{path}: a config field has the wrong type or value ({type(e).__name__}: {e})") from None


def _positive_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"config field '{key}' is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config field '{key}' must be a positive integer, got {value!r}")
    return value


def _rope_theta(cfg: dict[str, Any]) -> float:
    """Theta from ``rope_parameters`` (transformers 5 exports) or top-level ``rope_theta``."""
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config field 'rope_parameters' must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"config field 'rope_parameters.rope_type' is {rope_type!r}: only 'default' RoPE "
                          "(no scaling) is supported, as in every released LFM2 / DSpark checkpoint")
    if cfg.get("rope_scaling"):
        raise ConfigError("config field 'rope_scaling' is set: RoPE scaling is not supported")
    nested, top = params.get("rope_theta"), cfg.get("rope_theta")
    if nested is not None and top is not None and float(nested) != float(top):
        raise ConfigError(f"config fields 'rope_theta' ({top}) and 'rope_parameters.rope_theta' ({nested}) "
                          "disagree: fix the config so they match")
    theta = nested if nested is not None else top
    theta = DEFAULT_ROPE_THETA if theta is None else float(theta)
    if not theta > 0:
        raise ConfigError(f"config field 'rope_theta' must be positive, got {theta}")
    return theta


def parse_token_ids(value: Any) -> tuple[int, ...]:
    """A config's token id field (``eos_token_id``: one id, a list of ids or null) as a tuple; any
    other value raises :class:`ConfigError`."""
    if value is None:
        return ()
    ids = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(ids, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ids):
        raise ConfigError(f"token ids must be a non-negative integer or a list of them, got {value!r}")
    return tuple(ids)


@dataclass(frozen=True)
class TargetConfig:
    """An LFM2 / LFM2-MoE target, with every derived size resolved."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    intermediate_size: int             # effective dense FFN width (after block_ff_dim / auto-adjust)
    norm_eps: float = 1e-5
    conv_L_cache: int = 3
    rope_theta: float = DEFAULT_ROPE_THETA
    max_position_embeddings: int = 128_000
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (7,)
    pad_token_id: int | None = 0
    # LFM2-MoE only
    num_dense_layers: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    use_expert_bias: bool = True
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    # -- derived ---------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.model_type == "lfm2_moe"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    @property
    def conv_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == CONV)

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.num_dense_layers

    # -- parsing ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> "TargetConfig":
        """Parse ``config.json`` of a model directory (or the file itself)."""
        return _from_file(cls.from_dict, path)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "TargetConfig":
        model_type = cfg.get("model_type")
        if model_type not in ("lfm2", "lfm2_moe"):
            raise ConfigError(f"config field 'model_type' is {model_type!r}: lfmspark serves 'lfm2' and 'lfm2_moe' "
                              "targets (DSpark drafts are loaded as the draft, not the target)")
        hidden = _positive_int(cfg, "hidden_size")
        n_layers = _positive_int(cfg, "num_hidden_layers")
        n_heads = _positive_int(cfg, "num_attention_heads")
        n_kv = _positive_int(cfg, "num_key_value_heads")
        if n_heads % n_kv:
            raise ConfigError(f"config field 'num_attention_heads' ({n_heads}) must be a multiple of "
                              f"'num_key_value_heads' ({n_kv})")
        if cfg.get("head_dim") is not None:
            head_dim = _positive_int(cfg, "head_dim")
        elif hidden % n_heads:
            raise ConfigError(f"config field 'hidden_size' ({hidden}) is not divisible by 'num_attention_heads' "
                              f"({n_heads}) and no 'head_dim' is given")
        else:
            head_dim = hidden // n_heads
        if head_dim % 2:
            raise ConfigError(f"config field 'head_dim' ({head_dim}) must be even for RoPE")
        if cfg.get("conv_bias", False):
            raise ConfigError("config field 'conv_bias' is true: ShortConv biases are not supported "
                              "(no released LFM2 checkpoint has them)")
        conv_l = _positive_int(cfg, "conv_L_cache", 3)
        if conv_l < 2:
            raise ConfigError(f"config field 'conv_L_cache' must be >= 2, got {conv_l}")

        layer_types = cls._layer_schedule(cfg, model_type, n_layers)
        tie = cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))
        eos = cfg.get("eos_token_id", 7)

        common: dict[str, Any] = dict(
            model_type=model_type, vocab_size=_positive_int(cfg, "vocab_size"), hidden_size=hidden,
            num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim,
            layer_types=layer_types, intermediate_size=cls._dense_ffn_width(cfg, model_type),
            norm_eps=float(cfg.get("norm_eps", 1e-5)), conv_L_cache=conv_l, rope_theta=_rope_theta(cfg),
            max_position_embeddings=_positive_int(cfg, "max_position_embeddings", 128_000),
            tie_word_embeddings=bool(tie), bos_token_id=cfg.get("bos_token_id"), eos_token_ids=parse_token_ids(eos),
            pad_token_id=cfg.get("pad_token_id"),
        )
        if model_type == "lfm2_moe":
            common.update(cls._moe_fields(cfg, n_layers))
        return cls(**common)

    @staticmethod
    def _layer_schedule(cfg: dict[str, Any], model_type: str, n_layers: int) -> tuple[str, ...]:
        types = cfg.get("layer_types")
        if types is None:
            idxs = cfg.get("full_attn_idxs")
            if model_type == "lfm2_moe" or idxs is None:
                need = "'layer_types'" if model_type == "lfm2_moe" else "'layer_types' or 'full_attn_idxs'"
                raise ConfigError(f"config has no layer schedule: {need} is required (without it transformers "
                                  "would silently make every layer attention)")
            bad = [i for i in idxs if not (isinstance(i, int) and 0 <= i < n_layers)]
            if bad:
                raise ConfigError(f"config field 'full_attn_idxs' has indices outside 0..{n_layers - 1}: {bad}")
            types = [ATTENTION if i in idxs else CONV for i in range(n_layers)]
        types = tuple(types)
        if len(types) != n_layers:
            raise ConfigError(f"config field 'layer_types' has {len(types)} entries but 'num_hidden_layers' is "
                              f"{n_layers}")
        unknown = sorted({t for t in types if t not in (ATTENTION, CONV)})
        if unknown:
            raise ConfigError(f"config field 'layer_types' has unknown layer types {unknown}: expected "
                              f"'{CONV}' or '{ATTENTION}'")
        if ATTENTION not in types:
            raise ConfigError("config field 'layer_types' has no 'full_attention' layer: LFM2 needs at least one")
        return types

    @staticmethod
    def _dense_ffn_width(cfg: dict[str, Any], model_type: str) -> int:
        # transformers' Lfm2Config lets Liquid's `block_ff_dim` override `intermediate_size`;
        # Lfm2MoeConfig does not read `block_ff_dim` at all
        ff = cfg.get("intermediate_size") if model_type == "lfm2_moe" else cfg.get("block_ff_dim",
                                                                                  cfg.get("intermediate_size"))
        if ff is None:
            raise ConfigError("config field 'intermediate_size' (or 'block_ff_dim') is missing")
        if isinstance(ff, bool) or not isinstance(ff, int) or ff <= 0:
            raise ConfigError(f"config field 'intermediate_size' must be a positive integer, got {ff!r}")
        if model_type == "lfm2" and cfg.get("block_auto_adjust_ff_dim", True):
            ff = int(2 * ff / 3)
            multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
            if multiplier is not None:
                multiple_of = _positive_int(cfg, "block_multiple_of", 256)
                ff = int(multiplier * ff)
                ff = multiple_of * math.ceil(ff / multiple_of)
        return ff

    @staticmethod
    def _moe_fields(cfg: dict[str, Any], n_layers: int) -> dict[str, Any]:
        n_dense = cfg.get("num_dense_layers", 2)
        if not isinstance(n_dense, int) or not 0 <= n_dense <= n_layers:
            raise ConfigError(f"config field 'num_dense_layers' must be in 0..{n_layers}, got {n_dense!r}")
        n_experts = _positive_int(cfg, "num_experts", 32)
        top_k = _positive_int(cfg, "num_experts_per_tok", 4)
        if top_k > n_experts:
            raise ConfigError(f"config field 'num_experts_per_tok' ({top_k}) exceeds 'num_experts' ({n_experts})")
        return dict(
            num_dense_layers=n_dense, num_experts=n_experts, num_experts_per_tok=top_k,
            moe_intermediate_size=_positive_int(cfg, "moe_intermediate_size", 1792),
            use_expert_bias=bool(cfg.get("use_expert_bias", True)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers ``config.json`` dict describing the same model (for writing checkpoints)."""
        d: dict[str, Any] = dict(
            model_type=self.model_type, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            layer_types=list(self.layer_types), intermediate_size=self.intermediate_size,
            norm_eps=self.norm_eps, conv_L_cache=self.conv_L_cache, conv_bias=False,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id, pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids),
        )
        if self.is_moe:
            d.update(num_dense_layers=self.num_dense_layers, num_experts=self.num_experts,
                     num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_intermediate_size,
                     use_expert_bias=self.use_expert_bias, norm_topk_prob=self.norm_topk_prob,
                     routed_scaling_factor=self.routed_scaling_factor)
            d["architectures"] = ["Lfm2MoeForCausalLM"]
        else:
            d["block_auto_adjust_ff_dim"] = False      # the width above is already the effective one
            d["architectures"] = ["Lfm2ForCausalLM"]
        return d


MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DraftConfig:
    """A DSpark draft (DeepSpec layout: slot ``k`` of a block predicts position ``s + k + 1``)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int                         # draft proposals per round (gamma); verify width is block_size + 1
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    vocab_size: int | None = None           # rows of the target embedding the draft was trained with
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_is_neox_style: bool = True
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    num_target_layers: int | None = None
    target_hidden_size: int | None = None   # width of each tapped target feature (defaults to hidden_size)
    max_position_embeddings: int | None = None
    # the confidence head's Sequential Temperature Scaling (reference/dspark.md §4.4): c_k = sigmoid(z_k / T_k),
    # one temperature per block slot; None: uncalibrated (every T_k = 1). `lfmspark calibrate` fits them.
    sts_temperatures: tuple[float, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def verify_width(self) -> int:
        return self.block_size + 1

    @property
    def n_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DraftConfig":
        return _from_file(cls.from_dict, path)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "DraftConfig":
        if cfg.get("speculators_model_type") is not None or "transformer_layer_config" in cfg:
            raise ConfigError(
                "this is a vllm-project/speculators checkpoint (field 'speculators_model_type'): its blocks use "
                "the DFlash slot convention (slot j predicts anchor + j), while lfmspark follows DeepSpec DSpark "
                "(slot k predicts anchor + k + 1). Served here it would read every slot one position early and "
                "accept almost nothing. Convert it to the DeepSpec layout or use a DeepSpec/LiquidAI DSpark export.")
        if "dflash_config" in cfg and "block_size" not in cfg:
            raise ConfigError("this is a DFlash draft (field 'dflash_config'): lfmspark serves DSpark drafts, whose "
                              "config has top-level 'block_size', 'target_layer_ids' and 'mask_token_id'")
        for key in ("block_size", "target_layer_ids", "mask_token_id"):
            if cfg.get(key) is None:
                raise ConfigError(f"draft config field '{key}' is missing: not a DSpark draft config")
        hidden = _positive_int(cfg, "hidden_size")
        n_heads = _positive_int(cfg, "num_attention_heads")
        n_kv = _positive_int(cfg, "num_key_value_heads", n_heads)
        if n_heads % n_kv:
            raise ConfigError(f"draft config field 'num_attention_heads' ({n_heads}) must be a multiple of "
                              f"'num_key_value_heads' ({n_kv})")
        head_dim = cfg.get("head_dim") or hidden // n_heads
        ids = cfg["target_layer_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise ConfigError(f"draft config field 'target_layer_ids' must be a non-empty list of ints, got {ids!r}")
        if any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < -1:
            raise ConfigError(f"draft config field 'target_layer_ids' must be strictly increasing ids in "
                              f"{{-1}} ∪ [0, target layers), got {ids}")
        markov_rank = int(cfg.get("markov_rank", 0) or 0)
        head_type = cfg.get("markov_head_type", "vanilla") if markov_rank > 0 else "vanilla"
        if head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"draft config field 'markov_head_type' is {head_type!r}: expected one of "
                              f"{list(MARKOV_HEAD_TYPES)}")
        confidence = bool(cfg.get("enable_confidence_head", False))
        if confidence and cfg.get("confidence_head_with_markov", False) and markov_rank == 0:
            raise ConfigError("draft config sets 'confidence_head_with_markov' but 'markov_rank' is 0: the confidence "
                              "head would need Markov features that do not exist")
        neox = cfg.get("rope_is_neox_style", cfg.get("is_neox_style"))
        if neox is None:
            raise ConfigError("draft config has no 'rope_is_neox_style': the RoPE pairing of a draft cannot be "
                              "guessed (LFM2 DSpark drafts are interleaved, false; Qwen3 drafts are neox, true). "
                              "Add the field to config.json")
        block = _positive_int(cfg, "block_size")
        sts = cfg.get("sts_temperatures")
        if sts is not None:
            if not confidence:
                raise ConfigError("draft config has 'sts_temperatures' but no confidence head "
                                  "('enable_confidence_head' is false): there is nothing to calibrate")
            if (not isinstance(sts, list) or len(sts) != block
                    or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in sts)):
                raise ConfigError(f"draft config field 'sts_temperatures' must be a list of {block} positive numbers "
                                  f"(one per block slot), got {sts!r}")
            sts = tuple(float(t) for t in sts)
        known = {f for f in cls.__dataclass_fields__}
        return cls(
            hidden_size=hidden, intermediate_size=_positive_int(cfg, "intermediate_size"),
            num_hidden_layers=_positive_int(cfg, "num_hidden_layers"), num_attention_heads=n_heads,
            num_key_value_heads=n_kv, head_dim=int(head_dim), block_size=block,
            target_layer_ids=tuple(ids), mask_token_id=int(cfg["mask_token_id"]),
            vocab_size=cfg.get("vocab_size"), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg), rope_is_neox_style=bool(neox), markov_rank=markov_rank,
            markov_head_type=head_type, enable_confidence_head=confidence,
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", False)) and confidence,
            num_target_layers=cfg.get("num_target_layers"),
            target_hidden_size=cfg.get("target_hidden_size"),
            max_position_embeddings=cfg.get("max_position_embeddings"), sts_temperatures=sts,
            extra={k: v for k, v in cfg.items() if k not in known},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "rope_theta")}
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        d["architectures"] = ["Lfm2DSparkDraftModel"]
        d["model_type"] = "qwen3"
        d["layer_types"] = ["full_attention"] * self.num_hidden_layers
        return {k: v for k, v in d.items() if v is not None}
