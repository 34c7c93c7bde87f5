"""benchmarks/kernels/grid_barrier.py (the barrier-against-hand-off probe, a script): its checks, under
the interpreter on CPU (on CUDA when present, where the barrier runs with one program per SM). The
timing runs on the H200 only."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels" / "grid_barrier.py"


@pytest.fixture(scope="module")
def probe():
    # loaded by path (benchmarks/ is no package); its `common` import resolves next to it
    sys.path.insert(0, str(PROBE.parent))
    spec = importlib.util.spec_from_file_location("_grid_barrier_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(PROBE.parent))


def test_barrier_rounds_read_every_value(probe, triton_device: str) -> None:
    """Every round's read-back sees every program's value of that round (one program in the interpreter)."""
    P = torch.cuda.get_device_properties(0).multi_processor_count if triton_device == "cuda" else 1
    assert probe.run_barrier(P, 6, torch.device(triton_device))[1] == 0


@pytest.mark.parametrize("pdl", [False, True] if torch.cuda.is_available() else [False])
def test_chained_launches_read_their_predecessor(probe, triton_device: str, pdl: bool) -> None:
    assert probe.run_launches(3, 6, pdl, torch.device(triton_device))[1] == 0


def test_a_launch_without_its_predecessor_is_counted_wrong(probe, triton_device: str) -> None:
    """The check can fail: launch 1 alone finds none of launch 0's three values, in each of three programs."""
    buf = torch.zeros(8, dtype=torch.int32, device=triton_device)
    bad = torch.zeros(1, dtype=torch.int32, device=triton_device)
    probe._phase_kernel[(3,)](buf, bad, 3, 1, BLOCK_P=4, PDL=False)
    assert bad.item() == 9
