"""VERIFY + ``commit`` leaves exactly the state that decoding the accepted tokens one by one leaves.

For every accepted length 1..W (W = 8), with several rows on permuted slots accepting different
lengths in the same batch and a padding row (slot -1):
- the conv state of each slot equals the window ``[pre-round state ; Bx of the block][a : a+K-1]``
  built here from the ``in_proj`` outputs of the verify forward itself (bit-exact: commit only
  copies the verify's own Bx values), and matches the state of one-by-one decoding (a tight
  tolerance: decode runs the GEMMs on other shapes than the verify block);
- K/V of positions ``< start + a`` match one-by-one decoding (positions before the round bit-exact);
- slots no row uses (the padding row would alias slot 0 if it were not skipped) are bit-identical
  before and after, in the conv state and in K/V;
- the next decode step from the committed state gives the same logits as from the decoded state.
"""

from __future__ import annotations

import pytest
import torch

from lfm_testing import pad_batch, rand_tokens
from spec_fixtures import slots_view
from lfmspark.models.cache import TargetCache
from lfmspark.models.lfm2 import ForwardMode
from lfmspark.models.loading import load_target

W = 8
SLOTS = [4, 1, 3, 6]
UNUSED = [0, 2, 5, 7]
N_SLOTS = 8
PROMPTS = [3, 1, 6, 2]
MAX_SEQ = 32
TOL = dict(rtol=1e-5, atol=1e-5)     # same math, other GEMM shapes (measured: up to 1.5e-6 on values of ~1-5)


def _clone(c: TargetCache) -> TargetCache:
    return TargetCache(k=c.k.clone(), v=c.v.clone(), page_table=c.page_table, conv_state=c.conv_state.clone(), conv_tape=c.conv_tape.clone(),
                       rope=c.rope)


class BxRecorder:
    """Records ``B * x`` of every ShortConv layer (HF chunk order B, C, x of ``in_proj``)."""

    def __init__(self, model):
        self.out: list[torch.Tensor] = []
        self.handles = []
        for layer in model.model.layers:
            if not layer.is_attention:
                self.handles.append(layer.conv.in_proj.register_forward_hook(self._hook))

    def _hook(self, module, args, output):
        b, _, x = output.chunk(3, dim=-1)
        self.out.append((b * x).detach().clone())

    def close(self):
        for h in self.handles:
            h.remove()


@pytest.fixture(params=["dense", "moe"])
def setup(request):
    ckpt = request.getfixturevalue(f"{request.param}_ckpt")
    model = load_target(ckpt.path, dtype=torch.float32)
    cfg = model.config
    gen = torch.Generator().manual_seed(21)
    base = TargetCache.allocate(cfg, N_SLOTS, MAX_SEQ, W, torch.float32, "cpu")
    # garbage everywhere: a write into the wrong slot, or a read of a stale state, shows up
    for t in (base.k, base.v, base.conv_state, base.conv_tape):
        t.copy_(torch.randn(t.shape, generator=gen))
    prompts = [rand_tokens(n, cfg.vocab_size, gen) for n in PROMPTS]
    slots = torch.tensor(SLOTS + [-1])
    with torch.no_grad():
        model(pad_batch(prompts + [[1, 2, 3]], cfg.vocab_size, gen), base, slots,
              torch.zeros(len(slots), dtype=torch.long), torch.tensor(PROMPTS + [3]), ForwardMode.PREFILL)
    return model, base, prompts, gen


def _decode_one_by_one(model, cache, blocks, accepted, start):
    """Decode ``blocks[b][:accepted[b]]`` one token per step; rows that are done become padding."""
    logits = {}
    for j in range(W):
        slots = torch.tensor([s if accepted[b] > j else -1 for b, s in enumerate(SLOTS)] + [-1])
        ids = torch.tensor([blocks[b][j] for b in range(len(SLOTS))] + [0])[:, None]
        with torch.no_grad():
            out = model(ids, cache, slots, torch.tensor(start + [0]) + j, None, ForwardMode.DECODE)
        for b in range(len(SLOTS)):
            if accepted[b] > j:
                logits[b, j] = out.logits[b, 0]
    return logits


@pytest.mark.parametrize("round_", range(W))
def test_commit_equals_sequential_decode(setup, round_):
    model, base, prompts, gen = setup
    cfg = model.config
    K = cfg.conv_L_cache
    accepted = [(round_ + 3 * b) % W + 1 for b in range(len(SLOTS))]   # every length 1..W over the rounds
    start = [len(p) for p in prompts]
    blocks = [rand_tokens(W, cfg.vocab_size, gen) for _ in range(len(SLOTS) + 1)]
    slots = torch.tensor(SLOTS + [-1])

    # verify + commit
    a = _clone(base)
    rec = BxRecorder(model)
    with torch.no_grad():
        vout = model(torch.tensor(blocks), a, slots, torch.tensor(start + [0]), None, ForwardMode.VERIFY)
    rec.close()
    model.commit(a, slots, torch.tensor(accepted + [W]))

    # the same tokens decoded one by one
    b_cache = _clone(base)
    dlogits = _decode_one_by_one(model, b_cache, blocks, accepted, start)

    assert len(rec.out) == len(cfg.conv_layers)
    for b, slot in enumerate(SLOTS):
        acc, end = accepted[b], start[b] + accepted[b]
        # conv state: exactly the window after `acc` block tokens of the verify's own Bx
        for layer, bx in enumerate(rec.out):
            window = torch.cat([base.conv_state[layer, slot], bx[b]], dim=0)[acc:acc + K - 1]
            assert torch.equal(a.conv_state[layer, slot], window), f"conv layer {layer}, row {b}, accepted {acc}"
        torch.testing.assert_close(a.conv_state[:, slot], b_cache.conv_state[:, slot], **TOL)
        # K/V up to the new length; the committed prefix is untouched
        assert torch.equal(slots_view(a, a.k)[:, slot, :start[b]], slots_view(base, base.k)[:, slot, :start[b]])
        assert torch.equal(slots_view(a, a.v)[:, slot, :start[b]], slots_view(base, base.v)[:, slot, :start[b]])
        torch.testing.assert_close(slots_view(a, a.k)[:, slot, :end], slots_view(b_cache, b_cache.k)[:, slot, :end], **TOL)
        torch.testing.assert_close(slots_view(a, a.v)[:, slot, :end], slots_view(b_cache, b_cache.v)[:, slot, :end], **TOL)
        # the verify logits of accepted positions are the decode logits
        for j in range(acc):
            torch.testing.assert_close(vout.logits[b, j], dlogits[b, j], rtol=1e-5, atol=1e-4)

    # slots nobody uses: untouched, bit for bit (the padding row must not write through slot -1)
    for s in UNUSED:
        for name, view in (("k", slots_view), ("v", slots_view), ("conv_state", lambda c, t: t)):
            for c in (a, b_cache):
                assert torch.equal(view(c, getattr(c, name))[:, s], view(base, getattr(base, name))[:, s]), \
                    f"{name} of unused slot {s}"

    # and both states continue identically
    nxt = torch.tensor(rand_tokens(len(SLOTS) + 1, cfg.vocab_size, gen))[:, None]
    new_start = torch.tensor([start[b] + accepted[b] for b in range(len(SLOTS))] + [0])
    with torch.no_grad():
        la = model(nxt, a, slots, new_start, None, ForwardMode.DECODE).logits
        lb = model(nxt, b_cache, slots, new_start, None, ForwardMode.DECODE).logits
    torch.testing.assert_close(la[:len(SLOTS)], lb[:len(SLOTS)], rtol=1e-5, atol=1e-4)


def test_two_rounds_with_permuted_rows(setup):
    """Two verify rounds in a row: the second verify reads the state the first commit wrote, and a
    commit does not depend on tape rows of other batch rows (rows are permuted between rounds)."""
    model, base, prompts, gen = setup
    cfg = model.config
    start = [len(p) for p in prompts]
    a, b_cache = _clone(base), _clone(base)
    accepted1, accepted2 = [2, 8, 1, 5], [7, 1, 4, 3]
    blocks1 = [rand_tokens(W, cfg.vocab_size, gen) for _ in SLOTS]
    blocks2 = [rand_tokens(W, cfg.vocab_size, gen) for _ in SLOTS]
    # round 1 in slot order, round 2 with the rows reversed and a padding row first
    with torch.no_grad():
        slots1 = torch.tensor(SLOTS)
        model(torch.tensor(blocks1), a, slots1, torch.tensor(start), None, ForwardMode.VERIFY)
        model.commit(a, slots1, torch.tensor(accepted1))
        start2 = [s + acc for s, acc in zip(start, accepted1)]
        order = list(reversed(range(len(SLOTS))))
        slots2 = torch.tensor([-1] + [SLOTS[i] for i in order])
        ids2 = torch.tensor([[0] * W] + [blocks2[i] for i in order])
        model(ids2, a, slots2, torch.tensor([0] + [start2[i] for i in order]), None, ForwardMode.VERIFY)
        model.commit(a, slots2, torch.tensor([W] + [accepted2[i] for i in order]))
    _decode_one_by_one(model, b_cache, blocks1, accepted1, start)
    _decode_one_by_one(model, b_cache, blocks2, accepted2, start2)
    for b, slot in enumerate(SLOTS):
        end = start2[b] + accepted2[b]
        torch.testing.assert_close(a.conv_state[:, slot], b_cache.conv_state[:, slot], **TOL)
        torch.testing.assert_close(slots_view(a, a.k)[:, slot, :end], slots_view(b_cache, b_cache.k)[:, slot, :end], **TOL)
        torch.testing.assert_close(slots_view(a, a.v)[:, slot, :end], slots_view(b_cache, b_cache.v)[:, slot, :end], **TOL)
    for s in UNUSED:
        assert torch.equal(a.conv_state[:, s], base.conv_state[:, s])
        assert torch.equal(slots_view(a, a.k)[:, s], slots_view(base, base.k)[:, s])
