"""Config parsing (reference/lfm2.md §2, reference/dspark.md §8) and the real-shape presets.

Where transformers derives a value (layer schedule, FFN width, head_dim, RoPE theta, tied
embeddings, MoE layer plan) the expected value is taken from transformers' own ``Lfm2Config`` /
``Lfm2MoeConfig`` or from the shapes of HF modules built (on the meta device) from the same dict.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from transformers import Lfm2Config, Lfm2ForCausalLM, Lfm2MoeConfig, Lfm2MoeForCausalLM
from transformers.models.lfm2.modeling_lfm2 import Lfm2Attention, Lfm2MLP
from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeMLP, Lfm2MoeSparseMoeBlock

from lfmspark.models.config import (ATTENTION, CONV, DRAFT_FIELDS, ROPE_PARAMETER_FIELDS, TARGET_FIELDS, ConfigError,
                                    DraftConfig, Kind, TargetConfig)
from lfmspark.models.dspark import DSparkDraft
from lfmspark.models.lfm2_moe import build_target
from lfmspark.models.presets import DRAFT_PRESETS, TARGET_PRESETS

SMALL_ATTN = [2, 5, 8, 10, 12, 14]


def lfm2_dict(**over) -> dict:
    """An LFM2-1.2B-style config.json as first released (Liquid's keys next to HF's), narrow."""
    d = dict(
        model_type="lfm2", architectures=["Lfm2ForCausalLM"], vocab_size=65536, hidden_size=256,
        block_dim=256, num_hidden_layers=16, num_attention_heads=4, num_heads=4, num_key_value_heads=2,
        intermediate_size=12288, block_ff_dim=12288, block_auto_adjust_ff_dim=True, block_multiple_of=256,
        block_ffn_dim_multiplier=1.0, full_attn_idxs=list(SMALL_ATTN), conv_L_cache=3, conv_bias=False,
        conv_dim=256, conv_dim_out=256, norm_eps=1e-5, block_norm_eps=1e-5, rope_theta=1e6, theta=1e6,
        max_position_embeddings=128000, tie_embedding=True, bos_token_id=1, eos_token_id=7, pad_token_id=0,
        use_pos_enc=True,
    )
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}


def moe_dict(**over) -> dict:
    """An LFM2-8B-A1B-style config.json (transformers 5 export), narrow."""
    d = dict(
        model_type="lfm2_moe", architectures=["Lfm2MoeForCausalLM"], vocab_size=65536, hidden_size=256,
        num_hidden_layers=24, num_attention_heads=4, num_key_value_heads=2, intermediate_size=7168,
        moe_intermediate_size=1792, layer_types=[ATTENTION if i in (2, 6, 10, 14, 18, 21) else CONV
                                                 for i in range(24)],
        num_dense_layers=2, num_experts=32, num_experts_per_tok=4, use_expert_bias=True, norm_topk_prob=True,
        routed_scaling_factor=1.0, conv_L_cache=3, conv_bias=False, norm_eps=1e-5,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, max_position_embeddings=128000,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=7, pad_token_id=0,
    )
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}


def hf_cfg(d: dict):
    """transformers' config object for a config.json dict (as ``from_pretrained`` would build it)."""
    moe = d["model_type"] == "lfm2_moe"
    d = {k: v for k, v in copy.deepcopy(d).items() if k not in ("model_type", "architectures")}
    return Lfm2MoeConfig(**d) if moe else Lfm2Config(**d)


def hf_dense_ffn_width(d: dict) -> int:
    """Rows of ``feed_forward.w1`` in the HF module built from ``d``."""
    cfg = hf_cfg(d)
    with torch.device("meta"):
        mlp = Lfm2MoeMLP(cfg) if isinstance(cfg, Lfm2MoeConfig) else Lfm2MLP(cfg)
    return mlp.w1.weight.shape[0]


def raises(d: dict, *fields: str, cls=TargetConfig):
    with pytest.raises(ConfigError) as e:
        cls.from_dict(d)
    for f in fields:
        assert f in str(e.value), f"message does not name {f!r}: {e.value}"
    return str(e.value)


# ---------------------------------------------------------------------------------------------
# FFN width

@pytest.mark.parametrize("block_ff_dim,effective", [(6656, 4608), (10240, 6912), (12288, 8192)])
def test_auto_adjust_ff_dim(block_ff_dim, effective):
    d = lfm2_dict(intermediate_size=block_ff_dim, block_ff_dim=block_ff_dim)
    assert hf_dense_ffn_width(d) == effective
    assert TargetConfig.from_dict(d).intermediate_size == effective


def test_block_ff_dim_overrides_intermediate_size():
    # 12288 -> 8192 through the auto-adjust rule; 8192 alone would give int(2*8192/3) -> 5632
    d = lfm2_dict(intermediate_size=8192, block_ff_dim=12288)
    assert hf_dense_ffn_width(d) == 8192
    assert TargetConfig.from_dict(d).intermediate_size == 8192
    d = lfm2_dict(intermediate_size=8192, block_ff_dim=None)
    assert hf_dense_ffn_width(d) == 5632
    assert TargetConfig.from_dict(d).intermediate_size == 5632


def test_auto_adjust_off_keeps_width():
    d = lfm2_dict(intermediate_size=10752, block_ff_dim=10752, block_auto_adjust_ff_dim=False, num_hidden_layers=30,
                  full_attn_idxs=[2, 5, 9, 13, 17, 21, 24, 27])
    assert hf_dense_ffn_width(d) == 10752
    assert TargetConfig.from_dict(d).intermediate_size == 10752


@pytest.mark.parametrize("multiplier,multiple_of", [(1.5, 256), (1.0, 100), (2, 64)])
def test_auto_adjust_multiplier_and_rounding(multiplier, multiple_of):
    d = lfm2_dict(intermediate_size=1000, block_ff_dim=1000, block_ffn_dim_multiplier=multiplier,
                  block_multiple_of=multiple_of)
    assert TargetConfig.from_dict(d).intermediate_size == hf_dense_ffn_width(d)


def test_auto_adjust_without_multiplier_does_not_round():
    # transformers 4.x / reference §2.3: the round-up happens only inside the multiplier branch
    # (transformers 5.24's strict config no longer accepts None, so the value is computed here)
    d = lfm2_dict(intermediate_size=1000, block_ff_dim=1000)
    d["block_ffn_dim_multiplier"] = None
    assert TargetConfig.from_dict(d).intermediate_size == int(2 * 1000 / 3) == 666


@pytest.mark.parametrize("extra", [{}, {"block_auto_adjust_ff_dim": True}, {"block_ff_dim": 12288}])
def test_moe_never_auto_adjusts(extra):
    d = moe_dict(**extra)
    assert hf_dense_ffn_width(d) == 7168
    cfg = TargetConfig.from_dict(d)
    assert cfg.intermediate_size == 7168
    assert cfg.moe_intermediate_size == 1792


# ---------------------------------------------------------------------------------------------
# layer schedule

def test_layer_types_from_full_attn_idxs():
    d = lfm2_dict()
    cfg = TargetConfig.from_dict(d)
    assert list(cfg.layer_types) == hf_cfg(d).layer_types
    assert cfg.attention_layers == tuple(SMALL_ATTN)
    assert cfg.conv_layers == tuple(i for i in range(16) if i not in SMALL_ATTN)


def test_layer_types_win_over_full_attn_idxs():
    types = [ATTENTION if i in (0, 15) else CONV for i in range(16)]
    d = lfm2_dict(layer_types=types)                 # full_attn_idxs still says SMALL_ATTN
    assert hf_cfg(d).layer_types == types
    assert list(TargetConfig.from_dict(d).layer_types) == types


def test_moe_layer_plan_matches_hf():
    d = moe_dict(num_hidden_layers=6, layer_types=[CONV, CONV, ATTENTION, CONV, ATTENTION, CONV], num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64, hidden_size=64)
    cfg = TargetConfig.from_dict(d)
    with torch.device("meta"):
        hf = Lfm2MoeForCausalLM(hf_cfg(d))
    for i, layer in enumerate(hf.model.layers):
        assert cfg.is_moe_layer(i) == isinstance(layer.feed_forward, Lfm2MoeSparseMoeBlock)
        assert (cfg.layer_types[i] == ATTENTION) == hasattr(layer, "self_attn")
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, False, True, True, True, True]
    dense = TargetConfig.from_dict(lfm2_dict())
    assert not any(dense.is_moe_layer(i) for i in range(16))


def test_moe_fields_and_defaults():
    cfg = TargetConfig.from_dict(moe_dict(num_dense_layers=3, num_experts=16, num_experts_per_tok=2,
                                          moe_intermediate_size=512, use_expert_bias=False, norm_topk_prob=False,
                                          routed_scaling_factor=2.5))
    assert (cfg.num_dense_layers, cfg.num_experts, cfg.num_experts_per_tok) == (3, 16, 2)
    assert cfg.moe_intermediate_size == 512
    assert (cfg.use_expert_bias, cfg.norm_topk_prob, cfg.routed_scaling_factor) == (False, False, 2.5)
    assert cfg.is_moe
    # absent fields take transformers' defaults
    d = moe_dict(num_dense_layers=None, num_experts=None, num_experts_per_tok=None, moe_intermediate_size=None,
                 use_expert_bias=None, norm_topk_prob=None, routed_scaling_factor=None)
    cfg, hf = TargetConfig.from_dict(d), hf_cfg(d)
    for f in ("num_dense_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "use_expert_bias",
              "norm_topk_prob", "routed_scaling_factor"):
        assert getattr(cfg, f) == getattr(hf, f), f


# ---------------------------------------------------------------------------------------------
# RoPE, aliases, head_dim, token ids

@pytest.mark.parametrize("rope", [
    dict(rope_theta=5e5, theta=None),
    dict(rope_theta=None, theta=None, rope_parameters={"rope_theta": 2e6, "rope_type": "default"}),
    dict(rope_theta=5e5, theta=None, rope_parameters={"rope_theta": 5e5, "rope_type": "default"}),
    dict(rope_theta=None, theta=None),                   # default 1e6
    dict(rope_theta=1e4, theta=3e6),                     # Liquid's `theta` is ignored by transformers 5
    dict(rope_theta=None, theta=3e6),
], ids=["top-level", "rope_parameters", "both-agree", "default", "theta-ignored", "theta-only"])
def test_rope_theta(rope):
    d = lfm2_dict(**rope)
    assert TargetConfig.from_dict(d).rope_theta == hf_cfg(d).rope_parameters["rope_theta"]


def test_rope_theta_disagreement_is_an_error():
    d = lfm2_dict(rope_theta=1e6, rope_parameters={"rope_theta": 5e6, "rope_type": "default"})
    raises(d, "rope_theta", "rope_parameters")


def test_rope_type_not_default_is_an_error():
    d = lfm2_dict(rope_parameters={"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0})
    raises(d, "rope_type", "linear")


@pytest.mark.parametrize("key,value", [("tie_embedding", False), ("tie_embedding", True),
                                       ("tie_word_embeddings", False)])
def test_tie_embedding_alias(key, value):
    d = lfm2_dict(tie_embedding=None)
    d[key] = value
    assert hf_cfg(d).tie_word_embeddings is value
    assert TargetConfig.from_dict(d).tie_word_embeddings is value


@pytest.mark.parametrize("head_dim", [None, 32, 128])
def test_head_dim(head_dim):
    d = lfm2_dict(hidden_size=256, num_attention_heads=4, head_dim=head_dim)
    cfg = TargetConfig.from_dict(d)
    with torch.device("meta"):
        attn = Lfm2Attention(hf_cfg(d), layer_idx=2)
    assert cfg.head_dim == attn.head_dim == attn.q_layernorm.weight.shape[0]
    assert cfg.head_dim == (256 // 4 if head_dim is None else head_dim)


@pytest.mark.parametrize("eos,expected", [(7, (7,)), ([7, 2], (7, 2)), ([7], (7,))])
def test_eos_int_or_list(eos, expected):
    assert TargetConfig.from_dict(lfm2_dict(eos_token_id=eos)).eos_token_ids == expected


def test_released_configs_equal_presets():
    """config.json dicts shaped like the released dense checkpoints parse to the presets."""
    real = {
        "lfm2-350m": lfm2_dict(hidden_size=1024, block_dim=1024, num_attention_heads=16, num_heads=16,
                               num_key_value_heads=8, intermediate_size=6656, block_ff_dim=6656),
        "lfm2-700m": lfm2_dict(hidden_size=1536, block_dim=1536, num_attention_heads=24, num_heads=24,
                               num_key_value_heads=8, intermediate_size=10240, block_ff_dim=10240),
        "lfm2-1.2b": lfm2_dict(hidden_size=2048, block_dim=2048, num_attention_heads=32, num_heads=32,
                               num_key_value_heads=8),
        "lfm2-2.6b": lfm2_dict(hidden_size=2048, block_dim=2048, num_attention_heads=32, num_heads=32,
                               num_key_value_heads=8, num_hidden_layers=30, full_attn_idxs=None,
                               layer_types=[ATTENTION if i in (2, 5, 9, 13, 17, 21, 24, 27) else CONV
                                            for i in range(30)],
                               intermediate_size=10752, block_ff_dim=10752, block_auto_adjust_ff_dim=False),
        "lfm2-8b-a1b": moe_dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8),
    }
    for name, d in real.items():
        assert TargetConfig.from_dict(d) == TARGET_PRESETS[name], name


def test_to_hf_dict_round_trip():
    for name, cfg in TARGET_PRESETS.items():
        d = cfg.to_hf_dict()
        assert TargetConfig.from_dict(d) == cfg, name
        assert hf_dense_ffn_width(d) == cfg.intermediate_size, name
        assert hf_cfg(d).layer_types == list(cfg.layer_types), name


# ---------------------------------------------------------------------------------------------
# errors

def test_unknown_model_type():
    raises(lfm2_dict(model_type="llama"), "model_type", "llama")


def test_no_layer_schedule_dense():
    # transformers would silently make every layer attention
    d = lfm2_dict(full_attn_idxs=None)
    assert hf_cfg(d).layer_types == [ATTENTION] * 16
    raises(d, "layer_types", "full_attn_idxs")


def test_no_layer_schedule_moe():
    d = moe_dict(layer_types=None, full_attn_idxs=[2, 6, 10, 14, 18, 21])   # MoE has no full_attn_idxs fallback
    raises(d, "layer_types")


def test_layer_types_length_mismatch():
    raises(lfm2_dict(full_attn_idxs=None, layer_types=[CONV, ATTENTION] * 7), "layer_types", "num_hidden_layers")


def test_unknown_layer_type():
    types = [CONV] * 16
    types[2], types[5] = ATTENTION, "sliding_attention"
    raises(lfm2_dict(full_attn_idxs=None, layer_types=types), "layer_types", "sliding_attention")


def test_heads_not_divisible_by_kv_heads():
    raises(lfm2_dict(num_attention_heads=6, num_key_value_heads=4, hidden_size=384), "num_attention_heads",
           "num_key_value_heads")


def test_hidden_not_divisible_by_heads_without_head_dim():
    raises(lfm2_dict(hidden_size=250, num_attention_heads=4, num_key_value_heads=2), "hidden_size",
           "num_attention_heads", "head_dim")
    # with an explicit head_dim the same geometry is fine
    assert TargetConfig.from_dict(lfm2_dict(hidden_size=250, head_dim=64)).head_dim == 64


def test_conv_bias_true():
    raises(lfm2_dict(conv_bias=True), "conv_bias")


def test_top_k_exceeds_experts():
    raises(moe_dict(num_experts=4, num_experts_per_tok=8), "num_experts_per_tok", "num_experts")


# ---------------------------------------------------------------------------------------------
# DSpark draft config

def draft_dict(**over) -> dict:
    """An LFM2.5-1.2B DSpark draft config.json (DeepSpec layout)."""
    d = dict(
        architectures=["Lfm2DSparkDraftModel"], model_type="qwen3", vocab_size=65536, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, rope_is_neox_style=False,
        num_target_layers=16, target_layer_ids=[1, 4, 7, 10, 13], block_size=9, mask_token_id=65535,
        num_anchors=512, markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}


def test_draft_config_parses():
    cfg = DraftConfig.from_dict(draft_dict())
    assert cfg.block_size == 9 and cfg.verify_width == 10
    assert cfg.target_layer_ids == (1, 4, 7, 10, 13) and cfg.n_taps == 5
    assert cfg.rope_is_neox_style is False
    assert cfg.markov_rank == 256 and cfg.confidence_head_with_markov
    assert DraftConfig.from_dict(draft_dict(rope_is_neox_style=True)).rope_is_neox_style is True


def test_draft_speculators_format_refused():
    d = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
         "transformer_layer_config": {"hidden_size": 2048}, "block_size": 8, "aux_hidden_state_layer_ids": [1, 4]}
    msg = raises(d, "speculators", cls=DraftConfig)
    # the message explains the slot convention (why serving it would silently fail)
    assert re.search(r"slot j predicts anchor \+ j", msg) and re.search(r"slot k predicts anchor \+ k \+ 1", msg), msg


@pytest.mark.parametrize("field", ["block_size", "target_layer_ids", "mask_token_id"])
def test_draft_missing_required_field(field):
    raises(draft_dict(**{field: None}), field, cls=DraftConfig)


@pytest.mark.parametrize("ids", [[1, 4, 4, 10], [5, 2], [1, 7, 4]])
def test_draft_target_layer_ids_must_increase(ids):
    raises(draft_dict(target_layer_ids=ids), "target_layer_ids", cls=DraftConfig)


def test_draft_missing_rope_pairing_refused():
    msg = raises(draft_dict(rope_is_neox_style=None), "rope_is_neox_style", cls=DraftConfig)
    assert "guess" in msg


def test_draft_confidence_with_markov_needs_rank():
    raises(draft_dict(markov_rank=0), "confidence_head_with_markov", "markov_rank", cls=DraftConfig)


def test_draft_without_markov_head():
    cfg = DraftConfig.from_dict(draft_dict(markov_rank=0, confidence_head_with_markov=False))
    assert cfg.markov_rank == 0 and cfg.enable_confidence_head and not cfg.confidence_head_with_markov
    assert DraftConfig.from_dict(draft_dict(markov_rank=None, confidence_head_with_markov=False)).markov_rank == 0


@pytest.mark.parametrize("head_dim", [7, 63])
def test_draft_odd_head_dim(head_dim):
    raises(draft_dict(head_dim=head_dim), "head_dim", f"({head_dim})", "even", cls=DraftConfig)


def test_draft_head_dim_derived_from_hidden_size():
    assert DraftConfig.from_dict(draft_dict(head_dim=None)).head_dim == 2048 // 32
    # 2040 / 32 is not whole: refused, as for a target, instead of rounding down
    raises(draft_dict(head_dim=None, hidden_size=2040), "hidden_size", "num_attention_heads", "head_dim",
           cls=DraftConfig)
    assert DraftConfig.from_dict(draft_dict(hidden_size=2040)).head_dim == 64


def test_draft_heads_not_divisible_by_kv_heads():
    raises(draft_dict(num_attention_heads=32, num_key_value_heads=6), "num_attention_heads", "num_key_value_heads",
           cls=DraftConfig)


@pytest.mark.parametrize("field, value", [("markov_rank", -1), ("block_size", 0), ("mask_token_id", -5),
                                          ("target_layer_ids", [])])
def test_draft_structural_fields_out_of_range(field, value):
    raises(draft_dict(**{field: value}), f"{field}: expected", f"got {json.dumps(value)}", cls=DraftConfig)


def test_target_odd_head_dim():
    raises(lfm2_dict(head_dim=15), "head_dim", "(15)", "even")


# ---------------------------------------------------------------------------------------------
# every field is read through its table of field -> kind

# values of several JSON types: for each field, the first its kind refuses is written into the config
WRONG_VALUES = ["x", 3, 2.5, -1, True, [1], {"a": 1}, None]


def _wrong_value(kind: Kind):
    return next((v for v in WRONG_VALUES if not (kind.accepts(v) if v is not None else kind.nullable)), "--none--")


def _refusals(bases, field: str, value) -> list[str]:
    """The messages of the configs in ``bases`` (each a dict and the class that parses it) with
    ``field`` set to ``value``; a config that does not read the field parses."""
    messages = []
    for d, cls in bases:
        try:
            cls.from_dict({**d, field: value})
        except ConfigError as e:
            messages.append(str(e))
    return messages


TARGET_BASES = [(lfm2_dict(), TargetConfig), (moe_dict(), TargetConfig)]


@pytest.mark.parametrize("field", sorted(f for f, k in TARGET_FIELDS.items() if _wrong_value(k) != "--none--"))
def test_every_target_field_of_the_wrong_kind_is_named(field):
    kind = TARGET_FIELDS[field]
    value = _wrong_value(kind)
    want = f"{field}: expected {kind.expected}, got {json.dumps(value)}"
    messages = _refusals(TARGET_BASES, field, value)
    assert any(want in m for m in messages), (want, messages)


@pytest.mark.parametrize("field", sorted(f for f, k in DRAFT_FIELDS.items() if _wrong_value(k) != "--none--"))
def test_every_draft_field_of_the_wrong_kind_is_named(field):
    kind = DRAFT_FIELDS[field]
    value = _wrong_value(kind)
    want = f"{field}: expected {kind.expected}, got {json.dumps(value)}"
    messages = _refusals([(draft_dict(), DraftConfig)], field, value)
    assert any(want in m for m in messages), (want, messages)


@pytest.mark.parametrize("field", sorted(ROPE_PARAMETER_FIELDS))
def test_every_rope_parameter_of_the_wrong_kind_is_named(field):
    kind = ROPE_PARAMETER_FIELDS[field]
    value = _wrong_value(kind)
    want = f"rope_parameters.{field}: expected {kind.expected}, got {json.dumps(value)}"
    for d, cls in [(moe_dict(), TargetConfig), (draft_dict(), DraftConfig)]:
        raises({**d, "rope_parameters": {"rope_theta": 1e6, field: value}}, want, cls=cls)


class ReadRecorder(dict):
    """A config dict that records the fields read from it."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


@pytest.mark.parametrize("d, cls, table", [
    (lfm2_dict(), TargetConfig, TARGET_FIELDS),
    (lfm2_dict(full_attn_idxs=None, layer_types=[ATTENTION] * 16, block_ffn_dim_multiplier=None), TargetConfig,
     TARGET_FIELDS),
    (moe_dict(), TargetConfig, TARGET_FIELDS),
    (draft_dict(), DraftConfig, DRAFT_FIELDS),
    (draft_dict(markov_rank=0, confidence_head_with_markov=False, sts_temperatures=[1.0] * 9), DraftConfig,
     DRAFT_FIELDS),
], ids=["lfm2", "lfm2-layer-types", "lfm2-moe", "draft", "draft-no-markov"])
def test_every_field_read_has_a_kind(d, cls, table):
    """from_dict reads the config only through its table: every field it reads has a kind there."""
    recorder = ReadRecorder(d)
    cls.from_dict(recorder)
    assert recorder.read and recorder.read <= set(table), sorted(recorder.read - set(table))


# ---------------------------------------------------------------------------------------------
# real-shape presets: parameter counts on the meta device

def _n_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())          # a tied tensor is counted once


@pytest.mark.parametrize("name,card", [("lfm2-350m", 354_483_968), ("lfm2-700m", 742_489_344),
                                       ("lfm2-1.2b", 1_170_340_608), ("lfm2.5-1.2b", 1_170_340_608),
                                       ("lfm2-2.6b", 2_569_272_320)])
def test_dense_preset_parameter_counts(name, card):
    with torch.device("meta"):
        model = build_target(TARGET_PRESETS[name])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert _n_params(model) == card


@pytest.mark.parametrize("name", sorted(TARGET_PRESETS))
def test_preset_parameter_counts_match_hf(name):
    cfg = TARGET_PRESETS[name]
    hf_d = cfg.to_hf_dict()
    with torch.device("meta"):
        ours = build_target(cfg)
        hf = (Lfm2MoeForCausalLM if cfg.is_moe else Lfm2ForCausalLM)(hf_cfg(hf_d))
    assert _n_params(ours) == _n_params(hf)
    if name == "lfm2-8b-a1b":
        assert round(_n_params(ours) / 1e9, 1) == 8.3              # model card: "8.3B"


def test_draft_preset_parameter_count():
    cfg = DRAFT_PRESETS["lfm2.5-1.2b-dspark"]
    with torch.device("meta"):
        draft = DSparkDraft(cfg, target_hidden=2048)
    n = _n_params(draft)
    # the model card's 295.7M (5 layers, hidden 2048, FFN 6144, 32/8 heads, Markov rank 256,
    # confidence head; the embedding and LM head are the target's)
    assert abs(n - 295.7e6) / 295.7e6 < 1e-3, n
    # and the same count from the architecture by hand
    H, F, hd, L, V, r, taps = 2048, 6144, 64, 5, 65536, 256, 5
    per_layer = 2 * H + H * 32 * hd + 2 * H * 8 * hd + 32 * hd * H + 2 * hd + 3 * H * F
    by_hand = L * per_layer + taps * H * H + 2 * H + 2 * V * r + (H + r) + 1
    assert n == by_hand
