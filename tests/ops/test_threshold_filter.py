"""``lfmspark::threshold_filter``: the sort-free Triton thresholds (interpreter on CPU, native on CUDA)
against the op's sort-based PyTorch reference (thresholds and tops bit for bit, masses to fp32
rounding) and against a float64 oracle of the kept set written from the definitions: tie grids
(values on 0.5 / 2.0 grids), continuous rows, top_k 1 / 80 / 128 / beyond the distinct values /
at and beyond V, top_p alone up to 0.999, min_p alone, their combinations, a row all ``-inf`` but
one; several programs per row; the refinement rounds and the last step's single-program loop
forced by tiny constants (one value gathered, two pivots per refinement); order independence;
the served vocabulary; registration, errors, opcheck and torch.compile."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops import threshold_filter as tf
from lfmspark.ops.threshold_filter import threshold_filter_reference, threshold_filter_triton
from env_vars import interpret_triton

# (top_k, top_p, min_p): the model cards' kinds of settings and the corners
SETTINGS = [(0, 1.0, 0.0), (50, 0.1, 0.0), (80, 1.0, 0.0), (0, 1.0, 0.15), (0, 0.9, 0.0), (128, 0.95, 0.05),
            (1, 1.0, 0.0), (7, 0.5, 0.2), (0, 0.999, 0.0), (128, 1.0, 0.0), (300, 0.5, 0.0), (299, 1.0, 0.0),
            (150, 0.3, 0.01), (40, 1.0, 0.9)]


def kept_oracle(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The kept tokens of one row (float64) from the definitions: top-k keeps the values at least the
    k-th largest (counted with multiplicity); top-p keeps each remaining value, with all its ties,
    whose mass strictly above it is below ``top_p`` of the top-k mass; min-p keeps ``p >= min_p * p_max``."""
    V = len(x)
    kept = x >= np.sort(x)[::-1][(top_k if 0 < top_k < V else V) - 1]
    e = np.exp(x - x.max())
    if top_p < 1:
        z = e[kept].sum()
        values = np.unique(x[kept])[::-1]
        above = np.array([e[x > v].sum() for v in values])
        kept &= x >= values[above < top_p * z].min()
    if min_p > 0:
        kept &= x - x.max() >= np.log(min_p)
    return kept


def _rows(n: int, v: int, seed: int, grid: float | None) -> torch.Tensor:
    """Random rows; on a coarse ``grid`` many values tie (as bf16 logits do)."""
    x = torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3
    return x if grid is None else (x / grid).round() * grid


def _params(settings: list[tuple[int, float, float]], device: str) -> tuple[torch.Tensor, ...]:
    return (torch.tensor([s[0] for s in settings], device=device),
            torch.tensor([s[1] for s in settings], dtype=torch.float32, device=device),
            torch.tensor([s[2] for s in settings], dtype=torch.float32, device=device))


def _check(x: torch.Tensor, settings: list[tuple[int, float, float]], block_v: int | None = None,
           oracle: bool = True) -> tuple[torch.Tensor, ...]:
    """The op on the kernels equals the reference (thresholds and tops exactly) and keeps what the
    float64 oracle keeps, with its mass."""
    top_k, top_p, min_p = _params(settings, x.device.type)
    thr, top, z = threshold_filter_triton(x, top_k, top_p, min_p, block_v)
    assert thr.dtype == top.dtype == z.dtype == torch.float32 and thr.shape == (x.shape[0],)
    r_thr, r_top, r_z = threshold_filter_reference(x, top_k, top_p, min_p)
    assert torch.equal(top.cpu(), r_top.cpu())
    assert torch.equal(thr.cpu(), r_thr.cpu()), [(i, s) for i, s in enumerate(settings) if thr[i] != r_thr[i]]
    torch.testing.assert_close(z.cpu(), r_z.cpu(), rtol=2e-6, atol=0)
    if oracle:
        xc = x.float().cpu()
        for i, (k, p, m) in enumerate(settings):
            xd = xc[i].double().numpy()
            want = kept_oracle(xd, k, p, m)
            assert np.array_equal((xc[i] >= thr[i].cpu()).numpy(), want), (i, k, p, m)
            np.testing.assert_allclose(float(z[i]), np.exp(xd - xd.max())[want].sum(), rtol=2e-6)
    return thr, top, z


@pytest.mark.parametrize("grid", [None, 0.5, 2.0], ids=["continuous", "ties", "many-ties"])
def test_every_setting_on_tied_and_continuous_rows(triton_device: str, grid: float | None) -> None:
    """One row per setting of a 300-token vocabulary; on the 2.0 grid top_k 80 and 128 exceed the
    number of distinct values."""
    x = _rows(len(SETTINGS), 300, seed=len(str(grid)), grid=grid).to(triton_device)
    _check(x, SETTINGS)


def test_several_programs_per_row(triton_device: str) -> None:
    """64 columns per program: five programs per row, every pass combining their partials."""
    settings = SETTINGS[1:9]
    x = torch.cat([_rows(4, 300, seed=3, grid=None), _rows(4, 300, seed=4, grid=0.5)])
    _check(x.to(triton_device), settings, block_v=64)


def test_minus_inf_and_top_k_at_the_vocabulary(triton_device: str) -> None:
    """A row all -inf but one value (every filter keeps that value alone), rows with many -inf, top_k
    equal to and beyond V, and min_p 1 (the top value's ties alone)."""
    x = _rows(6, 40, seed=5, grid=0.5)
    x[0] = float("-inf")
    x[0, 17] = 2.5
    x[1, :30] = float("-inf")
    x[2, 5:35] = float("-inf")
    settings = [(5, 0.5, 0.1), (20, 0.9, 0.0), (0, 0.7, 0.0), (40, 1.0, 0.0), (1000, 0.8, 0.0), (0, 1.0, 1.0)]
    thr, _, z = _check(x.to(triton_device), settings)
    assert float(thr[0]) == 2.5 and float(z[0]) == 1.0


@pytest.mark.parametrize("cap, npiv, rounds", [(1, 2, 1), (4, 4, 2)], ids=["bisection-alone", "small-rounds"])
def test_refinement_and_the_last_steps_loop(triton_device: str, monkeypatch: pytest.MonkeyPatch, cap: int, npiv: int,
                                            rounds: int) -> None:
    """Brackets gathered only when one (or four) values remain and split in two (or four) per pass.
    Bisection with one multi-program round leaves every row open when the last step begins: its
    single-program loop resolves them, within its bound (a row left open would come back NaN); with
    four pivots the multi-program rounds resolve them. The same thresholds either way. The last row
    spans keys from -1e30 to 1e30, the widest bracket a refinement can meet."""
    monkeypatch.setattr(tf, "_CAP", cap)
    monkeypatch.setattr(tf, "_NPIV", npiv)
    monkeypatch.setattr(tf, "_ROUNDS", rounds)
    settings = [(80, 1.0, 0.0), (0, 0.9, 0.0), (128, 0.95, 0.05), (7, 0.5, 0.2), (0, 0.999, 0.0), (150, 0.3, 0.0),
                (3, 1.0, 0.0), (60, 1.0, 0.0)]
    x = torch.cat([_rows(4, 200, seed=6, grid=None), _rows(3, 200, seed=7, grid=0.5)])
    g = torch.Generator().manual_seed(8)
    wide = torch.sign(torch.randn(1, 200, generator=g)) * 10 ** (torch.rand(1, 200, generator=g) * 60 - 30)
    thr, _, z = _check(torch.cat([x, wide]).to(triton_device), settings, block_v=64)
    assert not thr.isnan().any() and not z.isnan().any()


def test_threshold_does_not_depend_on_the_column_order(triton_device: str) -> None:
    """The gathered values' order varies with the programs' order on a GPU; the step sorts them, so a
    permuted row gives the same threshold (and its mass to rounding)."""
    settings = [(50, 0.9, 0.0), (0, 0.8, 0.0), (100, 1.0, 0.0)]
    x = _rows(3, 300, seed=9, grid=0.5)
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(1))
    a = threshold_filter_triton(x.to(triton_device), *_params(settings, triton_device), 64)
    b = threshold_filter_triton(x[:, perm].to(triton_device), *_params(settings, triton_device), 64)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    torch.testing.assert_close(a[2], b[2], rtol=2e-6, atol=0)


def test_served_vocabulary(triton_device: str) -> None:
    """65536 columns, fp32 and bf16-rounded rows at the model cards' settings (LFM2.5: temperature
    0.1, top_k 50, top_p 0.1; LFM2.5-8B-A1B: temperature 0.2, top_k 80; min_p 0.15 at 0.2; top_p 0.9 at
    0.7); the temperatures are applied here."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 65536, generator=g) * 3
    x = torch.cat([x, x.to(torch.bfloat16).float()])
    settings = [(50, 0.1, 0.0), (80, 1.0, 0.0), (0, 1.0, 0.15), (0, 0.9, 0.0)]
    temperature = torch.tensor([0.1, 0.2, 0.2, 0.7])
    _check((x / temperature[:, None]).to(triton_device), settings, oracle=False)


def test_strided_and_bf16_rows(triton_device: str) -> None:
    settings = [(10, 0.9, 0.0), (0, 0.5, 0.1)]
    x = _rows(2, 600, seed=11, grid=None).to(triton_device)
    _check(x[:, ::2], settings)
    _check(x.to(torch.bfloat16), settings)


def test_bad_arguments_name_the_problem() -> None:
    x = torch.zeros(2, 8)
    k, p, m = torch.zeros(2, dtype=torch.int64), torch.ones(2), torch.zeros(2)
    with pytest.raises(ValueError, match="expected x"):
        torch.ops.lfmspark.threshold_filter(torch.zeros(8), k, p, m)
    with pytest.raises(ValueError, match="top_k must be"):
        torch.ops.lfmspark.threshold_filter(x, torch.zeros(2), p, m)
    with pytest.raises(ValueError, match="min_p must be fp32"):
        torch.ops.lfmspark.threshold_filter(x, k, p, torch.zeros(3))
    with pytest.raises(ValueError, match="V = 0"):
        torch.ops.lfmspark.threshold_filter(torch.zeros(2, 0), k, p, m)


def _op_inputs() -> tuple[torch.Tensor, ...]:
    return (_rows(3, 300, seed=12, grid=0.5), *_params([(50, 0.9, 0.0), (0, 0.8, 0.1), (0, 1.0, 0.0)], "cpu"))


@pytest.mark.parametrize("on_triton", [False, True], ids=["reference", "triton"])
def test_opcheck(monkeypatch: pytest.MonkeyPatch, on_triton: bool) -> None:
    if on_triton:
        interpret_triton(monkeypatch)
    torch.library.opcheck(torch.ops.lfmspark.threshold_filter, _op_inputs())


def test_registered_op_compiles_with_the_triton_kernels(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    x, k, p, m = (t.to(triton_device) for t in _op_inputs())
    fn = torch.compile(lambda t, k, p, m: torch.ops.lfmspark.threshold_filter(t * 2.0, k, p, m), fullgraph=True)
    got = fn(x, k, p, m)
    want = threshold_filter_reference(x * 2.0, k, p, m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=2e-6, atol=0)
