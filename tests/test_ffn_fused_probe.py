"""benchmarks/kernels/ffn_fused_probe.py (the one-launch feed-forward probe, a script): its check on tiny
shapes, under the interpreter on CPU (on CUDA when present). The timing runs on the H200 only."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels" / "ffn_fused_probe.py"


@pytest.fixture(scope="module")
def probe():
    # loaded by path (benchmarks/ is no package); registered while it runs, as its dataclasses need
    spec = importlib.util.spec_from_file_location("_ffn_fused_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("shape, cfg", [
    ((10, 128, 256), (64, 64, 64, 1)),   # P = 4 programs, 2 column tiles: one counter bump per tile
    ((16, 128, 256), (64, 32, 64, 4)),   # grouped bumps (4 tiles per atomic round trip)
    ((3, 128, 192), (64, 16, 32, 2)),    # P = 3 (not a power of two), fewer programs than tiles
    ((10, 128, 128), (64, 32, 64, 2, 0)),  # no w2 prefetch
])
def test_fused_matches_reference(probe, triton_device: str, shape, cfg) -> None:
    rows = probe.check(triton_device, [shape], probe.FusedConfig(*cfg), log=lambda _: None)
    assert rows[0]["max_abs_diff"] <= 2e-2 * max(1.0, rows[0]["max_abs_ref"])


def test_counters_left_zero_and_deterministic(probe, triton_device: str) -> None:
    """Two launches on one set of buffers: the second finds the counters at zero (else no program would
    see itself last and the output would stay unwritten) and gives the same bits."""
    cfg = probe.FusedConfig(64, 64, 64, 1)
    M, H, F = 4, 128, 128
    x, w13, w2 = probe.grid_layer(M, H, F, triton_device, torch.Generator(device=triton_device).manual_seed(3))
    buf = probe.make_buffers(M, H, F, cfg, triton_device)
    first = probe.ffn_fused(x, w13, w2, cfg, buf)
    second = probe.ffn_fused(x, w13, w2, cfg, buf)
    assert torch.equal(first, second)
    assert not buf.counters.any()


def test_shape_contract(probe) -> None:
    with pytest.raises(ValueError):
        probe.make_buffers(10, 128, 200, probe.FusedConfig(), "cpu")  # F not a multiple of block_f


def test_check_cli(probe) -> None:
    assert probe.main(["--check"]) == 0
