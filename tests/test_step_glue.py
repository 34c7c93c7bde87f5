"""No tensor computation between the compiled regions of a step (graphs/compile.py, runtime/steps.py).

A captured step runs every op between two compiled regions as a CUDA-graph kernel node of its own,
launched without programmatic dependent launch, so it cuts the PDL chain of the compiled kernels
and costs its full launch latency (ops/_dispatch.py). Counted on CPU with the dispatch-level
recorder of tests/eager_ops.py: the compiled decode step and greedy round must run no eager compute
op outside their regions beyond :data:`ALLOWED`. Before the step heads existed the counter found 9
such ops in the decode step (clamp, index, ones_like, arange, add, embedding, ...) and 19 in the
round (the same plus the verify's and the draft's cat / full / full_like).
"""

from __future__ import annotations

import pytest
import torch

from eager_ops import eager_ops
from lfmspark.ops.window_attention import window_attention_requested
from lfmspark.runtime import Engine

# Eager compute ops a compiled step may run between its regions, with the reason for each. Empty:
# the per-layer cache slices taken between regions are views (``aten.slice`` / ``aten.select``),
# which launch no kernel, and the recorder files them under ``free``.
ALLOWED: dict[str, str] = {}


@pytest.fixture(scope="module")
def engine() -> Engine:
    """With ``LFMSPARK_COMMIT_OVERLAP=0``: the context injection inside the commit region."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("LFMSPARK_COMMIT_OVERLAP", "0")
        return Engine.from_preset("tiny", "tiny-dspark", dtype=torch.float32, device="cpu", max_batch=1,
                                  max_seq_len=64, compile=True)


@pytest.fixture(scope="module")
def overlap_engine() -> Engine:
    """With ``LFMSPARK_COMMIT_OVERLAP=1`` (the default): the context injection is a region of its own, and on CUDA
    the glue between it and the commit forks and joins a side stream (no tensor op either)."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("LFMSPARK_COMMIT_OVERLAP", "1")
        return Engine.from_preset("tiny", "tiny-dspark", dtype=torch.float32, device="cpu", max_batch=1,
                                  max_seq_len=64, compile=True)


def _count(step, sampling: bool = False):
    slots = torch.tensor([-1])                 # a padding row: the step changes no request's state
    with torch.no_grad():
        step(slots, sampling)                  # compiles (outside the recorder)
    return eager_ops(step, slots, sampling)


@pytest.mark.parametrize("step", ["decode", "spec_round"])
def test_compiled_step_runs_no_eager_compute_between_regions(engine, step):
    ops = _count(getattr(engine.steps, step))
    unexpected = {op: n for op, n in ops.compute.items() if op not in ALLOWED}
    assert not unexpected, ops.table()
    # the regions did run, and their ops were told apart as compiled code
    attention = "qkv_window_attention" if window_attention_requested() else "cache_attention"
    assert ops.inside[f"lfmspark.{attention}.default"] > 0 and ops.inside["aten.mm.out"] > 0
    assert set(ops.free) <= {"aten.slice.Tensor", "aten.select.int"}


def test_overlapped_commit_runs_no_eager_compute_between_regions(engine, overlap_engine):
    assert overlap_engine.steps.commit_overlap and not engine.steps.commit_overlap
    ops = _count(overlap_engine.steps.spec_round)
    unexpected = {op: n for op, n in ops.compute.items() if op not in ALLOWED}
    assert not unexpected, ops.table()
    # the K/V writes (the injection's and, on CPU, each draft layer's) ran compiled, as in the plain round
    write = "lfmspark.kv_norm_rope_write.default"
    assert ops.inside[write] == _count(engine.steps.spec_round).inside[write] > 0
    assert set(ops.free) <= {"aten.slice.Tensor", "aten.select.int"}


def test_recorder_counts_glue_of_an_uncompiled_step():
    """The recorder is not blind: run uncompiled, the decode step's every op is eager (the
    embedding lookup, the per-slot gathers, the layers' GEMMs and lfmspark ops)."""
    plain = Engine.from_preset("tiny", None, dtype=torch.float32, device="cpu", max_batch=1, max_seq_len=64)
    ops = eager_ops(plain.steps.decode, torch.tensor([-1]), False)
    assert not ops.inside
    attention = "qkv_window_attention" if window_attention_requested() else "qkv_norm_rope_write"
    for op in ("aten.embedding.default", "aten.index.Tensor", "aten.mm.default", f"lfmspark.{attention}.default"):
        assert ops.compute[op] > 0, ops.table()
