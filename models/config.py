"""Typed model configs parsed from Hugging Face ``config.json`` files.

``TargetConfig`` covers ``lfm2`` (dense LFM2 / LFM2.5) and ``lfm2_moe`` (LFM2-MoE) with the rules of
reference/lfm2.md §2: ``block_ff_dim`` overrides ``intermediate_size``; the 2/3 + round-up FFN rule
applies to dense ``lfm2`` only; the layer schedule comes from ``layer_types`` or ``full_attn_idxs``
(one is required; ``lfm2_moe`` needs ``layer_types``); RoPE theta from ``rope_parameters`` or
``rope_theta``; ``tie_embedding`` aliases ``tie_word_embeddings``; ``head_dim`` defaults to
``hidden_size // num_attention_heads``. ``DraftConfig`` covers DSpark drafts (reference/dspark.md §8).

A config that cannot be served raises :class:`ConfigError` naming the field and the fix. Every
field is read through a table of field -> :class:`Kind` (:data:`TARGET_FIELDS`, :data:`DRAFT_FIELDS`;
runtime/prompts.py has generation_config.json's), so a value of the wrong type is refused as
``config.json: full_attn_idxs: expected a list of layer indices, got 3``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
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


def _from_file(parse, path: str | Path, overrides: dict[str, Any] | None = None,
               defaults: dict[str, Any] | None = None):
    """``parse(config dict)`` of the file at ``path`` (``overrides`` replace fields of the file,
    ``defaults`` fill fields it lacks), with every :class:`ConfigError` (a field of the wrong kind,
    see :class:`Fields`, or a value the model cannot take) naming the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    raw = {**(defaults or {}), **_read_json(path), **(overrides or {})}
    try:
        return parse(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------------------------
# field kinds: every field read from config.json, generation_config.json or a draft's config.json
# is read through a table of field -> Kind, so that a value of the wrong type is refused naming the
# field, the value found and what the field takes, instead of failing somewhere inside

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_list(v: Any, item: Callable[[Any], bool], non_empty: bool = False) -> bool:
    return isinstance(v, (list, tuple)) and (bool(v) or not non_empty) and all(item(i) for i in v)


@dataclass(frozen=True)
class Kind:
    """What a config field takes. ``expected`` completes "expected ..." in the error; ``nullable``:
    JSON null is a value of the field (it then means what the code reading it says: none, or
    derive the value), not an error."""

    expected: str
    accepts: Callable[[Any], bool]
    nullable: bool = False

    def or_null(self) -> "Kind":
        return Kind(self.expected, self.accepts, nullable=True)


POSITIVE_INT = Kind("a positive integer", lambda v: _is_int(v) and v > 0)
NON_NEGATIVE_INT = Kind("a non-negative integer", lambda v: _is_int(v) and v >= 0)
WHOLE_NUMBER = Kind("an integer", lambda v: _is_number(v) and v == int(v))
NUMBER = Kind("a number", _is_number)
POSITIVE_NUMBER = Kind("a positive number", lambda v: _is_number(v) and v > 0)
NON_NEGATIVE_NUMBER = Kind("a non-negative number", lambda v: _is_number(v) and v >= 0)
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
STRING = Kind("a string", lambda v: isinstance(v, str))
OBJECT = Kind("a JSON object", lambda v: isinstance(v, dict))
ANYTHING = Kind("any value", lambda v: True, nullable=True)
TOKEN_ID = Kind("a token id (a non-negative integer)", NON_NEGATIVE_INT.accepts)
TOKEN_IDS = Kind("a token id or a list of token ids (non-negative integers)",
                 lambda v: NON_NEGATIVE_INT.accepts(v) or _is_list(v, NON_NEGATIVE_INT.accepts), nullable=True)
LAYER_INDICES = Kind("a list of layer indices", lambda v: _is_list(v, _is_int))
LAYER_TYPES = Kind("a list of layer types ('conv' or 'full_attention')", lambda v: _is_list(v, STRING.accepts))
TAP_IDS = Kind("a non-empty list of target layer ids (integers)", lambda v: _is_list(v, _is_int, non_empty=True))
NUMBERS = Kind("a list of numbers", lambda v: _is_list(v, _is_number))

# RoPE fields, common to targets and drafts (``rope_parameters`` is read with ROPE_PARAMETER_FIELDS)
ROPE_FIELDS: dict[str, Kind] = {
    "rope_parameters": OBJECT.or_null(), "rope_theta": POSITIVE_NUMBER.or_null(), "rope_scaling": ANYTHING,
}
ROPE_PARAMETER_FIELDS: dict[str, Kind] = {
    "rope_type": STRING, "type": STRING, "rope_theta": POSITIVE_NUMBER.or_null(),
}

# every field TargetConfig.from_dict reads (the dense-only and MoE-only ones are read for that
# model type only)
TARGET_FIELDS: dict[str, Kind] = {
    "model_type": STRING, "vocab_size": POSITIVE_INT, "hidden_size": POSITIVE_INT,
    "num_hidden_layers": POSITIVE_INT, "num_attention_heads": POSITIVE_INT, "num_key_value_heads": POSITIVE_INT,
    "head_dim": POSITIVE_INT.or_null(), "layer_types": LAYER_TYPES.or_null(), "full_attn_idxs": LAYER_INDICES.or_null(),
    "conv_bias": BOOL, "conv_L_cache": POSITIVE_INT, "norm_eps": NON_NEGATIVE_NUMBER,
    "max_position_embeddings": POSITIVE_INT, "tie_embedding": BOOL, "tie_word_embeddings": BOOL,
    "bos_token_id": TOKEN_ID.or_null(), "eos_token_id": TOKEN_IDS, "pad_token_id": TOKEN_ID.or_null(),
    "intermediate_size": POSITIVE_INT,
    # dense lfm2: the FFN width rule
    "block_ff_dim": POSITIVE_INT, "block_auto_adjust_ff_dim": BOOL,
    "block_ffn_dim_multiplier": POSITIVE_NUMBER.or_null(), "block_multiple_of": POSITIVE_INT,
    # lfm2_moe
    "num_dense_layers": NON_NEGATIVE_INT, "num_experts": POSITIVE_INT, "num_experts_per_tok": POSITIVE_INT,
    "moe_intermediate_size": POSITIVE_INT, "use_expert_bias": BOOL, "norm_topk_prob": BOOL,
    "routed_scaling_factor": NUMBER,
    **ROPE_FIELDS,
}

# every field DraftConfig.from_dict reads
DRAFT_FIELDS: dict[str, Kind] = {
    # format markers: only their presence is read
    "speculators_model_type": ANYTHING, "transformer_layer_config": ANYTHING, "dflash_config": ANYTHING,
    "block_size": POSITIVE_INT, "target_layer_ids": TAP_IDS.or_null(), "mask_token_id": TOKEN_ID.or_null(),
    "hidden_size": POSITIVE_INT, "intermediate_size": POSITIVE_INT, "num_hidden_layers": POSITIVE_INT,
    "num_attention_heads": POSITIVE_INT, "num_key_value_heads": POSITIVE_INT, "head_dim": POSITIVE_INT.or_null(),
    "vocab_size": POSITIVE_INT.or_null(), "rms_norm_eps": NON_NEGATIVE_NUMBER,
    "rope_is_neox_style": BOOL.or_null(), "is_neox_style": BOOL.or_null(),
    "markov_rank": NON_NEGATIVE_INT.or_null(), "markov_head_type": STRING,
    "enable_confidence_head": BOOL, "confidence_head_with_markov": BOOL,
    "num_target_layers": POSITIVE_INT.or_null(), "target_hidden_size": POSITIVE_INT.or_null(),
    "max_position_embeddings": POSITIVE_INT.or_null(), "sts_temperatures": NUMBERS.or_null(),
    **ROPE_FIELDS,
}


def _shown(value: Any) -> str:
    """A value as the JSON file spells it (``null``, ``true``, ``"small"``), shortened."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Fields:
    """A config dict read through its table of field -> :class:`Kind`: every value read is checked,
    and one of the wrong kind raises :class:`ConfigError` "``where``field: expected <kind>, got
    <value>". Reading a field that has no entry in the table is a bug here (KeyError)."""

    def __init__(self, raw: dict[str, Any], kinds: dict[str, Kind], where: str = ""):
        self.raw, self.kinds, self.where = raw, kinds, where

    def __contains__(self, key: str) -> bool:
        if key not in self.kinds:
            raise KeyError(f"config field {key!r} has no kind in the table")
        return key in self.raw

    def get(self, key: str, default: Any = None) -> Any:
        """The field's value (checked), ``default`` when the file lacks it."""
        kind = self.kinds.get(key)
        if kind is None:
            raise KeyError(f"config field {key!r} has no kind in the table")
        if key not in self.raw:
            return default
        value = self.raw[key]
        if value is None and kind.nullable:
            return None
        if value is None or not kind.accepts(value):
            raise ConfigError(f"{self.where}{key}: expected {kind.expected}, got {_shown(value)}")
        return value

    def nested(self, key: str, kinds: dict[str, Kind]) -> "Fields":
        """The JSON object in field ``key`` (empty when absent or null), read through ``kinds``."""
        return Fields(self.get(key) or {}, kinds, f"{self.where}{key}.")


def _required(cfg: Fields, key: str, default: Any = None) -> Any:
    """A field the config must have (or ``default``), of its table's kind."""
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"config field '{key}' is missing")
    return value


def _head_dim(cfg: Fields, hidden: int, n_heads: int, what: str) -> int:
    """``head_dim``, or ``hidden_size // num_attention_heads`` where it is absent; even, for RoPE."""
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % n_heads:
            raise ConfigError(f"{what} field 'hidden_size' ({hidden}) is not divisible by 'num_attention_heads' "
                              f"({n_heads}) and no 'head_dim' is given")
        head_dim = hidden // n_heads
    if head_dim % 2:
        raise ConfigError(f"{what} field 'head_dim' ({head_dim}) must be even: RoPE rotates the head dimension in "
                          "pairs")
    return head_dim


def _rope_theta(cfg: Fields) -> float:
    """Theta from ``rope_parameters`` (transformers 5 exports) or top-level ``rope_theta``."""
    params = cfg.nested("rope_parameters", ROPE_PARAMETER_FIELDS)
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
    return DEFAULT_ROPE_THETA if theta is None else float(theta)


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
    def from_dict(cls, raw: dict[str, Any]) -> "TargetConfig":
        cfg = Fields(raw, TARGET_FIELDS)
        model_type = cfg.get("model_type")
        if model_type not in ("lfm2", "lfm2_moe"):
            raise ConfigError(f"config field 'model_type' is {model_type!r}: lfmspark serves 'lfm2' and 'lfm2_moe' "
                              "targets (DSpark drafts are loaded as the draft, not the target)")
        hidden = _required(cfg, "hidden_size")
        n_layers = _required(cfg, "num_hidden_layers")
        n_heads = _required(cfg, "num_attention_heads")
        n_kv = _required(cfg, "num_key_value_heads")
        if n_heads % n_kv:
            raise ConfigError(f"config field 'num_attention_heads' ({n_heads}) must be a multiple of "
                              f"'num_key_value_heads' ({n_kv})")
        head_dim = _head_dim(cfg, hidden, n_heads, "config")
        if cfg.get("conv_bias", False):
            raise ConfigError("config field 'conv_bias' is true: ShortConv biases are not supported "
                              "(no released LFM2 checkpoint has them)")
        conv_l = _required(cfg, "conv_L_cache", 3)
        if conv_l < 2:
            raise ConfigError(f"config field 'conv_L_cache' must be >= 2, got {conv_l}")

        layer_types = cls._layer_schedule(cfg, model_type, n_layers)
        tie = cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True))
        eos = cfg.get("eos_token_id", 7)

        common: dict[str, Any] = dict(
            model_type=model_type, vocab_size=_required(cfg, "vocab_size"), hidden_size=hidden,
            num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim,
            layer_types=layer_types, intermediate_size=cls._dense_ffn_width(cfg, model_type),
            norm_eps=float(cfg.get("norm_eps", 1e-5)), conv_L_cache=conv_l, rope_theta=_rope_theta(cfg),
            max_position_embeddings=_required(cfg, "max_position_embeddings", 128_000),
            tie_word_embeddings=bool(tie), bos_token_id=cfg.get("bos_token_id"), eos_token_ids=parse_token_ids(eos),
            pad_token_id=cfg.get("pad_token_id"),
        )
        if model_type == "lfm2_moe":
            common.update(cls._moe_fields(cfg, n_layers))
        return cls(**common)

    @staticmethod
    def _layer_schedule(cfg: Fields, model_type: str, n_layers: int) -> tuple[str, ...]:
        types = cfg.get("layer_types")
        if types is None:
            idxs = cfg.get("full_attn_idxs")
            if model_type == "lfm2_moe" or idxs is None:
                need = "'layer_types'" if model_type == "lfm2_moe" else "'layer_types' or 'full_attn_idxs'"
                raise ConfigError(f"config has no layer schedule: {need} is required (without it transformers "
                                  "would silently make every layer attention)")
            bad = [i for i in idxs if not 0 <= i < n_layers]
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
    def _dense_ffn_width(cfg: Fields, model_type: str) -> int:
        # transformers' Lfm2Config lets Liquid's `block_ff_dim` override `intermediate_size`;
        # Lfm2MoeConfig does not read `block_ff_dim` at all
        ff = cfg.get("intermediate_size") if model_type == "lfm2_moe" else cfg.get("block_ff_dim",
                                                                                  cfg.get("intermediate_size"))
        if ff is None:
            raise ConfigError("config field 'intermediate_size' (or 'block_ff_dim') is missing")
        if model_type == "lfm2" and cfg.get("block_auto_adjust_ff_dim", True):
            configured = ff
            ff = int(2 * ff / 3)
            multiplier = cfg.get("block_ffn_dim_multiplier", 1.0)
            if multiplier is not None:
                multiple_of = _required(cfg, "block_multiple_of", 256)
                ff = int(multiplier * ff)
                ff = multiple_of * math.ceil(ff / multiple_of)
            if ff <= 0:
                raise ConfigError(f"config field 'intermediate_size' / 'block_ff_dim' ({configured}) gives an FFN "
                                  f"width of {ff} after 'block_auto_adjust_ff_dim': the feed-forward would be empty")
        return ff

    @staticmethod
    def _moe_fields(cfg: Fields, n_layers: int) -> dict[str, Any]:
        n_dense = cfg.get("num_dense_layers", 2)
        if not 0 <= n_dense <= n_layers:
            raise ConfigError(f"config field 'num_dense_layers' must be in 0..{n_layers}, got {n_dense!r}")
        n_experts = _required(cfg, "num_experts", 32)
        top_k = _required(cfg, "num_experts_per_tok", 4)
        if top_k > n_experts:
            raise ConfigError(f"config field 'num_experts_per_tok' ({top_k}) exceeds 'num_experts' ({n_experts})")
        return dict(
            num_dense_layers=n_dense, num_experts=n_experts, num_experts_per_tok=top_k,
            moe_intermediate_size=_required(cfg, "moe_intermediate_size", 1792),
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
    def from_pretrained(cls, path: str | Path, overrides: dict[str, Any] | None = None,
                        defaults: dict[str, Any] | None = None) -> "DraftConfig":
        """Parse the draft's ``config.json`` (``overrides`` replace fields of the file, e.g. a RoPE
        pairing given on the command line; ``defaults`` fill fields it lacks)."""
        return _from_file(cls.from_dict, path, overrides, defaults)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DraftConfig":
        cfg = Fields(raw, DRAFT_FIELDS)
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
        hidden = _required(cfg, "hidden_size")
        n_heads = _required(cfg, "num_attention_heads")
        n_kv = _required(cfg, "num_key_value_heads", n_heads)
        if n_heads % n_kv:
            raise ConfigError(f"draft config field 'num_attention_heads' ({n_heads}) must be a multiple of "
                              f"'num_key_value_heads' ({n_kv})")
        head_dim = _head_dim(cfg, hidden, n_heads, "draft config")
        ids = list(cfg.get("target_layer_ids"))
        if any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < -1:
            raise ConfigError(f"draft config field 'target_layer_ids' must be strictly increasing ids in "
                              f"{{-1}} ∪ [0, target layers), got {ids}")
        markov_rank = cfg.get("markov_rank", 0) or 0        # 0 (or null): no Markov head
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
        block = _required(cfg, "block_size")
        sts = cfg.get("sts_temperatures")
        if sts is not None:
            if not confidence:
                raise ConfigError("draft config has 'sts_temperatures' but no confidence head "
                                  "('enable_confidence_head' is false): there is nothing to calibrate")
            if len(sts) != block or not all(t > 0 for t in sts):
                raise ConfigError(f"draft config field 'sts_temperatures' must be a list of {block} positive numbers "
                                  f"(one per block slot), got {sts!r}")
            sts = tuple(float(t) for t in sts)
        known = {f for f in cls.__dataclass_fields__}
        return cls(
            hidden_size=hidden, intermediate_size=_required(cfg, "intermediate_size"),
            num_hidden_layers=_required(cfg, "num_hidden_layers"), num_attention_heads=n_heads,
            num_key_value_heads=n_kv, head_dim=head_dim, block_size=block,
            target_layer_ids=tuple(ids), mask_token_id=cfg.get("mask_token_id"),
            vocab_size=cfg.get("vocab_size"), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg), rope_is_neox_style=bool(neox), markov_rank=markov_rank,
            markov_head_type=head_type, enable_confidence_head=confidence,
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", False)) and confidence,
            num_target_layers=cfg.get("num_target_layers"),
            target_hidden_size=cfg.get("target_hidden_size"),
            max_position_embeddings=cfg.get("max_position_embeddings"), sts_temperatures=sts,
            extra={k: v for k, v in raw.items() if k not in known},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("extra", "rope_theta")}
        d["target_layer_ids"] = list(self.target_layer_ids)
        d["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        d["architectures"] = ["Lfm2DSparkDraftModel"]
        d["model_type"] = "qwen3"
        d["layer_types"] = ["full_attention"] * self.num_hidden_layers
        return {k: v for k, v in d.items() if v is not None}
