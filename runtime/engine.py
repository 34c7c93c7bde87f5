"""The Engine people embed: load a target (and optionally a DSpark draft), warm up, generate.

::

    engine = Engine.from_config(EngineConfig(target="LFM2.5-1.2B-Instruct", draft="LFM2.5-1.2B-Instruct-DSpark"))
    engine.warmup()                                   # compile + capture before taking traffic
    out = engine.generate("Why is the sky blue?", SamplingParams(max_new_tokens=64))[0]
    for event in engine.stream(["a", "b"], SamplingParams(temperature=0.7)):
        print(event.index, event.text, end="")

The engine is glue over the :class:`Scheduler` (runtime/scheduler.py: queue, slots, admission, the
prefill plan; host only), the :class:`ModelRunner` (runtime/model_runner.py: caches, graphs, every
device call) and the requests (runtime/requests.py: validation, stop rules, text, output).
:meth:`Engine.step` runs one scheduling step over them; a request holds a state slot from admission
to its finish, cancellation or error.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..environment import environment
from ..graphs.runner import WarmupReport
from ..models.dspark import DSparkDraft
from ..models.lfm2 import Lfm2ForCausalLM
from .config import EngineConfig
from .distributions import SamplingMode
from .loader import LoadedModels, load_models
from .model_runner import ModelRunner, RoundResult
from .outputs import GenerationOutput, StreamEvent
from .pages import PagePool
from .prompts import Prompt
from .requests import (EngineDeadError, Request, RequestError, RequestFailedError, RequestLimits, describe,
                       is_device_error, make_requests, pair_prompts)
from .sampling import SamplingParams
from .scheduler import Scheduler
from .structured import GrammarCache

log = logging.getLogger("lfmspark")


@dataclass
class StartupTimes:
    """How long this engine took to get ready, by phase (:attr:`Engine.startup`). None: the phase did
    not run in this engine's life (an engine built from models already in memory loaded nothing, one
    not warmed up has no warm-up)."""

    load_s: float | None = None          # from_config: the weights and tokenizer (runtime/loader.py)
    build_s: float | None = None         # Engine(...): caches, state, step functions, graph runner
    warmup: WarmupReport | None = None   # the last warmup()'s report: seconds, prefill_s, total_s, profile_s

    def phases(self) -> dict[str, float]:
        """The phases that ran, in order, disjoint: ``load``, ``build``, ``warmup_prefill`` (prefill
        kernels and bucket graphs), ``warmup_steps`` (the step regions compiled and captured: rounds,
        or a target-only engine's decode steps) and ``warmup_profile`` (the captured rounds timed for
        the width policy; 0 where there is one width)."""
        phases = {"load": self.load_s, "build": self.build_s}
        if self.warmup is not None:
            phases |= {"warmup_prefill": self.warmup.prefill_s, "warmup_steps": self.warmup.total_s,
                       "warmup_profile": self.warmup.profile_s}
        return {name: s for name, s in phases.items() if s is not None}


class Engine:
    """Serve one target (dense LFM2 or LFM2-MoE) with an optional DSpark draft.

    Build it with :meth:`from_config` (or the conveniences :meth:`from_pretrained` and
    :meth:`from_preset`), or from models already in memory: ``Engine(target, draft, config,
    **options)``, the options being :class:`EngineConfig` fields (runtime/config.py documents each).
    The engine is inference-only: it turns ``requires_grad`` off on the models' parameters, and the
    draft borrows the target's embedding and LM head (``DSparkDraft.attach_target``).
    """

    def __init__(self, target: Lfm2ForCausalLM, draft: DSparkDraft | None = None, config: EngineConfig | None = None,
                 *, tokenizer=None, stop_token_ids: Sequence[int] = (), sampling_defaults: dict | None = None,
                 **options):
        started = time.perf_counter()
        environment()   # a bad LFMSPARK_* value fails here, naming the variable (lfmspark/environment.py)
        self.config = cfg = (config or EngineConfig()).replace(**options)
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.sampling_defaults = dict(sampling_defaults or {})
        SamplingParams(**self.sampling_defaults).validate(target.config.vocab_size)   # a bad default fails here
        self.model_runner = ModelRunner(target, draft, cfg)
        self.scheduler = Scheduler(cfg.max_batch, cfg.prefill_chunk, cfg.prefill_budget, cfg.prefix_block,
                                   self.model_runner.pages, self.model_runner.verify_width)
        grammars = GrammarCache(tokenizer, target.config.vocab_size, self.stop_token_ids) if tokenizer else None
        self.limits = RequestLimits(target.config.vocab_size, self.model_runner.max_seq_len, self.model_runner.verify_width,
                                    cfg.max_batch, tokenizer, cfg.chat, self.stop_token_ids, grammars)
        self._ids = itertools.count()
        self._rng = random.Random()
        self._dead: BaseException | None = None    # the device-level failure that ended the engine
        # one scheduling step at a time: streams iterated from several threads take turns, each
        # step advancing every active request (their events go to their own streams)
        self._lock = threading.RLock()
        self.startup = StartupTimes(build_s=time.perf_counter() - started)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig, models: LoadedModels | None = None) -> Engine:
        """The engine a config describes: its models loaded (runtime/loader.py), or ``models`` already
        loaded from it (engines sharing one set of weights)."""
        t0 = time.perf_counter()
        loaded = models if models is not None else load_models(config)
        load_s = time.perf_counter() - t0
        engine = cls(loaded.target, loaded.draft, config, tokenizer=loaded.tokenizer,
                     stop_token_ids=loaded.stop_token_ids, sampling_defaults=loaded.sampling_defaults)
        engine.startup.load_s = load_s if models is None else None
        return engine

    @classmethod
    def from_pretrained(cls, target_dir: str | Path, draft_dir: str | Path | None = None, *,
                        dtype: torch.dtype | str = torch.bfloat16, device: str | torch.device | None = None,
                        **options) -> Engine:
        """Load HF checkpoints from local directories (``options``: :class:`EngineConfig` fields)."""
        return cls.from_config(EngineConfig(target=str(target_dir), draft=None if draft_dir is None else str(draft_dir),
                                            dtype=dtype, device=device, **options))

    @classmethod
    def from_preset(cls, name: str, draft: str | None = "default", *, dtype: torch.dtype | str = torch.bfloat16,
                    device: str | torch.device | None = None, **options) -> Engine:
        """Random weights with the shapes of a real model (benchmarks). ``draft="default"`` takes the
        preset's usual draft, ``None`` serves target-only."""
        return cls.from_config(EngineConfig(preset=name, draft_preset=draft, dtype=dtype, device=device, **options))

    # -- what it serves: the target's config and the engine's shape (block_size is 0 without a draft;
    # verify_width is the widest window: the anchor and the whole block) ------------------------
    model_config = property(lambda self: self.target.config)
    device = property(lambda self: self.model_runner.device)
    dtype = property(lambda self: self.model_runner.dtype)
    max_batch = property(lambda self: self.config.max_batch)
    max_seq_len = property(lambda self: self.model_runner.max_seq_len)   # the config's, or the model's context
    exact = property(lambda self: self.config.exact)
    block_size = property(lambda self: self.model_runner.block_size)
    verify_width = property(lambda self: self.model_runner.verify_width)
    verify_widths = property(lambda self: self.model_runner.verify_widths)
    cuda_graphs = property(lambda self: self.model_runner.cuda_graphs)

    # engine-wide counters (empty where there is no draft / no prefix cache): runtime/speculation.py
    # SpeculationStats, runtime/prefix_cache.py PrefixCacheStats
    speculation_stats = property(lambda self: self.model_runner.speculation_stats())
    prefix_cache_stats = property(lambda self: self.model_runner.prefix_cache_stats())

    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix and the finished turns waiting to be cached (running requests keep
        what they copied); returns the blocks dropped."""
        with self._lock:
            self.scheduler.cache_jobs.clear()
            cache = self.model_runner.prefix_cache
            return cache.clear() if cache is not None else 0

    def set_imposed_acceptance(self, rates: Sequence[float]) -> None:
        """New imposed per-position rates (an engine built with ``imposed_acceptance``; no recompile)."""
        self.model_runner.set_imposed_acceptance(rates)

    def default_sampling_params(self) -> SamplingParams:
        """What ``params=None`` means: ``SamplingParams()`` with the checkpoint's generation_config.json
        sampling fields (``sampling_defaults``), as transformers and vLLM apply them."""
        return SamplingParams(**self.sampling_defaults)

    def warmup(self, progress: bool = True, sampling: bool | Sequence[SamplingMode] = True) -> WarmupReport:
        """Compile and capture everything the engine will replay (ModelRunner.warmup), in every
        sampling mode, only greedy (``sampling=False``), or the modes ``sampling`` lists. Call once
        before taking traffic; progress goes to the ``lfmspark`` logger. The report's times
        (``seconds``, ``prefill_s``, ``total_s`` for the steps, ``profile_s``) are kept in
        :attr:`startup` too."""
        if not self.idle:
            raise RuntimeError("Engine.warmup() must run before the engine takes requests: it uses free "
                               "state slots as scratch; call it right after constructing the engine")
        modes = (tuple(SamplingMode) if sampling else (SamplingMode.GREEDY,)) if isinstance(sampling, bool) \
            else tuple(sampling)
        t0 = time.perf_counter()
        report = self.model_runner.warmup(progress, modes)
        report.seconds = time.perf_counter() - t0
        self.startup.warmup = report
        return report

    # -- the synchronous API -------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationOutput]:
        """One output per prompt (and per ``SamplingParams.n`` sample), in order; docs/api.md. A bad
        request raises :class:`RequestError` before anything runs; one that fails while running raises
        :class:`RequestFailedError` once the others have finished."""
        outputs: dict[tuple[int, int], GenerationOutput] = {}
        for event in self.stream(prompts, params):
            if event.finished:
                outputs[event.index, event.sample] = event.output
        return [outputs[key] for key in sorted(outputs)]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[StreamEvent]:
        """Yield :class:`StreamEvent` s as prefill and rounds commit tokens (index = prompt position).
        Leaving the iteration early cancels the remaining requests. Several streams may be open at
        once, from any threads: each yields only its own requests' events. A failed request yields
        its last event; once all have finished the stream raises :class:`RequestFailedError`."""
        pairs = pair_prompts(prompts, params if params is not None else self.default_sampling_params())
        mine: deque[StreamEvent] = deque()      # this stream's events (a step also advances other streams')
        with self._lock:
            self._check_alive()
            requests = [r for i, (prompt, p) in enumerate(pairs)
                        for r in self._new_requests(prompt, p, index=i, sink=mine.append, label=f"request {i}: ")]
            self.scheduler.add(requests)
        try:
            while mine or any(not r.finished for r in requests):
                if not mine:
                    self.step()
                while mine:
                    yield mine.popleft()
            failed = [r for r in requests if r.finish_reason == "error"]
            if failed:
                raise RequestFailedError(f"requests {[r.index for r in failed]} failed: {describe(failed[0].error)}",
                                         [r.request_id for r in failed]) from failed[0].error
        finally:
            with self._lock:
                self._cancel([r for r in requests if not r.finished])

    # -- the request-level API (what AsyncEngine drives) ---------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                    on_event: Callable[[StreamEvent], None] | None = None) -> str:
        """Validate and queue one request; returns its id. It runs as :meth:`step` is called, each
        event passed to ``on_event`` in the stepping thread (if it raises, that request ends with
        ``finish_reason="error"``). ``n > 1`` samples run as ``{id}-0 .. {id}-(n-1)``; aborting the
        id aborts them all. Raises :class:`RequestError` or, once the engine has failed,
        :class:`EngineDeadError`."""
        requests = self.prepare(prompt, params, request_id=request_id, on_event=on_event)
        self.submit(requests)
        return requests[0].group or requests[0].request_id

    def prepare(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                on_event: Callable[[StreamEvent], None] | None = None) -> list[Request]:
        """The validation half of :meth:`add_request`, without the engine's lock (an event loop
        prepares here; the stepping thread calls :meth:`submit`)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        self._check_alive()
        return self._new_requests(prompt, params or self.default_sampling_params(), request_id=request_id,
                                  sink=on_event)

    def submit(self, requests: list[Request]) -> None:
        """Queue the requests :meth:`prepare` made (once)."""
        with self._lock:
            self._check_alive()
            self.scheduler.add(requests)

    def abort(self, request_id: str) -> bool:
        """End a queued or running request (``finish_reason="cancelled"``, its last event delivered),
        or every sample of an ``n > 1`` request; False if no such request is live."""
        with self._lock:
            targets = self.scheduler.find(request_id)
            if not targets:
                return False
            self._cancel(targets)
            return True

    def abort_all(self) -> int:
        """End every queued and running request as :meth:`abort` does; returns how many."""
        with self._lock:
            live = list(self.scheduler.live.values())
            self._cancel(live)
            return len(live)

    @property
    def idle(self) -> bool:
        return not self.scheduler.has_work() and self.model_runner.in_flight is None

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a slot: prefilling or decoding."""
        return self.scheduler.pool.in_use

    @property
    def kv_pages(self) -> PagePool:
        """The KV page pool (``n_pages``, ``in_use``, ``n_free``: runtime/pages.py)."""
        return self.model_runner.pages.pool

    def kv_cache_info(self) -> dict:
        """The KV pool: page size, pages in all, in use now and at most so far, and its bytes."""
        runner = self.model_runner
        pool = runner.pages.pool
        return {"page_size": runner.pages.page_size, "pages": pool.n_pages, "pages_in_use": pool.in_use,
                "pages_in_use_peak": pool.peak_in_use, "bytes": pool.n_pages * runner.page_nbytes(runner.pages.page_size),
                "max_seq_len": runner.max_seq_len}

    @property
    def num_preemptions(self) -> int:
        """Requests preempted so far when the KV pool ran out."""
        return self.scheduler.preemptions

    @property
    def dead(self) -> BaseException | None:
        """The device-level failure that ended the engine, or None while it is healthy."""
        return self._dead

    # -- one scheduling step -------------------------------------------------------------------
    def step(self) -> list[StreamEvent]:
        """One scheduling step: end requests past their deadline, admit queued requests, prefill what
        the step allows, launch the next round for the decoding requests and collect the previous
        round's tokens; finished requests release their slots as their last event is made.

        A failure is kept to the requests it concerns: a prefill's to the requests of that forward, a
        round's to the rows in it, a text decode's or an event consumer's to its request; each ends
        with ``finish_reason="error"`` and the engine goes on. A device-level failure (a CUDA error)
        fails every request and raises :class:`EngineDeadError`, as does every later step."""
        with self._lock:
            self._check_alive()
            events: list[StreamEvent] = []
            for req in self.scheduler.expired(time.perf_counter()):
                events.append(self._end(req, "timeout"))
            events += self.prefill_step()
            try:
                self.scheduler.reserve_rounds(self.model_runner.in_flight is not None)
                results = self.model_runner.step(self.scheduler.running)
            except BaseException as e:
                self._contain(e, list(self.scheduler.running), events)
                return events
            for result in results:
                if not result.request.finished:      # ended by an earlier row's consumer in this loop
                    events.append(self._emit(result))
            return events

    def prefill_step(self) -> list[StreamEvent]:
        """The first half of :meth:`step`: admit queued requests and run this step's prefill, without
        launching a round (for code that runs the rounds itself, such as tests of the round)."""
        with self._lock:
            self._admit()
            return self._prefill()

    def _admit(self) -> None:
        """Give queued requests free slots (runtime/scheduler.py); at a step where nothing decodes,
        the finished turns waiting to be cached go first and the queue waits for the next step."""
        in_flight = self.model_runner.in_flight is not None
        jobs = self.scheduler.admit_cache_jobs(in_flight)
        for job in jobs:
            self.model_runner.load_cached_prefix(job)
            self.scheduler.begin_prefill(job)
        if jobs and self.scheduler.prefilling:
            return
        for group in self.scheduler.admit(in_flight):
            self.model_runner.admit(group)
            self.scheduler.begin_prefill(group[0], group[1:])

    def _prefill(self) -> list[StreamEvent]:
        """Run the prefill forwards the scheduler plans for this step (one while requests decode,
        else every prompt to its end); requests whose prompt completes get their first token and
        decode from the next round on. A failure ends the requests of the failing forward only."""
        events: list[StreamEvent] = []
        started = []
        while (plan := self.scheduler.next_prefill()) is not None:
            try:
                logits = self.model_runner.prefill(plan)
                done = [(lead, self.scheduler.followers(lead)) for lead in self.scheduler.prefilled(plan)]
                started += self.model_runner.first_tokens(plan, logits, done)
            except BaseException as e:          # the forward wrote only these requests' slots
                self._contain(e, self.scheduler.drop_prefill(plan), events)
                break
            if plan.budgeted:
                break                            # one budgeted forward per step
        firsts, now = self.model_runner.read_first_tokens(started), time.perf_counter()   # the read syncs first
        for first in firsts:
            first.request.first_token_at = first.request.first_token_at or now   # kept across a preemption
            self.scheduler.start_running(first.request)
            events.append(self._emit(first))
        return events

    def _contain(self, error: BaseException, concerned: list[Request], events: list[StreamEvent]) -> None:
        """Fail the requests a failure concerns. A device error fails every request and kills the
        engine; an interrupt (not an Exception) is re-raised after its requests are failed."""
        if is_device_error(error):
            self._dead = error
            concerned = list(self.scheduler.live.values())
        for req in concerned:
            if req.cache_only:          # only the cache misses out: the request it came from had succeeded
                log.warning("could not cache the output of %s: %s", req.request_id, describe(error))
                self.scheduler.release_job(req)
            elif not req.finished:
                events.append(self._end(req, "error", error))
        if self._dead is not None:
            log.error("device failure, engine stopped: %s", describe(error))
            raise EngineDeadError(f"the engine failed: {describe(error)}; restart the process") from error
        if not isinstance(error, Exception):
            raise error
        log.error("a step failed; %d requests ended with finish_reason 'error'", len(concerned), exc_info=error)

    # -- requests ------------------------------------------------------------------------------
    def _new_requests(self, prompt: Prompt, params: SamplingParams, *, index: int = 0, request_id: str | None = None,
                      sink: Callable[[StreamEvent], None] | None = None, label: str = "") -> list[Request]:
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise RequestError(f"{label}request_id must be a non-empty string, got {request_id!r}")
        elif self.scheduler.is_live(request_id):
            raise RequestError(f"{label}request_id {request_id!r} is already running: ids must be unique")
        return make_requests(prompt, params, self.limits, request_id, index=index, sink=sink, label=label,
                             rng=self._rng)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed earlier ({describe(self._dead)}); restart the process")

    def _emit(self, result: RoundResult) -> StreamEvent:
        """Commit a request's new tokens (its stop rules applied) and deliver the event."""
        req = result.request
        try:
            kept, delta, logprobs = req.commit(result.tokens, result.logprobs)
        except Exception as e:            # a tokenizer that cannot decode this output fails this request only
            return self._end(req, "error", e)
        output = self._finish(req, req.finish_reason) if req.finished else None
        return self._deliver(req, req.event(kept, delta, logprobs, output))

    def _end(self, req: Request, reason: str, error: BaseException | None = None) -> StreamEvent:
        """Finish a request outside the token flow (cancelled, timeout, error) and deliver its last event."""
        req.error = error
        return self._deliver(req, req.event([], req.final_text(), output=self._finish(req, reason)))

    def _deliver(self, req: Request, event: StreamEvent) -> StreamEvent:
        """Hand an event to the request's consumer; one that raises ends its own request (the event
        returned is then that request's last)."""
        if req.sink is None:
            return event
        try:
            req.sink(event)
        except Exception as e:
            req.sink = None
            if not req.finished:
                return self._end(req, "error", e)
        return event

    def _finish(self, req: Request, reason: str) -> GenerationOutput:
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        if self.config.prefix_cache_outputs and reason in ("stop", "length"):
            self.scheduler.queue_cache_job(req, self.model_runner.prefix_cache.block)
        self.scheduler.release(req)
        return req.to_output(self.block_size, self.model_runner.imposed_acceptance is not None)

    def _cancel(self, requests: list[Request], reason: str = "cancelled") -> None:
        for req in requests:
            if not req.finished:
                self._end(req, reason)
        if not self.scheduler.running:
            self.model_runner.drop_in_flight()
