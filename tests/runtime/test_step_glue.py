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
from lfmspark.runtime import Engine
from lfmspark.runtime.distributions import SamplingMode

# Eager compute ops a compiled step may run between its regions, with the reason for each. Empty:
# the per-layer cache slices taken between regions are views (``aten.slice`` / ``aten.select``),
# which launch no kernel, and the recorder files them under ``free``.
ALLOWED: dict[str, str] = {}


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The draft's context injection is a region of its own (runtime/steps.py ``round_inject``), and on
    CUDA the glue around it forks and joins a side stream (no tensor op either). Dynamo's state is reset
    first: its memory of which values varied between calls is per function and process-wide, and an
    earlier test's engines (tests/runtime/test_context_injection.py's, whose drafts' float settings differ)
    made it compile ``draft_head`` with a symbolic float, which the glue then wraps as a tensor each
    call (``aten.lift_fresh``, torch's ``_as_tensor_fullprec``). An engine in a fresh process, as
    served, starts from nothing."""
    torch._dynamo.reset()
    return Engine.from_preset("tiny", "tiny-dspark", dtype=torch.float32, device="cpu", max_batch=1, max_seq_len=64,
                              compile=True)


def _count(step):
    slots = torch.tensor([-1])                 # a padding row: the step changes no request's state
    with torch.no_grad():
        step(slots, SamplingMode.GREEDY)       # compiles (outside the recorder)
    return eager_ops(step, slots, SamplingMode.GREEDY)


@pytest.mark.parametrize("step", ["decode", "spec_round"])
def test_compiled_step_runs_no_eager_compute_between_regions(engine, step):
    ops = _count(getattr(engine.model_runner.steps, step))
    unexpected = {op: n for op, n in ops.compute.items() if op not in ALLOWED}
    assert not unexpected, ops.table()
    # the regions did run, and their ops were told apart as compiled code
    attention = "qkv_window_attention"   # the tiny models' decode and verify windows fit one tile
    assert ops.inside[f"lfmspark.{attention}.default"] > 0 and ops.inside["aten.mm.out"] > 0
    assert set(ops.free) <= {"aten.slice.Tensor", "aten.select.int"}


def test_every_declared_region_is_compiled(engine):
    """The regions runtime/steps.py declares (``@region``) are what compile_regions compiled."""
    names = set(engine.model_runner.steps.region_names())
    assert names == {"decode_head", "finish_decode", "draft_head", "finish_draft", "verify_head", "round_inject",
                     "round_accept_commit"}
    assert all(hasattr(getattr(engine.model_runner.steps, name), "_torchdynamo_orig_callable") for name in names)
    target_only = Engine.from_preset("tiny", None, dtype=torch.float32, device="cpu", max_batch=1, max_seq_len=64)
    assert set(target_only.model_runner.steps.region_names()) == {"decode_head", "finish_decode"}


def test_recorder_counts_glue_of_an_uncompiled_step():
    """The recorder is not blind: run uncompiled, the decode step's every op is eager (the
    embedding lookup, the per-slot gathers, the layers' GEMMs and lfmspark ops)."""
    plain = Engine.from_preset("tiny", None, dtype=torch.float32, device="cpu", max_batch=1, max_seq_len=64)
    ops = eager_ops(plain.model_runner.steps.decode, torch.tensor([-1]), SamplingMode.GREEDY)
    assert not ops.inside
    attention = "qkv_window_attention"
    for op in ("aten.embedding.default", "aten.index.Tensor", "aten.mm.default", f"lfmspark.{attention}.default"):
        assert ops.compute[op] > 0, ops.table()
