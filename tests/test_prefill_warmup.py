"""The engine's prefill warm-up: after ``Engine.warmup()``, no prompt shape compiles a kernel.

A Triton variant compiled by a first request cost it 0.3-0.6 s of TTFT on the H200
(docs/benchmarks.md, "TTFT"). The CPU tests check the shape list against the attention's launch
plan; the GPU test checks the property itself: prompts of new shapes compile nothing.
"""

from __future__ import annotations

import pytest
import torch

from lfmspark.ops.cache_attention import plan_launch
from lfmspark.runtime import Engine, SamplingParams
from lfmspark.runtime.engine import prefill_warm_shapes

# (n_heads, n_kv, head_dim): LFM2.5-1.2B / LFM2-8B-A1B, a group of 3, a long head
_ATTENTION = [(32, 8, 64), (24, 8, 64), (16, 4, 128)]


@pytest.mark.parametrize("heads", _ATTENTION, ids=lambda h: "x".join(map(str, h)))
@pytest.mark.parametrize("sms", [132, 78])
@pytest.mark.parametrize("max_batch,cache_len", [(1, 4096), (4, 300), (16, 1024)])
def test_every_prefill_shape_uses_an_attention_variant_the_warmup_compiled(heads, sms, max_batch, cache_len):
    n_heads, n_kv, hd = heads
    longest = min(2048, cache_len)

    def variant(rows: int, length: int):
        return plan_launch(rows, length, n_heads, n_kv, hd, cache_len, 2, sms).variant

    shapes = prefill_warm_shapes(max_batch, longest, variant)
    warmed = {variant(r, n) for r, n in shapes}
    for rows in range(1, max_batch + 1):
        for length in range(1, longest + 1, 7 if max_batch > 4 else 1):
            assert variant(rows, length) in warmed, (rows, length)


def test_warm_shapes_cover_row_counts_and_length_classes_and_fit_the_cache():
    shapes = prefill_warm_shapes(6, 40, None)
    assert {r for r, n in shapes if n == 16} == set(range(1, 7))       # LM head / argmax row tiles
    assert (1, 1) in shapes and (1, 17) in shapes                      # Triton's "== 1" / "% 16" classes
    assert len(shapes) == len(set(shapes))
    assert all(n <= 12 for _, n in prefill_warm_shapes(3, 12, lambda r, n: (r > 1, n > 5)))


def test_cpu_engine_warms_one_short_prefill():
    engine = Engine.from_preset("tiny", None, dtype=torch.float32, device="cpu", max_batch=3, max_seq_len=64)
    assert engine.prefill_warm_shapes() == [(1, 16)]
    engine.warmup(progress=False, sampling=True)       # runs them (greedy and sampling) without error
    assert engine.pool.in_use == 0


@pytest.mark.gpu
def test_after_warmup_new_prompt_shapes_compile_no_triton_kernel():
    import triton

    from test_graphs_gpu import small_models

    target, draft = small_models(dtype=torch.bfloat16)
    engine = Engine(target, draft, max_batch=4, max_seq_len=320, batch_sizes=[1, 2, 4], stop_token_ids=())
    engine.warmup(progress=False, sampling=True)
    compiled: list[str] = []

    def record(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        compiled.append(repr)
        return None

    triton.knobs.runtime.jit_cache_hook = record
    try:
        for rows, length in [(1, 3), (1, 40), (3, 100), (4, 7), (2, 200), (1, 250), (4, 130)]:
            prompts = [[(5 * i + 3 * j) % 500 + 1 for j in range(length)] for i in range(rows)]
            params = SamplingParams(max_new_tokens=3, temperature=0.7 if rows == 3 else 0.0, seed=1)
            engine.generate(prompts, params)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert compiled == []
