"""``lfmspark::skinny_linear``: the Triton kernels (interpreter on CPU, native on CUDA) against the
reference ``F.linear``; forced split-K and its in-kernel fix-up (the last program of a tile sums the
partials in split order), the swap-AB variant, launch heuristics, the benchmark's sweep grid,
registration checks, torch.compile.

The oracle is the product in fp64 of the (upcast) inputs. Tolerances, as relative Frobenius errors
``|out - oracle| / |oracle|``: fp32 1e-5 (the kernel lands near 2e-7); bf16 1e-2 (one rounding of
the fp32 sum, about 3e-3, as the reference; the interpreter truncates fp32 -> bf16 instead of
rounding, still about 3e-3 at these sizes).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import lfmspark.ops  # noqa: F401  (registers the ops)
from lfmspark.ops.linear.skinny_linear import (MAX_M, SIDE_STREAM_STAGES, SkinnyConfig, _counter_buffer,
                                               _split_counters, skinny_config, skinny_linear_reference,
                                               skinny_linear_triton, split_k_plan, swap_ab_config)
from env_vars import interpret_triton, set_env

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _inputs(device: str, dtype: torch.dtype, M: int, N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    return x, w


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == x.dtype and out.device == x.device
    want = x.double() @ w.double().T
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < TOL[x.dtype], err
    ref = skinny_linear_reference(x, w)
    ref_err = ((ref.double() - want).norm() / want.norm()).item()
    assert ref_err < TOL[x.dtype], ref_err  # the reference itself meets the same bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [1, 3, 10, 17, 40])
@pytest.mark.parametrize("N, K", [(160, 256), (100, 128), (33, 96 + 32 + 7)], ids=["even", "n_tail", "k_tail"])
def test_kernel_matches_reference(triton_device: str, dtype: torch.dtype, M: int, N: int, K: int) -> None:
    x, w = _inputs(triton_device, dtype, M, N, K, seed=M)
    _check(skinny_linear_triton(x, w), x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M, N, K, cfg", [
    (10, 100, 256, SkinnyConfig(block_n=32, block_k=64, split_k=4)),    # 4 even splits
    (17, 48, 200, SkinnyConfig(block_n=16, block_k=32, split_k=3)),     # K tail in the last split
    (3, 64, 192, SkinnyConfig(block_n=64, block_k=64, split_k=5)),      # 5 asked, 3 non-empty
    (40, 160, 128, SkinnyConfig(block_n=128, block_k=16, split_k=8)),   # N tail, one K step a split
], ids=["even", "k_tail", "fewer_splits", "n_tail"])
def test_forced_split_k(triton_device: str, dtype: torch.dtype, M: int, N: int, K: int, cfg: SkinnyConfig) -> None:
    x, w = _inputs(triton_device, dtype, M, N, K, seed=N)
    _check(skinny_linear_triton(x, w, cfg), x, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N, K, cfg", [
    (160, 256, SkinnyConfig(block_n=16, block_k=128, gemv=True)),               # two K steps
    (100, 300, SkinnyConfig(block_n=8, block_k=64, gemv=True)),                 # N and K tails
    (64, 512, SkinnyConfig(block_n=32, block_k=64, split_k=3, gemv=True)),      # splits, K tail in the last
    (33, 1024, SkinnyConfig(block_n=4, block_k=256, split_k=4, gemv=True)),     # even splits, N tail
], ids=["even", "tails", "split_tail", "split_even"])
def test_gemv_kernel_for_one_row(triton_device: str, dtype: torch.dtype, N: int, K: int, cfg: SkinnyConfig) -> None:
    x, w = _inputs(triton_device, dtype, 1, N, K, seed=K)
    _check(skinny_linear_triton(x, w, cfg), x, w)


def test_gemv_flag_is_ignored_for_several_rows(triton_device: str) -> None:
    x, w = _inputs(triton_device, torch.float32, 3, 64, 128)
    _check(skinny_linear_triton(x, w, SkinnyConfig(block_n=16, block_k=64, gemv=True)), x, w)


# ---------------------------------------------------------------------------------------------
# split-K fix-up: each split stores its fp32 partial, the tile's last program sums them in split order

def _round_like_kernel(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> ``dtype`` as the kernels' final conversion does: round to nearest on CUDA; the Triton
    3.9 interpreter truncates fp32 -> bf16 (normal numbers: the low 16 bits dropped)."""
    if dtype == torch.bfloat16 and t.device.type == "cpu":
        return (t.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return t.to(dtype)


def _split_order_sum(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig) -> torch.Tensor:
    """What a two-kernel split-K (partials, then a reduce kernel) produces, from the workspace math
    alone: each split's partial is the product over its K range (as its own one-split fp32 launch of
    the same kernel: the same K blocks in the same order, so the same fp32 partial), and the reduce
    kernel sums the partials in split order 0, 1, ..., then rounds once."""
    K = x.shape[1]
    k_split, splits = split_k_plan(K, cfg.block_k, cfg.split_k)
    one = SkinnyConfig(block_n=cfg.block_n, block_k=cfg.block_k, split_k=1, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, gemv=cfg.gemv)
    total = None
    for s in range(splits):
        ks = slice(s * k_split, min((s + 1) * k_split, K))
        part = skinny_linear_triton(x[:, ks].float(), w[:, ks].float(), one)
        total = part if total is None else total + part
    return _round_like_kernel(total, x.dtype)


# (M, N, K, cfg): even splits, K tail in the last split, fewer non-empty splits than asked, one K
# block per split, more than four splits (two passes of the fix-up's four-slice loads), the GEMV
SPLIT_CASES = [
    (10, 100, 256, SkinnyConfig(block_n=32, block_k=64, split_k=4)),
    (9, 48, 200, SkinnyConfig(block_n=64, block_k=32, split_k=3)),
    (3, 64, 192, SkinnyConfig(block_n=16, block_k=64, split_k=5)),
    (16, 80, 96, SkinnyConfig(block_n=64, block_k=16, split_k=6)),
    (2, 40, 352, SkinnyConfig(block_n=16, block_k=32, split_k=11)),
    (1, 100, 300, SkinnyConfig(block_n=8, block_k=64, split_k=3, gemv=True)),
    (1, 33, 1024, SkinnyConfig(block_n=4, block_k=128, split_k=8, gemv=True)),
]
SPLIT_IDS = ["even", "k_tail", "fewer_splits", "one_step_splits", "eleven_splits", "gemv_tails", "gemv_even"]


def test_split_cases_split() -> None:
    """The cases really run split, with the split counts their ids say."""
    splits = [split_k_plan(K, cfg.block_k, cfg.split_k)[1] for _, _, K, cfg in SPLIT_CASES]
    assert splits == [4, 3, 3, 6, 11, 3, 8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M, N, K, cfg", SPLIT_CASES, ids=SPLIT_IDS)
def test_split_k_fixup_sums_in_split_order(triton_device: str, dtype: torch.dtype, M: int, N: int, K: int,
                                           cfg: SkinnyConfig) -> None:
    """The fix-up's output: near the reference, and bit-identical to the partials summed in split
    order (a separate reduce kernel's result). On CUDA the bit-identity is checked in fp32 only: a
    bf16 split's partial comes from bf16 MMAs, which its fp32 re-computation here does not repeat."""
    x, w = _inputs(triton_device, dtype, M, N, K, seed=M * N + K)
    out = skinny_linear_triton(x, w, cfg)
    _check(out, x, w)
    if triton_device == "cpu" or dtype == torch.float32:
        assert torch.equal(out, _split_order_sum(x, w, cfg))


@pytest.mark.parametrize("M, N, K, cfg", [SPLIT_CASES[1], SPLIT_CASES[4], SPLIT_CASES[5]],
                         ids=["tile", "two_rows", "gemv"])
def test_split_k_is_deterministic_and_resets_its_counters(triton_device: str, M: int, N: int, K: int,
                                                          cfg: SkinnyConfig) -> None:
    """Two calls are bit-identical; the arrival counters are all zero after each (the next launch,
    or the next replay of a graph, finds them as the first did)."""
    x, w = _inputs(triton_device, torch.float32, M, N, K)
    first = skinny_linear_triton(x, w, cfg)
    counters = _split_counters(x.device, side_stream=False)
    assert not counters.any()
    assert torch.equal(skinny_linear_triton(x, w, cfg), first)
    assert not counters.any()


def test_side_stream_launches_use_their_own_counters(triton_device: str) -> None:
    """``side_stream=True`` (a stream that runs beside another's split-K launches) takes a counter
    buffer of its own, left all-zero as the main stream's; the values are the same."""
    M, N, K, cfg = SPLIT_CASES[1]
    x, w = _inputs(triton_device, torch.float32, M, N, K)
    want = skinny_linear_triton(x, w, cfg)
    assert torch.equal(skinny_linear_triton(x, w, cfg, side_stream=True), want)
    assert _split_counters(x.device, side_stream=True) is _counter_buffer(x.device, 1)
    assert _split_counters(x.device, side_stream=False) is _counter_buffer(x.device, 0)
    assert _counter_buffer(x.device, 1) is not _counter_buffer(x.device, 0)
    assert not _counter_buffer(x.device, 1).any() and not _counter_buffer(x.device, 0).any()


def test_side_stream_caps_the_pipeline_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the side stream (the round's context injection, runtime/steps.py) the batch-1 injection's
    products (fc 10 x 10240 -> 2048, split; kv_proj 10 x 2048 -> 5120, 80 tiles: both 5 stages by
    default) take at most ``SIDE_STREAM_STAGES``; the rest of the config is unchanged, and an
    LFMSPARK_TUNE value wins over the cap."""
    set_env(monkeypatch, TUNE=None)
    shapes = [(10, 2048, 10240), (10, 5120, 2048)]
    default = [swap_ab_config(M, N, K, 2, 132) for M, N, K in shapes]
    assert [c.num_stages for c in default] == [5, 5]
    capped = [skinny_config(M, N, K, 2, 132, side_stream=True) for M, N, K in shapes]
    assert [c.num_stages for c in capped] == [SIDE_STREAM_STAGES] * 2 == [3, 3]
    assert [dataclasses.replace(c, num_stages=0) for c in capped] == [dataclasses.replace(c, num_stages=0)
                                                                       for c in default]
    set_env(monkeypatch, TUNE="tile@2048x10240.num_stages=5")
    assert swap_ab_config(10, 2048, 10240, 2, 132, side_stream=True).num_stages == 5


def test_split_k_counters_are_reused_across_launches(triton_device: str) -> None:
    """Back-to-back split-K launches of different tilings (and both kernels) share the counters:
    each is still correct after the others."""
    for M, N, K, cfg in SPLIT_CASES * 2:
        x, w = _inputs(triton_device, torch.float32, M, N, K, seed=N)
        _check(skinny_linear_triton(x, w, cfg), x, w)


@pytest.mark.skipif(torch.cuda.is_available(), reason="drives the interpreter's program order")
@pytest.mark.parametrize("M, N, K, cfg", [SPLIT_CASES[0], SPLIT_CASES[4], SPLIT_CASES[6]], ids=["swap_ab", "dot", "gemv"])
def test_split_k_result_does_not_depend_on_arrival_order(monkeypatch: pytest.MonkeyPatch, M: int, N: int, K: int,
                                                         cfg: SkinnyConfig) -> None:
    """The interpreter runs a tile's splits in order 0, 1, ..., so the last split arrives last. Run
    them backwards instead (split 0 arrives last and does the fix-up): the result is bit-identical,
    because the fix-up sums in split order whoever runs it (fp32: a bf16 rounding could hide an
    order-dependent sum)."""
    from triton.runtime import interpreter

    x, w = _inputs("cpu", torch.float32, M, N, K, seed=K)
    forward = skinny_linear_triton(x, w, cfg)
    assert torch.equal(forward, _split_order_sum(x, w, cfg))
    builder = interpreter.interpreter_builder
    set_grid_idx = builder.set_grid_idx
    order = []

    def backwards(x_: int, y: int, z: int) -> None:
        order.append(builder.grid_dim[1] - 1 - y)
        set_grid_idx(x_, builder.grid_dim[1] - 1 - y, z)

    monkeypatch.setattr(builder, "set_grid_idx", backwards)
    assert torch.equal(skinny_linear_triton(x, w, cfg), forward)
    assert order[-1] == 0 and order[0] == builder.grid_dim[1] - 1  # really ran backwards
    assert not _split_counters(torch.device("cpu"), side_stream=False).any()


def test_split_k_tile_limit(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A split-K launch with more column tiles than counters is refused before it runs."""
    import lfmspark.ops.linear.skinny_linear as sl

    monkeypatch.setattr(sl, "MAX_SPLIT_TILES", 3)
    x, w = _inputs(triton_device, torch.float32, 4, 64, 128)
    with pytest.raises(ValueError, match="4 column tiles: at most 3"):
        skinny_linear_triton(x, w, SkinnyConfig(block_n=16, block_k=32, split_k=2))
    _check(skinny_linear_triton(x, w, SkinnyConfig(block_n=16, block_k=32)), x, w)  # no split: no counters


# ---------------------------------------------------------------------------------------------
# swap-AB variant: out^T = weight tile @ x tile^T

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [2, 9, 10, 16, 33])
@pytest.mark.parametrize("N, K, cfg", [
    (100, 200, SkinnyConfig(block_n=64, block_k=64)),               # N and K tails, one split
    (130, 300, SkinnyConfig(block_n=128, block_k=64, split_k=3)),   # N tail, K tail in the last split
    # one K block per split, no pipelining: the whole weight slice is the pre-wait load (the
    # one-K-block-per-program 2048 x 2048 candidate of docs/decisions.md, scaled down)
    (100, 512, SkinnyConfig(block_n=16, block_k=256, split_k=2, num_stages=1)),
    (100, 512, SkinnyConfig(block_n=32, block_k=128, split_k=4, num_stages=1)),
], ids=["one_split", "split_k", "block_per_split_16", "block_per_split_32"])
def test_swap_ab_kernel_matches_reference(triton_device: str, dtype: torch.dtype, M: int, N: int, K: int,
                                          cfg: SkinnyConfig) -> None:
    x, w = _inputs(triton_device, dtype, M, N, K, seed=M + K)
    _check(skinny_linear_triton(x, w, cfg), x, w)


def test_swap_ab_heuristic_config_and_strided_x(triton_device: str) -> None:
    """The heuristic's own config (split-K at this size on the interpreter's 8 "SMs"), and ``x``
    as a column slice of a wider activation."""
    cfg = swap_ab_config(10, 200, 2048, 4, 8)
    assert not cfg.gemv and split_k_plan(2048, cfg.block_k, cfg.split_k)[1] > 1
    wide, w = _inputs(triton_device, torch.float32, 10, 200, 3 * 2048)
    x = wide[:, 2048:4096]
    _check(skinny_linear_triton(x, w[:, :2048].contiguous(), cfg), x, w[:, :2048])


@pytest.mark.parametrize("M", [2, 9, 10, 40, 64])
@pytest.mark.parametrize("N, K", [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (3072, 2048),
                                  (65536, 2048), (2048, 4096), (4096, 2048), (12288, 2048)])
def test_swap_ab_heuristic_on_132_sms(M: int, N: int, K: int) -> None:
    """The swap-AB heuristic at the served shapes on 132 SMs: wgmma-sized column tiles, the unmasked
    path, one warpgroup, 2-5 stages within 200 KB of shared memory, a split only when the column
    tiles give less than one program per SM and never past one wave, each split at least 4 K steps
    long and all of them non-empty."""
    cfg = swap_ab_config(M, N, K, 2, 132)
    assert not cfg.gemv and cfg.num_warps == 4 and 2 <= cfg.num_stages <= 5
    assert cfg.block_n in (64, 128) and 64 <= cfg.block_k <= 128 and K % cfg.block_k == 0
    block_m = max(16, 1 << (M - 1).bit_length())
    assert cfg.num_stages * (cfg.block_n + block_m) * cfg.block_k * 2 <= 200 * 1024
    n_blocks = -(-N // cfg.block_n)
    k_split, splits = split_k_plan(K, cfg.block_k, cfg.split_k)
    assert splits == cfg.split_k and (splits == 1 or n_blocks * splits <= 132)
    assert k_split // cfg.block_k >= 4


# the sweep's fastest swap-AB configs at M = 10 on 132 SMs, (block_n, block_k, split)
SWEEP_WINNERS_M10_132_SMS = {(2048, 2048): (64, 128, 4), (2048, 8192): (64, 128, 4),
                             (3072, 2048): (64, 128, 2), (16384, 2048): (64, 128, 1),
                             (65536, 2048): (128, 64, 1)}


@pytest.mark.parametrize("N, K", list(SWEEP_WINNERS_M10_132_SMS))
def test_swap_ab_heuristic_reproduces_the_sweep(N: int, K: int) -> None:
    cfg = swap_ab_config(10, N, K, 2, 132)
    assert (cfg.block_n, cfg.block_k, cfg.split_k) == SWEEP_WINNERS_M10_132_SMS[N, K]


@pytest.mark.parametrize("N, K, stages", [(6144, 2048, 5), (5120, 2048, 5), (16384, 2048, 3), (65536, 2048, 4),
                                           (2048, 8192, 5)])
def test_swap_ab_stages_follow_the_programs(N: int, K: int, stages: int) -> None:
    """At M = 10 on 132 SMs: unsplit launches with fewer column tiles than SMs (the 96-program
    in_proj, the 80-program context K/V) take 5 stages, as split ones do; a full wave keeps 3 (64-row
    tiles) or 4 (128-row tiles)."""
    cfg = swap_ab_config(10, N, K, 2, 132)
    assert cfg.num_stages == stages
    assert (cfg.split_k > 1 or -(-N // cfg.block_n) < 132) == (stages == 5)


@pytest.mark.parametrize("K, block_k, split_k, want", [
    (256, 64, 4, (64, 4)), (300, 64, 3, (128, 3)), (192, 64, 5, (64, 3)), (100, 64, 1, (128, 1)), (64, 64, 8, (64, 1)),
])
def test_split_k_plan(K: int, block_k: int, split_k: int, want: tuple[int, int]) -> None:
    assert split_k_plan(K, block_k, split_k) == want


def _sweep_module():
    """benchmarks/kernels/skinny_linear.py, a script (no package): loaded by path, with its folder
    on sys.path for its ``common`` helpers, as when it runs; importing it needs no GPU."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"
    spec = importlib.util.spec_from_file_location("_skinny_linear_bench", bench / "skinny_linear.py")
    module = importlib.util.module_from_spec(spec)
    had_common = "common" in sys.modules
    sys.path.insert(0, str(bench))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
        if not had_common:
            sys.modules.pop("common", None)  # a generic name: leave no trace for other tests
    return module


def test_benchmark_sweep_grid() -> None:
    """The sweep's schedule (pure Python): every grid config exactly once, grouped by compiled
    kernel, two swap-AB groups per GEMV one; and the per-case trimming."""
    bench = _sweep_module()
    swap, gemv = bench._swap_candidates(), bench._gemv_candidates()
    assert len(swap) == 2 * 3 * 4 * 3 * 2 and all(not c.gemv and c.block_n in (64, 128) for c in swap)
    order = bench._schedule((1, 10))
    timed = [c for _, group in order for c in group]
    assert sorted(map(repr, timed)) == sorted(map(repr, swap + gemv))
    for variant, group in order:
        assert len({bench._kernel_key(c) for c in group}) == 1
        assert all(c.gemv == (variant == "gemv") for c in group)
    assert [v for v, _ in order[:6]] == ["gemv", "swap_ab", "swap_ab"] * 2
    assert {v for v, _ in bench._schedule((10,))} == {"swap_ab"}
    # trimming at K = 2048 on 132 SMs
    applies = bench._applies
    cfg = SkinnyConfig(block_n=64, block_k=128, split_k=4, num_stages=4)
    assert applies(cfg, 10, 2048, 2048, 132) and not applies(cfg, 1, 2048, 2048, 132)
    assert not applies(cfg, 10, 65536, 2048, 132)             # 1024 column tiles: no split
    assert not applies(SkinnyConfig(block_n=64, block_k=256, split_k=8), 10, 2048, 1024, 132)  # 4 K steps
    big = SkinnyConfig(block_n=128, block_k=256, num_stages=4)
    assert not applies(big, 10, 2048, 2048, 132)               # 288 KB of pipeline
    assert applies(SkinnyConfig(block_n=128, block_k=256, num_stages=3), 10, 2048, 2048, 132)


def test_benchmark_sweep_runs_with_a_fake_timer(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The sweep's bookkeeping end to end without a GPU: no kernel runs, a fake timer favours
    swap-AB with 64-wide tiles and 4 splits; the summary must find that config and name it fully."""
    bench = _sweep_module()

    class Props:
        multi_processor_count = 132

    def fake_ms(fn, x, weights, iters=50):
        cfg = getattr(fn, "keywords", {}).get("config")  # skinny_linear_triton partials; cuBLAS: F.linear
        if cfg is None:
            return 0.010
        if cfg.block_n == 128 and cfg.block_k == 256 and cfg.num_stages == 3:
            raise RuntimeError("out of resource: shared memory\nmore")
        best = not cfg.gemv and (cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_stages, cfg.num_warps) == (64, 128, 4, 4, 4)
        return 0.005 if best else 0.008 + 0.0001 * cfg.num_stages

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: Props())
    monkeypatch.setattr(bench, "_weights", lambda N, K: [None])
    monkeypatch.setattr(bench, "_x", lambda M, K: None)
    monkeypatch.setattr(bench, "_per_product_ms", fake_ms)
    rows, summary = bench.sweep(4000.0, budget_s=60, rows_m=(10,), shapes=((2048, 2048), (65536, 2048)))
    assert [(s["M"], s["N"], s["K"]) for s in summary] == [(10, 2048, 2048), (10, 65536, 2048)]
    first = summary[0]
    assert first["best_swap_ab_us"] == 5.0 and first["cuBLAS_us"] == 10.0
    assert first["best_swap_ab_config"] == repr(SkinnyConfig(block_n=64, block_k=128, split_k=4, num_warps=4,
                                                             num_stages=4))
    assert first["swap_heuristic_config"] == repr(swap_ab_config(10, 2048, 2048, 2, 132))
    assert first["default_config"] == repr(skinny_config(10, 2048, 2048, 2, 132))
    assert first["best_gemv_us"] is None and first["timed_swap_ab"] > 50
    assert summary[1]["best_swap_ab_us"] > 5.0  # no split for 65536 columns: the favoured config is not run there
    assert any("error" in r and r["error"].startswith("RuntimeError: out of resource") for r in rows)
    bench.print_sweep(rows, summary)
    assert "swap bn64 bk128 sk4 w4 s4" in capsys.readouterr().out


def test_benchmark_swiglu_runs_with_a_fake_timer(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``--swiglu`` bookkeeping without a GPU: the served w13 shapes at 9 and 10 rows, the fused
    default and the two unfused pairs timed at every case, the grid limited to configs whose two
    weight tiles fit in shared memory, and the favoured config found and named."""
    from lfmspark.ops.linear.skinny_linear import swiglu_config

    bench = _sweep_module()

    class Props:
        multi_processor_count = 132

    favoured = SkinnyConfig(block_n=128, block_k=64, split_k=1, num_warps=4, num_stages=3)

    def fake_ms(fn, x, weights, iters=50):
        cfg = getattr(fn, "keywords", {}).get("config")  # the fused op's partials; the unfused pairs: lambdas
        if cfg is None:
            return 0.030
        return 0.020 if cfg == favoured else 0.025

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: Props())
    monkeypatch.setattr(bench, "_weights", lambda N, K: [None])
    monkeypatch.setattr(bench, "_x", lambda M, K: None)
    monkeypatch.setattr(bench, "_per_product_ms", fake_ms)
    rows, summary = bench.swiglu_bench(4000.0, act=lambda h: h, budget_s=60)
    assert [(s["M"], s["w13"]) for s in summary] == [(9, "[16384, 2048]"), (10, "[16384, 2048]"),
                                                    (9, "[14336, 2048]"), (10, "[14336, 2048]")]
    first = summary[0]
    assert (first["fused_default_us"], first["skinny_linear+act_us"], first["cuBLAS+act_us"]) == (25.0, 30.0, 30.0)
    assert first["fused_default_config"] == repr(swiglu_config(9, 8192, 2048, 2, 132))
    assert first["best_fused_us"] == 20.0 and first["best_fused_config"] == repr(favoured)
    grid = [r for r in rows if r["role"] == "candidate"]
    assert len(grid) > 50 and all(r["num_stages"] * (2 * r["block_n"] + 16) * r["block_k"] * 2 <= 227 * 1024
                                  for r in grid)
    bench.print_swiglu(rows, summary)
    assert "swap bn128 bk64 sk1 w4 s3" in capsys.readouterr().out
    _, no_grid = bench.swiglu_bench(4000.0, act=lambda h: h)     # without --sweep: the fixed rows only
    assert all(s["timed_fused"] == 1 for s in no_grid)


def test_strided_x(triton_device: str) -> None:
    """``x`` as a column slice of a wider activation (row stride > K), and as a transposed view
    (column stride != 1: made contiguous)."""
    wide, w = _inputs(triton_device, torch.float32, 10, 96, 3 * 64)
    _check(skinny_linear_triton(wide[:, 64:128], w[:, :64].contiguous()), wide[:, 64:128], w[:, :64])
    xt = torch.randn(64, 10, device=triton_device).T
    _check(skinny_linear_triton(xt, w[:, :64].contiguous()), xt, w[:, :64])


def test_empty_and_zero_k(triton_device: str) -> None:
    x, w = _inputs(triton_device, torch.float32, 0, 32, 64)
    assert skinny_linear_triton(x, w).shape == (0, 32)
    x, w = _inputs(triton_device, torch.float32, 4, 32, 0)
    assert torch.equal(skinny_linear_triton(x, w), torch.zeros(4, 32, device=triton_device))


def test_rejects_unsupported(triton_device: str) -> None:
    x, w = _inputs(triton_device, torch.float32, MAX_M + 1, 32, 64)
    with pytest.raises(ValueError, match=str(MAX_M)):
        skinny_linear_triton(x, w)
    with pytest.raises(ValueError, match=str(MAX_M)):
        torch.ops.lfmspark.skinny_linear(x, w)  # the op (reference path on CPU) has the same limit
    with pytest.raises(ValueError, match="row-major"):
        skinny_linear_triton(x[:8], w.T.contiguous().T)
    with pytest.raises(ValueError, match="dtype"):
        skinny_linear_triton(x[:8], w.double())


@pytest.mark.parametrize("M", [1, 9, 10, 18, 20, 36, 40, 64])
@pytest.mark.parametrize("N, K", [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (3072, 2048),
                                  (65536, 2048), (2048, 4096), (4096, 2048), (12288, 2048)])
def test_config_heuristic_on_132_sms(M: int, N: int, K: int) -> None:
    """At the served shapes on 132 SMs: the fast (unmasked) path, at least 1.5 programs per SM,
    a split only when N alone cannot supply them, and no more splits than K steps allow."""
    cfg = skinny_config(M, N, K, 2, 132)
    if M == 1:  # the GEMV kernel, its measured best config
        assert cfg.gemv and cfg.split_k == 1 and cfg.block_n == 4 and K % cfg.block_k == 0
        return
    assert cfg == swap_ab_config(M, N, K, 2, 132)  # several rows: the swap-AB kernel
    assert K % cfg.block_k == 0 and cfg.block_n in (64, 128)
    n_blocks, k_steps = -(-N // cfg.block_n), K // cfg.block_k
    assert cfg.split_k == 1 or (n_blocks < 132 and -(-k_steps // cfg.split_k) >= 4)


# ---------------------------------------------------------------------------------------------
# op registration, torch.compile

def _op_args() -> tuple[torch.Tensor, torch.Tensor]:
    return _inputs("cpu", torch.float32, 10, 48, 96)


def test_opcheck_reference() -> None:
    torch.library.opcheck(torch.ops.lfmspark.skinny_linear, _op_args())


def test_opcheck_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    torch.library.opcheck(torch.ops.lfmspark.skinny_linear, _op_args())


def test_torch_compile_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    interpret_triton(monkeypatch)
    x, w = _op_args()

    def project(x, w):
        return torch.ops.lfmspark.skinny_linear(x * 2, w).relu()

    torch._dynamo.reset()
    compiled = torch.compile(project, fullgraph=True)
    eager = project(x, w)
    torch.testing.assert_close(compiled(x, w), eager, rtol=0, atol=0)
    torch.testing.assert_close(eager, skinny_linear_reference(x * 2, w).relu(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# CUDA: the served shapes (LFM2.5-1.2B target and its draft), default heuristic

@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 9, 10, 40, 64])
@pytest.mark.parametrize("N, K", [(6144, 2048), (2048, 8192), (3072, 2048), (65536, 2048), (2048, 4096)])
def test_gpu_served_shapes(M: int, N: int, K: int) -> None:
    x, w = _inputs("cuda", torch.bfloat16, M, N, K, seed=M)
    _check(torch.ops.lfmspark.skinny_linear(x, w), x, w)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_input() -> None:
    x, w = _inputs("cuda", torch.bfloat16, 10, 2048, 8192)   # the split-K path
    assert skinny_config(10, 2048, 8192, 2, torch.cuda.get_device_properties(0).multi_processor_count).split_k > 1
    torch.ops.lfmspark.skinny_linear(x, w)                    # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.lfmspark.skinny_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    _check(out, x, w)
    first = out.clone()
    graph.replay()
    assert torch.equal(out, first)  # deterministic run to run


@pytest.mark.gpu
def test_gpu_split_k_fixup_is_bit_exact_under_load() -> None:
    """Many split-K launches back to back in one CUDA graph (PDL on where supported): the programs
    of a tile arrive in varying orders, the result stays the split-order sum, and the counters end
    all zero."""
    x, w = _inputs("cuda", torch.float32, 10, 2048, 8192)
    cfg = SkinnyConfig(block_n=64, block_k=128, split_k=8, num_stages=3)
    want = _split_order_sum(x, w, cfg)
    torch.testing.assert_close(want, skinny_linear_reference(x, w), rtol=1e-4, atol=1e-4)
    skinny_linear_triton(x, w, cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [skinny_linear_triton(x, w, cfg) for _ in range(16)]
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(out, want) for out in outs)
    assert not _split_counters(x.device, side_stream=False).any()


@pytest.mark.gpu
def test_gpu_split_k_chain_with_pdl_is_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dependent split-K launches back to back, each reading its predecessor's output and all
    sharing the arrival counters (10-row products, the SwiGLU op, a split GEMV), replayed from a
    CUDA graph with PDL: bit-identical to the same chain run without PDL."""
    from lfmspark.ops.linear.skinny_linear import skinny_swiglu_triton, swiglu_config

    g = torch.Generator(device="cuda").manual_seed(0)
    K = 2048

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16) / shape[-1] ** 0.5

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert swap_ab_config(10, K, K, 2, sms).split_k > 1 and swiglu_config(10, K, K, 2, sms).split_k > 1
    x, squares, w13, w_row = rand(10, K) * K ** 0.5, [rand(K, K) for _ in range(8)], rand(2 * K, K), rand(K, K)
    gemv_split = SkinnyConfig(block_n=4, block_k=256, split_k=4, gemv=True)

    def chain() -> tuple[torch.Tensor, torch.Tensor]:
        h = x
        for w in squares:
            h = skinny_linear_triton(h, w)
        h = skinny_swiglu_triton(h, w13)                     # [10, K]
        return h, skinny_linear_triton(h[:1], w_row, gemv_split)

    set_env(monkeypatch, PDL="0")
    want = chain()
    set_env(monkeypatch, PDL="1")
    chain()                                                   # compile the PDL variants outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    assert want[1].abs().max() > 0.01                          # no decay to zeros (which would hide a race)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not _split_counters(x.device, side_stream=False).any()


@pytest.mark.gpu
def test_gpu_split_k_on_two_concurrent_streams_with_their_own_counters() -> None:
    """Split-K chains on two streams at once, captured as a fork and a join in one CUDA graph (the
    round's context injection beside the verify): with the side stream's launches on counter set 1,
    both chains stay bit-exact replay after replay and every counter ends at zero."""
    x, w = _inputs("cuda", torch.float32, 10, 2048, 8192)
    cfg = SkinnyConfig(block_n=64, block_k=128, split_k=8, num_stages=3)
    want = _split_order_sum(x, w, cfg)
    side = torch.cuda.Stream()

    def both() -> list[torch.Tensor]:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            outs = [skinny_linear_triton(x, w, cfg, side_stream=True) for _ in range(8)]
        outs += [skinny_linear_triton(x, w, cfg) for _ in range(8)]
        main.wait_stream(side)
        return outs

    both()                                                     # creates set 1 outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = both()
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(out, want) for out in outs)
    assert not _counter_buffer(x.device, 0).any() and not _counter_buffer(x.device, 1).any()


@pytest.mark.gpu
def test_gpu_counters_are_not_created_during_capture() -> None:
    """Creating the counters (a zero fill) cannot be captured: it raises, naming the fix."""
    x, w = _inputs("cuda", torch.float32, 4, 64, 64)
    skinny_linear_triton(x, w)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(graph):
            _counter_buffer.__wrapped__(x.device, 0)  # the uncached body: what a first use would run
