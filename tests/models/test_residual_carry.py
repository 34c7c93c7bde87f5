"""Residual carry (models/lfm2.py module doc): layers that hand their last residual add to the next
layer give bit-identical results, in bf16, to layers that finish with it (no carry).

Reference: every layer completed on its own (``h + feed_forward(ffn_norm(h))`` at its end), then
the final norm and LM head over the completed state. Checked for the dense and the MoE target
over prefill (ragged rows, a padding row, ``logits_index``), verify and decode, for the logits,
the aux taps (the embeddings, a middle layer, and the last layer, whose output no later layer
completes) and the caches; and for the draft's block.
"""

from __future__ import annotations

import pytest
import torch

from lfmspark.models.cache import DraftCache, TargetCache
from lfmspark.models.lfm2 import ForwardMode, Rows
from lfmspark.models.presets import random_draft, random_target
from spec_fixtures import tiny_draft_config, tiny_target_config

DTYPE = torch.bfloat16
TAPS = (-1, 0, 2, 4)          # 4 = the last layer of the 5-layer tiny target


def _completed_layer(layer, h, layer_cache, rows, mode, rope):
    """``Lfm2DecoderLayer`` without the residual carry: it finishes its own last residual add."""
    x = layer.operator_norm(h)
    if layer.is_attention:
        h = h + layer.self_attn(x, layer_cache, rows, rope)
    else:
        h = h + layer.conv(x, layer_cache, rows, mode)
    return h + layer.feed_forward(layer.ffn_norm(h))


@torch.no_grad()
def _reference(model, ids, cache, slots, start, lens, mode, logits_index=None):
    """``(logits, aux)`` of the target with completed layers."""
    rows = Rows(slots, start, lens)
    outputs = [model.model.embed_tokens(ids)]                  # outputs[k + 1] = output of layer k
    for layer, layer_cache in zip(model.model.layers, cache.layer_caches(model.config), strict=True):
        outputs.append(_completed_layer(layer, outputs[-1], layer_cache, rows, mode, cache.rope))
    h = outputs[-1]
    if logits_index is not None:
        h = h[torch.arange(h.shape[0]), logits_index]
    return model.lm_head(model.model.embedding_norm(h)), torch.cat([outputs[i + 1] for i in TAPS], dim=-1)


def _clone(c: TargetCache) -> TargetCache:
    return TargetCache(k=c.k.clone(), v=c.v.clone(), page_table=c.page_table, conv_state=c.conv_state.clone(), conv_tape=c.conv_tape.clone(),
                       rope=c.rope)


def _assert_same_cache(a: TargetCache, b: TargetCache) -> None:
    for x, y in ((a.k, b.k), (a.v, b.v), (a.conv_state, b.conv_state), (a.conv_tape, b.conv_tape)):
        assert torch.equal(x, y)


def _random_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that every layer moves the residual stream (norm weights around 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.2 if p.dim() == 1 or name == "k_norm" else 1.0 / p.shape[-1] ** 0.5
            p.copy_((1.0 if p.dim() == 1 or name == "k_norm" else 0.0) + scale * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_target_matches_completed_layers_bit_for_bit(moe):
    cfg = tiny_target_config(moe)
    model = random_target(cfg, DTYPE, "cpu", seed=5)
    _random_weights(model, seed=5)
    gen = torch.Generator().manual_seed(7)
    cache = TargetCache.allocate(cfg, 4, 32, 4, DTYPE, "cpu")
    ref_cache = _clone(cache)
    slots = torch.tensor([2, 0, 3, -1])
    ids = torch.randint(0, cfg.vocab_size, (4, 6), generator=gen)
    start, lens = torch.zeros(4, dtype=torch.long), torch.tensor([6, 2, 5, 1])

    def check(ids, start, lens, mode, logits_index=None):
        with torch.no_grad():
            out = model(ids, cache, slots, start, lens, mode, TAPS, logits_index)
        logits, aux = _reference(model, ids, ref_cache, slots, start, lens, mode, logits_index)
        assert torch.equal(out.logits, logits)
        assert torch.equal(out.aux, aux)
        _assert_same_cache(cache, ref_cache)

    check(ids, start, lens, ForwardMode.PREFILL, logits_index=lens - 1)
    start = start + lens
    check(torch.randint(0, cfg.vocab_size, (4, 4), generator=gen), start, torch.full_like(lens, 4),
          ForwardMode.VERIFY)
    check(torch.randint(0, cfg.vocab_size, (4, 1), generator=gen), start, torch.ones_like(lens), ForwardMode.DECODE)


def test_draft_block_matches_completed_layers_bit_for_bit():
    """The draft layers' bodies are unchanged with ``delta=None``; completing each layer by adding
    its two outputs is the code before the carry."""
    cfg = tiny_draft_config(block=4)
    target = random_target(tiny_target_config(), DTYPE, "cpu", seed=3)
    draft = random_draft(cfg, target.config.hidden_size, DTYPE, "cpu", seed=4)
    _random_weights(draft, seed=4)
    draft.attach_target(target.model.embed_tokens, target.lm_head)
    gen = torch.Generator().manual_seed(9)
    cache = DraftCache.allocate(cfg, 3, 32, DTYPE, "cpu")
    slots, start = torch.tensor([1, 2, -1]), torch.tensor([5, 3, 0])
    aux = torch.randn(3, 5, cfg.n_taps * target.config.hidden_size, generator=gen).to(DTYPE)
    with torch.no_grad():
        draft.inject_context(aux, cache, slots, torch.zeros_like(start), start)
        x, delta = draft.block_hidden(torch.tensor([7, 11, 0]), cache, slots, start)

        G = cfg.block_size
        block = torch.tensor([[7], [11], [0]]).expand(3, G).clone()
        block[:, 1:] = cfg.mask_token_id
        h = draft.embed_tokens(block)
        for i, layer in enumerate(draft.layers):
            mid, mlp = layer(h, None, draft.kv_proj[i], draft.k_norm[i:i + 1], cache.k[i:i + 1], cache.v[i:i + 1],
                             cache.page_table, cache.rope, slots, start, torch.full_like(start, G))
            h = mid + mlp
    assert torch.equal(x + delta, h)
