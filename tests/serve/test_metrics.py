"""The server's Prometheus metrics as a scraper sees them: the tiny server runs streamed and whole
requests, a 400 and 404s, then ``/metrics`` is parsed with prometheus_client's own parser.

Every series the Grafana dashboard (docs/grafana/lfmspark.json) queries exists; the latency split
(inter-token latency per token, time per output token per request, queue / prefill / decode) has
the observations its definition implies; the engine's state is read at the scrape (a running
stream holds one slot of four); every response is counted by route template and status, the
guards' 401 and 413 included; no ``*_created`` series is exposed."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lfmspark.serve import make_server_app
from server_fixtures import MODEL, Served, load

MAX_BATCH = 4
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "lfmspark.json"
METRIC_NAME = re.compile(r"lfmspark:[A-Za-z0-9_:]+")


@pytest.fixture(scope="module")
def served(ckpt):
    """Imposed acceptance: rounds commit several tokens, as a trained draft's do."""
    s = Served(make_server_app(load(ckpt, max_batch=MAX_BATCH, imposed_acceptance=(0.9,)), MODEL, warmup=False))
    yield s
    s.stop()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, labels less model_name): value}`` of ``/metrics``, parsed as Prometheus does."""
    text = httpx.get(url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            values[(s.name, labels)] = s.value
    return values


def total(values: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in values.items() if n == name and set(labels.items()) <= set(ls))


def dashboard_series() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    assert exprs
    return {name for e in exprs for name in METRIC_NAME.findall(e)}


def run_some_requests(s: Served) -> list[int]:
    """Whole and streamed completions and a streamed chat; a 400, and a 404 three ways. Returns
    the tokens each successful request generated."""
    c = s.client()
    tokens = []
    whole = c.completions.create(model=MODEL, prompt="w3 w7 w9", max_tokens=9, temperature=0.0,
                                 extra_body={"ignore_eos": True})
    tokens.append(whole.usage.completion_tokens)
    chunks = list(c.completions.create(model=MODEL, prompt="w4 w8", max_tokens=11, temperature=0.0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    tokens.append(chunks[-1].usage.completion_tokens)
    chat = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5 w6"}], max_tokens=7,
                                          temperature=0.0, stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True}))
    tokens.append(chat[-1].usage.completion_tokens)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="w3", max_tokens=4, temperature=-1.0)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-9", prompt="w3", max_tokens=2)
    assert httpx.get(s.url + "/v1/models/gpt-9").status_code == 404
    assert httpx.get(s.url + "/no/such/route").status_code == 404
    return tokens


def test_the_dashboards_series_and_the_latency_split_after_a_few_requests(served):
    before = scrape(served.url)
    tokens = run_some_requests(served)
    after = scrape(served.url)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    names = {n for n, _ in after}
    missing = sorted(n for n in dashboard_series() if n not in names)
    assert not missing, f"the dashboard queries series /metrics does not have: {missing}"
    assert not [n for n in names if n.endswith("_created")]

    finished = len(tokens)
    for phase in ("queue", "prefill", "decode"):
        assert delta(f"lfmspark:request_{phase}_time_seconds_count") == finished, phase
    assert delta("lfmspark:request_time_per_output_token_seconds_count") == finished   # each has 2+ tokens
    # one inter-token observation per token after each request's first, though rounds commit several
    assert delta("lfmspark:spec_decode_num_accepted_tokens_total") > 0
    assert delta("lfmspark:inter_token_latency_seconds_count") == sum(n - 1 for n in tokens)
    assert delta("lfmspark:spec_decode_num_drafts_total") < sum(n - 1 for n in tokens)
    # the per-token gaps of a request add up to its decode time (both measured in the engine thread)
    itl, decode = delta("lfmspark:inter_token_latency_seconds_sum"), delta("lfmspark:request_decode_time_seconds_sum")
    assert itl == pytest.approx(decode, rel=0.1, abs=0.02)
    # the whole latency is its phases: queue + prefill = TTFT, TTFT + decode = e2e
    ttft = delta("lfmspark:time_to_first_token_seconds_sum")
    assert delta("lfmspark:request_queue_time_seconds_sum") + delta("lfmspark:request_prefill_time_seconds_sum") \
        == pytest.approx(ttft, abs=1e-6)
    assert ttft + decode == pytest.approx(delta("lfmspark:e2e_request_latency_seconds_sum"), abs=1e-6)

    http = "lfmspark:http_requests_total"
    assert delta(http, route="/v1/completions", status="200") == 2
    assert delta(http, route="/v1/chat/completions", status="200") == 1
    assert delta(http, route="/v1/completions", status="400") == 1
    assert delta(http, route="/v1/completions", status="404") == 1
    assert delta(http, route="/v1/models/{model_id}", status="404") == 1         # the template, not the id
    assert delta(http, route="none", status="404") == 1
    assert not [ls for n, ls in after if n == http and ("route", "/v1/models/gpt-9") in ls]


def test_the_engines_state_is_read_at_the_scrape(served):
    """A stream holding one slot of four shows as one running request and the KV pages it holds (the
    engine held after the step that started it); once it has ended, nothing is running and only the
    prefix cache holds pages."""
    engine, gate = served.engine.engine, threading.Event()
    real_step = engine.step

    def held_step():
        events = real_step()
        if engine.num_running:
            gate.wait(30)
        return events

    engine.step = held_step
    body = {"model": MODEL, "prompt": "w3 w4", "max_tokens": 20, "stream": True, "ignore_eos": True,
            "temperature": 0.0}
    try:
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass                                       # until its first token is out; the engine is held
            during = scrape(served.url)
            held = served.engine.usage()
            gate.set()
            assert "data: [DONE]" in list(lines)           # the stream then runs to its end
    finally:
        gate.set()
        del engine.step
    assert during[("lfmspark:num_requests_running", ())] == 1
    assert held["kv_pages_in_use"] > 0
    assert during[("lfmspark:kv_cache_usage_perc", ())] == pytest.approx(held["kv_pages_in_use"] / held["kv_pages"])
    assert during[("lfmspark:num_preemptions_total", ())] == 0
    assert during[("lfmspark:num_requests_waiting", ())] == 0
    usage = served.engine.usage()
    assert during[("lfmspark:prefix_cache_queries_total", ())] == usage["prefix_cache_queries"]
    assert during[("lfmspark:prefix_cache_usage_perc", ())] == pytest.approx(
        usage["prefix_cache_blocks"] / usage["prefix_cache_capacity"] if usage["prefix_cache_capacity"] else 0.0)
    after = scrape(served.url)
    cached = served.engine.engine.model_runner.prefix_cache          # a cached block holds one page
    assert after[("lfmspark:num_requests_running", ())] == 0
    assert after[("lfmspark:kv_cache_usage_perc", ())] == pytest.approx(
        cached.cached_blocks / held["kv_pages"] if cached is not None else 0.0)


def test_the_guards_answers_are_counted(ckpt):
    """The API key's 401 and the body limit's 413 never reach a route; they are counted under the
    route they were sent to."""
    s = Served(make_server_app(load(ckpt, max_batch=2), MODEL, warmup=False, api_key="sk-k", max_request_bytes=512))
    try:
        assert httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "w3"}).status_code == 401
        big = httpx.post(s.url + "/v1/completions", headers={"Authorization": "Bearer sk-k"},
                         json={"model": MODEL, "prompt": "w3 " * 400, "max_tokens": 2})
        assert big.status_code == 413
        values = scrape(s.url)                 # /metrics needs no key
        http = "lfmspark:http_requests_total"
        assert total(values, http, route="/v1/completions", status="401") == 1
        assert total(values, http, route="/v1/completions", status="413") == 1
        assert not [n for n, _ in values if n.endswith("_created")]
    finally:
        s.stop()
