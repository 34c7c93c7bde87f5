"""Hardening, checked on a CPU: extreme or mistyped sampling values are refused by name before
anything runs (one client's values never fail a step shared with others), parameters
are copied at submission, and one engine serves several threads as it serves one. After every
refused input the engine still serves a normal request with its earlier output and holds no slot."""

from __future__ import annotations

import random
import threading

import pytest

from lfmspark.runtime import Engine, RequestError, SamplingParams


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_preset("tiny", max_batch=4, max_seq_len=128)


PROMPTS = [[i + 1, 7, 9] for i in range(6)]
PARAMS = [SamplingParams(max_new_tokens=20, temperature=0.9, seed=i, ignore_eos=True) for i in range(6)]


@pytest.fixture(scope="module")
def reference(engine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]


def _still_serves(engine: Engine, reference: list[list[int]]) -> None:
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == reference
    assert engine.scheduler.pool.n_free == engine.max_batch and engine.idle


@pytest.mark.parametrize("field, value, message", [
    ("temperature", 1e39, "temperature must be a finite number >= 0 .* fits fp32"),
    ("temperature", float("inf"), "temperature"),
    ("temperature", True, "temperature"),
    ("temperature", "0.7", "temperature"),
    ("top_k", True, "top_k must be an integer"),
    ("top_k", 1.5, "top_k must be an integer"),
    ("top_p", True, "top_p must be a number"),
    ("top_p", 0.0, "top_p"),
    ("max_new_tokens", True, "max_new_tokens"),
    ("ignore_eos", "false", "ignore_eos must be True or False"),
    ("ignore_eos", 1, "ignore_eos must be True or False"),
    ("seed", 1.0, "seed must be an integer"),
    ("stop_token_ids", "12", "stop_token_ids must be a list"),
    ("stop_token_ids", [True], "stop_token_ids"),
])
def test_bad_values_are_refused_by_name(engine, reference, field, value, message):
    bad = SamplingParams(**{"max_new_tokens": 4, field: value})
    with pytest.raises(RequestError, match=message):
        engine.generate([[1, 2, 3], [4, 5]], [SamplingParams(max_new_tokens=4), bad])
    _still_serves(engine, reference)


def test_an_enormous_top_k_is_no_filter(engine):
    """top_k past the vocabulary keeps every token, as top_k=0 does (it once overflowed the step)."""
    want = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, ignore_eos=True))
    got = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, ignore_eos=True,
                                                      top_k=2 ** 63))
    assert got[0].token_ids == want[0].token_ids


def test_parameters_are_copied_at_submission(engine):
    """Changing the caller's SamplingParams after submission changes nothing: a stream submitted with
    max_new_tokens=5 emits 5 tokens though the object then asks for 960."""
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    stream = engine.stream([1, 2, 3], params)
    first = next(stream)
    params.max_new_tokens = 960
    tokens = list(first.token_ids) + [t for event in stream for t in event.token_ids]
    assert len(tokens) == 5
    assert engine.scheduler.pool.n_free == engine.max_batch


def test_stop_ids_from_an_iterator_are_read_once(engine):
    """An iterator of stop ids is materialised at submission, not consumed by validation and lost."""
    free_run = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    stop = free_run[3]
    out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12, stop_token_ids=iter([stop])))[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run[:free_run.index(stop) + 1]


def test_explicit_stop_ids_survive_ignore_eos(engine):
    """ignore_eos drops the default EOS ids only; stop ids the caller names still stop."""
    free_run = engine.generate([[4, 5]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    stop = free_run[2]
    out = engine.generate([[4, 5]], SamplingParams(max_new_tokens=12, stop_token_ids=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop and len(out.token_ids) <= 3


def test_two_threads_share_one_engine(engine, reference):
    """Two threads calling generate at once on one engine: each gets its solo output (the requests
    are seeded, and a seeded request's tokens do not depend on the batch it shares)."""
    out: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            out[k] = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
        except BaseException as e:   # surfaced below, with the thread's error
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert out[0] == reference and out[1] == reference
    assert engine.scheduler.pool.n_free == engine.max_batch and engine.idle


@pytest.mark.parametrize("prompts, message", [
    (None, "prompts must be a string"),
    (5, "prompts must be a string"),
    ({"role": "user", "content": "hi"}, "a chat message must be inside a list"),
    ([[1, 2], None], r"prompts \[1\] are None"),
    ([[1, 2], [{"role": "user", "content": "x"}, 3]], "must hold only message dicts"),
])
def test_malformed_prompts_are_refused(engine, reference, prompts, message):
    with pytest.raises(RequestError, match=message):
        engine.generate(prompts, SamplingParams(max_new_tokens=2))
    _still_serves(engine, reference)


@pytest.mark.parametrize("messages, message", [
    ([{"content": "hi"}], "message 0: role must be one of"),
    ([{"role": "user"}], "message 0 .user.: content must be a string"),
    ([{"role": "user", "content": None}], "content must be a string"),
    ([{"role": 3, "content": "hi"}], "role must be one of"),
    ([{"role": "user", "content": "ok"}, {"role": "wizard", "content": "hi"}], "message 1: role"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "content parts must be"),
    ([{"role": "user", "content": "a\ud800b"}], "message 0 is not valid Unicode text"),
])
def test_chat_messages_are_validated(messages, message):
    from lfmspark.runtime.prompts import PromptError, encode_prompt

    with pytest.raises(PromptError, match=message):
        encode_prompt(messages, tokenizer=None, vocab_size=100)


def test_a_lone_surrogate_in_a_text_prompt_is_refused(engine):
    with pytest.raises(RequestError, match=r"not valid Unicode text \(a lone surrogate at character 2\)"):
        engine.generate("ab\udc80", SamplingParams(max_new_tokens=2))


def test_soak_of_mixed_requests_with_aborts_and_refusals(engine, reference):
    """Two hundred requests through the request-level API, a quarter aborted at random points, bad
    requests refused between them: every finished output is its solo run, every aborted one a
    prefix of it, and nothing is held at the end."""
    rng = random.Random(0)
    solo_engine = Engine.from_preset("tiny", max_batch=1, max_seq_len=128)
    solo: dict[tuple, list[int]] = {}
    expected, finished, live = {}, {}, []

    def record(ev):
        if ev.finished:
            finished[ev.request_id] = ev.output

    for n in range(200):
        prompt = [rng.randrange(1, 200) for _ in range(rng.randint(1, 6))]
        params = SamplingParams(max_new_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.8]),
                                top_k=rng.choice([0, 5]), seed=rng.randrange(1000), ignore_eos=True)
        key = (tuple(prompt), params.max_new_tokens, params.temperature, params.top_k, params.seed)
        if key not in solo:
            solo[key] = solo_engine.generate([prompt], params)[0].token_ids
        rid = engine.add_request(prompt, params, request_id=f"soak-{n}", on_event=record)
        expected[rid], live = solo[key], live + [rid]
        if rng.random() < 0.2:
            with pytest.raises(RequestError):
                engine.add_request(prompt, SamplingParams(top_p=rng.choice([0.0, 2.0, float("nan")])))
        for _ in range(rng.randint(0, 2)):
            engine.step()
        if live and rng.random() < 0.25:
            engine.abort(rng.choice(live))
        live = [r for r in live if r in engine.scheduler.live]
    while not engine.idle:
        engine.step()
    aborted = 0
    for rid, out in finished.items():
        if out.finish_reason == "cancelled":
            aborted += 1
            assert out.token_ids == expected[rid][:len(out.token_ids)], rid
        else:
            assert out.finish_reason == "length" and out.token_ids == expected[rid], rid
    assert aborted > 10 and len(finished) == 200
    assert not engine.scheduler.live
    _still_serves(engine, reference)
