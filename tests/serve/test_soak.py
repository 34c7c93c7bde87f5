"""A soak of the server: 1,000 requests over loopback, streaming and not, about a quarter of them
disconnecting at a random point and a tenth invalid, at most 24 in flight on an engine of 8 slots.
Every request that completes answers what the same request answers alone; the invalid ones get
their 4xx; afterwards nothing is held (slots, queue, streams, cache jobs) and the process's resident
memory is within 10% of where it was after a warm-up of the same kind of traffic."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random

import httpx
import pytest

from engine_fixtures import assert_no_page_leaked
from lfmspark.runtime import SamplingParams
from lfmspark.serve import make_server_app
from server_fixtures import MODEL, Served, load

WORDS = [f"w{i}" for i in range(40)]


def resident_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def traffic(n: int, seed: int) -> list[dict]:
    """``n`` requests: a prompt from 30 (so many repeat, and the prefix cache has hits), a length,
    streaming or not, and whether the client hangs up (after how many chunks) or sends a bad body."""
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(30)]
    out = []
    for i in range(n):
        kind = rng.random()
        out.append({"i": i, "prompt": rng.choice(prompts), "max_tokens": rng.randint(1, 24),
                    "stream": rng.random() < 0.5,
                    "invalid": kind < 0.1, "hang_up": 0.1 <= kind < 0.35, "after": rng.randint(0, 6)})
    return out


def body(req: dict) -> dict:
    b = {"model": MODEL, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0.0,
         "stream": req["stream"]}
    if req["invalid"]:
        b[random.Random(req["i"]).choice(["temperature", "max_tokens", "model"])] = {
            "temperature": -1.0, "max_tokens": 0, "model": "other"}
    return b


async def send(client: httpx.AsyncClient, req: dict) -> tuple[str, object]:
    """("done", text) | ("refused", status) | ("hung up", None)."""
    b = body(req)
    if req["invalid"]:
        return "refused", (await client.post("/v1/completions", json=b)).status_code
    if not req["stream"]:
        # a client that hangs up gives up after a few ms (its connection closes), unless the answer came first
        timeout = 0.002 * (1 + req["after"]) if req["hang_up"] else 120
        try:
            r = await client.post("/v1/completions", json=b, timeout=timeout)
        except httpx.TimeoutException:
            if req["hang_up"]:
                return "hung up", None
            raise
        r.raise_for_status()
        return "done", r.json()["choices"][0]["text"]
    text, chunks = "", 0
    async with client.stream("POST", "/v1/completions", json=b) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            if req["hang_up"] and chunks > req["after"]:
                return "hung up", None            # leaving the block closes the connection mid-stream
            text += json.loads(line[6:])["choices"][0]["text"]
    return "done", text


async def run(url: str, requests: list[dict], in_flight: int = 24) -> list[tuple[str, object]]:
    limit = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(req):
            async with limit:
                return await send(client, req)
        return await asyncio.gather(*(one(r) for r in requests))


@pytest.mark.slow
def test_a_thousand_requests_leave_nothing_behind(ckpt):
    solo = load(ckpt, max_batch=1, prefix_block=16, chat=False)      # completions take the text as it is
    engine = load(ckpt, max_batch=8, prefix_block=16)
    served = Served(make_server_app(engine, MODEL, warmup=False))
    try:
        asyncio.run(run(served.url, traffic(150, seed=1)))          # warm-up: allocator, caches, tokenizer
        gc.collect()
        warm = resident_bytes()
        requests = traffic(1000, seed=2)
        results = asyncio.run(run(served.url, requests))
        gc.collect()
        after = resident_bytes()
        ae = served.engine
        assert (ae.num_running, ae.num_waiting, ae.num_open_streams) == (0, 0, 0)
        assert engine.idle and not engine.scheduler.live and engine.scheduler.pool.n_free == 8
        assert_no_page_leaked(engine)
        cache = engine.prefix_cache_stats
        assert 0 < cache["cached_blocks"] <= cache["capacity_blocks"] and cache["hits"] > 0

        counts = {"done": 0, "refused": 0, "hung up": 0}
        for req, (outcome, value) in zip(requests, results):
            counts[outcome] += 1
            if req["invalid"]:
                assert outcome == "refused" and value in (400, 404), (req, value)
            elif outcome == "done":
                want = solo.generate(req["prompt"], SamplingParams(max_new_tokens=req["max_tokens"]))[0].text
                assert value == want, req
            else:
                assert req["hang_up"], req
        assert counts["refused"] >= 60 and counts["hung up"] >= 100 and counts["done"] >= 500, counts
        assert after <= 1.1 * warm, (warm, after)
    finally:
        served.stop()
