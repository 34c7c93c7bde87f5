"""AsyncEngine: streams equal the synchronous engine's outputs whatever the concurrency,
abort / disconnect / deadline / overflow / shutdown each end what they should and leak nothing, a
fault in one request leaves the others' tokens alone, and a device failure reaches every waiter."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from lfmspark.runtime import Engine, EngineDeadError, RequestError, SamplingParams
from lfmspark.runtime.async_engine import AsyncEngine, EngineShutdownError, QueueFullError


def make(target, draft=None, max_batch: int = 4) -> Engine:
    return Engine(target, draft, max_batch=max_batch, max_seq_len=128)


def params(i: int, n: int = 12) -> SamplingParams:
    """Mixed greedy and seeded sampling."""
    if i % 3 == 0:
        return SamplingParams(max_new_tokens=n, ignore_eos=True)
    return SamplingParams(max_new_tokens=n, temperature=0.8, top_k=(i % 2) * 6, top_p=0.9, seed=i, ignore_eos=True)


PROMPTS = [[(5 * i + j) % 60 + 1 for j in range(1 + i % 5)] for i in range(12)]


def solo(target, draft, prompts=PROMPTS, n: int = 12) -> list[list[int]]:
    e = make(target, draft, max_batch=1)
    return [e.generate([p], params(i, n))[0].token_ids for i, p in enumerate(prompts)]


async def collect(ae: AsyncEngine, prompt, p, **kw):
    tokens, last = [], None
    async for ev in ae.generate(prompt, p, **kw):
        tokens += ev.token_ids
        last = ev
    return tokens, last.output


def run(coro, timeout: float = 120):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)       # a hung waiter fails the test instead of CI
    return asyncio.run(bounded())


def assert_clean(ae: AsyncEngine) -> None:
    """No slot, stream or waiting request left; the engine thread collects a trailing round (launched
    before its last request finished) on its own, so idleness may take one more step."""
    assert ae.engine.scheduler.pool.in_use == 0 and ae.num_open_streams == 0 and ae.num_waiting == 0
    deadline = time.monotonic() + 5
    while not ae.engine.idle:
        assert time.monotonic() < deadline, "the engine thread left a round in flight"
        time.sleep(0.001)


@pytest.mark.parametrize("spec", [False, True], ids=["target-only", "speculative"])
def test_concurrent_streams_equal_their_solo_runs(target, draft, spec):
    d = draft if spec else None
    ref = solo(target, d)

    async def main():
        ae = AsyncEngine(make(target, d))
        results = await asyncio.gather(*(collect(ae, p, params(i)) for i, p in enumerate(PROMPTS)))
        for (tokens, out), want in zip(results, ref):
            assert tokens == out.token_ids == want and out.finish_reason == "length"
        assert_clean(ae)
        await ae.shutdown()

    run(main())


def test_submission_from_several_threads_and_event_loops(target, draft):
    ref = solo(target, draft)
    ae = AsyncEngine(make(target, draft))
    got: dict[int, list[int]] = {}

    def client(indices):
        async def main():
            outs = await asyncio.gather(*(collect(ae, PROMPTS[i], params(i)) for i in indices))
            for i, (tokens, _) in zip(indices, outs):
                got[i] = tokens
        run(main())

    threads = [threading.Thread(target=client, args=(list(range(k, 12, 3)),)) for k in range(3)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert [got[i] for i in range(12)] == ref
    assert_clean(ae)
    run(ae.shutdown())


def test_abort_by_id_and_leaving_the_stream_free_the_slot_within_a_round(target, draft):
    async def main():
        ae = AsyncEngine(make(target, draft, max_batch=2))
        long = SamplingParams(max_new_tokens=100, ignore_eos=True)
        stream = ae.generate([1, 2, 3], long, request_id="a")
        first = await stream.__anext__()
        assert first.request_id == "a" and ae.engine.scheduler.pool.in_use == 1
        await ae.abort("a")
        rest = [ev async for ev in stream]
        assert rest[-1].finished and rest[-1].output.finish_reason == "cancelled"
        assert len(first.token_ids) + sum(len(ev.token_ids) for ev in rest) < 100
        assert ae.engine.scheduler.pool.in_use == 0

        async for _ in ae.generate([4, 5], long, request_id="b"):       # a client that walks away
            break
        await asyncio.sleep(0)
        # the next request is admitted beside a fresh one: both slots were freed
        outs = await asyncio.gather(collect(ae, [6], params(0, 5)), collect(ae, [7], params(0, 5)))
        assert all(out.finish_reason == "length" for _, out in outs)
        assert_clean(ae)
        await ae.abort("never-existed")                                  # ignored
        await ae.shutdown()

    run(main())


def test_a_deadline_ends_the_stream_with_timeout(target, draft):
    async def main():
        ae = AsyncEngine(make(target, draft))
        p = SamplingParams(max_new_tokens=110, ignore_eos=True, timeout_s=0.05)
        real_run = ae.engine.model_runner.step_runner.run

        def slow(*args, **kw):
            threading.Event().wait(0.01)
            return real_run(*args, **kw)

        ae.engine.model_runner.step_runner.run = slow
        tokens, out = await collect(ae, [1, 2], p)
        assert out.finish_reason == "timeout" and len(tokens) < 110 and tokens == out.token_ids
        assert_clean(ae)
        await ae.shutdown()

    run(main())


def test_queue_overflow_is_refused_at_once(target):
    async def main():
        ae = AsyncEngine(make(target, max_batch=1), max_waiting=2)
        long = SamplingParams(max_new_tokens=100, ignore_eos=True)
        running = ae.generate([1], long)
        await running.__anext__()                      # admitted: holds the only slot
        waiting = [asyncio.ensure_future(collect(ae, [2 + i], params(0, 3))) for i in range(2)]
        while ae.num_waiting < 2:
            await asyncio.sleep(0.001)
        with pytest.raises(QueueFullError, match="max_waiting=2"):
            await collect(ae, [9], params(0, 3))
        await running.aclose()                         # frees the slot: the waiting two run
        outs = await asyncio.gather(*waiting)
        assert [out.finish_reason for _, out in outs] == ["length", "length"]
        assert_clean(ae)
        await ae.shutdown()

    run(main())


def test_bad_requests_and_duplicate_ids_are_refused_before_anything_runs(target):
    async def main():
        ae = AsyncEngine(make(target))
        with pytest.raises(RequestError, match="top_p"):
            await collect(ae, [1], SamplingParams(top_p=0.0))
        with pytest.raises(RequestError, match="outside the vocabulary"):
            await collect(ae, [1, 10_000], None)
        s = ae.generate([1], SamplingParams(max_new_tokens=50, ignore_eos=True), request_id="x")
        await s.__anext__()
        with pytest.raises(RequestError, match="already running"):
            await collect(ae, [2], None, request_id="x")
        await s.aclose()
        await asyncio.sleep(0.05)
        assert_clean(ae)
        await ae.shutdown()

    run(main())


@pytest.mark.parametrize("drain", [False, True], ids=["cancel", "drain"])
def test_shutdown_with_requests_in_flight(target, draft, drain):
    async def main():
        ae = AsyncEngine(make(target, draft, max_batch=2))
        tasks = [asyncio.ensure_future(collect(ae, [i + 1, 3], params(i, 40))) for i in range(5)]
        while ae.engine.num_running < 2:
            await asyncio.sleep(0.001)
        await ae.shutdown(drain=drain)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        if drain:
            assert [r[1].finish_reason for r in results] == ["length"] * 5
        else:       # each ended: cancelled with its last event, or refused if it never reached the engine
            for r in results:
                assert isinstance(r, EngineShutdownError) or r[1].finish_reason in ("cancelled", "length")
            assert any(not isinstance(r, Exception) and r[1].finish_reason == "cancelled" for r in results)
        assert ae.engine.scheduler.pool.in_use == 0 and ae.num_open_streams == 0
        with pytest.raises(EngineShutdownError):
            await collect(ae, [1], None)

    run(main())


def test_a_consumer_that_fails_leaves_the_other_requests_tokens_identical(target, draft):
    ref = solo(target, draft)

    async def failing_consumer():
        async for ev in ae.generate([50, 51, 52], params(1, 30)):
            if ev.token_ids:
                raise ValueError("the client's handler crashed")

    async def main():
        results = await asyncio.gather(failing_consumer(), *(collect(ae, p, params(i)) for i, p in enumerate(PROMPTS)),
                                       return_exceptions=True)
        assert isinstance(results[0], ValueError)
        assert [r[0] for r in results[1:]] == ref
        await asyncio.sleep(0.05)
        assert_clean(ae)
        await ae.shutdown()

    ae = AsyncEngine(make(target, draft))
    run(main())


def test_a_device_error_reaches_every_waiter_and_never_hangs(target, draft):
    async def main():
        ae = AsyncEngine(make(target, draft, max_batch=2))
        calls = []
        real_run = ae.engine.model_runner.step_runner.run

        def dying(*args, **kw):
            calls.append(1)
            if len(calls) > 3:
                raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
            return real_run(*args, **kw)

        ae.engine.model_runner.step_runner.run = dying
        results = await asyncio.gather(*(collect(ae, [i + 1], params(i, 60)) for i in range(4)),
                                       return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "illegal memory access" in str(results[0])
        assert ae.failure is not None and not ae.ready
        with pytest.raises(EngineDeadError):
            await collect(ae, [1], None)
        assert ae.engine.scheduler.pool.in_use == 0
        await ae.shutdown()

    run(main())


def test_warmup_runs_in_the_engine_thread_before_serving(target):
    async def main():
        ae = AsyncEngine(make(target), warmup=True)
        await ae.wait_ready(60)
        assert ae.ready
        tokens, out = await collect(ae, [1, 2], params(0, 4))
        assert out.finish_reason == "length" and len(tokens) == 4
        await ae.shutdown()

    run(main())


def test_on_ready_runs_once_warmed_up_and_a_failure_in_it_leaves_the_engine_serving(target, caplog):
    """``on_ready`` runs in the engine thread after the warm-up, before ``ready`` turns true; what it
    raises is logged, and the engine serves all the same."""
    engine, box, go = make(target), {}, threading.Event()

    def on_ready():
        go.wait(30)
        box["seen"] = threading.current_thread().name, engine.startup.warmup is not None, box["engine"].ready
        raise RuntimeError("a broken report")

    async def main():
        box["engine"] = ae = AsyncEngine(engine, warmup=True, on_ready=on_ready)
        go.set()
        await ae.wait_ready(60)
        assert ae.ready and box["seen"] == ("lfmspark-engine", True, False)
        tokens, out = await collect(ae, [1, 2], params(0, 3))
        assert len(tokens) == 3
        await ae.shutdown()

    run(main())
    assert "on_ready failed: RuntimeError: a broken report" in caplog.text
