"""The server's guards and edges, over loopback with the official ``openai`` client and ``httpx``:
clients that disconnect (streaming or not) free their slots; a body over the size limit is a 413
and a text that cannot fit the context a 400, while ``/health`` keeps answering; the API key and
CORS; ``/v1/models/{id}``, ``/tokenize``, ``/detokenize``, ``/version``; the context a request can
use; strict types, JSON errors, logprob offsets and non-finite numbers; the port check and the
start-up line."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import httpx
import openai
import pytest

from env_vars import set_env
from lfmspark.serve import PortInUseError, check_port_free, make_server_app, startup_line
from lfmspark.serve.app import SafeJSONResponse
from lfmspark.serve.guards import DEFAULT_MAX_REQUEST_BYTES
from lfmspark.serve.protocol import dumps
from server_fixtures import MODEL, Served, load

MAX_BATCH = 4
EOS = 5                # <|im_end|> in the word-level tokenizer (tests/engine_fixtures.py)
KEY = "sk-test-key"
T = TypeVar("T")


@pytest.fixture(scope="module")
def served(ckpt):
    s = Served(make_server_app(load(ckpt, max_batch=MAX_BATCH), MODEL, warmup=False))
    yield s
    s.stop()


def context_of(s: Served) -> int:
    """What a request can use: the engine's max_seq_len (prompt and output)."""
    return s.engine.engine.max_seq_len


# -- cancellation -------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_16_clients_that_disconnect_free_every_slot(ckpt, stream):
    """16 long requests (4 running, 12 queued) whose clients leave early: within a second every slot
    and the queue are empty, and 4 new requests then run at once to completion."""
    s = Served(make_server_app(load(ckpt, max_batch=MAX_BATCH, max_seq_len=512), MODEL, warmup=False))
    ae = s.engine
    try:
        running = []

        async def leave_early(client: openai.AsyncOpenAI, i: int):
            kw = dict(model=MODEL, prompt=f"w{3 + i} w9", max_tokens=480, temperature=0.0,
                      extra_body={"ignore_eos": True})
            if not stream:
                with pytest.raises(openai.APITimeoutError):
                    await client.completions.create(**kw)          # the client's timeout drops the connection
                return
            try:
                chunks = await client.completions.create(stream=True, **kw)
            except openai.APITimeoutError:
                return                                             # still queued when the client gave up
            async for _ in chunks:
                break                                              # one chunk, then walk away
            await chunks.close()

        async def main():
            client = s.async_client(timeout=1.5)
            try:
                tasks = asyncio.gather(*(leave_early(client, i) for i in range(16)))
                while not tasks.done():
                    running.append(ae.num_running)
                    await asyncio.sleep(0.005)
                await tasks
            finally:
                await client.close()

        asyncio.run(main())
        assert max(running) == MAX_BATCH                # they ran: the clients left while requests were decoding
        deadline = time.monotonic() + 1.0
        while ae.num_running or ae.num_waiting or ae.num_open_streams:
            assert time.monotonic() < deadline, (ae.num_running, ae.num_waiting)
            time.sleep(0.005)
        assert_admits_max_batch_at_once(s)
    finally:
        s.stop()


def assert_admits_max_batch_at_once(s: Served) -> None:
    peak, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            peak.append(s.engine.num_running)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()

    async def main():
        client = s.async_client()
        try:
            return await asyncio.gather(*(client.completions.create(
                model=MODEL, prompt=f"w{5 + i}", max_tokens=30, temperature=0.0, extra_body={"ignore_eos": True})
                for i in range(MAX_BATCH)))
        finally:
            await client.close()

    try:
        outs = asyncio.run(main())
    finally:
        stop.set()
        watcher.join()
    assert all(o.usage.completion_tokens == 30 for o in outs)
    assert max(peak) == MAX_BATCH


# -- limits and a responsive loop -----------------------------------------------------------------

def health_latencies(url: str, action: Callable[[], T]) -> tuple[T, list[float]]:
    """Run ``action`` while a thread calls /health back to back; its result and the latencies (s)."""
    latencies, stop = [], threading.Event()

    def probe():
        with httpx.Client(timeout=5) as c:
            while not stop.is_set():
                t = time.perf_counter()
                assert c.get(url + "/health").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.002)

    thread = threading.Thread(target=probe)
    thread.start()
    time.sleep(0.05)
    try:
        result = action()
        time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
    return result, latencies


def answered_while_health_answers(url: str, action: Callable[[], httpx.Response], attempts: int = 3) -> httpx.Response:
    """``action``'s response, once every /health call made meanwhile took < 100 ms. A frozen event
    loop fails every attempt; a busy test machine that delays a thread fails one at most, so the
    measurement is repeated (the server does the same work each time)."""
    for _ in range(attempts):
        response, latencies = health_latencies(url, action)
        assert latencies
        if max(latencies) < 0.1:
            return response
    raise AssertionError(f"/health took {max(latencies) * 1000:.0f} ms while the request was handled")


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_a_413_while_health_answers(served, chunked):
    size = DEFAULT_MAX_REQUEST_BYTES + (4 << 20)
    block = bytes(1 << 20)

    def send() -> httpx.Response:
        content = (block for _ in range(size >> 20)) if chunked else bytes(size)
        return httpx.post(served.url + "/v1/completions", content=content, timeout=30,
                          headers={"content-type": "application/json"})

    r = answered_while_health_answers(served.url, send)
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and str(DEFAULT_MAX_REQUEST_BYTES) in error["message"]
    assert httpx.get(served.url + "/health").status_code == 200


def test_a_smaller_limit_is_taken(ckpt):
    s = Served(make_server_app(load(ckpt, max_batch=2), MODEL, warmup=False, max_request_bytes=1000))
    try:
        ok = s.client().completions.create(model=MODEL, prompt="w3", max_tokens=2, extra_body={"ignore_eos": True})
        assert ok.usage.completion_tokens == 2        # (a sampled EOS would end it after one)
        with pytest.raises(openai.APIStatusError) as err:
            s.client().completions.create(model=MODEL, prompt="w3 " * 400, max_tokens=2)
        assert err.value.status_code == 413 and "1000 bytes" in err.value.message
    finally:
        s.stop()


@pytest.mark.parametrize("route, key", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"),
                                        ("/tokenize", "prompt")])
def test_a_text_too_long_for_the_context_is_refused_untokenized_while_health_answers(served, monkeypatch,
                                                                                     route, key):
    encoded = []

    class Spy:
        """The tokenizer, noting every call that tokenizes."""

        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def __call__(self, *args, **kw):
            encoded.append(args)
            return self.tokenizer(*args, **kw)

        def __getattr__(self, name):
            if name in ("encode", "apply_chat_template"):
                encoded.append(name)
            return getattr(self.tokenizer, name)

    monkeypatch.setattr(served.engine.engine, "tokenizer", Spy(served.engine.engine.tokenizer))
    text = "w3 " * (1 << 20)                                   # 3 MiB: under the body limit
    value = [{"role": "user", "content": text}] if key == "messages" else text
    content = json.dumps({"model": MODEL, key: value}).encode()
    r = answered_while_health_answers(served.url, lambda: httpx.post(
        served.url + route, content=content, timeout=30, headers={"content-type": "application/json"}))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == key and "characters" in error["message"] and "max_model_len" in error["message"]
    assert not encoded


# -- the API key and CORS ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed(ckpt):
    s = Served(make_server_app(load(ckpt, max_batch=2), MODEL, warmup=False, api_key=KEY,
                               allowed_origins=["https://app.example"]))
    yield s
    s.stop()


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"),
                                          ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                          ("POST", "/tokenize"), ("POST", "/detokenize"),
                                          ("POST", "/reset_prefix_cache")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}"])
def test_every_api_route_needs_the_key(keyed, method, path, auth):
    headers = {"authorization": auth} if auth else {}
    r = httpx.request(method, keyed.url + path, headers=headers, json={"prompt": "w3"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "invalid_request_error"


def test_the_key_opens_the_api_and_probes_stay_open(keyed):
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="wrong").completions.create(model=MODEL, prompt="w3", max_tokens=2)
    c = keyed.client(api_key=KEY)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert c.completions.create(model=MODEL, prompt="w3", max_tokens=2,
                                extra_body={"ignore_eos": True}).usage.completion_tokens == 2
    auth = {"authorization": f"Bearer {KEY}"}
    assert httpx.post(keyed.url + "/tokenize", json={"prompt": "w3"}, headers=auth).json()["count"] == 2
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(keyed.url + path).status_code == 200, path


def test_the_key_comes_from_LFMSPARK_API_KEY(ckpt, monkeypatch):
    set_env(monkeypatch, API_KEY="from-the-environment")
    try:
        s = Served(make_server_app(load(ckpt, max_batch=2), MODEL, warmup=False))
    finally:
        set_env(monkeypatch, API_KEY=None)
    try:
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert s.client(api_key="from-the-environment").models.list().data[0].id == MODEL
    finally:
        s.stop()


def test_cors_answers_allowed_origins_only(keyed, served):
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
    ok = httpx.options(keyed.url + "/v1/chat/completions", headers={"origin": "https://app.example", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(keyed.url + "/v1/chat/completions", headers={"origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    simple = httpx.get(keyed.url + "/health", headers={"origin": "https://app.example"})
    assert simple.headers["access-control-allow-origin"] == "https://app.example"
    # no allowed origins (the default): no CORS headers at all
    none = httpx.options(served.url + "/v1/chat/completions", headers={"origin": "https://app.example", **preflight})
    assert "access-control-allow-origin" not in none.headers


# -- endpoints -----------------------------------------------------------------------------------

def test_models_advertise_the_context_a_request_can_use(served):
    context = context_of(served)
    listed = served.client().models.list().data[0]
    assert listed.model_extra["max_model_len"] == context
    one = served.client().models.retrieve(MODEL)
    assert one.id == MODEL and one.model_extra["max_model_len"] == context
    with pytest.raises(openai.NotFoundError) as err:
        served.client().models.retrieve("gpt-9")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    # "w3" is two tokens (BOS, w3): prompt + max_tokens may reach the advertised length exactly
    c = served.client()
    full = c.completions.create(model=MODEL, prompt="w3", max_tokens=context - 2, temperature=0.0,
                                extra_body={"ignore_eos": True})
    assert full.usage.total_tokens == context and full.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt="w3", max_tokens=context - 1)
    assert err.value.body["param"] == "max_tokens" and f"at most {context - 2}" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w3"}],
                                  max_completion_tokens=context)
    assert err.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt=[7] * context, max_tokens=1)
    assert err.value.body["param"] == "prompt" and "shorten the prompt" in err.value.body["message"]


def post(s: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=30)


def test_tokenize_gives_the_ids_the_engine_runs(served):
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w5 w6"}]
    chat = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                   extra_body={"return_token_ids": True})
    tokens = post(served, "/tokenize", {"model": MODEL, "messages": messages}).json()
    assert tokens["count"] == chat.usage.prompt_tokens == len(tokens["tokens"])
    assert tokens["max_model_len"] == context_of(served) and tokens["token_strs"] is None
    done = served.client().completions.create(model=MODEL, prompt="w3 w7", max_tokens=2,
                                              extra_body={"return_token_ids": True})
    plain = post(served, "/tokenize", {"prompt": "w3 w7", "return_token_strs": True}).json()
    assert plain["tokens"] == done.choices[0].model_extra["prompt_token_ids"]
    assert plain["token_strs"] == ["<|startoftext|>", "w3", "w7"]
    bare = post(served, "/tokenize", {"prompt": "w3 w7", "add_special_tokens": False}).json()
    assert bare["tokens"] == plain["tokens"][1:]
    no_gen = post(served, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == tokens["tokens"][:no_gen["count"]] and no_gen["count"] < tokens["count"]
    back = post(served, "/detokenize", {"model": MODEL, "tokens": plain["tokens"]}).json()
    assert back == {"prompt": "<|startoftext|> w3 w7"}
    assert post(served, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, param, status", [
    ("/tokenize", {"prompt": "w3", "messages": [{"role": "user", "content": "w3"}]}, "prompt", 400),
    ("/tokenize", {}, "prompt", 400),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "w3"}]}, "messages", 400),
    ("/tokenize", {"prompt": "w3", "model": "gpt-9"}, "model", 404),
    ("/detokenize", {"tokens": [1, 999]}, "tokens", 400),
    ("/detokenize", {"tokens": [1, True]}, "tokens", 400),
    ("/detokenize", {"tokens": [1], "model": "gpt-9"}, "model", 404),
])
def test_tokenize_and_detokenize_refusals_are_named(served, path, body, param, status):
    r = post(served, path, body)
    assert r.status_code == status and r.json()["error"]["param"] == param


def test_version(served):
    from lfmspark import __version__

    assert httpx.get(served.url + "/version").json() == {"version": __version__}


# -- small API defects ---------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b'{"model": "tiny-chat", "prompt": "w3", "max_tokens": 2', b"", b"{'prompt': 1}"])
def test_malformed_json_is_a_400_without_an_offset_for_a_param(served, raw):
    r = httpx.post(served.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] is None and "not valid JSON" in error["message"]


@pytest.mark.parametrize("field, value", [("max_tokens", True), ("max_tokens", 2.0), ("max_tokens", "2"),
                                          ("stream", "yes"), ("stream", 1), ("n", False), ("seed", 1.5),
                                          ("temperature", "0.5"), ("ignore_eos", "true"), ("logprobs", True),
                                          ("stop", 3), ("logit_bias", {"5": "1"})])
def test_types_are_strict(served, field, value):
    r = post(served, "/v1/completions", {"model": MODEL, "prompt": "w3", "max_tokens": 2} | {field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert served.engine.num_running == 0


def test_an_integer_is_a_number(served):
    out = served.client().completions.create(model=MODEL, prompt="w3", max_tokens=2, temperature=0, top_p=1)
    assert out.usage.completion_tokens == 2
    r = httpx.post(served.url + "/v1/completions", content=b'{"prompt": "w3", "temperature": NaN}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize("stream", [False, True])
def test_text_offsets_index_the_text_when_special_tokens_are_skipped(served, stream):
    def completion(**kw):
        args = dict(model=MODEL, prompt="w3 w7", max_tokens=24, logprobs=0, extra_body={"ignore_eos": True}) | kw
        if not stream:
            choice = served.client().completions.create(**args).choices[0]
            return choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
        text, tokens, offsets = "", [], []
        for ch in served.client().completions.create(stream=True, **args):
            if ch.choices:
                text += ch.choices[0].text
                if ch.choices[0].logprobs:
                    tokens += ch.choices[0].logprobs.tokens
                    offsets += ch.choices[0].logprobs.text_offset
        return text, tokens, offsets

    # every token an EOS, shown among the logprobs but not in the text: every offset is 0
    text, tokens, offsets = completion(temperature=0.0, logit_bias={str(EOS): 100.0})
    assert text == "" and tokens == ["<|im_end|>"] * 24 and offsets == [0] * 24
    # special tokens among words: each adds nothing, and no offset passes the text's end
    text, tokens, offsets = completion(temperature=1.0, seed=2, logit_bias={str(EOS): 3.0})
    specials = [i for i, t in enumerate(tokens[:-1]) if t.startswith("<|")]
    assert specials and len(text) > 0
    assert all(offsets[i + 1] == offsets[i] for i in specials)
    assert offsets == sorted(offsets) and max(offsets) <= len(text)


def test_json_answers_have_no_nan():
    content = {"tau": 1.5, "acceptance_per_position": [0.5, math.nan, math.inf], "nested": {"x": -math.inf}}
    text = dumps(content)
    assert json.loads(text) == {"tau": 1.5, "acceptance_per_position": [0.5, None, None], "nested": {"x": None}}
    assert "NaN" not in SafeJSONResponse(content).body.decode()
    assert dumps({"a": [1, 2.5, "NaN"]}) == '{"a":[1,2.5,"NaN"]}'


# -- the command line's helpers ------------------------------------------------------------------

def test_check_port_free_refuses_a_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{port}.*--port"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)              # released: free again
    with pytest.raises(PortInUseError, match="does not resolve"):
        check_port_free("no-such-host.invalid", 8000)


def test_startup_line_says_what_is_served(served):
    engine = served.engine.engine
    line = startup_line(engine, MODEL, "127.0.0.1", 8000, api_key=True)
    for part in (MODEL, "http://127.0.0.1:8000", str(engine.config.target), str(engine.config.draft), "float32",
                 "cpu", f"context {context_of(served)} tokens", f"{MAX_BATCH} slots", "CUDA graphs off",
                 "API key required"):
        assert part in line, part
