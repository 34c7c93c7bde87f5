"""PREFILL forwards inside ``Lfm2ForCausalLM.conv_snapshots`` copy the conv state after every page
multiple their rows pass (models/lfm2.py ``ConvSnapshots``, the prefix cache's snapshots): each one
holds the bits of the state a prefill ending there leaves, the one at a chunk's end those of the
state the op writes; multiples nothing wants, padding rows and forwards outside the scope write
only the scratch row or nothing."""

from __future__ import annotations

import torch

from lfmspark.models.cache import TargetCache
from lfmspark.models.lfm2 import ConvSnapshots, ForwardMode, Lfm2ShortConv
from spec_fixtures import random_tiny_target

EVERY = 4
T = 11           # the forward's width (rows are shorter: padding columns)
SLOTS = [2, 0, -1]
STARTS = [7, 0, 0]   # 7: the first multiple (8) one token in, its state half from before the chunk
LENS = [9, 11, 0]    # row 0 passes 8 and 12 and ends at 16; row 1 passes 4 and 8 and ends at 11


def _cache(target) -> TargetCache:
    return TargetCache.allocate(target.config, 3, 64, 2, torch.float32, "cpu")


def _prefill(target, cache, ids, slots, starts, lens) -> None:
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    target(ids, cache, t(slots), t(starts), t(lens), ForwardMode.PREFILL)


def _prepared(target):
    """A cache whose slot 2 holds the first 7 tokens of row 0 (its chunk resumes there), and the ids."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (3, T), generator=gen)
    prefix = torch.randint(0, target.config.vocab_size, (1, 7), generator=gen)
    cache = _cache(target)
    _prefill(target, cache, prefix, [2], [0], [7])
    return cache, ids


def test_snapshots_hold_the_state_a_prefill_ending_there_leaves(monkeypatch):
    """Bit for bit the window ``[state ; B * x][p - start : p - start + K - 1]`` of the forward's own
    ``in_proj`` outputs (the op's state after ``p``), and the state a prefill of the same rows ending
    at ``p`` leaves (to GEMM roundings: that forward's rows are other lengths)."""
    target = random_tiny_target(seed=3)
    cache, ids = _prepared(target)
    start_cache = TargetCache(k=cache.k.clone(), v=cache.v.clone(), page_table=cache.page_table,
                              conv_state=cache.conv_state.clone(), conv_tape=cache.conv_tape, rope=cache.rope)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []       # per ShortConv layer: (bcx, its state before)
    mix = Lfm2ShortConv.mix

    def recording(self, bcx, state_tape, rows, mode):
        seen.append((bcx.clone(), state_tape[0][0].clone()))
        return mix(self, bcx, state_tape, rows, mode)

    monkeypatch.setattr(Lfm2ShortConv, "mix", recording)
    s = cache.conv_state
    store = torch.full((s.shape[0], 6, *s.shape[2:]), float("nan"))
    scratch = 5
    # row 0: multiples 8, 12, 16 -> rows 0, 1, 2; row 1: 4, 8 -> 3, 4 (its third, 12, is past its end)
    index = torch.tensor([[0, 1, 2], [3, 4, scratch], [scratch] * 3, [scratch] * 3])
    with target.conv_snapshots(ConvSnapshots(store, index, EVERY)):
        _prefill(target, cache, ids, SLOTS, STARTS, LENS)
    monkeypatch.setattr(Lfm2ShortConv, "mix", mix)
    assert torch.equal(store[:, 2], cache.conv_state[:, 2])        # row 0's end (16): the op's state
    km1 = s.shape[2]
    for row, b, p in ((0, 0, 8), (1, 0, 12), (2, 0, 16), (3, 1, 4), (4, 1, 8)):
        off = p - STARTS[b]
        for layer, (bcx, before) in enumerate(seen):
            H = bcx.shape[-1] // 3
            init = before[SLOTS[b]] if STARTS[b] > 0 else torch.zeros_like(before[0])
            x_ext = torch.cat([init, bcx[b, :, :H] * bcx[b, :, 2 * H:]])
            assert torch.equal(store[layer, row], x_ext[off:off + km1]), (row, layer)
        ref = TargetCache(k=start_cache.k.clone(), v=start_cache.v.clone(), page_table=cache.page_table,
                          conv_state=start_cache.conv_state.clone(), conv_tape=cache.conv_tape, rope=cache.rope)
        lens = [off if b == 0 else 0, off if b == 1 else 0, 0]
        _prefill(target, ref, ids, [2 if b == 0 else -1, 0 if b == 1 else -1, -1], STARTS, lens)
        torch.testing.assert_close(store[:, row], ref.conv_state[:, SLOTS[b]], rtol=1e-5, atol=1e-5)
    assert torch.isnan(store[:, scratch]).sum() < store[:, scratch].numel()   # the unwanted ones: scratch


def test_outside_the_scope_nothing_is_copied():
    target = random_tiny_target(seed=3)
    cache, ids = _prepared(target)
    s = cache.conv_state
    store = torch.zeros((s.shape[0], 2, *s.shape[2:]))
    sink = ConvSnapshots(store, torch.zeros((4, 3), dtype=torch.int64), EVERY)
    with target.conv_snapshots(sink):
        pass
    _prefill(target, cache, ids, SLOTS, STARTS, LENS)
    assert not store.any()
    assert all(layer.is_attention or layer.conv.snapshots is None for layer in target.model.layers)
