"""Targets and drafts built on purpose for the speculative-decoding tests.

A *bigram target* is a tiny LFM2 (dense or MoE) whose operators and feed-forwards write back
only ``leak`` times their output, and whose untied LM head maps each token ``v`` to ``perm[v]``:
with ``leak = 0`` its greedy next token is exactly ``perm[current token]`` (while every conv state,
KV entry and tape is still computed from real activations); with a small leak the context
sometimes changes the choice. An *oracle draft* has zero base logits and a Markov head that
encodes a permutation, so it proposes ``perm2[prev]`` at every slot: equal to the target's
permutation it is accepted (almost) always, partly equal it is accepted partly, disjoint never.
"""

from __future__ import annotations

import dataclasses

import torch

from lfmspark.models.cache import DraftCache
from lfmspark.models.config import ATTENTION, CONV, DraftConfig, TargetConfig
from lfmspark.models.presets import random_draft, random_target

V = 64


def tiny_target_config(moe: bool = False, vocab: int = V, head_dim: int = 8) -> TargetConfig:
    types = (CONV, ATTENTION, CONV, CONV, ATTENTION)
    extra = dict(num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24) if moe else {}
    return TargetConfig(model_type="lfm2_moe" if moe else "lfm2", vocab_size=vocab, hidden_size=32,
                        num_hidden_layers=len(types), num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                        layer_types=types, intermediate_size=48, tie_word_embeddings=False, eos_token_ids=(),
                        rope_theta=10_000.0, max_position_embeddings=4096, **extra)   # the tiny preset's context


def tiny_draft_config(block: int = 4, vocab: int = V, rank: int = V, taps: tuple[int, ...] = (0, 2, 3),
                      head_dim: int = 8) -> DraftConfig:
    return DraftConfig(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=head_dim, block_size=block, target_layer_ids=taps,
                       mask_token_id=vocab - 1, vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=10_000.0,
                       rope_is_neox_style=False, markov_rank=rank, markov_head_type="vanilla",
                       enable_confidence_head=True, confidence_head_with_markov=True)


@torch.no_grad()
def random_tiny_target(moe: bool = False, seed: int = 0, vocab: int = V, head_dim: int = 8):
    """A random target whose outputs depend on the whole context (weights large enough to matter);
    ``head_dim`` 16 or more for the attention kernels (the CPU references take any)."""
    cfg = tiny_target_config(moe, vocab, head_dim)
    model = random_target(cfg, torch.float32, "cpu", seed)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        elif "conv_weight" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.7)
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 / p.shape[-1] ** 0.5 * 4)
    return model


@torch.no_grad()
def bigram_target(perm: torch.Tensor, leak: float = 0.0, moe: bool = False, seed: int = 0, head_dim: int = 8):
    """A target whose greedy choice is ``perm[token]`` (exactly when ``leak == 0``)."""
    model = random_tiny_target(moe, seed, vocab=len(perm), head_dim=head_dim)
    for name, p in model.named_parameters():
        if name.endswith(("out_proj.weight", "w2.weight", "experts.w2")):
            p.mul_(leak)
    embed = model.model.embed_tokens.weight
    normed = model.model.embedding_norm(embed)                 # final hidden when nothing else contributes
    head = torch.empty_like(model.lm_head.weight)
    head[perm] = 4.0 * normed / normed.norm(dim=-1, keepdim=True)
    model.lm_head.weight.copy_(head)
    return model


@torch.no_grad()
def oracle_draft(perm: torch.Tensor, block: int = 4, seed: int = 1, head_dim: int = 8):
    """A draft proposing ``perm[prev]`` at every slot (base logits zero, Markov bias one-hot)."""
    vocab = len(perm)
    cfg = tiny_draft_config(block, vocab, rank=vocab, head_dim=head_dim)
    draft = random_draft(cfg, 32, torch.float32, "cpu", seed)
    draft.norm.weight.zero_()                                   # base logits = LM head(0) = 0
    draft.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
    w2 = torch.zeros(vocab, vocab)
    w2[perm, torch.arange(vocab)] = 10.0
    draft.markov_head.markov_w2.weight.copy_(w2)
    return draft


@torch.no_grad()
def random_tiny_draft(block: int = 4, seed: int = 1, vocab: int = V, taps: tuple[int, ...] = (0, 2, 3),
                      head_dim: int = 8):
    cfg = tiny_draft_config(block, vocab, rank=8, taps=taps, head_dim=head_dim)
    draft = random_draft(cfg, 32, torch.float32, "cpu", seed)
    gen = torch.Generator().manual_seed(seed)
    for name, p in draft.named_parameters():
        if p.dim() > 1 and name != "k_norm":
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return draft


def permutation(seed: int, vocab: int = V) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))


def mix_permutations(perm: torch.Tensor, other: torch.Tensor, agree: float, seed: int) -> torch.Tensor:
    """``perm`` on a random ``agree`` fraction of tokens, ``other`` elsewhere."""
    keep = torch.rand(len(perm), generator=torch.Generator().manual_seed(seed)) < agree
    return torch.where(keep, perm, other)


def derangement_of(perm: torch.Tensor) -> torch.Tensor:
    """A map that never agrees with ``perm``."""
    return torch.roll(perm, 1)


def with_config(model, **changes):
    model.config = dataclasses.replace(model.config, **changes)
    return model


def random_tiny_draft_with_context(block: int = 4):
    """A tiny draft attached to a tiny target's embedding and LM head, with 6 context positions
    injected into slot 1 of a fresh cache. Returns ``(draft, cache, slot, start)``."""
    draft = random_tiny_draft(block=block)
    target = random_tiny_target(seed=2)
    draft.attach_target(target.model.embed_tokens, target.lm_head)
    cfg = draft.config
    cache = DraftCache.allocate(cfg, 2, 32, torch.float32, "cpu")
    aux = torch.randn(1, 6, len(cfg.target_layer_ids) * cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    slot, start = torch.tensor([1]), torch.tensor([6])
    with torch.no_grad():
        draft.inject_context(aux, cache, slot, torch.zeros_like(start), start)
    return draft, cache, slot, start


class TapsNeverReadyEarly:
    """A target stand-in whose verify never offers its taps before the last layer: the draft's
    context injection then forks at the commit (``Steps.round_commit``'s fallback). Everything else
    is the target's."""

    def __init__(self, target):
        self._target = target

    def taps_ready(self, fwd):
        return None

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __call__(self, *args, **kwargs):
        return self._target(*args, **kwargs)


def slots_view(cache, t: torch.Tensor) -> torch.Tensor:
    """``t`` (a cache's ``k`` or ``v``, ``[L, n_pages + 1, P, n_kv, hd]``) as ``[L, slots, positions, n_kv,
    hd]``: the dense layout, for caches allocated without a pool (their table is the identity)."""
    table = cache.page_table
    assert torch.equal(table.flatten(), torch.arange(table.numel(), dtype=table.dtype)), "not the identity table"
    return t[:, :-1].unflatten(1, tuple(table.shape)).flatten(2, 3)
