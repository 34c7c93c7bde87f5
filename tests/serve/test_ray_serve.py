"""Replicas on Ray Serve (serve/ray_app.py), on the CPU: two replicas of a tiny checkpoint behind one
endpoint, driven with the openai client over loopback.

One local Ray instance and one deployment serve the module (starting them takes ~10-15 s).
"""

from __future__ import annotations

import concurrent.futures
import socket
import time

import httpx
import pytest
import torch

from engine_fixtures import save_tiny_draft, save_tiny_target
from lfmspark.runtime import Engine, SamplingParams
from lfmspark.runtime.config import EngineConfig

ray = pytest.importorskip("ray", reason="the ray extra (pip install 'lfmspark[ray]') is not installed")
serve = pytest.importorskip("ray.serve")
from lfmspark.serve.ray_app import (PrefixAffinityRouter, merge_metrics, prefix_keys, relay,  # noqa: E402
                                    routing_text)

MODEL = "tiny"
MAX_BATCH = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    return save_tiny_target(root / "target"), save_tiny_draft(root / "draft")


@pytest.fixture(scope="module")
def cluster(ckpt):
    from lfmspark.serve.ray_app import deployments

    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    target, draft = ckpt
    config = EngineConfig(target=str(target), draft=str(draft), max_batch=MAX_BATCH, max_seq_len=512)
    serve.run(deployments(config, MODEL, 2), route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def test_app_builder_takes_the_engine_flags_by_name(ckpt, monkeypatch):
    """``serve run lfmspark.serve.ray_app:app_builder key=value ...``: every engine flag of
    ``lfmspark serve`` by its name, switches as key=true, the output parsers as server options; an
    unknown key is named."""
    from lfmspark.serve import ray_app

    built = {}
    monkeypatch.setattr(ray_app, "deployments", lambda config, name, replicas, server_options=None: built.update(
        config=config, name=name, replicas=replicas, options=server_options))
    target, draft = ckpt
    ray_app.app_builder({"target": str(target), "draft": str(draft), "max_batch": "3", "max_model_len": "300",
                         "exact": "true", "prefix_cache_outputs": "false", "replicas": "2", "name": "m",
                         "reasoning_parser": "qwen3"})
    assert built["config"] == EngineConfig(target=str(target), draft=str(draft), max_batch=3, max_seq_len=300,
                                           exact=True)
    assert (built["name"], built["replicas"], built["options"]) == ("m", 2, {"reasoning_parser": "qwen3"})
    with pytest.raises(ValueError, match="unknown key 'max_batches'"):
        ray_app.app_builder({"preset": "tiny", "max_batches": "3"})
    with pytest.raises(ValueError, match="needs target=DIR"):
        ray_app.app_builder({"max_batch": "3"})
    with pytest.raises(ValueError, match="max-batch"):
        ray_app.app_builder({"preset": "tiny", "max_batch": "three"})


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def solo(ckpt, prompt, max_tokens: int, chat: bool) -> list[int]:
    target, draft = ckpt
    engine = Engine.from_pretrained(target, draft, dtype=torch.float32, device="cpu", max_batch=1, max_seq_len=512,
                                    chat=chat)
    return engine.generate([prompt], SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))[0].token_ids


def words(n: int, start: int = 3) -> str:
    return " ".join(f"w{start + i % 40}" for i in range(n))


def test_replicas_answer_what_one_engine_answers(cluster, ckpt):
    c = client(cluster)
    prompt = words(12)
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].token_ids == solo(ckpt, prompt, 6, chat=False)
    messages = [{"role": "user", "content": words(9, 7)}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    assert chat.choices[0].token_ids == solo(ckpt, messages, 5, chat=True)
    streamed = "".join(chunk.choices[0].text for chunk in c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == out.choices[0].text
    bad = httpx.post(cluster + "/v1/completions", json={"model": MODEL, "prompt": prompt, "bogus": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bogus"


def test_a_conversation_stays_on_one_replica(cluster):
    """Each chat's turns (each turn's messages start with the previous turn's) reach one replica."""
    served: dict[int, set[str]] = {}
    for turn in range(3):
        for conv in range(4):
            messages = [{"role": "system", "content": words(80, 3 + conv)}]
            for t in range(turn + 1):
                messages += [{"role": "user", "content": words(6, 10 + t)}, {"role": "assistant", "content": "w5"}]
            r = httpx.post(cluster + "/v1/chat/completions", timeout=120,
                           json={"model": MODEL, "messages": messages[:-1], "max_tokens": 2, "temperature": 0.0})
            assert r.status_code == 200, r.text
            served.setdefault(conv, set()).add(r.headers["x-lfmspark-replica"])
    assert all(len(replicas) == 1 for replicas in served.values()), served


def metric_lines(url: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of the samples named ``name`` in the merged /metrics."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


def settled_total(url: str, name: str) -> float:
    """The sum of ``name`` over every replica once two reads 2.5 s apart agree (replicas post every second)."""
    last = None
    for _ in range(20):
        total = sum(metric_lines(url, name).values())
        if total == last:
            return total
        last = total
        time.sleep(2.5)
    return last


def test_metrics_gather_every_replica(cluster):
    """Both replicas appear in one exposition, each sample labelled with its replica, and the
    requests' counts add up across them."""
    success = "lfmspark:request_success_total"
    deadline = time.time() + 20
    while len(metric_lines(cluster, "lfmspark:num_requests_running")) < 2 and time.time() < deadline:
        time.sleep(0.5)
    running = metric_lines(cluster, "lfmspark:num_requests_running")
    assert len({labels.split('replica="')[1] for labels in running}) == 2
    before = settled_total(cluster, success)     # earlier tests' requests may still be on their way
    c = client(cluster)
    for i in range(4):
        c.completions.create(model=MODEL, prompt=words(5, 20 + 7 * i), max_tokens=3, temperature=0.0,
                             extra_body={"ignore_eos": True})
    deadline = time.time() + 20                   # replicas post their metrics every second
    while sum(metric_lines(cluster, success).values()) < before + 4 and time.time() < deadline:
        time.sleep(0.5)
    assert sum(metric_lines(cluster, success).values()) == before + 4
    assert httpx.get(cluster + "/metrics").text.count("# TYPE lfmspark:request_success counter") == 1


def test_killing_a_replica_loses_no_request_that_had_not_started(cluster):
    """Ten requests on four slots (two replicas of two): while they run, one replica is killed. Only
    requests it had started may fail; the ones still waiting in Ray's router run elsewhere, and the
    service keeps answering (Ray replaces the replica)."""
    c = client(cluster)

    def ask(i: int):
        try:
            out = c.completions.create(model=MODEL, prompt=words(5, 3 + 4 * i), max_tokens=60, temperature=0.0,
                                       extra_body={"ignore_eos": True})
            return out.choices[0].finish_reason
        except Exception as e:                   # noqa: BLE001 - the killed replica's own requests
            assert getattr(e, "status_code", None) == 503, e      # a clear error, never a hang
            return e

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(ask, i) for i in range(10)]
        time.sleep(1.0)
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Replica#" in a["name"]]
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=False)
        results = [f.result(timeout=300) for f in futures]
    failed = [r for r in results if r != "length"]
    assert len(failed) <= MAX_BATCH, results
    after = c.completions.create(model=MODEL, prompt=words(4), max_tokens=3, temperature=0.0)
    assert after.choices[0].finish_reason in ("length", "stop")


def test_routing_text_and_prefix_keys():
    chat = routing_text("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}')
    longer = routing_text("/v1/chat/completions",
                          b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}')
    assert longer.startswith(chat) and chat
    assert routing_text("/v1/completions", b'{"prompt": "abc"}') == "abc"
    assert routing_text("/v1/models", b"") == "" and routing_text("/v1/completions", b"{not json") == ""
    a, b = prefix_keys("x" * 600, 256), prefix_keys("x" * 512 + "y" * 88, 256)
    assert len(a) == 2 and a == b                 # whole blocks only, equal prefixes, equal keys
    assert prefix_keys("x" * 511 + "z", 256)[1] != a[1]
    assert PrefixAffinityRouter._keys(None) == []


def test_merge_metrics_labels_each_replica_once_per_family():
    text = "# HELP c_total things\n# TYPE c_total counter\nc_total{model_name=\"m\"} 3.0\n"
    merged = merge_metrics({"a": text, "b": text.replace("3.0", "4.0")})
    assert merged.count("# TYPE c counter") == 1
    assert 'c_total{model_name="m",replica="a"} 3.0' in merged and 'replica="b"} 4.0' in merged


def _replica_stream(*items):
    """A replica's asgi_exchange stream: each item yielded, or raised where it is an exception."""
    async def gen():
        for item in items:
            if isinstance(item, BaseException):
                raise item
            yield item
    return gen()


def test_relay_turns_a_replica_dying_after_its_response_start_into_a_503():
    import asyncio

    json_start = (200, [("content-type", "application/json"), ("content-length", "7")])
    died = asyncio.run(relay(_replica_stream(json_start, RuntimeError("actor died"))))
    assert died.status_code == 503 and b"replica_failed" in died.body
    before = asyncio.run(relay(_replica_stream(RuntimeError("actor died"))))
    assert before.status_code == 503
    whole = asyncio.run(relay(_replica_stream(json_start, b'{"a":', b"1}")))
    assert whole.status_code == 200 and whole.body == b'{"a":1}' and whole.headers["content-length"] == "7"
    sse = asyncio.run(relay(_replica_stream((200, [("content-type", "text/event-stream")]), b"data: 1\n\n")))
    assert sse.status_code == 200 and sse.media_type is None and hasattr(sse, "body_iterator")
