"""``lfmspark bench serve``: an open-loop serving benchmark, target-only and speculative on one trace.

Requests arrive on their own clock (Poisson at ``request_rate`` per second, or all at once with
``inf``; at most ``max_concurrency`` in flight), as in ``vllm bench serve`` and
``sglang.bench_serving``, so a slow step shows as queueing, TTFT and inter-token latency instead of
as a lower closed-loop rate. Each engine is built, warmed up and driven through an
:class:`AsyncEngine` with the same trace (prompts, output lengths, arrival times). Reported per
engine, in vLLM's words and units: successful requests, duration, tokens, request / output / total
token throughput, TTFT, TPOT (per request, excluding the first token) and ITL (the gap between
consecutive streamed events, each event's tokens counted at its arrival) as mean / p50 / p90 / p99,
end-to-end latency, τ, peak GPU memory.

Prompts: random token ids of ``input_len`` (drawn in ``[input_len * (1 - range_ratio), input_len *
(1 + range_ratio)]``, likewise the outputs), or a JSONL file with one ``{"prompt": text or token
ids, "output_len": n}`` per line (text needs a checkpoint with a tokenizer).

With ``base_url`` the same trace (prompts, output lengths, arrival times, from the same seed) goes
over HTTP to any OpenAI-compatible server instead (``lfmspark serve``, vLLM, SGLang), streaming, so
that servers are compared on one machine with the numbers measured the same way: from the client,
TTFT to the first chunk that carries tokens, ITL between such chunks, the token counts from the
final chunk's ``usage`` (``stream_options.include_usage``), or where the server returns none from
the chunks, one token each (the report says which). Each request asks for exactly its trace length
(``max_tokens``, and ``ignore_eos`` / ``min_tokens``, the extensions vLLM and lfmspark take; a
server that refuses one by name is sent the rest). The result is one entry, ``server``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..runtime.async_engine import AsyncEngine
from ..runtime.config import EngineConfig
from ..runtime.engine import Engine
from ..runtime.loader import load_models
from ..runtime.sampling import SamplingParams
from .bench import bench_mode

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("lfmspark")

# --endpoint: the OpenAI routes a server is driven through
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# random prompts' token ids over HTTP are drawn below this (the server's vocabulary is not asked):
# LFM2's and LFM2.5-1.2B's, so the trace is the in-process one of those models
DEFAULT_VOCAB = 65536
# body fields beyond what every OpenAI-compatible server takes: sent unless the server refuses them
# by name (the warm-up request finds out), so each request runs to its trace length and reports usage
_OPTIONAL_FIELDS = ("ignore_eos", "min_tokens", "stream_options")


@dataclass
class ServeBenchConfig:
    """The trace and its arrivals; the engines' config is ``engine`` (its ``max_seq_len`` is fitted to
    the trace by :func:`fitted_seq_len` unless the command line sets one)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    num_prompts: int = 64
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.0
    dataset: str | None = None
    request_rate: float = math.inf
    max_concurrency: int | None = None
    # set: each engine first serves the trace all at once (its capacity, requests per second at
    # saturation), then again with Poisson arrivals at this fraction of that capacity
    capacity_fraction: float | None = None
    temperature: float = 0.0
    json_path: str | None = None
    # set: the trace goes over HTTP to this OpenAI-compatible server, not through in-process engines
    base_url: str | None = None
    endpoint: str = "completions"      # a key of ENDPOINTS; chat: each prompt one user message (text only)
    model: str | None = None           # the name the requests send (None: the first id of GET /v1/models)
    api_key: str | None = field(default=None, repr=False)   # never written to the report
    vocab_size: int = DEFAULT_VOCAB    # random prompts' ids with base_url (in-process: the target's vocabulary)


@dataclass
class _Trace:
    prompts: list[list[int] | str]
    output_lens: list[int]
    arrivals: list[float]            # seconds from the start


@dataclass
class _Result:
    ok: bool
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    tau: float = 1.0
    cached: int = 0                   # prompt tokens the prefix cache supplied
    error: str | None = None
    counted: str = "engine"           # where the token counts come from: engine, usage or chunks (HTTP)


def make_trace(cfg: ServeBenchConfig, vocab: int) -> _Trace:
    rng = random.Random(cfg.engine.seed)

    def length(base: int) -> int:
        lo, hi = max(1, int(base * (1 - cfg.range_ratio))), max(1, int(base * (1 + cfg.range_ratio)))
        return rng.randint(lo, hi)

    if cfg.dataset:
        prompts, output_lens = [], []
        with open(cfg.dataset) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    prompts.append(row["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{cfg.dataset}:{n}: each line must be a JSON object with a 'prompt' "
                                     f"({type(e).__name__}: {e})") from None
                output_lens.append(int(row.get("output_len", cfg.output_len)))
                if len(prompts) == cfg.num_prompts:
                    break
        if not prompts:
            raise ValueError(f"{cfg.dataset} holds no prompts")
    else:
        prompts = [[rng.randrange(1, vocab) for _ in range(length(cfg.input_len))] for _ in range(cfg.num_prompts)]
        output_lens = [length(cfg.output_len) for _ in prompts]
    return _Trace(prompts, output_lens, poisson_arrivals(len(prompts), cfg.request_rate, rng))


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival times (seconds from the start) of ``n`` requests at ``rate`` per second (inf: all at 0)."""
    t, arrivals = 0.0, []
    for _ in range(n):
        arrivals.append(t)
        if math.isfinite(rate):
            t += rng.expovariate(rate)
    return arrivals


async def _open_loop(trace: _Trace, cfg: ServeBenchConfig,
                     request: Callable[[int], Awaitable[_Result]]) -> tuple[list[_Result], float]:
    """Send request ``i`` at its arrival time (at most ``max_concurrency`` in flight); the results in
    trace order and the duration, from the first arrival to the last request's end."""
    gate = asyncio.Semaphore(cfg.max_concurrency or len(trace.prompts))
    start = time.perf_counter()

    async def one(i: int) -> _Result:
        await asyncio.sleep(max(0.0, start + trace.arrivals[i] - time.perf_counter()))
        async with gate:
            return await request(i)

    results = await asyncio.gather(*(one(i) for i in range(len(trace.prompts))))
    return list(results), time.perf_counter() - start


async def _drive(engine: AsyncEngine, trace: _Trace, cfg: ServeBenchConfig) -> tuple[list[_Result], float]:
    async def request(i: int) -> _Result:
        params = SamplingParams(max_new_tokens=trace.output_lens[i], temperature=cfg.temperature,
                                seed=cfg.engine.seed + i, ignore_eos=True)
        t0 = last = time.perf_counter()
        res = _Result(ok=False)
        try:
            async for ev in engine.generate(trace.prompts[i], params, request_id=f"bench-{i}"):
                now = time.perf_counter()
                if ev.token_ids:
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
                if ev.finished:
                    out = ev.output
                    res.ok, res.output_len, res.prompt_len = True, len(out.token_ids), len(out.prompt_token_ids)
                    res.e2e, res.tau = now - t0, out.stats.tau
                    res.cached = out.stats.prompt_tokens_cached
        except Exception as e:        # a failed request is counted, not fatal to the benchmark
            res.error = f"{type(e).__name__}: {e}"
        return res

    return await _open_loop(trace, cfg, request)


async def _serve_trace(engine: Engine, trace: _Trace, cfg: ServeBenchConfig) -> tuple[list[_Result], float]:
    ae = AsyncEngine(engine, max_waiting=len(trace.prompts) + 1)
    try:
        return await _drive(ae, trace, cfg)
    finally:
        await ae.shutdown()


# -- an OpenAI-compatible server over HTTP -------------------------------------------------------

def require_httpx() -> Any:
    """httpx (the HTTP client of ``base_url``), or an ImportError that says how to install it."""
    try:
        import httpx
    except ImportError:
        raise ImportError("--base-url needs httpx: install it with pip install 'lfmspark[serve]' (or pip install "
                          "httpx)") from None
    return httpx


class _Server:
    """An OpenAI-compatible server as the benchmark drives it: the route, the model name, and the
    optional body fields it refused (dropped from every request)."""

    def __init__(self, cfg: ServeBenchConfig):
        root = cfg.base_url.rstrip("/")
        self.root = root.removesuffix("/v1")           # http://host:port and http://host:port/v1 alike
        self.url = self.root + ENDPOINTS[cfg.endpoint]
        self.chat = cfg.endpoint == "chat"
        self.model = cfg.model
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.refused: list[str] = []

    def body(self, prompt: list[int] | str, output_len: int, seed: int, temperature: float) -> dict:
        """One streamed request of ``output_len`` tokens, as the in-process request asks for them."""
        body: dict[str, Any] = {"model": self.model} if self.model else {}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body.update(max_tokens=output_len, temperature=temperature, seed=seed, stream=True)
        optional = {"ignore_eos": True, "min_tokens": output_len, "stream_options": {"include_usage": True}}
        body.update({k: v for k, v in optional.items() if k not in self.refused})
        return body

    def carries_tokens(self, chunk: dict) -> bool:
        """Whether a streamed chunk brings tokens. A completion chunk with a choice always does (as
        vllm bench serve counts them); a chat chunk does when its delta has content, or an empty
        content without the role (tokens whose text is not yet whole characters): the opening
        role chunk, the closing finish chunk and the usage chunk do not."""
        choices = chunk.get("choices") or []
        if not choices:
            return False
        if not self.chat:
            return True
        delta = choices[0].get("delta") or {}
        content = delta.get("content")
        return bool(content) or (content is not None and "role" not in delta)


def _error_text(raw: bytes | str | dict) -> str:
    """The message of an error body (OpenAI's ``{"error": {"message": ...}}`` and the like), short."""
    body: Any = raw
    if not isinstance(raw, dict):
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        try:
            body = json.loads(text)
        except ValueError:
            return text.strip()[:300]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:300]
        return str(body.get("message") or body.get("detail") or err)[:300]
    return str(body)[:300]


def _client(lib: Any, connections: int, server: _Server) -> httpx.AsyncClient:
    """An httpx client (``lib``: the module) with one connection per request in flight (httpx's
    default pool of 100 would queue the rest client-side, inside their TTFT) and no read deadline
    (a long trace's requests may wait long)."""
    return lib.AsyncClient(timeout=lib.Timeout(None, connect=30.0), headers=server.headers,
                           limits=lib.Limits(max_connections=connections, max_keepalive_connections=connections))


async def _prepare(server: _Server, trace: _Trace, cfg: ServeBenchConfig) -> None:
    """Before the clock starts: the model name (GET /v1/models) unless given, then one short request
    (as vllm bench serve's test prompt), which warms the server's route and finds the optional
    fields it refuses. A server that does not answer is not an error here: the trace's requests
    record it."""
    httpx = require_httpx()
    async with _client(httpx, 1, server) as client:
        if server.model is None:
            try:
                r = await client.get(server.root + "/v1/models")
                r.raise_for_status()
                server.model = r.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
                log.warning("GET %s/v1/models failed (%s: %s): the requests name no model", server.root,
                            type(e).__name__, e)
        for _ in range(len(_OPTIONAL_FIELDS)):
            body = server.body(trace.prompts[0], 1, cfg.engine.seed, cfg.temperature)
            try:
                r = await client.post(server.url, json=body)
            except httpx.HTTPError:
                return
            refused = [k for k in _OPTIONAL_FIELDS if k not in server.refused and k in r.text]
            if r.status_code not in (400, 422) or not refused:
                return
            log.warning("%s refuses %s: the requests go without", server.url, ", ".join(refused))
            server.refused += refused


async def _http_request(client: httpx.AsyncClient, server: _Server, prompt: list[int] | str, output_len: int,
                        seed: int, temperature: float) -> _Result:
    """One streamed request, timed from the client as :func:`_drive` times an engine's."""
    res = _Result(ok=False)
    chunks, usage, last = 0, None, 0.0
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", server.url, json=server.body(prompt, output_len, seed, temperature)) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {_error_text(await r.aread())}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk and not chunk.get("choices"):       # a request that failed midway
                    res.error = f"stream error: {_error_text(chunk)}"
                    return res
                if server.carries_tokens(chunk):
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last, chunks = now, chunks + 1
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except Exception as e:             # a failed request is counted, not fatal to the benchmark
        res.error = f"{type(e).__name__}: {e}"
        return res
    if chunks == 0:
        res.error = "the stream ended without tokens"
        return res
    res.ok, res.e2e = True, last - t0
    if usage and usage.get("completion_tokens") is not None:
        res.output_len, res.prompt_len = usage["completion_tokens"], usage.get("prompt_tokens") or 0
        res.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        res.counted = "usage"
    else:
        res.output_len = chunks
        res.prompt_len = len(prompt) if isinstance(prompt, list) else 0
        res.counted = "chunks"
    return res


async def _serve_over_http(server: _Server, trace: _Trace, cfg: ServeBenchConfig) -> tuple[list[_Result], float]:
    async with _client(require_httpx(), cfg.max_concurrency or len(trace.prompts), server) as client:
        return await _open_loop(trace, cfg, lambda i: _http_request(
            client, server, trace.prompts[i], trace.output_lens[i], cfg.engine.seed + i, cfg.temperature))


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    s = sorted(values)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
    return {"mean": statistics.fmean(s), "p50": statistics.median(s), "p90": pct(0.90), "p99": pct(0.99)}


def _summarise(results: list[_Result], duration: float, peak_bytes: int | None, warmup_s: float | None) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ms = lambda xs: {k: v * 1e3 for k, v in _stats(xs).items()}  # noqa: E731
    return {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": ms([r.ttft for r in ok]),
        "tpot_ms": ms([(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]),
        "itl_ms": ms([x for r in ok for x in r.itls]),
        "e2el_ms": ms([r.e2e for r in ok]),
        "tau_mean": statistics.fmean(r.tau for r in ok) if ok else float("nan"),
        "cached_input_tokens": sum(r.cached for r in ok),
        "peak_memory_gb": None if peak_bytes is None else peak_bytes / 1e9,
        "warmup_s": warmup_s,
    }


def _summarise_server(results: list[_Result], duration: float) -> dict:
    """:func:`_summarise` of requests a server answered: no τ (a client does not see the rounds), no
    memory or warm-up, and ``token_counts``: where the token counts came from (usage, chunks)."""
    summary = _summarise(results, duration, None, None)
    summary["tau_mean"] = None
    sources = sorted({r.counted for r in results if r.ok})
    summary["token_counts"] = ", ".join(sources) if sources else None
    if "chunks" in sources:
        log.warning("the server returned no usage for some requests: their tokens are counted as one per chunk")
    return summary


def fitted_seq_len(cfg: ServeBenchConfig) -> int:
    """A ``max_seq_len`` that holds the trace's longest request and its verify window."""
    longest = int(cfg.input_len * (1 + cfg.range_ratio)) + int(cfg.output_len * (1 + cfg.range_ratio))
    if cfg.dataset:
        longest = max(longest, 4096)
    return 1 << max(7, math.ceil(math.log2(longest + 64)))


def _report_frame(cfg: ServeBenchConfig) -> dict:
    config = {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf") for k, v in asdict(cfg).items()
              if k != "api_key"}
    return {"schema": 1, "config": config, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "results": {}}


def _at_capacity_fraction(name: str, trace: _Trace, cfg: ServeBenchConfig, report: dict,
                          serve: Callable[[_Trace], dict]) -> tuple[_Trace, float]:
    """Serve the trace all at once (the capacity, reported as ``NAME_saturation``), then return the
    trace with Poisson arrivals at ``capacity_fraction`` of it, and that rate."""
    at_once = _Trace(trace.prompts, trace.output_lens, [0.0] * len(trace.prompts))
    saturation = serve(at_once)
    report["results"][f"{name}_saturation"] = saturation
    rate = cfg.capacity_fraction * saturation["request_throughput"]
    if rate <= 0:             # nothing succeeded: there is no capacity to take a fraction of
        log.warning("%s: no request succeeded at saturation; serving the trace all at once", name)
        return at_once, math.inf
    served = _Trace(trace.prompts, trace.output_lens,
                    poisson_arrivals(len(trace.prompts), rate, random.Random(cfg.engine.seed + 1)))
    log.info("%s: capacity %.2f req/s; serving at %.2f req/s", name, saturation["request_throughput"], rate)
    return served, rate


def run_serve_bench(cfg: ServeBenchConfig) -> dict:
    """Both engines on one trace, or the server at ``cfg.base_url``; the report (also written to
    ``cfg.json_path``)."""
    if cfg.capacity_fraction is not None and not 0 < cfg.capacity_fraction <= 1:
        raise ValueError(f"capacity_fraction must be in (0, 1], got {cfg.capacity_fraction}")
    if cfg.base_url is not None:
        report = _run_against_server(cfg)
    else:
        report = _run_in_process(cfg)
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(report, indent=1))
    return report


def _run_against_server(cfg: ServeBenchConfig) -> dict:
    if cfg.endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {cfg.endpoint!r}")
    require_httpx()
    if not log.isEnabledFor(logging.DEBUG):
        logging.getLogger("httpx").setLevel(logging.WARNING)      # not a line per request
    server = _Server(cfg)
    trace = make_trace(cfg, cfg.vocab_size)
    if server.chat and not all(isinstance(p, str) for p in trace.prompts):
        raise ValueError("the chat endpoint takes text prompts: token-id prompts need the completions endpoint")
    asyncio.run(_prepare(server, trace, cfg))
    report = _report_frame(cfg)
    report["server"] = {"base_url": cfg.base_url, "endpoint": server.url.removeprefix(server.root),
                        "model": server.model, "refused_fields": list(server.refused)}
    log.info("server: %d requests to %s (model %s), rate %s/s", len(trace.prompts), server.url, server.model,
             cfg.request_rate)

    def serve(t: _Trace) -> dict:
        return _summarise_server(*asyncio.run(_serve_over_http(server, t, cfg)))

    served, rate = trace, None
    if cfg.capacity_fraction is not None:
        served, rate = _at_capacity_fraction("server", trace, cfg, report, serve)
    report["results"]["server"] = serve(served)
    if rate is not None:
        report["results"]["server"]["request_rate"] = rate
    return report


def _run_in_process(cfg: ServeBenchConfig) -> dict:
    models = load_models(cfg.engine)       # one set of weights for both engines
    kinds = ["target_only"] + (["speculative"] if models.draft is not None else [])
    report = _report_frame(cfg)
    trace = make_trace(cfg, models.target.config.vocab_size)
    for kind in kinds:
        if kind == "speculative":
            engine = Engine.from_config(cfg.engine, models)
        else:
            engine = Engine.from_config(cfg.engine.replace(imposed_acceptance=None, verify_widths=None),
                                        models.without_draft())
        t0 = time.perf_counter()
        engine.warmup(progress=False, sampling=[bench_mode(cfg.temperature, engine)])   # the trace's mode only
        warmup_s = time.perf_counter() - t0
        if engine.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(engine.device)
        log.info("%s: %d requests, rate %s/s", kind, len(trace.prompts), cfg.request_rate)

        served, rate = trace, None
        if cfg.capacity_fraction is not None:
            served, rate = _at_capacity_fraction(
                kind, trace, cfg, report,
                lambda t, e=engine: _summarise(*asyncio.run(_serve_trace(e, t, cfg)), None, warmup_s))
            if engine.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(engine.device)
        engine.kv_pages.peak_in_use = engine.kv_pages.in_use
        results, duration = asyncio.run(_serve_trace(engine, served, cfg))
        peak = torch.cuda.max_memory_allocated(engine.device) if engine.device.type == "cuda" else None
        report["results"][kind] = _summarise(results, duration, peak, warmup_s)
        report["results"][kind]["kv_cache"] = {**engine.kv_cache_info(), "preemptions": engine.num_preemptions}
        if rate is not None:
            report["results"][kind]["request_rate"] = rate
        if cfg.json_path:       # each engine's figures as soon as they exist, should a later one fail
            Path(cfg.json_path).write_text(json.dumps(report, indent=1))
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return report


def format_report(report: dict) -> str:
    """vLLM's ``bench serve`` block, once per engine (or server)."""
    lines = []
    counted = {"usage": "the server's usage", "chunks": "streamed chunks, one token each (no usage returned)",
               "chunks, usage": "usage where returned, else one token per chunk"}
    for kind, r in report["results"].items():
        lines += [f"{' Serving Benchmark Result: ' + kind + ' ':=^60}"]
        if "request_rate" in r:
            lines.append(f"{'Request rate (req/s):':<44}{r['request_rate']:.2f}")
        lines += [f"{'Successful requests:':<44}{r['successful_requests']}",
                  f"{'Failed requests:':<44}{r['failed_requests']}",
                  f"{'Benchmark duration (s):':<44}{r['duration_s']:.2f}",
                  f"{'Total input tokens:':<44}{r['total_input_tokens']}",
                  f"{'Total generated tokens:':<44}{r['total_output_tokens']}",
                  f"{'Request throughput (req/s):':<44}{r['request_throughput']:.2f}",
                  f"{'Output token throughput (tok/s):':<44}{r['output_throughput']:.2f}",
                  f"{'Total Token throughput (tok/s):':<44}{r['total_token_throughput']:.2f}",
                  f"{'Mean tau (tokens per round):':<44}"
                  + ("n/a" if r["tau_mean"] is None else f"{r['tau_mean']:.2f}"),
                  f"{'Prefix-cached input tokens:':<44}{r['cached_input_tokens']}"]
        if r.get("token_counts"):
            lines.append(f"{'Token counts from:':<44}{counted.get(r['token_counts'], r['token_counts'])}")
        if r["errors"]:
            lines.append(f"{'First error:':<44}{r['errors'][0]}")
        for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                           ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
            short = key.split("_")[0].upper()
            lines.append(f"{title:-^60}")
            for stat, name in (("mean", "Mean"), ("p50", "Median"), ("p90", "P90"), ("p99", "P99")):
                lines.append(f"{f'{name} {short} (ms):':<44}{r[key][stat]:.3f}")
        if r["peak_memory_gb"] is not None:
            lines.append(f"{'Peak GPU memory (GB):':<44}{r['peak_memory_gb']:.2f}")
        kv = r.get("kv_cache")
        if kv is not None:
            lines.append(f"{'KV pages in use at most / pool:':<44}{kv['pages_in_use_peak']} / {kv['pages']} "
                         f"({kv['page_size']} tokens, {kv['bytes'] / 2**30:.2f} GiB)")
            lines.append(f"{'Preemptions:':<44}{kv['preemptions']}")
        lines.append("=" * 60)
    return "\n".join(lines)
