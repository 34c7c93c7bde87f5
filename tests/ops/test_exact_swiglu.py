"""``lfmspark::exact_swiglu`` (exact mode's dense SwiGLU gate/up product with the activation in its
epilogue): the Triton kernel (interpreter on CPU, native on CUDA) against ``exact_linear``'s sums of
the stacked weight and the fp64 activation, and the exact-mode property: a row's bits do not depend
on the other rows of the launch (alone, at any position of 2, 10 and 16-row launches, in every row
tile of 80- and 200-row launches), with one K split and with several."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lfmspark.ops  # noqa: F401  (registers the ops)
import lfmspark.ops.linear.exact_linear as el
from lfmspark.ops.linear.exact_linear import (EXACT_COUNTERS, ExactConfig, exact_config, exact_linear_triton,
                                              exact_swiglu_reference, exact_swiglu_triton, row_tiles_per_program)
from lfmspark.ops.linear.skinny_linear import _counter_buffer
from test_skinny_linear import _inputs

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}   # test_skinny_swiglu.py's: bf16 rounds four times on the way


def _rel_err_fp64(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor) -> float:
    gate, up = (x.double() @ w13.double().T).chunk(2, dim=-1)
    want = F.silu(gate) * up
    return ((out.double() - want).norm() / want.norm()).item()


def _round(t: torch.Tensor, dtype: torch.dtype, interpreted: bool) -> torch.Tensor:
    # fp32 -> dtype -> fp32 as the kernel's casts do: the GPU rounds to nearest even, Triton's
    # interpreter truncates (keeps the high 16 bits of the fp32)
    if dtype == torch.float32:
        return t
    if interpreted:
        return (t.view(torch.int32) & -65536).view(torch.float32)
    return t.to(dtype).float()


def _module_roundings(sums: torch.Tensor, interpreted: bool) -> torch.Tensor:
    """The unfused module's roundings on the stacked product's rounded sums (skinny_linear's
    ``_store_out``): ``silu(gate)`` rounded, times ``up``, rounded; the exp of the interpreter (numpy's)
    where the kernel is interpreted."""
    dtype = sums.dtype
    gate, up = sums.float().chunk(2, dim=-1)
    exp = torch.from_numpy(np.exp(-gate.numpy())) if interpreted else torch.exp(-gate)
    act = _round(gate / (1.0 + exp), dtype, interpreted)
    return _round(act * up, dtype, interpreted).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M, F_, K", [(1, 64, 256), (10, 50, 300), (17, 96, 1024), (40, 33, 96)])
def test_kernel_is_the_stacked_product_then_the_activation(triton_device: str, dtype: torch.dtype, M: int, F_: int,
                                                           K: int) -> None:
    x, w13 = _inputs(triton_device, dtype, M, 2 * F_, K, seed=M)
    out = exact_swiglu_triton(x, w13)
    assert out.shape == (M, F_) and out.dtype == dtype
    assert _rel_err_fp64(out, x, w13) < TOL[dtype]
    assert _rel_err_fp64(exact_swiglu_reference(x, w13), x, w13) < TOL[dtype]
    # the gate and up sums are exact_linear's of w13 (the same plan), then the module's roundings:
    # the same bits under the interpreter, whose exact dots are per-element sums (ops/exact_dot.py):
    # an up column sits F columns right of its gate column in the stacked product and at the gate's
    # place in the fused one, which numpy's BLAS may sum differently. On the GPU Triton's exp (ex2.approx of the argument times
    # log2 e) and torch's differ by a few fp32 ulps plus |gate| / 2 ulps (the scaled argument's
    # rounding): in bf16 that moves a rare element by one unit; in fp32, where no rounding to a
    # coarser dtype hides it, most elements move, each within that bound
    sums = exact_linear_triton(x, w13)
    interpreted = triton_device == "cpu"
    want = _module_roundings(sums, interpreted)
    if interpreted:
        assert torch.equal(out, want)
    elif dtype == torch.bfloat16:
        assert (out == want).float().mean().item() >= 0.99
        torch.testing.assert_close(out.float(), want.float(), rtol=torch.finfo(dtype).eps, atol=1e-30)
    else:
        gate = sums.chunk(2, dim=-1)[0].abs()
        bound = (8 + gate) * torch.finfo(dtype).eps * want.abs()
        assert ((out - want).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("F_, K", [(96, 1024), (96, 128)], ids=["two_splits", "one_split"])
def test_a_rows_bits_do_not_depend_on_the_launch(triton_device: str, dtype: torch.dtype, F_: int, K: int) -> None:
    """Each of 16 rows alone, and at every position of 2- and 10-row launches among other rows, and
    as the last row of a 33-row chunk, gives the same bits (under the interpreter through the
    kernel's per-element sums, ops/exact_dot.py, as for exact_linear)."""
    assert (exact_config(2 * F_, K).splits > 1) == (K == 1024)
    x, w13 = _inputs(triton_device, dtype, 16, 2 * F_, K, seed=7)
    others, _ = _inputs(triton_device, dtype, 16, 2 * F_, K, seed=8)
    alone = torch.cat([exact_swiglu_triton(x[r:r + 1], w13) for r in range(16)])
    assert torch.equal(exact_swiglu_triton(x, w13), alone)
    for rows in (2, 10):
        for pos in range(rows):
            batch = others[:rows].clone()
            batch[pos] = x[3]
            assert torch.equal(exact_swiglu_triton(batch, w13)[pos], alone[3]), (rows, pos)
    long_chunk = torch.cat([others, others, x[3:4]])
    assert torch.equal(exact_swiglu_triton(long_chunk, w13)[-1], alone[3])


@pytest.mark.parametrize("F_, K", [(96, 1024), (96, 128)], ids=["two_splits", "one_split"])
def test_a_rows_bits_do_not_depend_on_its_programs_row_tiles(triton_device: str, F_: int, K: int) -> None:
    """Two accumulators a row tile: a program runs up to 5 row tiles (80 rows, a batch-8 verify:
    one group of 5; 200 rows: 13 tiles in groups of 5, 5 and 3). A row alone and in every row tile
    agree."""
    assert row_tiles_per_program(80, 64, weight_tiles=2) == 5 and row_tiles_per_program(200, 64, weight_tiles=2) == 5
    assert row_tiles_per_program(300, 32, weight_tiles=2) == 5     # 32 columns: still the 5 pairs the kernel holds
    assert row_tiles_per_program(80, 128, weight_tiles=2) == 2     # 128 columns: 2 pairs' worth of registers
    x, w13 = _inputs(triton_device, torch.bfloat16, 1, 2 * F_, K, seed=9)
    others, _ = _inputs(triton_device, torch.bfloat16, 200, 2 * F_, K, seed=10)
    alone = exact_swiglu_triton(x, w13)[0]
    for rows in (80, 200):
        batch = others[:rows].clone()
        positions = list(range(5, rows, 16))   # one row in every row tile
        batch[positions] = x[0]
        out = exact_swiglu_triton(batch, w13)
        for pos in positions:
            assert torch.equal(out[pos], alone), (rows, pos)
        assert _rel_err_fp64(out, batch, w13) < TOL[torch.bfloat16]


@pytest.mark.parametrize("cfg", [ExactConfig(32, 64, splits=2, steps=2), ExactConfig(32, 64, splits=1, steps=3),
                                 ExactConfig(16, 64, splits=3, steps=1), ExactConfig(32, 64, splits=2, steps=2,
                                                                                     row_programs=64)],
                         ids=["split", "one_split", "three_splits", "spread"])
def test_forced_plans(triton_device: str, cfg: ExactConfig) -> None:
    """A K tail in the last split, column tiles past F, 130 rows (9 row tiles: groups of 5 and 4, or
    of one with ``row_programs``): near the fp64 activation, and every row the bits it has alone."""
    x, w13 = _inputs(triton_device, torch.float32, 130, 2 * 45, 6 * 32 - 7, seed=1)
    out = exact_swiglu_triton(x, w13, cfg)
    assert _rel_err_fp64(out, x, w13) < TOL[torch.float32]
    for r in (0, 17, 64, 129):
        assert torch.equal(exact_swiglu_triton(x[r:r + 1], w13, cfg)[0], out[r]), r


def test_a_launch_past_the_counters_runs_in_row_ranges_with_the_same_bits(triton_device: str, monkeypatch) -> None:
    """More (row group, column tile) counters than the set holds: row ranges of whole groups, one
    launch each, the 2F-wide workspace reused; every row keeps its bits, the counters end at zero."""
    x, w13 = _inputs(triton_device, torch.bfloat16, 200, 192, 1024, seed=4)
    whole = exact_swiglu_triton(x, w13)
    monkeypatch.setattr(el, "MAX_SPLIT_TILES", 2)   # two column tiles of F = 96: one group (5 row tiles) a launch
    assert torch.equal(exact_swiglu_triton(x, w13), whole)
    assert not _counter_buffer(x.device, EXACT_COUNTERS).any()


def test_split_launches_leave_their_counters_at_zero(triton_device: str) -> None:
    x, w13 = _inputs(triton_device, torch.float32, 20, 192, 1024, seed=3)
    assert exact_config(192, 1024).splits > 1
    first = exact_swiglu_triton(x, w13)
    assert not _counter_buffer(x.device, EXACT_COUNTERS).any()
    assert torch.equal(exact_swiglu_triton(x, w13), first)


def test_bad_weights_are_refused() -> None:
    x, w13 = _inputs("cpu", torch.float32, 2, 9, 32)
    with pytest.raises(ValueError, match="odd"):
        torch.ops.lfmspark.exact_swiglu(x, w13)
    with pytest.raises(ValueError, match="share a dtype"):
        torch.ops.lfmspark.exact_swiglu(x, w13[:8].double())


def test_opcheck() -> None:
    x, w13 = _inputs("cpu", torch.float32, 3, 32, 32)
    torch.library.opcheck(torch.ops.lfmspark.exact_swiglu, (x, w13))
