"""graphs/compile.py: one symbolic graph per region serves every batch size of two or more.

Counted on CPU with Dynamo's graphs only (``backend="eager"``: what is compiled, not how). The
routes the GPU takes are forced by patching ``routing.product_kernels`` (as tests/models/test_norm_carry.py
does) to the tiny preset's version of the served shapes: the batch-1 round's draft block (4 rows) and
verify window (5 rows) run the few-row routes, whose layers hand on a ``NormedCarry``; every larger
batch runs the modules, whose layers hand on a plain pending tensor, an input the regions never saw at
batch 1.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import lfmspark.graphs.compile as compile_module
from lfmspark.graphs.compile import BatchDynamic, lasting_storages
from lfmspark.graphs.runner import StepKind
from lfmspark.models.dspark import DraftLayer
from lfmspark.models.layers import NormedCarry
from lfmspark.models.lfm2 import Lfm2DecoderLayer
from lfmspark.ops import routing
from lfmspark.runtime import Engine
from lfmspark.runtime.distributions import SamplingMode
from lfmspark.runtime.steps import Steps


@pytest.mark.slow
def test_regions_compile_once_for_every_size_above_one(monkeypatch):
    """Whole-block greedy rounds in the capture's order (graphs/capture.py: the smallest size, the
    largest, then the rest largest first): batch 1 and the largest size compile each region once
    for each (a layer once per kind), and three more sizes compile nothing. Without the batch marks
    (graphs/compile.py ``BatchDynamic``) the largest size compiled the regions whose pending input
    changes type after batch 1 with the batch fixed, and the next size compiled them again."""
    monkeypatch.setattr(compile_module, "COMPILE_OPTIONS", dict(compile_module.COMPILE_OPTIONS, backend="eager"))
    monkeypatch.setattr(routing, "product_kernels", lambda x: 1 <= routing.rows_of(x) <= 5)
    torch._dynamo.reset()
    engine = Engine.from_preset("tiny", "tiny-dspark", dtype=torch.float32, device="cpu", max_batch=8,
                                max_seq_len=64, compile=True)
    codes = {name: getattr(Steps, name).__code__ for name in engine.model_runner.steps.region_names()}
    codes |= {"target layer": Lfm2DecoderLayer.forward.__code__, "draft layer": DraftLayer.forward.__code__}

    def graphs_after(sizes: tuple[int, ...]) -> dict[str, int]:
        for size in sizes:
            with engine.model_runner.numerics():
                engine.model_runner.step_runner.run(StepKind.ROUND, [-1] * size, SamplingMode.GREEDY,
                                                    engine.verify_width)
        return {name: len(_debug_get_cache_entry_list(code)) for name, code in codes.items()}

    try:
        two = graphs_after((1, 8))
        assert two["draft layer"] == 2 and two["target layer"] == 4 and two["round_accept_commit"] == 2
        assert graphs_after((7, 6, 5)) == two
    finally:
        torch._dynamo.reset()


def test_batch_marks_rows_and_leaves_weights_and_caches(monkeypatch):
    """The marked tensors are the call's row-indexed ones (through dataclasses and tuples), at a batch
    of the hidden size and the slot count (64 each), so that a weight ``[64]`` and the page table
    ``[64 slots, pages]`` have it too and stay unmarked; a batch-1 call marks nothing."""
    engine = Engine.from_preset("tiny", "tiny-dspark", dtype=torch.float32, device="cpu", max_batch=64,
                                max_seq_len=64)
    steps = engine.model_runner.steps
    weight, table = steps.target.model.embedding_norm.weight, steps.tcache.page_table
    assert weight.shape[0] == table.shape[0] == 64
    marked: list[int] = []
    monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda t, dim: marked.append(id(t)))

    def region(x: torch.Tensor, delta: NormedCarry, weight: torch.Tensor, cache: tuple[torch.Tensor, ...],
               rows) -> None:
        """A region's signature: rows' slots in a dataclass, a carry, a weight and cache slices."""

    wrapped = BatchDynamic(lambda *args, **kwargs: None, region, lasting_storages(steps))
    rows = steps.target.begin(torch.zeros(64, 1, dtype=torch.int64), steps.tcache.rope,
                              torch.full((64,), -1), torch.zeros(64, dtype=torch.int64)).rows
    x, carry = torch.zeros(64, 5, 64), NormedCarry(torch.zeros(64, 64), torch.zeros(1, 64))
    wrapped(x, carry, weight, (steps.tcache.k[:1], table), rows)
    assert set(marked) == {id(x), id(carry.scaled), id(rows.slots), id(rows.start), id(rows.lens)}
    marked.clear()
    one = steps.target.begin(torch.zeros(1, 1, dtype=torch.int64), steps.tcache.rope, torch.full((1,), -1),
                             torch.zeros(1, dtype=torch.int64)).rows
    wrapped(torch.zeros(1, 5, 64), None, weight, (table,), rows=one)
    assert marked == []


def round_graphs(widths: tuple[int, ...], sizes: tuple[int, ...]) -> dict[str, int]:
    """Dynamo graphs per region (and per layer kind) after greedy rounds at each of ``widths`` (widest
    first) and ``sizes`` (in that order: the capture's), in a fresh Dynamo."""
    torch._dynamo.reset()
    engine = Engine.from_preset("tiny", "tiny-dspark", dtype=torch.float32, device="cpu", max_batch=max(sizes),
                                max_seq_len=64, compile=True, verify_widths=list(widths))
    codes = {name: getattr(Steps, name).__code__ for name in engine.model_runner.steps.region_names()}
    codes |= {"target layer": Lfm2DecoderLayer.forward.__code__, "draft layer": DraftLayer.forward.__code__}
    for width in reversed(widths):
        for size in sizes:
            with engine.model_runner.numerics():
                engine.model_runner.step_runner.run(StepKind.ROUND, [-1] * size, SamplingMode.GREEDY, width)
    return {name: len(_debug_get_cache_entry_list(code)) for name, code in codes.items()}


@pytest.mark.slow
def test_more_verify_widths_compile_no_more_graphs(monkeypatch):
    """Rounds at widths 3 and 4 besides 1 and the whole block (tiny: 5) compile no graph more in any
    region or layer (the width is a shape their graphs share: runtime/steps.py ``RoundInputs``),
    except the draft's tail: one narrow variant for both (the first slots of the block, sliced;
    the whole block's rows pass as they are: models/dspark.py ``block_prefix``), at batch 1 and
    above. With the width a Python int, the verify's and the commit's regions and the target
    layers compiled again at the second width of two or more."""
    monkeypatch.setattr(compile_module, "COMPILE_OPTIONS", dict(compile_module.COMPILE_OPTIONS, backend="eager"))
    monkeypatch.setattr(routing, "product_kernels", lambda x: 1 <= routing.rows_of(x) <= 5)
    sizes = (1, 8, 6)
    try:
        two, four = round_graphs((1, 5), sizes), round_graphs((1, 3, 4, 5), sizes)
    finally:
        torch._dynamo.reset()
    tail = "finish_draft"
    assert {k: v for k, v in four.items() if k != tail} == {k: v for k, v in two.items() if k != tail}
    assert two[tail] == 2 and four[tail] == 4
    assert four["verify_head"] > 0 and four["target layer"] > 0
