"""``lfmspark::exact_linear`` (exact mode's product): the Triton kernels (interpreter on CPU, native on
CUDA) against the fp64 product, and the property it exists for: a row's bits do not depend on the
other rows of the launch (alone, or at any position of 2, 10 and 16-row launches, or after a long
prefill chunk), where the default skinny product's do.

Tolerances as in test_skinny_linear.py (relative Frobenius error against fp64): fp32 1e-5, bf16 1e-2."""

from __future__ import annotations

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
import lfmspark.ops.linear.exact_linear as el
from lfmspark.ops.linear.exact_linear import (EXACT_COUNTERS, ExactConfig, _stages_that_fit, exact_config,
                                              exact_linear_reference, exact_linear_triton, row_tiles_per_program)
from lfmspark.ops.linear.skinny_linear import _counter_buffer, skinny_linear_triton
from test_skinny_linear import TOL, _inputs


def _rel_err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    want = x.double() @ w.double().T
    return ((out.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M, N, K", [(1, 128, 256), (10, 100, 300), (17, 64, 1024), (40, 33, 96)])
def test_kernel_matches_the_fp64_product(triton_device: str, dtype: torch.dtype, M: int, N: int, K: int) -> None:
    x, w = _inputs(triton_device, dtype, M, N, K, seed=M)
    out = exact_linear_triton(x, w)
    assert out.shape == (M, N) and out.dtype == dtype
    assert _rel_err(out, x, w) < TOL[dtype]
    assert _rel_err(exact_linear_reference(x, w), x, w) < TOL[dtype]


@pytest.mark.parametrize("cfg", [ExactConfig(32, 32, splits=3, steps=2), ExactConfig(64, 16, splits=5, steps=4)],
                         ids=["k_tail_in_last_split", "many_splits"])
def test_forced_plans(triton_device: str, cfg: ExactConfig) -> None:
    x, w = _inputs(triton_device, torch.float32, 5, 70, 6 * 32 - 7)
    assert _rel_err(exact_linear_triton(x, w, cfg), x, w) < TOL[torch.float32]


@pytest.mark.parametrize("N, K", [(2048, 2048), (65536, 2048), (2048, 8192), (33, 96), (8, 5)])
def test_the_plan_depends_on_the_shape_only_and_covers_k(N: int, K: int) -> None:
    cfg = exact_config(N, K)
    steps = max(1, -(-K // cfg.block_k))
    assert (cfg.splits - 1) * cfg.steps < steps <= cfg.splits * cfg.steps    # every split has K steps
    assert cfg == exact_config(N, K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N, K", [(96, 1024), (96, 128)], ids=["two_splits", "one_split"])
def test_a_rows_bits_do_not_depend_on_the_launch(triton_device: str, dtype: torch.dtype, N: int, K: int) -> None:
    """Each of 16 rows alone, and at every position of 2-, 10- and 16-row launches among other rows,
    gives the same bits (the exact-mode guarantee: decode, verify and prefill rows agree); with the
    workspace summed by each tile's last program (two splits) and with one split. A row sits at
    different rows of its 16-row tile across these launches; under the interpreter the kernel's dots
    are its own per-element sums (ops/exact_dot.py), as numpy's BLAS may sum a row by its position
    in the product (the GPU's dot does not)."""
    assert (exact_config(N, K).splits > 1) == (K == 1024)
    x, w = _inputs(triton_device, dtype, 16, N, K, seed=7)
    others, _ = _inputs(triton_device, dtype, 16, N, K, seed=8)
    alone = torch.cat([exact_linear_triton(x[r:r + 1], w) for r in range(16)])
    assert torch.equal(exact_linear_triton(x, w), alone)
    for rows in (2, 10):
        for pos in range(rows):
            batch = others[:rows].clone()
            batch[pos] = x[3]
            assert torch.equal(exact_linear_triton(batch, w)[pos], alone[3]), (rows, pos)
    long_chunk = torch.cat([others, others, x[3:4]])  # the last row of a 33-row chunk (three row tiles)
    assert torch.equal(exact_linear_triton(long_chunk, w)[-1], alone[3])


@pytest.mark.parametrize("N, K", [(96, 1024), (96, 128)], ids=["two_splits", "one_split"])
def test_a_rows_bits_do_not_depend_on_its_programs_row_tiles(triton_device: str, N: int, K: int) -> None:
    """A program runs up to ``MAX_ROW_TILES`` row tiles against its weight tile (a verify of 80 rows:
    five in one program; 200 rows: 13 tiles in groups of 7 and 6). A row alone, and the same row in
    every row tile of those launches, gives the same bits."""
    assert row_tiles_per_program(80, 64) == 5 and row_tiles_per_program(200, 64) == 7
    x, w = _inputs(triton_device, torch.bfloat16, 1, N, K, seed=9)
    others, _ = _inputs(triton_device, torch.bfloat16, 200, N, K, seed=10)
    alone = exact_linear_triton(x, w)[0]
    for rows in (80, 200):
        batch = others[:rows].clone()
        positions = list(range(3, rows, 16))   # one row in every row tile (a group's first, middle and last ones)
        batch[positions] = x[0]
        out = exact_linear_triton(batch, w)
        for pos in positions:
            assert torch.equal(out[pos], alone), (rows, pos)
        assert _rel_err(out, batch, w) < TOL[torch.bfloat16]


@pytest.mark.parametrize("M, block_n, want", [(1, 64, 1), (16, 64, 1), (17, 64, 2), (128, 64, 8), (129, 64, 5),
                                              (80, 128, 3), (2048, 64, 8), (300, 32, 7), (128, 32, 8)])
def test_row_tiles_per_program(M: int, block_n: int, want: int) -> None:
    # all of a launch's tiles up to the register budget (8 tiles of 64 columns, 4 of 128; never more
    # than the kernel's 8 accumulators), else an even share
    assert row_tiles_per_program(M, block_n) == want


@pytest.mark.parametrize("row_tiles, want", [(1, 4), (5, 4), (8, 3), (16, 2)])
def test_the_pipeline_depth_fits_the_shared_memory(row_tiles: int, want: int) -> None:
    # Triton 3.6 keeps num_stages - 1 buffers (scripts/compile_sm90.py, sm_90: 221,184 B for 5 row
    # tiles of a 64 x 256 bf16 plan at 4 stages, 196,608 B for 8 at 3); sm_90's 232,448 B a block
    cfg = ExactConfig(64, 256, splits=1, steps=8, num_stages=4)
    assert _stages_that_fit(cfg, row_tiles, 2, 232_448) == want
    assert _stages_that_fit(cfg, row_tiles, 2, None) == 4    # off the GPU: the plan's depth


@pytest.mark.parametrize("M, programs_per_group, row_programs, want", [
    (80, 48, 132, 2),     # 48 column tiles: 3 groups wanted, 5 tiles -> 2 a program
    (80, 128, 132, 3),    # a split product of 128 programs: 2 groups
    (80, 256, 132, 5),    # already past the aim: one group
    (1, 48, 132, 1),      # one tile: one group whatever the aim
    (2048, 48, 132, 8),   # 128 tiles: the accumulators already ask for 16 groups
    (80, 3, 64, 1)])      # more groups wanted than tiles: one tile a program
def test_row_tiles_per_program_spread_for_programs(M: int, programs_per_group: int, row_programs: int,
                                                   want: int) -> None:
    assert row_tiles_per_program(M, 64, programs_per_group, row_programs) == want


@pytest.mark.parametrize("splits, steps", [(1, 3), (2, 2)], ids=["one_split", "two_splits"])
def test_spreading_row_tiles_over_more_programs_changes_no_bit(triton_device: str, splits: int, steps: int) -> None:
    """``row_programs`` only regroups a launch's row tiles (80 rows: one program of five tiles a
    column tile and split, against five programs of one): every output bit is the same."""
    x, w = _inputs(triton_device, torch.bfloat16, 80, 96, 6 * 32 - 7, seed=12)
    grouped, spread = ExactConfig(32, 64, splits, steps), ExactConfig(32, 64, splits, steps, row_programs=64)
    assert row_tiles_per_program(80, 32, 3 * splits, 0) == 5 and row_tiles_per_program(80, 32, 3 * splits, 64) == 1
    out = exact_linear_triton(x, w, grouped)
    assert torch.equal(exact_linear_triton(x, w, spread), out)
    assert _rel_err(out, x, w) < TOL[torch.bfloat16]


@pytest.mark.parametrize("cfg", [ExactConfig(32, 32, splits=3, steps=2), ExactConfig(32, 64, splits=1, steps=3),
                                 ExactConfig(64, 64, splits=2, steps=2)], ids=["narrow_split", "narrow", "eight_tiles"])
def test_forced_plans_with_many_row_tiles(triton_device: str, cfg: ExactConfig) -> None:
    # 300 rows: 19 row tiles in groups of up to 8 (eight per program for 64 columns at 128 rows), the
    # narrow plans' groups capped at the kernel's accumulators; every row computed, near fp64
    for M in (128, 300):
        x, w = _inputs(triton_device, torch.float32, M, 70, 6 * 32 - 7, seed=M)
        assert _rel_err(exact_linear_triton(x, w, cfg), x, w) < TOL[torch.float32]


def test_split_products_leave_their_counters_at_zero(triton_device: str) -> None:
    """Each tile's last program resets its counter, so the next launch (here the same product again)
    starts from zero: its result is the same, and the counters end all-zero."""
    x, w = _inputs(triton_device, torch.float32, 20, 96, 1024, seed=3)
    assert exact_config(96, 1024).splits > 1
    first = exact_linear_triton(x, w)
    assert not _counter_buffer(x.device, EXACT_COUNTERS).any()
    assert torch.equal(exact_linear_triton(x, w), first)


def test_a_product_past_the_counters_runs_in_row_ranges_with_the_same_bits(triton_device: str, monkeypatch) -> None:
    """More (row group, column tile) counters than the set holds: the launcher splits the rows into
    ranges of whole groups, one launch each, and every row keeps its bits."""
    x, w = _inputs(triton_device, torch.bfloat16, 200, 96, 1024, seed=4)
    whole = exact_linear_triton(x, w)
    monkeypatch.setattr(el, "MAX_SPLIT_TILES", 2)   # two column tiles: one group (7 row tiles, 112 rows) a launch
    assert torch.equal(exact_linear_triton(x, w), whole)
    assert _rel_err(whole, x, w) < TOL[torch.bfloat16]


def test_a_split_plan_wider_than_the_counters_is_refused(monkeypatch) -> None:
    x, w = _inputs("cpu", torch.float32, 4, 96, 640, seed=5)
    monkeypatch.setattr(el, "MAX_SPLIT_TILES", 2)   # three column tiles of 32
    with pytest.raises(ValueError, match="one counter each"):
        exact_linear_triton(x, w, ExactConfig(32, 64, splits=2, steps=5))


def test_the_default_skinny_product_is_not_batch_invariant(triton_device: str) -> None:
    """Contrast (why exact mode has its own product): the default op sums one row with its GEMV kernel
    and ten rows with the split-K ``tl.dot`` kernel, and some row's bits differ."""
    x, w = _inputs(triton_device, torch.float32, 10, 96, 2048, seed=11)
    ten = skinny_linear_triton(x, w)
    one = torch.cat([skinny_linear_triton(x[r:r + 1], w) for r in range(10)])
    assert not torch.equal(ten, one)


def test_opcheck() -> None:
    x, w = _inputs("cpu", torch.float32, 3, 16, 32)
    torch.library.opcheck(torch.ops.lfmspark.exact_linear, (x, w))
