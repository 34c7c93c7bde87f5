"""A failure stays with the requests it concerns: a prefill's with the requests
being admitted, a text decode's or an event consumer's with its request, a round's with its rows;
the other requests' tokens are those of a run without the fault, and nothing leaks. A device error
fails everything, once, and the engine says so from then on. Also the request-level API the
asyncio engine drives: ids, abort, deadlines."""

from __future__ import annotations

import time

import pytest
import torch

from lfmspark.runtime import Engine, EngineDeadError, RequestError, RequestFailedError, SamplingParams
from lfmspark.runtime.requests import is_device_error
from engine_fixtures import word_tokenizer


def make(target, draft=None, **kw) -> Engine:
    return Engine(target, draft, max_batch=kw.pop("max_batch", 4), max_seq_len=kw.pop("max_seq_len", 96), **kw)


def sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.9, seed=seed, ignore_eos=True)


A_PROMPTS = [[3, 9, 27], [5, 6]]
A_PARAMS = [sampled(16, 1), SamplingParams(max_new_tokens=16, ignore_eos=True)]


def a_reference(target, draft) -> list[list[int]]:
    return [o.token_ids for o in make(target, draft).generate(A_PROMPTS, A_PARAMS)]


def assert_clean(e: Engine) -> None:
    assert e.scheduler.pool.in_use == 0 and e.idle and not e.scheduler.live


def drain(stream) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}
    for ev in stream:
        got.setdefault(ev.index, []).extend(ev.token_ids)
    return got


@pytest.mark.parametrize("spec", [False, True], ids=["target-only", "speculative"])
def test_a_failing_prefill_ends_only_the_requests_being_admitted(target, draft, spec, monkeypatch):
    d = draft if spec else None
    ref = a_reference(target, d)
    e = make(target, d)
    sa = e.stream(A_PROMPTS, A_PARAMS)
    got = {}
    ev = next(sa)                                   # a's requests are prefilled and running
    got.setdefault(ev.index, []).extend(ev.token_ids)
    real_run = e.model_runner.prefill_runner.run

    def failing_run(chunks, slots, c0):
        if chunks[0][:1] == [44]:
            raise RuntimeError("prefill kernel rejected the shape")
        return real_run(chunks, slots, c0)

    monkeypatch.setattr(e.model_runner.prefill_runner, "run", failing_run)
    sb = e.stream([[44, 1, 2]], sampled(8, 9))
    with pytest.raises(RequestFailedError, match="prefill kernel rejected the shape") as err:
        for ev in sb:
            assert ev.finished and ev.output.finish_reason == "error"
            assert ev.output.error == "RuntimeError: prefill kernel rejected the shape"
    assert isinstance(err.value.__cause__, RuntimeError)
    for ev in sa:
        got.setdefault(ev.index, []).extend(ev.token_ids)
    assert [got[0], got[1]] == ref                  # a's tokens are those of a run without the fault
    assert_clean(e)


def test_a_failing_round_ends_its_rows_and_leaves_the_queue_and_the_engine(target, draft, monkeypatch):
    e = make(target, draft, max_batch=2)
    sa = e.stream(A_PROMPTS, A_PARAMS)              # fills both slots
    next(sa)
    sb = e.stream([[7, 8]], sampled(6, 3))          # waits for a slot
    real_run, calls = e.model_runner.step_runner.run, []

    def failing_run(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("graph replay failed")
        return real_run(*args, **kw)

    monkeypatch.setattr(e.model_runner.step_runner, "run", failing_run)
    with pytest.raises(RequestFailedError, match="graph replay failed") as err:
        drain(sa)
    assert len(err.value.request_ids) == 2
    monkeypatch.setattr(e.model_runner.step_runner, "run", real_run)
    got = drain(sb)                                 # b was queued, not in the round: it runs as it would alone
    assert got[0] == make(target, draft).generate([[7, 8]], sampled(6, 3))[0].token_ids
    assert_clean(e)


def test_a_consumer_that_raises_ends_only_its_own_request(target, draft):
    ref = a_reference(target, draft)
    e = make(target, draft)
    got: dict[str, list[int]] = {"a0": [], "a1": []}

    def keep(rid):
        return lambda ev: got[rid].extend(ev.token_ids)

    def broken(ev):
        if len(ev.token_ids) and ev.token_ids[0] >= 0:
            raise ValueError("consumer bug")

    e.add_request(A_PROMPTS[0], A_PARAMS[0], request_id="a0", on_event=keep("a0"))
    e.add_request([7, 8, 9], sampled(16, 5), request_id="bad", on_event=broken)
    e.add_request(A_PROMPTS[1], A_PARAMS[1], request_id="a1", on_event=keep("a1"))
    finished = {}
    while not e.idle:
        for ev in e.step():
            if ev.finished:
                finished[ev.request_id] = ev.output
    assert finished["bad"].finish_reason == "error" and finished["bad"].error == "ValueError: consumer bug"
    assert [got["a0"], got["a1"]] == ref
    assert finished["a0"].token_ids == ref[0]
    assert_clean(e)


def test_a_tokenizer_that_fails_on_one_output_ends_only_that_request(target):
    ref = [o.token_ids for o in make(target).generate(A_PROMPTS, A_PARAMS)]
    # a third prompt whose first generated token is in neither of the others' outputs: the poison
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for start in range(1, 60):
        poison = make(target).generate([[start, 2]], params)[0].token_ids[0]
        if not any(poison in r for r in ref):
            break
    assert not any(poison in r for r in ref), "no prompt found whose first token the others never produce"
    tok = word_tokenizer()
    real_decode = tok.decode

    def decode(ids, **kw):
        if poison in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real_decode(ids, **kw)

    tok.decode = decode
    e = make(target, tokenizer=tok, chat=False)
    outs = {}
    with pytest.raises(RequestFailedError, match="requests \\[2\\] failed: UnicodeDecodeError"):
        for ev in e.stream(A_PROMPTS + [[start, 2]], A_PARAMS + [params]):
            if ev.finished:
                outs[ev.index] = ev.output
    assert [outs[0].token_ids, outs[1].token_ids] == ref
    assert outs[2].finish_reason == "error" and outs[2].error.startswith("UnicodeDecodeError")
    assert_clean(e)


def test_a_device_error_fails_every_request_and_the_engine_stays_dead(target, draft, monkeypatch):
    e = make(target, draft, max_batch=2)
    sa = e.stream(A_PROMPTS, A_PARAMS)
    next(sa)
    queued = e.add_request([7, 8], sampled(6, 3), request_id="queued")

    def dead_run(*args, **kw):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(e.model_runner.step_runner, "run", dead_run)
    with pytest.raises(EngineDeadError, match="illegal memory access"):
        drain(sa)
    assert e.dead is not None and e.scheduler.pool.in_use == 0 and not e.scheduler.live and queued not in e.scheduler.live
    with pytest.raises(EngineDeadError, match="restart the process"):
        e.add_request([1, 2])
    with pytest.raises(EngineDeadError):
        e.generate([[1, 2]])


def test_device_errors_are_told_from_request_errors():
    assert is_device_error(torch.AcceleratorError("CUDA error: misaligned address"))
    assert is_device_error(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_device_error(RuntimeError("shape mismatch"))
    assert not is_device_error(ValueError("CUDA error in a user's string"))


def test_request_ids_abort_and_polling(target, draft):
    e = make(target, draft)
    ref = a_reference(target, draft)
    rid = e.add_request(A_PROMPTS[0], A_PARAMS[0])
    assert rid.startswith("req-")
    with pytest.raises(RequestError, match="already running"):
        e.add_request([1], request_id=rid)
    with pytest.raises(RequestError, match="non-empty string"):
        e.add_request([1], request_id="")
    with pytest.raises(RequestError, match="must be SamplingParams"):
        e.add_request([1], {"temperature": 0.5})
    e.add_request([9, 9, 9], sampled(40, 2), request_id="doomed")
    tokens = [t for ev in e.step() if ev.request_id == rid for t in ev.token_ids]
    assert e.num_running == 2 and e.scheduler.pool.in_use == 2
    assert e.abort("doomed") is True and e.scheduler.pool.in_use == 1
    assert e.abort("doomed") is False and e.abort("never") is False
    last = None
    while not e.idle:
        for ev in e.step():
            assert ev.request_id == rid
            tokens += ev.token_ids
            last = ev
    assert last.finished and last.output.request_id == rid and tokens == ref[0]
    assert e.add_request([1], SamplingParams(max_new_tokens=4), request_id=rid) == rid   # a finished id is free
    e.abort(rid)
    assert_clean(e)


def test_a_deadline_ends_a_request_with_timeout_and_keeps_its_tokens(target, draft, monkeypatch):
    e = make(target, draft)
    slow_run = e.model_runner.step_runner.run

    def run(*args, **kw):
        time.sleep(0.02)
        return slow_run(*args, **kw)

    monkeypatch.setattr(e.model_runner.step_runner, "run", run)
    params = [SamplingParams(max_new_tokens=60, ignore_eos=True, timeout_s=0.15), A_PARAMS[1]]
    outs = e.generate([A_PROMPTS[0], A_PROMPTS[1]], params)
    assert outs[0].finish_reason == "timeout" and 0 < len(outs[0].token_ids) < 60
    assert outs[1].finish_reason == "length"
    monkeypatch.setattr(e.model_runner.step_runner, "run", slow_run)
    full = make(target, draft).generate([A_PROMPTS[0]], SamplingParams(max_new_tokens=60, ignore_eos=True))[0]
    assert full.token_ids[:len(outs[0].token_ids)] == outs[0].token_ids
    assert_clean(e)


def test_a_queued_request_can_time_out_before_it_starts(target):
    e = make(target, max_batch=1)
    e.add_request([1, 2], SamplingParams(max_new_tokens=30, ignore_eos=True), request_id="long")
    e.add_request([3], SamplingParams(max_new_tokens=5, timeout_s=1e-6), request_id="late")
    ends = {}
    while not e.idle:
        for ev in e.step():
            if ev.finished:
                ends[ev.request_id] = ev.output
    assert ends["late"].finish_reason == "timeout" and ends["late"].token_ids == []
    assert ends["long"].finish_reason == "length"
    assert_clean(e)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "5"])
def test_bad_timeouts_are_refused(target, value):
    with pytest.raises(RequestError, match="timeout_s"):
        make(target).add_request([1], SamplingParams(timeout_s=value))
