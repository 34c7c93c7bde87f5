"""``SamplingParams.n``: several samples of one prompt share one prefill. Each sample is
what a lone request with its seed (``seed + j``) gives, so the copied caches and state are exact;
the prompt is prefilled once; the samples are independent without a seed; the group is admitted,
aborted and streamed as one request."""

from __future__ import annotations

import asyncio

import pytest

from lfmspark.runtime import AsyncEngine, Engine, RequestError, SamplingParams
from spec_fixtures import random_tiny_draft, random_tiny_target

PROMPT = [3, 9, 27, 5, 11, 2, 8]


@pytest.fixture(scope="module")
def models():
    return random_tiny_target(seed=3), random_tiny_draft(seed=4)


def make(models, spec: bool, **kw) -> Engine:
    target, draft = models
    return Engine(target, draft if spec else None, max_batch=kw.pop("max_batch", 4), max_seq_len=96, **kw)


def sampled(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, ignore_eos=True, **kw)


@pytest.mark.parametrize("spec", [False, True], ids=["target-only", "speculative"])
@pytest.mark.parametrize("chunk", [2048, 3], ids=["one-chunk", "chunked"])
def test_each_sample_is_the_lone_request_with_its_seed(models, spec, chunk):
    e = make(models, spec, prefill_chunk=chunk)
    prefilled = []
    real_run = e.model_runner.prefill_runner.run

    def counting_run(chunks, slots, c0):
        prefilled.append(sum(len(c) for c in chunks))
        return real_run(chunks, slots, c0)

    e.model_runner.prefill_runner.run = counting_run
    outs = e.generate([PROMPT], sampled(n=3, seed=10, repetition_penalty=1.2))
    assert [o.sample for o in outs] == [0, 1, 2]
    assert sum(prefilled) == len(PROMPT)                     # one prefill for the three
    alone = make(models, spec, prefill_chunk=chunk)
    for j, out in enumerate(outs):
        assert out.token_ids == alone.generate([PROMPT], sampled(seed=10 + j, repetition_penalty=1.2))[0].token_ids
    assert e.scheduler.pool.in_use == 0 and e.idle


def test_greedy_samples_are_all_the_greedy_output(models):
    e = make(models, True)
    outs = e.generate([PROMPT, [4, 4]], SamplingParams(max_new_tokens=10, n=2, ignore_eos=True))
    ref = make(models, True).generate([PROMPT, [4, 4]], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [ref[0].token_ids] * 2 + [ref[1].token_ids] * 2


def test_unseeded_samples_are_independent(models):
    outs = make(models, True).generate([PROMPT], sampled(n=4))
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_a_group_waits_for_enough_slots_and_is_aborted_as_one(models):
    e = make(models, True, max_batch=3)
    e.add_request([1, 2], SamplingParams(max_new_tokens=40, ignore_eos=True), request_id="first")
    gid = e.add_request(PROMPT, sampled(n=3, seed=1), request_id="group")
    assert gid == "group"
    e.step()
    assert e.num_running == 1 and e.num_waiting == 3          # three slots needed, two free: it waits
    assert e.abort("group") and e.num_waiting == 0
    e.abort("first")
    with pytest.raises(RequestError, match="n=4 samples run at once"):
        e.add_request(PROMPT, sampled(n=4))
    with pytest.raises(RequestError, match="n must be"):
        e.add_request(PROMPT, sampled(n=0))
    assert e.scheduler.pool.in_use == 0


def test_the_async_stream_carries_every_sample(models):
    ref = make(models, True).generate([PROMPT], sampled(n=2, seed=5))

    async def main():
        ae = AsyncEngine(make(models, True))
        got: dict[int, list[int]] = {0: [], 1: []}
        async for ev in ae.generate(PROMPT, sampled(n=2, seed=5), request_id="r"):
            got[ev.sample] += ev.token_ids
            assert ev.request_id == f"r-{ev.sample}"
        await ae.shutdown()
        return got

    got = asyncio.run(main())
    assert [got[0], got[1]] == [o.token_ids for o in ref]
