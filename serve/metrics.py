"""Prometheus metrics of a served engine, named after vLLM's (``vllm:`` -> ``lfmspark:``) so the same
dashboards and alerts read both (docs/grafana/lfmspark.json is one).

Three sources feed them:

- the engine thread (``AsyncEngine(observer=...)``, :meth:`ServerMetrics.observe`): tokens and
  inter-token gaps as events arrive; per-request latencies (TTFT, queue, prefill, decode, e2e,
  time per output token) and speculation counts when a request finishes;
- the engine's state, read when scraped (:class:`_EngineState`, from ``AsyncEngine.usage()``):
  running and waiting requests, KV-cache and prefix-cache usage, prefix-cache queries and hits;
- the HTTP layer (:class:`CountResponses`, outermost in the app): every response by route
  template and status, the guards' 401 / 413 included;
- the server's start (:meth:`ServerMetrics.set_startup`, once the engine is ready): the seconds of
  each phase from the process's start to ready, ``lfmspark:startup_seconds{phase}`` (vLLM exports
  no such gauge; its ``vllm bench startup`` measures the same span from outside).

Each ``ServerMetrics`` has its own registry, so several servers in one process (tests) do not
collide. The exposition carries no ``*_created`` series (:class:`_WithoutCreated`): one more series
per counter and histogram, a start timestamp that neither vLLM's dashboards nor this one read.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.routing import Match, Router

from ..runtime.async_engine import AsyncEngine
from ..runtime.outputs import StreamEvent
from .guards import ASGIApp, Receive, Scope, Send

# seconds; as vLLM's buckets, with the fine end a speculative engine reaches (a token well under 1 ms)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_TOKEN_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                  0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0)

UNMATCHED_ROUTE = "none"      # the route label of a path no route serves (prometheus-fastapi-instrumentator's)


class ServerMetrics:
    """The server's metrics (module doc). ``attach`` an AsyncEngine for the scrape-time gauges,
    give :meth:`observe` to it as its observer, install :class:`CountResponses` for HTTP counts."""

    def __init__(self, model_name: str, block_size: int):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = {"model_name": model_name}
        names = ["model_name"]
        r = self.registry

        def counter(name: str, doc: str, extra: Iterable[str] = ()) -> Counter:
            return Counter(name, doc, names + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**labels)

        self._state = _EngineState(model_name)
        r.register(self._state)
        self._finished = counter("lfmspark:request_success", "Finished requests by finish reason.",
                                 ["finished_reason"])
        self._prompt_tokens = counter("lfmspark:prompt_tokens", "Prompt tokens of finished requests.").labels(**labels)
        self._generation_tokens = counter("lfmspark:generation_tokens", "Generated tokens.").labels(**labels)
        self._ttft = histogram("lfmspark:time_to_first_token_seconds", "Submission to first token.", _TTFT_BUCKETS)
        self._itl = histogram(
            "lfmspark:inter_token_latency_seconds",
            "Per token after a request's first: the gap since the request's previous streamed event, divided "
            "over the tokens of the event (a speculative round commits several at once; vLLM observes the "
            "whole gap once per engine output).", _TOKEN_BUCKETS)
        self._request_tpot = histogram(
            "lfmspark:request_time_per_output_token_seconds",
            "Per finished request of two tokens or more: decode time (first to last token) over its tokens "
            "less one.", _TOKEN_BUCKETS)
        self._e2e = histogram("lfmspark:e2e_request_latency_seconds", "Submission to finish.", _E2E_BUCKETS)
        self._queue = histogram("lfmspark:request_queue_time_seconds",
                                "Per finished request: submission to a slot (waiting).", _TTFT_BUCKETS)
        self._prefill = histogram("lfmspark:request_prefill_time_seconds",
                                  "Per finished request: a slot to its first token (prefill).", _TTFT_BUCKETS)
        self._decode = histogram("lfmspark:request_decode_time_seconds",
                                 "Per finished request: first to last token (decode).", _E2E_BUCKETS)
        self._drafts = counter("lfmspark:spec_decode_num_drafts", "Rounds that verified draft tokens, per request.") \
            .labels(**labels)
        self._draft_tokens = counter("lfmspark:spec_decode_num_draft_tokens", "Draft tokens verified by the target.") \
            .labels(**labels)
        self._fallbacks = counter("lfmspark:spec_decode_num_rounds_without_draft",
                                  "Rounds that verified no draft token, per request (the width policy chose "
                                  "width 1, or the request turned speculation off).").labels(**labels)
        self._accepted = counter("lfmspark:spec_decode_num_accepted_tokens", "Draft tokens accepted.") \
            .labels(**labels)
        self._accepted_per_pos = counter("lfmspark:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the block (0 = first).", ["position"])
        self._startup = Gauge("lfmspark:startup_seconds",
                              "Seconds of each phase of the server's start, set once the engine is ready: load, "
                              "build, warmup_prefill, warmup_steps, warmup_profile (those that ran) and other (the "
                              "rest since the process started); their sum is the time to healthy.",
                              names + ["phase"], registry=r)
        self._http = counter("lfmspark:http_requests",
                             "HTTP responses by route template (`none`: no route serves the path) and status, "
                             "the API key's 401 and the body limit's 413 included.", ["route", "status"])
        for k in range(block_size):    # every position's series from the start, as a dashboard expects
            self._accepted_per_pos.labels(position=str(k), **labels)
        self._labels = labels
        self._block_size = block_size
        self._last_event: dict[str, float] = {}    # per running request: when its previous tokens came

    def attach(self, engine: AsyncEngine) -> None:
        """Read the engine's state (requests, caches) from ``engine`` at every scrape."""
        self._state.engine = engine

    def observe(self, event: StreamEvent | None) -> None:
        """The AsyncEngine observer: called in the engine thread with every event (and None after
        every step), so the inter-token gaps are the engine's, not a client's."""
        if event is None:
            return
        if event.token_ids:
            self._observe_tokens(event.request_id, len(event.token_ids))
        if event.finished:
            self._last_event.pop(event.request_id, None)
            self._observe_finished(event)

    def _observe_tokens(self, request_id: str, n: int) -> None:
        """Count ``n`` new tokens; after the request's first event, spread the gap since its previous
        one over them, one observation a token, so that a round committing four tokens weighs as four
        tokens of a quarter of its gap (its first event's latency is TTFT's)."""
        self._generation_tokens.inc(n)
        now = time.perf_counter()
        last = self._last_event.get(request_id)
        self._last_event[request_id] = now
        if last is not None:
            per_token = (now - last) / n
            for _ in range(n):
                self._itl.observe(per_token)

    def _observe_finished(self, event: StreamEvent) -> None:
        out = event.output
        stats = out.stats
        self._finished.labels(finished_reason=out.finish_reason, **self._labels).inc()
        self._prompt_tokens.inc(stats.prompt_tokens)
        if stats.ttft_s > 0:           # it ran (a request cancelled while waiting has no phases to show)
            self._ttft.observe(stats.ttft_s)
            self._e2e.observe(stats.ttft_s + stats.decode_s)
            self._queue.observe(stats.queue_s)
            self._prefill.observe(stats.prefill_s)
            self._decode.observe(stats.decode_s)
        if len(out.token_ids) > 1:     # one token has no decode to divide
            self._request_tpot.observe(stats.decode_s / (len(out.token_ids) - 1))
        if self._block_size and stats.accept_lengths:
            without = stats.rounds_without_draft
            self._drafts.inc(stats.rounds - without)
            self._fallbacks.inc(without)
            self._draft_tokens.inc(stats.draft_tokens_verified)
            self._accepted.inc(stats.draft_tokens_accepted)
            for k in range(self._block_size):
                accepted = sum(1 for n in stats.accept_lengths if n - 1 > k)
                if accepted:
                    self._accepted_per_pos.labels(position=str(k), **self._labels).inc(accepted)

    def set_startup(self, phases: dict[str, float]) -> None:
        """The server's startup phases, in seconds (serve/__init__.py ``startup_phases``)."""
        for phase, seconds in phases.items():
            self._startup.labels(phase=phase, **self._labels).set(seconds)

    def count_response(self, route: str, status: int) -> None:
        """One HTTP response (:class:`CountResponses`)."""
        self._http.labels(route=route, status=str(status), **self._labels).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition, without ``*_created`` series (module doc)."""
        return generate_latest(_WithoutCreated(self.registry))


class _EngineState:
    """A collector of what the engine holds, read at each scrape from ``AsyncEngine.usage()`` (zeros
    before an engine is attached), so the gauges are never staler than the scrape."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.engine: AsyncEngine | None = None

    def collect(self) -> Iterator[Metric]:
        usage = self.engine.usage() if self.engine is not None else {}
        waiting = self.engine.num_waiting if self.engine is not None else 0
        pages, blocks = usage.get("kv_pages", 0), usage.get("prefix_cache_capacity", 0)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            return family

        yield gauge("lfmspark:num_requests_running", "Requests holding a slot (in the running batch).",
                    usage.get("slots_in_use", 0))
        yield gauge("lfmspark:num_requests_waiting", "Requests submitted and not yet admitted.", waiting)
        yield gauge("lfmspark:kv_cache_usage_perc",
                    "KV-cache usage, 1 = full: KV pages in use (by requests or the prefix cache) over the pool's "
                    "pages.", usage.get("kv_pages_in_use", 0) / pages if pages else 0.0)
        yield counter("lfmspark:num_preemptions", "Requests preempted when the KV pool ran out (each resumed by "
                      "recomputing its tokens).", usage.get("preemptions", 0))
        yield gauge("lfmspark:prefix_cache_usage_perc",
                    "Prefix-cache usage, 1 = full: blocks held over its capacity (0 without a prefix cache).",
                    usage.get("prefix_cache_blocks", 0) / blocks if blocks else 0.0)
        yield counter("lfmspark:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.",
                      usage.get("prefix_cache_queries", 0))
        yield counter("lfmspark:prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached.",
                      usage.get("prefix_cache_hits", 0))


class _WithoutCreated:
    """``registry``'s metrics less their ``*_created`` samples. Filtering here keeps the choice to
    this exposition: prometheus_client's ``disable_created_metrics()`` (and its environment
    variable) would turn them off for every registry in the process, an embedding
    application's included."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class CountResponses:
    """ASGI middleware counting every HTTP response in ``lfmspark:http_requests_total`` by route
    template (``/v1/models/{model_id}``, not the id a client sent, so the series stay few) and
    status. Installed outside the guards, it sees their 401 and 413 as well as the routes' answers;
    an exception that escapes the app is the 500 Starlette then sends. Plain ASGI, as the guards:
    a streamed answer passes through unbuffered."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, router: Router):
        self.app = app
        self.metrics = metrics
        self.router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self.route_of(scope)
        status: int | None = None

        async def sending(message: MutableMapping[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            self.metrics.count_response(route, status if status is not None else 500)
            raise
        if status is not None:
            self.metrics.count_response(route, status)

    def route_of(self, scope: Scope) -> str:
        """The template of the route serving ``scope``'s path: a full match, else one that serves
        the path for another method (a 405), else :data:`UNMATCHED_ROUTE`. Matched here, before the
        app runs, because a guard's answer never reaches the router."""
        partial = None
        for route in self.router.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return getattr(route, "path_format", UNMATCHED_ROUTE)
            if match == Match.PARTIAL and partial is None:
                partial = route
        return getattr(partial, "path_format", UNMATCHED_ROUTE) if partial is not None else UNMATCHED_ROUTE
