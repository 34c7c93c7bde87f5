"""Prefill graphs (graphs/prefill.py) on the GPU: a bucket's graph replay computes exactly what the
eager forward computes at the same padded shape (logits, target caches, conv states, draft
context), dense and MoE, for a first chunk and a continued one; and an engine's warm-up captures
them and serves prompts from them.
"""

from __future__ import annotations

import pytest
import torch

from lfmspark.runtime import Engine, SamplingParams

from test_graphs_gpu import small_models

pytestmark = pytest.mark.gpu


def _cache_tensors(engine: Engine) -> dict[str, torch.Tensor]:
    tc, dc = engine.model_runner.tcache, engine.model_runner.dcache
    return {"k": tc.k, "v": tc.v, "conv": tc.conv_state, "draft_k": dc.k, "draft_v": dc.v}


def _snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in _cache_tensors(engine).items()}


def _restore(engine: Engine, saved: dict[str, torch.Tensor]) -> None:
    for name, t in _cache_tensors(engine).items():
        t.copy_(saved[name])


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_bucket_graph_replays_the_eager_forward_bit_for_bit(moe, dtype):
    target, draft = small_models(moe=moe, dtype=dtype)
    engine = Engine(target, draft, max_batch=4, max_seq_len=320, batch_sizes=[1, 4], stop_token_ids=(),
                    prefill_graph_tokens=1024)
    runner = engine.model_runner.prefill_runner
    runner.warmup(progress=False, capture=True)
    assert set(runner.captured) == set(runner.buckets)
    chunks = [[(5 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((70, 3, 41))]
    slots, shape = [2, 0, 1], (4, 128)

    def eager(start: int) -> torch.Tensor:
        return runner.forward(*runner._unpack(runner._pack(chunks, slots, [start] * 3, shape).cuda(), shape))[:3]

    for t in _cache_tensors(engine).values():
        t.zero_()
    for start in (0, 70):             # a first chunk, then one that continues from the state it left
        before = _snapshot(engine)
        expected = eager(start).clone()
        expected_caches = _snapshot(engine)
        _restore(engine, before)
        assert runner.bucket(3, 70, start) == shape
        replayed = runner.run(chunks, slots, [start] * 3).clone()
        torch.cuda.synchronize()
        assert torch.equal(replayed, expected)
        for name, t in _cache_tensors(engine).items():
            assert torch.equal(t, expected_caches[name]), name
        assert not engine.model_runner.tcache.k[:, 3].any() and not engine.model_runner.tcache.conv_state[:, 3].any()  # the padding row


def test_a_warmed_engine_serves_prompts_from_its_prefill_graphs(monkeypatch):
    target, draft = small_models(dtype=torch.bfloat16)
    engine = Engine(target, draft, max_batch=2, max_seq_len=320, batch_sizes=[1, 2], stop_token_ids=(),
                    prefill_graph_tokens=1024)
    engine.warmup(progress=False, sampling=False)
    runner = engine.model_runner.prefill_runner
    assert set(runner.captured) == set(runner.buckets)
    replayed = []
    original = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: replayed.append(g) or original(g))
    outs = engine.generate([[3, 1, 4, 1, 5], [9] * 30], SamplingParams(max_new_tokens=4))
    assert [len(o.token_ids) for o in outs] == [4, 4]
    prefill_graphs = [graph for graph, _ in runner._graphs.values()]
    assert [g for g in replayed if any(g is p for p in prefill_graphs)] == [runner._graphs[(2, 32)][0]]
