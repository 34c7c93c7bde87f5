"""``LFMSPARK_TUNE`` (ops/tuning.py): overrides reach the launch parameters of each kind of kernel,
later heuristic choices follow them, and malformed values are rejected with the valid keys."""

from __future__ import annotations

import logging

import pytest
import torch

from lfmspark.ops.attention import cache_attention
from lfmspark.ops.linear import add_rmsnorm_gemv, skinny_linear
from lfmspark.ops.markov_walk import op as markov_walk
from env_vars import set_env
from lfmspark.ops.tuning import tuned

SMS = 132


def test_unset_keeps_the_heuristics(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, TUNE=None)
    gemv = skinny_linear.skinny_config(1, 2048, 8192, 2, SMS)
    assert (gemv.block_n, gemv.block_k, gemv.num_warps, gemv.num_stages) == (4, 2048, 4, 2)


def test_each_kind_reads_its_own_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, TUNE="gemv.block_k=1024, gemv.num_warps=8,tile.num_stages=2,tile.split_k=3,"
                                        "tile_swiglu.block_n=32,norm_gemv.block_n=4,norm_swiglu.num_warps=4,"
                                        "walk.block_v=128")
    gemv = skinny_linear.skinny_config(1, 2048, 8192, 2, SMS)
    assert (gemv.block_n, gemv.block_k, gemv.num_warps) == (4, 1024, 8)
    tile = skinny_linear.skinny_config(10, 6144, 2048, 2, SMS)
    assert (tile.block_n, tile.num_stages, tile.split_k) == (64, 2, 3)   # block_n from the heuristic
    swiglu = skinny_linear.swiglu_config(10, 8192, 2048, 2, SMS)
    assert (swiglu.block_n, swiglu.num_stages, swiglu.split_k) == (32, 3, 1)   # the tile keys are not the SwiGLU's
    assert add_rmsnorm_gemv.launch_params(2048, swiglu=False)[0] == 4
    assert add_rmsnorm_gemv.launch_params(2048, swiglu=True) == (4, 2048, 4)
    walk = markov_walk.walk_config(1, 65536, 256)
    assert (walk.block_v, walk.block_r, walk.num_warps) == (128, 64, 8)


def test_later_choices_follow_a_replaced_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wider tile means fewer column blocks, so the heuristic splits K further; a
    replaced split count is planned over whole K blocks like the heuristic's."""
    set_env(monkeypatch, TUNE=None)
    base = skinny_linear.swap_ab_config(10, 2048, 2048, 2, SMS)
    set_env(monkeypatch, TUNE="tile.block_n=128")
    wide = skinny_linear.swap_ab_config(10, 2048, 2048, 2, SMS)
    assert (base.block_n, wide.block_n) == (64, 128) and wide.split_k > base.split_k
    assert wide.block_k == 64                                  # the 128-row tiles' K step
    set_env(monkeypatch, TUNE="tile.split_k=3")
    split = skinny_linear.swap_ab_config(10, 2048, 2048, 2, SMS)
    assert split.split_k == skinny_linear.split_k_plan(2048, split.block_k, 3)[1] == 3


def test_shape_scoped_keys_win_for_their_shape_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tile@2048x2048`` retunes the 10-row out_proj (N = K = 2048) and nothing else; the kind-wide
    key still applies to the other shapes, and the scoped one wins where both match."""
    set_env(monkeypatch, TUNE=None)
    base = {shape: skinny_linear.swap_ab_config(10, *shape, 2, SMS) for shape in ((2048, 2048), (6144, 2048))}
    base_swiglu = skinny_linear.swiglu_config(10, 6144, 2048, 2, SMS)
    set_env(monkeypatch, TUNE="tile@2048x2048.block_n=16,tile@2048x2048.split_k=4,tile.num_stages=2,"
                                        "tile@2048x2048.num_stages=1,gemv@2048x8192.block_k=1024,"
                                        "tile_swiglu@8192x2048.num_stages=2")
    small = skinny_linear.swap_ab_config(10, 2048, 2048, 2, SMS)
    assert (small.block_n, small.split_k, small.num_stages) == (16, 4, 1)
    assert small.block_k == base[(2048, 2048)].block_k                     # not scoped: the heuristic's
    in_proj = skinny_linear.swap_ab_config(10, 6144, 2048, 2, SMS)
    assert base[(6144, 2048)].num_stages != 2                              # so the kind-wide key shows
    assert (in_proj.block_n, in_proj.split_k, in_proj.num_stages) == (base[(6144, 2048)].block_n,
                                                                       base[(6144, 2048)].split_k, 2)
    assert skinny_linear.skinny_config(1, 2048, 8192, 2, SMS).block_k == 1024
    assert skinny_linear.skinny_config(1, 2048, 2048, 2, SMS).block_k == 2048
    assert skinny_linear.swiglu_config(10, 8192, 2048, 2, SMS).num_stages == 2
    assert skinny_linear.swiglu_config(10, 6144, 2048, 2, SMS).num_stages == base_swiglu.num_stages != 2


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_an_applied_shape_scoped_key_is_logged_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # a handler of its own rather than pytest's caplog, which `-p no:logging` (scripts/device_run.sh) removes
    set_env(monkeypatch, TUNE="tile@4096x1024.num_warps=2")
    logger, records = logging.getLogger("lfmspark.ops.tuning"), _Records()
    level = logger.level
    logger.setLevel(logging.INFO)   # setLevel, not an attribute patch: it clears the logger's enabled-for cache
    logger.addHandler(records)
    try:
        for _ in range(3):
            assert tuned("tile", "num_warps", 4, (4096, 1024)) == 2
        assert tuned("tile", "num_warps", 4, (1024, 4096)) == 4              # N and K swapped: no match
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert records.messages == ["LFMSPARK_TUNE: tile@4096x1024.num_warps=2 applied"]


def test_spaces_around_items_and_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, TUNE=" gemv.block_k = 1024 , walk.num_warps=4")
    assert (tuned("gemv", "block_k", 2048), tuned("walk", "num_warps", 8)) == (1024, 4)


def test_a_tuned_launch_computes_the_same_product(monkeypatch: pytest.MonkeyPatch, triton_device: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g).to(triton_device)
    w = torch.randn(96, 256, generator=g).to(triton_device)
    set_env(monkeypatch, TUNE="tile.block_n=16,tile.block_k=32,tile.split_k=2")
    cfg = skinny_linear.skinny_config(3, 96, 256, 4, SMS)
    assert (cfg.block_n, cfg.block_k, cfg.split_k) == (16, 32, 2)
    got = skinny_linear.skinny_linear_triton(x, w)
    torch.testing.assert_close(got, skinny_linear.skinny_linear_reference(x, w), rtol=1e-4, atol=1e-4)


def test_resident_blocks_may_be_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, TUNE="walk_grid.resident=0")
    assert tuned("walk_grid", "resident", 1) == 0


@pytest.mark.parametrize("value, message", [
    ("gemv.block_k", "kind.parameter=integer"),
    ("gemv.bogus=4", "valid keys: gemv.block_n"),
    ("conv.block_n=4", "valid keys"),
    ("tile.block_k=x", "tile.block_k needs an integer, got 'x'"),
    ("tile.block_k=96", "power of two, got 96"),
    ("tile.num_stages=0", "positive integer, got 0"),
    ("walk_grid.resident=-1", "non-negative integer, got -1"),
    ("gemv.block_k=1024,gemv.block_k=2048", "given twice"),
    ("tile@2048x2048.block_n=16,tile@2048x2048.block_n=32", "given twice"),
    ("walk@65536x256.block_v=128", "for the kinds gemv, tile, tile_swiglu"),
    ("tile@2048.block_n=16", "kind@NxK.parameter with positive integers"),
    ("tile@0x2048.block_n=16", "kind@NxK.parameter with positive integers"),
    ("tile@2048x2048.bogus=1", "also as kind@NxK.parameter"),
])
def test_malformed_values_name_the_problem(monkeypatch: pytest.MonkeyPatch, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        set_env(monkeypatch, TUNE=value)         # refused when the variables are read


def test_attention_splits_key_reaches_only_split_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """``attention.num_splits`` replaces the split count of the launches the heuristic splits (a
    batch-1 verify window: 8 kv heads, one row tile) and leaves unsplit prefill launches alone."""
    verify, prefill = (1, 10, 32, 8, 64, 960, 2, SMS), (16, 128, 32, 8, 64, 960, 2, SMS)
    set_env(monkeypatch, TUNE=None)
    base = cache_attention.plan_launch(*verify)
    assert base.num_splits > 2 and cache_attention.plan_launch(*prefill).num_splits == 1
    set_env(monkeypatch, TUNE="attention.num_splits=2")
    assert cache_attention.plan_launch(*verify).num_splits == 2
    assert cache_attention.plan_launch(*prefill).num_splits == 1
    set_env(monkeypatch, TUNE="attention.num_splits=1")
    unsplit = cache_attention.plan_launch(*verify)
    assert not unsplit.split and unsplit.variant != base.variant
