"""The OpenAI-compatible server, driven by the official ``openai`` client over loopback:
a tiny checkpoint with a word-level tokenizer and a DSpark draft, served by uvicorn in a thread.

Streamed text equals non-streamed text equals the ``Engine``'s output for the same seed; 32
concurrent clients get their solo outputs; a client that disconnects frees its slot; what the
server cannot honour is a 400 naming the parameter; ``/metrics`` counts what was sent."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest
import torch

from lfmspark.runtime import SamplingParams
from lfmspark.serve import make_server_app
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import MODEL, Served, load

MAX_BATCH = 4


@pytest.fixture(scope="module")
def served(ckpt):
    s = Served(make_server_app(load(ckpt, max_batch=MAX_BATCH), MODEL, warmup=False))
    yield s
    s.stop()
    assert s.engine.engine.scheduler.pool.in_use == 0          # shutting the app down freed everything


@pytest.fixture(scope="module")
def solo(ckpt):
    """The synchronous engine, one request at a time: what every served request must equal."""
    chat, plain = load(ckpt, max_batch=1), load(ckpt, max_batch=1, chat=False)

    def run(prompt, params: SamplingParams, chat_prompt: bool):
        return (chat if chat_prompt else plain).generate([prompt], params)[0]
    return run


def sampled(seed: int | None, n: int = 12) -> dict:
    return dict(temperature=0.0) if seed is None else dict(temperature=0.8, top_p=0.9, seed=seed)


def test_health_and_models(served):
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_streamed_equals_whole_equals_the_engine(served, solo):
    c = served.client()
    kw = dict(model=MODEL, prompt="w3 w7 w9", max_tokens=14, seed=5, temperature=0.8,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    ref = solo("w3 w7 w9", SamplingParams(max_new_tokens=14, temperature=0.8, seed=5, ignore_eos=True), False)
    assert whole.choices[0].text == streamed == ref.text and ref.text
    assert whole.choices[0].model_extra["token_ids"] == ref.token_ids
    last_choice = [ch for ch in chunks if ch.choices][-1].choices[0]
    assert whole.choices[0].finish_reason == "length" == last_choice.finish_reason
    assert whole.usage.completion_tokens == 14 and whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_streamed_equals_whole_equals_the_engine(served, solo):
    c = served.client()
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w5 w6 w8"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0.0)
    whole = c.chat.completions.create(**kw)
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    ref = solo(messages, SamplingParams(max_new_tokens=10), True)
    assert whole.choices[0].message.content == streamed == ref.text
    assert whole.choices[0].finish_reason == ref.finish_reason == chunks[-1].choices[0].finish_reason
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_text_as_the_engine_does(served, solo, stream):
    c = served.client()
    base = solo("w3 w7", SamplingParams(max_new_tokens=12, ignore_eos=True), False).text.split(" ")
    stop = " ".join(base[3:5])                       # two words in the middle of the greedy text
    kw = dict(model=MODEL, prompt="w3 w7", max_tokens=12, temperature=0.0, stop=[stop],
              extra_body={"ignore_eos": True})
    ref = solo("w3 w7", SamplingParams(max_new_tokens=12, ignore_eos=True, stop=[stop]), False)
    assert ref.finish_reason == "stop" and stop not in ref.text
    if stream:
        chunks = list(c.completions.create(stream=True, **kw))
        text = "".join(ch.choices[0].text for ch in chunks)
        last = chunks[-1].choices[0]
    else:
        last = c.completions.create(**kw).choices[0]
        text = last.text
    assert text == ref.text and last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop


def test_penalties_bias_and_min_p_reach_the_engine(served, solo):
    kw = dict(presence_penalty=0.5, frequency_penalty=1.0, logit_bias={"12": 5.0})
    extra = {"min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 3, "ignore_eos": True, "return_token_ids": True}
    out = served.client().completions.create(model=MODEL, prompt="w3 w8", max_tokens=8, temperature=0.7, seed=3,
                                             extra_body=extra, **kw)
    ref = solo("w3 w8", SamplingParams(max_new_tokens=8, temperature=0.7, seed=3, presence_penalty=0.5,
                                       frequency_penalty=1.0, logit_bias={12: 5.0}, min_p=0.05,
                                       repetition_penalty=1.2, min_tokens=3, ignore_eos=True), False)
    assert out.choices[0].model_extra["token_ids"] == ref.token_ids


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_the_engines_samples_seed_by_seed(served, solo, stream):
    kw = dict(model=MODEL, prompt=["w3 w5", "w9"], max_tokens=6, temperature=0.8, seed=21, n=2,
              extra_body={"ignore_eos": True})
    if stream:
        texts: dict[int, str] = {}
        for ch in served.client().completions.create(stream=True, **kw):
            for c in ch.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
    else:
        texts = {c.index: c.text for c in served.client().completions.create(**kw).choices}
    assert sorted(texts) == [0, 1, 2, 3]                 # prompt i, sample j -> choice i * n + j
    for i, prompt in enumerate(["w3 w5", "w9"]):
        for j in range(2):
            ref = solo(prompt, SamplingParams(max_new_tokens=6, temperature=0.8, seed=21 + j, ignore_eos=True), False)
            assert texts[2 * i + j] == ref.text


def test_chat_n_choices(served, solo):
    messages = [{"role": "user", "content": "w4 w6"}]
    out = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.9,
                                                  seed=4, n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    for j, c in enumerate(out.choices):
        ref = solo(messages, SamplingParams(max_new_tokens=5, temperature=0.9, seed=4 + j, ignore_eos=True), True)
        assert c.message.content == ref.text
    assert out.usage.completion_tokens == 15


def test_token_id_prompts_and_several_prompts_in_one_request(served, solo):
    prompts = [[1, 10, 11], [1, 20]]
    out = served.client().completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0.0,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})
    for choice, p in zip(sorted(out.choices, key=lambda ch: ch.index), prompts):
        assert choice.model_extra["token_ids"] == solo(p, SamplingParams(max_new_tokens=6, ignore_eos=True),
                                                         False).token_ids


def test_32_concurrent_clients_get_their_solo_outputs(served, solo):
    cases = [(f"w{3 + i % 20} w{10 + i % 7} w{i % 5 + 30}", None if i % 2 else i) for i in range(32)]

    async def main():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i, prompt, seed):
            if i % 3 == 0:     # some stream, some do not
                text = ""
                async for ch in await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                                stream=True, extra_body={"ignore_eos": True},
                                                                **sampled(seed)):
                    text += ch.choices[0].text
                return text
            r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                extra_body={"ignore_eos": True}, **sampled(seed))
            return r.choices[0].text

        try:
            return await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(cases)))
        finally:
            await client.close()

    texts = asyncio.run(main())
    for (prompt, seed), text in zip(cases, texts):
        params = SamplingParams(max_new_tokens=12, ignore_eos=True, **sampled(seed))
        assert text == solo(prompt, params, False).text, (prompt, seed)


def test_a_client_that_disconnects_frees_its_slot(served):
    ae = served.engine
    body = {"model": MODEL, "prompt": "w3 w4", "max_tokens": 100, "stream": True, "ignore_eos": True,
            "temperature": 0.0}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break                                       # one chunk, then walk away
    deadline = time.monotonic() + 10
    while ae.engine.scheduler.pool.in_use:
        assert time.monotonic() < deadline, "the disconnected stream still holds its slot"
        time.sleep(0.005)
    peak = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak.append(ae.num_running)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()

    async def main():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(client.completions.create(
                model=MODEL, prompt=f"w{5 + i}", max_tokens=60, temperature=0.0, extra_body={"ignore_eos": True})
                for i in range(MAX_BATCH)))
        finally:
            await client.close()

    outs = asyncio.run(main())
    stop.set()
    watcher.join()
    assert all(o.usage.completion_tokens == 60 for o in outs)
    assert max(peak) == MAX_BATCH                           # all of them ran at once: every slot was free


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_are_the_engines(served, solo, stream):
    """The legacy completions form: one entry per token, the top-N as text -> logprob, offsets into
    the text; prompt_logprobs (vLLM's extension) keyed by token id."""
    kw = dict(model=MODEL, prompt="w3 w7 w9", max_tokens=9, logprobs=3, temperature=0.0,
              extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    ref = solo("w3 w7 w9", SamplingParams(max_new_tokens=9, ignore_eos=True, logprobs=3, prompt_logprobs=2), False)
    if stream:
        chunks = [ch.choices[0] for ch in served.client().completions.create(stream=True, **kw) if ch.choices]
        got = {k: [v for ch in chunks for v in ch.logprobs.model_dump()[k]]
               for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        prompt_lp = chunks[-1].model_extra["prompt_logprobs"]
    else:
        choice = served.client().completions.create(**kw).choices[0]
        got, prompt_lp = choice.logprobs.model_dump(), choice.model_extra["prompt_logprobs"]
    tok = served.engine.engine.tokenizer
    texts = [tok.decode([r.token_id]) for r in ref.logprobs]
    assert got["tokens"] == texts
    assert got["token_logprobs"] == pytest.approx([r.logprob for r in ref.logprobs], abs=1e-5)
    assert [list(d) for d in got["top_logprobs"]] == [[tok.decode([i]) for i, _ in r.top] for r in ref.logprobs]
    assert got["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert prompt_lp[0] is None and len(prompt_lp) == len(ref.prompt_token_ids)
    for entry, r in zip(prompt_lp[1:], ref.prompt_logprobs[1:]):
        assert entry[str(r.token_id)]["logprob"] == pytest.approx(r.logprob, abs=1e-5)
        assert entry[str(r.token_id)]["rank"] == r.rank


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_engines(served, solo, stream):
    messages = [{"role": "user", "content": "w5 w6 w8"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2)
    ref = solo(messages, SamplingParams(max_new_tokens=8, logprobs=2), True)
    if stream:
        content = [c for ch in served.client().chat.completions.create(stream=True, **kw)
                   if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    else:
        content = served.client().chat.completions.create(**kw).choices[0].logprobs.content
    tok = served.engine.engine.tokenizer
    assert [c.token for c in content] == [tok.decode([r.token_id]) for r in ref.logprobs]
    assert [c.logprob for c in content] == pytest.approx([r.logprob for r in ref.logprobs], abs=1e-5)
    assert [[t.token for t in c.top_logprobs] for c in content] == \
        [[tok.decode([i]) for i, _ in r.top] for r in ref.logprobs]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    plain = served.client().chat.completions.create(**{k: v for k, v in kw.items() if "logprobs" not in k})
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("kw, param", [
    (dict(n=99), "n"),
    (dict(stop=[""]), "stop"),
    (dict(logprobs=21), "logprobs"),
    (dict(extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(logit_bias={"w5": 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 300.0}), "logit_bias"),
    (dict(extra_body={"min_p": 2.0}), "min_p"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(echo=True), "echo"),
    (dict(best_of=3), "best_of"),
    (dict(suffix="w4"), "suffix"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(extra_body={"top_k": -3}), "top_k"),
    (dict(extra_body={"mirostat": 1}), "mirostat"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[1, 999]), "prompt"),
    (dict(max_tokens=500), None),
])
def test_what_the_server_cannot_honour_is_a_400_naming_it(served, kw, param):
    args = dict(model=MODEL, prompt="w3 w4", max_tokens=4) | kw
    with pytest.raises(openai.BadRequestError) as err:
        served.client().completions.create(**args)
    error = err.value.body
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param and param in error["message"]
    assert served.engine.engine.scheduler.pool.in_use == 0


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "custom", "custom": {"name": "f"}}]), "tools"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(top_logprobs=3), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=30), "logprobs"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(reasoning_effort="high"), "reasoning_effort"),
    (dict(messages=[{"role": "wizard", "content": "w3"}]), "messages"),
    (dict(messages=[{"role": "user"}]), "messages"),
])
def test_chat_parameters_it_cannot_honour_are_named(served, kw, param):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "w3"}], max_tokens=4) | kw
    with pytest.raises(openai.BadRequestError) as err:
        served.client().chat.completions.create(**args)
    assert err.value.body["param"] == param


def test_another_model_is_a_404(served):
    with pytest.raises(openai.NotFoundError) as err:
        served.client().completions.create(model="gpt-9", prompt="w3", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def metric_values(url: str) -> dict[tuple, float]:
    text = httpx.get(url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            values[(s.name, labels)] = s.value
    return values


def test_metrics_count_what_was_sent(served):
    before = metric_values(served.url)
    c = served.client()
    outs = [c.completions.create(model=MODEL, prompt=f"w{3 + i} w9", max_tokens=5 + i, temperature=0.0,
                                 extra_body={"ignore_eos": True}) for i in range(3)]
    outs.append(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w4"}], max_tokens=3,
                                          temperature=0.0, extra_body={"ignore_eos": True}))
    after = metric_values(served.url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("lfmspark:request_success_total", finished_reason="length") == 4
    assert delta("lfmspark:prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert delta("lfmspark:generation_tokens_total") == sum(o.usage.completion_tokens for o in outs)
    assert delta("lfmspark:time_to_first_token_seconds_count") == 4
    assert delta("lfmspark:e2e_request_latency_seconds_count") == 4
    rounds = delta("lfmspark:spec_decode_num_drafts_total")
    assert rounds > 0 and delta("lfmspark:spec_decode_num_draft_tokens_total") == 4 * rounds   # block of 4
    accepted = delta("lfmspark:spec_decode_num_accepted_tokens_total")
    per_pos = sum(delta("lfmspark:spec_decode_num_accepted_tokens_per_pos_total", position=str(k)) for k in range(4))
    assert per_pos == accepted
    assert after[("lfmspark:num_requests_running", ())] == 0 and after[("lfmspark:num_requests_waiting", ())] == 0


def test_a_request_can_turn_speculation_off_and_the_metrics_count_its_rounds_without_draft(served):
    before = metric_values(served.url)
    c = served.client()
    off = c.completions.create(model=MODEL, prompt="w3 w9", max_tokens=6, temperature=0.0,
                               extra_body={"ignore_eos": True, "max_speculative_tokens": 0})
    on = c.completions.create(model=MODEL, prompt="w3 w9", max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    after = metric_values(served.url)
    assert off.choices[0].text == on.choices[0].text
    delta = lambda name: after.get((name, ()), 0.0) - before.get((name, ()), 0.0)  # noqa: E731
    # the first token comes from the prefill, each later one from a round that verified no draft
    assert delta("lfmspark:spec_decode_num_rounds_without_draft_total") == off.usage.completion_tokens - 1
    bad = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": "w3", "max_tokens": 2,
                                                           "max_speculative_tokens": -1})
    assert bad.status_code == 400 and "max_speculative_tokens" in bad.text


def test_prefix_cache_hits_show_in_usage_and_metrics_and_reset_drops_them(ckpt):
    s = Served(make_server_app(load(ckpt, max_batch=2, prefix_block=8, page_size=8), MODEL, warmup=False))
    try:
        c = s.client()
        prompt = " ".join(f"w{3 + i % 20}" for i in range(30))
        first, second = (c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0)
                         for _ in range(2))
        assert first.choices[0].text == second.choices[0].text
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached == (second.usage.prompt_tokens - 1) // 8 * 8 > 0
        values = metric_values(s.url)
        assert values[("lfmspark:prefix_cache_hits_total", ())] == cached
        assert values[("lfmspark:prefix_cache_queries_total", ())] == 2 * second.usage.prompt_tokens
        reset = httpx.post(s.url + "/reset_prefix_cache")
        assert reset.status_code == 200 and reset.json()["dropped_blocks"] > 0
        third = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0)
        assert third.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        s.stop()


def test_health_says_warming_up_until_the_engine_is_warm(ckpt):
    engine = load(ckpt, max_batch=2)
    release = threading.Event()
    real_warmup = engine.warmup
    engine.warmup = lambda: (release.wait(30), real_warmup(progress=False))
    s = Served(make_server_app(engine, MODEL, warmup=True))
    try:
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "warming up"
        release.set()
        deadline = time.monotonic() + 30
        while httpx.get(s.url + "/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert s.client().completions.create(model=MODEL, prompt="w3", max_tokens=2).usage.completion_tokens >= 1
    finally:
        s.stop()


def test_a_device_failure_answers_every_waiter_and_shows_on_health(ckpt):
    engine = load(ckpt, max_batch=2)
    s = Served(make_server_app(engine, MODEL, warmup=False))
    try:
        def dead(*args, **kw):
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

        engine.model_runner.step_runner.run = dead
        with pytest.raises(openai.APIStatusError) as err:
            s.client().completions.create(model=MODEL, prompt="w3 w4", max_tokens=20)
        assert err.value.status_code in (500, 503) and "illegal memory access" in err.value.message
        health = httpx.get(s.url + "/health")
        assert health.status_code == 503 and "illegal memory access" in health.json()["error"]
        with pytest.raises(openai.APIStatusError) as err:
            s.client().completions.create(model=MODEL, prompt="w3", max_tokens=2)
        assert err.value.status_code == 503
    finally:
        s.stop()


def test_a_chats_next_turn_hits_the_previous_reply_with_cached_outputs(ckpt):
    """``prefix_cache_outputs=True`` (serve --prefix-cache-outputs): the second turn of a chat, which
    repeats the first turn's reply, finds it cached beyond the first prompt's blocks, and answers as
    an engine without the cache does."""
    replies, cached = {}, {}
    for name, kw in (("outputs", dict(prefix_cache_outputs=True)), ("off", dict(prefix_cache_tokens=0))):
        s = Served(make_server_app(load(ckpt, max_batch=2, prefix_block=8, page_size=8, **kw), MODEL, warmup=False))
        try:
            c = s.client()
            chat = [{"role": "user", "content": " ".join(f"w{3 + i % 17}" for i in range(20))}]
            first = c.chat.completions.create(model=MODEL, messages=chat, max_tokens=12, temperature=0.0,
                                              extra_body={"ignore_eos": True})
            chat += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "w5 w6 w7"}]
            second = c.chat.completions.create(model=MODEL, messages=chat, max_tokens=6, temperature=0.0,
                                               extra_body={"ignore_eos": True})
            replies[name] = (first.choices[0].message.content, second.choices[0].message.content)
            cached[name] = (first.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens)
        finally:
            s.stop()
    assert replies["outputs"] == replies["off"]
    first_prompt, hit = cached["outputs"]
    assert hit > first_prompt // 8 * 8 and hit % 8 == 0          # blocks of the reply, not only the prompt's
    assert cached["off"][1] == 0
