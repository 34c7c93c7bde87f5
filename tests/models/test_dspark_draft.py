"""The DSpark draft module against the plain cache-free reference (tests/reference_dspark.py)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lfmspark.models.cache import DraftCache
from lfmspark.models.config import DraftConfig
from lfmspark.models.presets import random_draft
from lfmspark.runtime.randomness import STREAM_DRAFT, draw_key, gumbel, sample
from reference_dspark import reference_block
from env_vars import interpret_triton

V, H, TAPS = 96, 32, 3


def draft_config(head: str = "vanilla", neox: bool = False, confidence: bool = True, with_markov: bool = True,
                 rank: int = 8, block: int = 5) -> DraftConfig:
    return DraftConfig(hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, block_size=block, target_layer_ids=tuple(range(TAPS)),
                       mask_token_id=V - 1, vocab_size=V, rms_norm_eps=1e-6, rope_theta=10_000.0,
                       rope_is_neox_style=neox, markov_rank=rank, markov_head_type=head,
                       enable_confidence_head=confidence, confidence_head_with_markov=confidence and with_markov)


def make_draft(cfg: DraftConfig, seed: int):
    """A random fp32 draft with weights large enough that every part changes the output."""
    torch.manual_seed(seed)
    draft = random_draft(cfg, H, torch.float32, "cpu", seed=seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 1 or name == "k_norm":
                p.copy_(1 + 0.3 * torch.randn_like(p))        # norms and biases away from trivial values
            else:
                p.normal_(0, 0.3)
    embed = nn.Embedding(V, H)
    lm_head = nn.Linear(H, V, bias=False)
    nn.init.normal_(embed.weight, 0, 1.0)
    nn.init.normal_(lm_head.weight, 0, 0.3)
    draft.attach_target(embed, lm_head)
    return draft, embed, lm_head


CASES = [dict(head=h, neox=n) for h, n in itertools.product(("vanilla", "gated", "rnn"), (False, True))] + [
    dict(confidence=False), dict(with_markov=False), dict(rank=0, confidence=True, with_markov=False)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_draft_block_matches_cache_free_reference(case):
    cfg = draft_config(**case)
    draft, embed, lm_head = make_draft(cfg, seed=len(str(case)))
    n_slots, S = 4, 64
    cache = DraftCache.allocate(cfg, n_slots, S, torch.float32, "cpu")
    # three real rows with different context lengths and slots, plus a padding row
    lengths, slots = [7, 1, 12], [2, 0, 3]
    feats = [torch.randn(n, TAPS * H) for n in lengths]
    anchors = torch.tensor([5, 17, 40, 0])
    slots_t = torch.tensor(slots + [-1])
    # inject the context in two chunks per row (prefill, then a commit-sized continuation)
    split = [n // 2 for n in lengths]
    for lo_of, hi_of in ((lambda i: 0, lambda i: split[i]), (lambda i: split[i], lambda i: lengths[i])):
        T = max(hi_of(i) - lo_of(i) for i in range(3))
        aux = torch.randn(4, max(T, 1), TAPS * H)              # garbage beyond each row's length
        for i in range(3):
            aux[i, : hi_of(i) - lo_of(i)] = feats[i][lo_of(i):hi_of(i)]
        draft.inject_context(aux, cache, slots_t, torch.tensor([lo_of(i) for i in range(3)] + [0]),
                             torch.tensor([hi_of(i) - lo_of(i) for i in range(3)] + [1]))
    start = torch.tensor(lengths + [0])
    with torch.no_grad():
        proposal = draft.propose(anchors, cache, slots_t, start, logits=True)
    for i in range(3):
        tokens, logits, confidence = reference_block(draft, feats[i], int(anchors[i]), embed.weight, lm_head.weight)
        torch.testing.assert_close(proposal.logits[i], logits, rtol=1e-4, atol=1e-4)
        assert proposal.tokens[i].tolist() == tokens.tolist()
        if cfg.enable_confidence_head:
            torch.testing.assert_close(proposal.confidence[i], confidence, rtol=1e-5, atol=1e-5)
        else:
            assert proposal.confidence is None


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_sampled_walk_feeds_sampled_tokens_forward(head):
    """The Markov walk conditions slot k on the token *drawn* at k-1, not on the argmax: noise that
    forces each slot's token (it outweighs every logit) steers the walk, and the logits are those
    of the forced path."""
    cfg = draft_config(head=head)
    draft, embed, lm_head = make_draft(cfg, seed=3)
    cache = DraftCache.allocate(cfg, 1, 32, torch.float32, "cpu")
    feats = torch.randn(6, TAPS * H)
    one = torch.ones(1, dtype=torch.int64)
    draft.inject_context(feats[None], cache, 0 * one, 0 * one, 6 * one)
    forced = [11, 3, 70, 2, 9]
    noise = torch.zeros(1, cfg.block_size, V)
    noise[0, torch.arange(cfg.block_size), torch.tensor(forced)] = 1e4
    with torch.no_grad():
        proposal = draft.propose(torch.tensor([4]), cache, 0 * one, 6 * one, noise, logits=True)
    tokens, logits, _ = reference_block(draft, feats, 4, embed.weight, lm_head.weight,
                                        pick=lambda k, lk: forced[k])
    assert proposal.tokens[0].tolist() == forced == tokens.tolist()
    torch.testing.assert_close(proposal.logits[0], logits, rtol=1e-4, atol=1e-4)


def test_rope_pairing_changes_the_draft():
    """The same weights with the other RoPE pairing give other logits: the flag is honoured."""
    outs = []
    for neox in (False, True):
        cfg = draft_config(neox=neox)
        draft, embed, lm_head = make_draft(cfg, seed=9)
        outs.append(reference_block(draft, torch.randn(8, TAPS * H, generator=torch.Generator().manual_seed(0)), 3,
                                    embed.weight, lm_head.weight)[1])
    assert not torch.allclose(outs[0], outs[1], atol=1e-3)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("head", ["vanilla", "none"])
def test_fused_walk_draws_what_the_slot_by_slot_walk_draws(head, temperature, monkeypatch):
    """With a vanilla Markov head, or none, the walk is fused (``lfmspark::markov_greedy_walk`` over
    the logits plus the Gumbel noise ``T * g``, or one argmax): its tokens are those of the plain
    slot-by-slot walk, each slot's token the argmax of its corrected logits (T = 0) or drawn by the
    exponential race from ``softmax(logits / T)`` on the same uniforms (runtime/randomness.py);
    the corrected logits it returns on request are the loop's, and none without the request. The
    Triton walk (interpreter) is checked on Markov weights whose products sum exactly in any
    order (tests/ops/test_markov_walk.py)."""
    cfg = draft_config(rank=0 if head == "none" else 16, confidence=True, with_markov=head != "none", block=7)
    draft, _, _ = make_draft(cfg, seed=21)
    if draft.markov_head is not None:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for w in (draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight):
                w.copy_(torch.randint(-16, 17, w.shape, generator=g) / 8)
    g = torch.Generator().manual_seed(2)
    B, G = 3, cfg.block_size
    base = (torch.randint(-40, 41, (B, G, V), generator=g) / 4).float()
    h, anchor = torch.randn(B, G, H, generator=g), torch.tensor([5, 0, V - 1])
    keys = draw_key(torch.tensor([7, 8, 9])[:, None], torch.arange(G)[None, :] + 30, STREAM_DRAFT)
    noise = temperature * gumbel(keys, V) if temperature else None

    prev, want_tokens, want_logits = anchor, [], []
    for k in range(G):
        logits_k = base[:, k]
        if draft.markov_head is not None:
            logits_k = logits_k + draft.markov_head.markov_w1.weight[prev] @ draft.markov_head.markov_w2.weight.T
        prev = (sample(torch.softmax(logits_k / temperature, -1), keys[:, k]) if temperature
                else logits_k.argmax(-1))
        want_tokens.append(prev)
        want_logits.append(logits_k)
    want_tokens, want_logits = torch.stack(want_tokens, 1), torch.stack(want_logits, 1)
    if temperature:
        assert not torch.equal(want_tokens, base.argmax(-1))    # the draws are not the argmax walk

    with torch.no_grad():
        plain = draft.walk(base, h, anchor, noise)
        with_logits = draft.walk(base, h, anchor, noise, logits=True)
        interpret_triton(monkeypatch)        # the ops on their Triton kernels
        on_triton = draft.walk(base, h, anchor, noise)
    assert plain.logits is None
    for proposal in (plain, with_logits, on_triton):
        assert torch.equal(proposal.tokens, want_tokens)
    torch.testing.assert_close(with_logits.logits, want_logits)
