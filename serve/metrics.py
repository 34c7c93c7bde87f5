"""Prometheus metrics of a served engine, named after vLLM's (``vllm:`` -> ``lfmspark:``) so the same
dashboards read both.

Fed from the engine thread (``AsyncEngine(observer=...)``): tokens as events arrive, per-request
latencies and speculation counts when a request finishes; the queue gauges read the engine when
scraped. Each ``ServerMetrics`` has its own registry, so several servers in one process (tests) do
not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..runtime.async_engine import AsyncEngine
from ..runtime.outputs import StreamEvent

# seconds; as vLLM's buckets, with the fine end a speculative engine reaches (TPOT well under 1 ms)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_TPOT_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0)


class ServerMetrics:
    def __init__(self, model_name: str, block_size: int):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = ["model_name"]
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(name, doc, names + list(extra), registry=r)

        self.running = Gauge("lfmspark:num_requests_running", "Requests holding a slot (in the running batch).",
                             names, registry=r).labels(**labels)
        self.waiting = Gauge("lfmspark:num_requests_waiting", "Requests submitted and not yet admitted.",
                             names, registry=r).labels(**labels)
        self._finished = counter("lfmspark:request_success", "Finished requests by finish reason.",
                                 ["finished_reason"])
        self._prompt_tokens = counter("lfmspark:prompt_tokens", "Prompt tokens of finished requests.").labels(**labels)
        self._generation_tokens = counter("lfmspark:generation_tokens", "Generated tokens.").labels(**labels)
        self._ttft = Histogram("lfmspark:time_to_first_token_seconds", "Submission to first token.", names,
                               buckets=_TTFT_BUCKETS, registry=r).labels(**labels)
        self._tpot = Histogram("lfmspark:time_per_output_token_seconds",
                               "Per request: first to last token over the tokens after the first.", names,
                               buckets=_TPOT_BUCKETS, registry=r).labels(**labels)
        self._e2e = Histogram("lfmspark:e2e_request_latency_seconds", "Submission to finish.", names,
                              buckets=_E2E_BUCKETS, registry=r).labels(**labels)
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
        self._prefix_queries = counter("lfmspark:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                       "cache.").labels(**labels)
        self._prefix_hits = counter("lfmspark:prefix_cache_hits", "Prompt tokens the prefix cache supplied.") \
            .labels(**labels)
        self._labels = labels
        self._block_size = block_size

    def attach(self, engine: AsyncEngine) -> None:
        """Read the queue gauges from ``engine`` at every scrape."""
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)

    def observe(self, event: StreamEvent | None) -> None:
        """The AsyncEngine observer: called with every event (and None after every step)."""
        if event is None:
            return
        if event.token_ids:
            self._generation_tokens.inc(len(event.token_ids))
        if not event.finished:
            return
        out = event.output
        stats = out.stats
        self._finished.labels(finished_reason=out.finish_reason, **self._labels).inc()
        self._prompt_tokens.inc(stats.prompt_tokens)
        if out.sample == 0:            # a prompt's other samples share its prefill
            self._prefix_queries.inc(stats.prompt_tokens)
            self._prefix_hits.inc(stats.prompt_tokens_cached)
        if stats.ttft_s > 0:
            self._ttft.observe(stats.ttft_s)
            self._e2e.observe(stats.ttft_s + stats.decode_s)
        if len(out.token_ids) > 1:
            self._tpot.observe(stats.decode_s / (len(out.token_ids) - 1))
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
