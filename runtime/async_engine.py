"""``AsyncEngine``: the engine for asyncio services.

One background thread owns the :class:`Engine` and runs its loop (admit, launch, collect) whenever
there is work; event loops never wait on the GPU. Coroutines, from any event loop in any thread,
submit requests and read their events through per-request ``asyncio.Queue`` s that the engine
thread fills with ``loop.call_soon_threadsafe``::

    engine = AsyncEngine(Engine.from_preset("lfm2.5-1.2b"), warmup=True)
    async for event in engine.generate("Why is the sky blue?", SamplingParams(max_new_tokens=64)):
        print(event.text, end="")
    await engine.shutdown()

Requests wait in a bounded queue (``max_waiting``): past it ``generate`` raises
:class:`QueueFullError` at once rather than buffering without limit. Abort (``abort``, or leaving
the ``async for``: a client disconnect) and deadlines (``SamplingParams.timeout_s``) reach the
engine thread before its next step, so the request's slot is free within one round.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from .engine import Engine
from .outputs import StreamEvent
from .prompts import Prompt, encode_prompt
from .requests import EngineDeadError, Request, RequestError, RequestFailedError, describe
from .sampling import SamplingParams
from .structured import StructuredOutputError, StructuredOutputsParams

log = logging.getLogger("lfmspark")


class QueueFullError(RuntimeError):
    """More requests are waiting than ``AsyncEngine(max_waiting=...)`` allows; retry later."""


class EngineShutdownError(RuntimeError):
    """The AsyncEngine has been shut down (or is shutting down) and takes no more requests."""


@dataclass
class _Stream:
    """One request's path back to the coroutine that reads it."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    waiting: int = 0               # its requests not yet admitted (no first event yet)
    finished: bool = False
    submitted: float = field(default_factory=time.perf_counter)


class AsyncEngine:
    """Drive an :class:`Engine` from a background thread for asyncio callers.

    ``warmup=True`` runs ``engine.warmup()`` in the engine thread before it serves (``ready``
    tells when it is done; requests sent before then wait). ``observer``, if given, is called in
    the engine thread with every event and after every step (the server's metrics). ``on_ready``,
    if given, is called in the engine thread once, warmed up, just before ``ready`` turns true (the
    server's startup times: ``engine.startup``); an exception it raises is logged, and the engine
    serves all the same.
    """

    def __init__(self, engine: Engine, *, max_waiting: int = 256, warmup: bool = False,
                 observer: Callable[[StreamEvent | None], None] | None = None,
                 on_ready: Callable[[], None] | None = None):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._observer = observer
        self._on_ready = on_ready
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()           # guards _streams and _waiting
        self._waiting = 0                        # submitted, not yet admitted
        self._accepting = True
        self._stop = False
        self._failure: BaseException | None = None    # what ended the loop (device error, warm-up failure)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(warmup,), name="lfmspark-engine", daemon=True)
        self._thread.start()

    # -- state -------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Warmed up (if asked) and serving."""
        return self._ready.is_set() and self.failure is None

    @property
    def failure(self) -> BaseException | None:
        """Why the engine stopped serving (a device error, a failed warm-up), or None."""
        return self._failure if self._failure is not None else self.engine.dead

    @property
    def num_waiting(self) -> int:
        return self._waiting

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_open_streams(self) -> int:
        """Requests whose stream has not delivered its last event (0 once everything has ended)."""
        with self._lock:
            return len(self._streams)

    # -- what a server needs to know -----------------------------------------------------------
    @property
    def tokenizer(self):
        """The engine's HF tokenizer (None: token-id prompts only)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Tokens per request: prompt and output (the engine's ``max_seq_len``)."""
        return self.engine.max_seq_len

    @property
    def sampling_defaults(self) -> dict:
        """The checkpoint's sampling defaults (``Engine.default_sampling_params``)."""
        return dict(self.engine.sampling_defaults)

    @property
    def block_size(self) -> int:
        """The draft's block (0 without a draft)."""
        return self.engine.block_size

    def usage(self) -> dict[str, int]:
        """What the engine holds now, for gauges: state slots in use and in all, KV pages in use and in
        all, preemptions so far, the prefix cache's blocks held and capacity, and its counters of
        prompt tokens looked up and found cached (a read without the engine's lock: each value is
        current, the set may straddle a step)."""
        cache = self.engine.prefix_cache_stats
        pool = self.engine.kv_pages
        return {"slots_in_use": self.engine.num_running, "slots": self.engine.max_batch,
                "kv_pages_in_use": pool.in_use, "kv_pages": pool.n_pages,
                "preemptions": self.engine.num_preemptions,
                "prefix_cache_blocks": cache.get("cached_blocks", 0),
                "prefix_cache_capacity": cache.get("capacity_blocks", 0),
                "prefix_cache_queries": cache.get("queries", 0), "prefix_cache_hits": cache.get("hits", 0)}

    def encode(self, prompt: Prompt, chat: bool = True, *, tools: list[dict] | None = None,
               template_kwargs: dict | None = None) -> list[int]:
        """A prompt's token ids as the engine would make them (raises ``PromptError``); ``tools`` and
        ``template_kwargs`` go to the chat template (``encode_prompt``)."""
        return encode_prompt(prompt, self.engine.tokenizer, self.engine.model_config.vocab_size, chat=chat,
                             tools=tools, template_kwargs=template_kwargs)

    def check_constraint(self, constraint: StructuredOutputsParams) -> None:
        """Compile a structured-output constraint now (cached for the request that will use it),
        raising ``StructuredOutputError`` with the grammar engine's message: a server checks it in
        a worker thread, naming the request's parameter, before the request is submitted."""
        grammars = self.engine.limits.grammars
        if grammars is None:
            raise StructuredOutputError("structured outputs need a tokenizer, and this engine has none")
        constraint.validate()
        grammars.compile(constraint)

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most tokens a request with a prompt of ``prompt_len`` tokens may generate."""
        return max(1, self.engine.max_seq_len - prompt_len)

    async def clear_prefix_cache(self) -> int:
        """Drop every cached prefix (running requests are unaffected); the blocks dropped."""
        return await asyncio.to_thread(self.engine.clear_prefix_cache)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Return once warm-up is done; raise its failure if it failed."""
        ok = await asyncio.to_thread(self._ready.wait, timeout)
        if self._failure is not None:
            raise EngineDeadError(f"the engine failed: {describe(self._failure)}") from self._failure
        if not ok:
            raise TimeoutError(f"the engine was not ready within {timeout} s")

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                       request_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """Stream one request's events (token deltas; the last has ``finished`` and ``output``).

        Raises :class:`RequestError` for a bad request and :class:`QueueFullError` when too many
        wait, both before anything runs; :class:`RequestFailedError` if the request fails while
        running, :class:`EngineDeadError` if the engine does. A timeout or an abort ends the stream
        with a last event whose ``output.finish_reason`` is ``"timeout"`` / ``"cancelled"``.
        Leaving the iteration early aborts the request."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        requests = self._submit(prompt, params, request_id, stream)
        rid = requests[0].group or requests[0].request_id
        by_id = {r.request_id: r for r in requests}
        left = len(requests)                  # SamplingParams.n samples share the stream
        try:
            while True:
                item = await stream.events.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    left -= 1
                    stream.finished = left == 0
                    if self.engine.dead is not None:
                        raise EngineDeadError(f"the engine failed: {describe(self.engine.dead)}; restart the "
                                              "process") from self.engine.dead
                    if item.output.finish_reason == "error":
                        raise RequestFailedError(f"request {item.request_id!r} failed: {item.output.error}",
                                                 [item.request_id]) from by_id[item.request_id].error
                yield item
                if stream.finished:
                    return
        finally:
            if not stream.finished:
                self._command("abort", rid)

    async def abort(self, request_id: str) -> None:
        """End a request (``finish_reason="cancelled"``; its stream gets the last event) before the
        engine's next step. Unknown or finished ids are ignored."""
        self._command("abort", request_id)

    def _submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                stream: _Stream) -> list[Request]:
        self._check_serving()
        requests = self.engine.prepare(prompt, params, request_id=request_id, on_event=self._sink(stream))
        with self._lock:
            if any(r.request_id in self._streams for r in requests):
                raise RequestError(f"request_id {request_id!r} is already running: ids must be unique")
            if self._waiting >= self.max_waiting:
                raise QueueFullError(f"{self._waiting} requests are already waiting (max_waiting="
                                     f"{self.max_waiting}): retry later, or raise AsyncEngine(max_waiting=...)")
            for r in requests:
                self._streams[r.request_id] = stream
            stream.waiting = len(requests)
            self._waiting += len(requests)
        self._command("add", requests)
        return requests

    def _sink(self, stream: _Stream) -> Callable[[StreamEvent], None]:
        """The engine-thread side of a stream: count admission, hand the event to its loop."""
        started: set[str] = set()

        def deliver(event: StreamEvent) -> None:
            with self._lock:
                if event.request_id not in started:
                    started.add(event.request_id)
                    stream.waiting -= 1
                    self._waiting -= 1
                if event.finished:
                    self._streams.pop(event.request_id, None)
            self._observe(event)
            stream.loop.call_soon_threadsafe(stream.events.put_nowait, event)
        return deliver

    def _observe(self, event: StreamEvent | None) -> None:
        """Tell the observer (metrics); its failure is logged, never a request's."""
        if self._observer is None:
            return
        try:
            self._observer(event)
        except Exception:
            log.exception("the AsyncEngine observer failed")

    def _check_serving(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(f"the engine failed: {describe(self.failure)}; restart the process")
        if not self._accepting:
            raise EngineShutdownError("the AsyncEngine is shut down and takes no more requests")

    def _command(self, kind: str, arg) -> None:
        self._commands.put((kind, arg))
        self._wake.set()

    # -- shutdown ----------------------------------------------------------------------------
    async def shutdown(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop taking requests; with ``drain`` let the running and waiting ones finish (for at most
        ``timeout`` seconds), then cancel whatever is left and stop the engine thread. Every stream
        ends (cancelled ones with their last event), and every slot is free afterwards."""
        self._accepting = False
        if drain:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._streams and (deadline is None or time.monotonic() < deadline) and self._thread.is_alive():
                await asyncio.sleep(0.005)
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)

    # -- the engine thread -------------------------------------------------------------------
    def _run(self, warmup: bool) -> None:
        try:
            if warmup:
                self.engine.warmup()
            if self._on_ready is not None:
                try:
                    self._on_ready()
                except Exception as e:       # a report of the start must not keep the engine from serving
                    log.error("on_ready failed: %s", describe(e), exc_info=e)
            self._ready.set()
            while True:
                self._wake.clear()
                self._apply_commands()
                if self._stop:
                    break
                if self.engine.idle:
                    self._wake.wait()
                    continue
                self.engine.step()
                self._observe(None)
        except BaseException as e:          # a device error (EngineDeadError) or a bug in the loop itself
            self._failure = e
            log.error("the engine thread stopped: %s", describe(e), exc_info=e)
        finally:
            self._accepting = False
            self._ready.set()
            self._close_all()

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.submit(arg)
                except BaseException as e:       # an id clash with the engine's own requests, a dead engine
                    for r in arg:
                        self._fail_stream(r.request_id, e)
            else:
                self.engine.abort(arg)

    def _fail_stream(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is not None and stream.waiting > 0:
                stream.waiting -= 1
                self._waiting -= 1
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.events.put_nowait, error)

    def _close_all(self) -> None:
        """The loop has ended: cancel what the engine still holds, fail what never reached it."""
        if self.engine.dead is None:
            self.engine.abort_all()
        error = self._failure if self._failure is not None else EngineShutdownError("the AsyncEngine shut down")
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                for r in arg:
                    self._fail_stream(r.request_id, error)
        for request_id in list(self._streams):
            self._fail_stream(request_id, error)
