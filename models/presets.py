"""Model presets: configs with the real shapes of released LFM2 / LFM2.5 checkpoints and their
DSpark drafts, plus tiny configs for tests, with random initialisation for benchmarks.

Weights cannot be downloaded here, so benchmarks run these shapes with random weights (DESIGN §7).
Real-shape sources: reference/lfm2.md §5.3/§6 (parameter counts match the model cards exactly for
the dense models) and reference/sglang.md / anchors.md §4.4 for the drafts (LFM2.5-1.2B-Instruct-
DSpark: 5 layers, hidden 2048, FFN 6144, 32/8 heads, head_dim 64, Markov rank 256 + confidence
head, block 9, 295.7M parameters). Fields no source gives (the drafts' ``target_layer_ids`` and
``mask_token_id``, the 8B-A1B draft's FFN width) are plausible placeholders, marked below.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .config import ATTENTION, CONV, DraftConfig, TargetConfig


def _schedule(n_layers: int, attention: Iterable[int]) -> tuple[str, ...]:
    attention = set(attention)
    return tuple(ATTENTION if i in attention else CONV for i in range(n_layers))


def _lfm2(hidden: int, heads: int, ffn: int, n_layers: int, attention: Iterable[int], vocab: int = 65536,
          theta: float = 1e6, kv_heads: int = 8, **kw) -> TargetConfig:
    return TargetConfig(model_type="lfm2", vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n_layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                        layer_types=_schedule(n_layers, attention), intermediate_size=ffn, rope_theta=theta, **kw)


def _lfm2_moe(vocab: int, theta: float) -> TargetConfig:
    return TargetConfig(model_type="lfm2_moe", vocab_size=vocab, hidden_size=2048, num_hidden_layers=24,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        layer_types=_schedule(24, (2, 6, 10, 14, 18, 21)), intermediate_size=7168, rope_theta=theta,
                        num_dense_layers=2, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=1792)


_SMALL_ATTENTION = (2, 5, 8, 10, 12, 14)

TARGET_PRESETS: dict[str, TargetConfig] = {
    "lfm2-350m": _lfm2(1024, 16, 4608, 16, _SMALL_ATTENTION),
    "lfm2-700m": _lfm2(1536, 24, 6912, 16, _SMALL_ATTENTION),
    "lfm2-1.2b": _lfm2(2048, 32, 8192, 16, _SMALL_ATTENTION),
    "lfm2.5-1.2b": _lfm2(2048, 32, 8192, 16, _SMALL_ATTENTION),
    "lfm2-2.6b": _lfm2(2048, 32, 10752, 30, (2, 5, 9, 13, 17, 21, 24, 27)),
    "lfm2-8b-a1b": _lfm2_moe(65536, 1e6),
    "lfm2.5-8b-a1b": _lfm2_moe(128000, 5e6),
    # tiny shapes for tests and CPU smoke runs (same layer kinds, a few hundred thousand parameters); their
    # vocabulary is the byte tokenizer's (runtime/byte_tokenizer.py: LFM2's 8 special tokens and 256 bytes)
    "tiny": _lfm2(64, 4, 128, 4, (1, 3), vocab=264, kv_heads=2, max_position_embeddings=4096),
    "tiny-moe": TargetConfig(model_type="lfm2_moe", vocab_size=264, hidden_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             layer_types=_schedule(4, (1, 3)), intermediate_size=128, num_dense_layers=1,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             max_position_embeddings=4096),
}


def _dspark(hidden: int, n_layers: int, ffn: int, taps: tuple[int, ...], vocab: int, mask: int,
            theta: float = 1e6, heads: int = 32, kv_heads: int = 8, block: int = 9, rank: int = 256) -> DraftConfig:
    return DraftConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=n_layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                       block_size=block, target_layer_ids=taps, mask_token_id=mask, vocab_size=vocab,
                       rms_norm_eps=1e-5, rope_theta=theta, rope_is_neox_style=False, markov_rank=rank,
                       markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True)


# target_layer_ids follow DFlash's evenly spaced rule round(1 + i (N - 4) / (n_taps - 1)) with 5 taps;
# mask_token_id is an id near the end of the vocabulary (placeholders: the released configs are not
# available offline). The 8B-A1B draft's FFN width is assumed equal to the 1.2B draft's.
DRAFT_PRESETS: dict[str, DraftConfig] = {
    "lfm2.5-1.2b-dspark": _dspark(2048, 5, 6144, (1, 4, 7, 10, 13), 65536, 65535),
    "lfm2-8b-a1b-dspark": _dspark(2048, 3, 6144, (1, 6, 11, 16, 21), 65536, 65535),
    "lfm2.5-8b-a1b-dspark": _dspark(2048, 3, 6144, (1, 6, 11, 16, 21), 128000, 127999, theta=5e6),
    "tiny-dspark": _dspark(64, 2, 96, (0, 2), 264, 263, heads=4, kv_heads=2, block=4, rank=16),
}

# the draft each target preset is benchmarked with
DEFAULT_DRAFT: dict[str, str] = {
    "lfm2-1.2b": "lfm2.5-1.2b-dspark",
    "lfm2.5-1.2b": "lfm2.5-1.2b-dspark",
    "lfm2-8b-a1b": "lfm2-8b-a1b-dspark",
    "lfm2.5-8b-a1b": "lfm2.5-8b-a1b-dspark",
    "tiny": "tiny-dspark",
    "tiny-moe": "tiny-dspark",
}


def target_preset(name: str) -> TargetConfig:
    if name not in TARGET_PRESETS:
        raise ValueError(f"unknown target preset {name!r}; choose one of {sorted(TARGET_PRESETS)}")
    return TARGET_PRESETS[name]


def draft_preset(name: str) -> DraftConfig:
    if name not in DRAFT_PRESETS:
        raise ValueError(f"unknown draft preset {name!r}; choose one of {sorted(DRAFT_PRESETS)}")
    return DRAFT_PRESETS[name]


@torch.no_grad()
def materialize_random(module: nn.Module, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                       std: float = 0.02) -> nn.Module:
    """Give a module built on the meta device random weights on ``device`` without ever holding
    an fp32 copy: matrices ~ N(0, std), norm scales 1, conv taps ~ N(0, 1/K), biases 0, fp32
    buffers (MoE expert bias) ~ N(0, 0.01)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    done: set[int] = set()      # a tied tensor is materialised once; callers re-tie
    for owner_name, owner in module.named_modules():
        for name, t in list(owner.named_parameters(recurse=False)) + list(owner.named_buffers(recurse=False)):
            if not t.is_meta or id(t) in done:
                continue
            done.add(id(t))
            keep_fp32 = t.dtype == torch.float32 and name in ("expert_bias",)
            new = torch.empty(t.shape, dtype=torch.float32 if keep_fp32 else dtype, device=device)
            if name == "expert_bias":
                new.normal_(0.0, 0.01, generator=gen)
            elif "norm" in owner_name.rsplit(".", 1)[-1] or name == "k_norm":
                new.fill_(1.0)
            elif name == "conv_weight":
                new.normal_(0.0, t.shape[-1] ** -0.5, generator=gen)
            elif name == "bias":
                new.zero_()
            else:
                new.normal_(0.0, std, generator=gen)
            if isinstance(t, nn.Parameter):
                setattr(owner, name, nn.Parameter(new, requires_grad=False))
            else:
                owner.register_buffer(name, new)
    return module


def random_target(cfg: TargetConfig, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                  seed: int = 0):
    """A target module with random weights (real shapes for benchmarks, tiny ones for tests)."""
    from .lfm2_moe import build_target

    with torch.device("meta"):
        model = build_target(cfg)
    materialize_random(model, dtype, device, seed)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def random_draft(cfg: DraftConfig, target_hidden: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", seed: int = 1):
    """A DSpark draft with random weights (attach the target's embedding and LM head before use)."""
    from .dspark import DSparkDraft

    with torch.device("meta"):
        draft = DSparkDraft(cfg, target_hidden)
    return materialize_random(draft, dtype, device, seed).eval()
