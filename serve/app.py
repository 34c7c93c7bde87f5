"""The OpenAI-compatible HTTP server: FastAPI routes over one :class:`AsyncEngine`.

``/v1/completions`` and ``/v1/chat/completions`` (JSON or SSE streams, as OpenAI and vLLM send
them), ``/v1/models``, ``/health`` (503 while warming up or after a device failure) and
``/metrics`` (Prometheus). Errors have OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``: 400 for a request the engine refuses or a parameter it cannot honour (named), 404 for
another model, 503 when the queue is full or the engine is not serving, 500 when a running request
failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import __version__
from ..runtime.async_engine import AsyncEngine, EngineShutdownError, QueueFullError
from ..runtime.outputs import GenerationOutput, StreamEvent
from ..runtime.prompts import PromptError
from ..runtime.requests import EngineDeadError, RequestError, RequestFailedError
from ..runtime.sampling import SamplingParams
from .logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, UnsupportedParameter, error_json

log = logging.getLogger("lfmspark.serve")


def build_app(engine: AsyncEngine, model_name: str, metrics: ServerMetrics | None = None) -> FastAPI:
    """The app serving ``engine`` as ``model_name``. Shutting the app down shuts the engine down
    (running requests are cancelled and every waiter answered)."""
    if metrics is not None:
        metrics.attach(engine)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown()

    app = FastAPI(title="lfmspark", version=__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    _install_error_handlers(app)
    token_text = TokenText(engine.tokenizer)

    @app.get("/health")
    async def health():
        if engine.failure is not None:
            return JSONResponse({"status": "unhealthy", "error": f"{type(engine.failure).__name__}: "
                                 f"{engine.failure}"}, status_code=503)
        if not engine.ready:
            return JSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ok"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Drop every cached prefix (vLLM's endpoint of that name); running requests are unaffected."""
        dropped = await engine.clear_prefix_cache()
        return {"status": "ok", "dropped_blocks": dropped}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "lfmspark", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return JSONResponse(error_json("metrics are off in this server", "not_found"), status_code=404)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def check_model(body) -> JSONResponse | None:
        if body.model not in (None, model_name):
            return JSONResponse(error_json(f"The model `{body.model}` does not exist (this server serves "
                                           f"`{model_name}`).", "invalid_request_error", "model",
                                           "model_not_found"), status_code=404)
        return None

    def encode(prompt, chat: bool, param: str) -> list[int]:
        try:
            return engine.encode(prompt, chat=chat)
        except PromptError as e:
            raise UnsupportedParameter(param, f"{param}: {e}") from e

    def room(prompt_ids: list[int]) -> int:
        """The most tokens a request with this prompt may generate (the default chat max_tokens)."""
        return engine.max_new_tokens(len(prompt_ids))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if (missing := check_model(body)) is not None:
            return missing
        body.check()
        rid = f"cmpl-{uuid.uuid4().hex}"
        prompts = [encode(p, chat=False, param="prompt") for p in body.prompts()]
        defaults = engine.sampling_defaults
        max_tokens = body.max_tokens if body.max_tokens is not None else defaults.get("max_new_tokens", 16)
        params = body.sampling(max_tokens, defaults, logprobs=body.logprobs)
        streams = await _start(engine, prompts, params, rid)
        if body.stream:
            return _sse(_completion_chunks(streams, rid, model_name, prompts, body, token_text))
        outs = await _finish_all(streams)
        n = body.n or 1
        choices = [{"index": i, "text": out.text or "",
                    "logprobs": completion_logprobs(out.logprobs, token_text) if out.logprobs is not None else None,
                    "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                    **({"token_ids": out.token_ids, "prompt_token_ids": prompts[i // n]} if body.return_token_ids
                       else {}),
                    **_prompt_logprobs(out, token_text)}
                   for i, out in enumerate(outs)]
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage(prompts, outs)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if (missing := check_model(body)) is not None:
            return missing
        body.check()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prompt_ids = encode(body.messages, chat=True, param="messages")
        defaults = engine.sampling_defaults
        max_tokens = body.requested_max_tokens or min(room(prompt_ids), defaults.get("max_new_tokens", 1 << 30))
        params = body.sampling(max_tokens, defaults, logprobs=body.logprobs_count)
        streams = await _start(engine, [prompt_ids], params, rid)
        if body.stream:
            return _sse(_chat_chunks(streams[0], rid, model_name, prompt_ids, body, token_text))
        outs = await _finish_all(streams)
        choices = [{"index": j, "message": {"role": "assistant", "content": out.text or ""},
                    "logprobs": chat_logprobs(out.logprobs, token_text) if out.logprobs is not None else None,
                    "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                    **({"token_ids": out.token_ids} if body.return_token_ids else {}),
                    **_prompt_logprobs(out, token_text)}
                   for j, out in enumerate(outs)]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage([prompt_ids], outs)}

    return app


# -- running requests ---------------------------------------------------------------------------

class _Started:
    """A request (its ``n`` samples) whose first event has arrived (so a refusal became an HTTP
    error, not a broken stream)."""

    def __init__(self, stream: AsyncIterator[StreamEvent], first: StreamEvent):
        self.stream, self.first = stream, first

    async def events(self) -> AsyncIterator[StreamEvent]:
        yield self.first
        async for ev in self.stream:
            yield ev

    async def finish(self) -> list[GenerationOutput]:
        """Every sample's output, in sample order."""
        outs = [ev.output async for ev in self.events() if ev.finished]
        return sorted(outs, key=lambda o: o.sample)


async def _start(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, rid: str) -> list[_Started]:
    """Submit every prompt and wait for each one's first event; if one is refused, abort the others."""
    streams = [engine.generate(p, params, request_id=f"{rid}-{i}") for i, p in enumerate(prompts)]
    firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
    failed = [f for f in firsts if isinstance(f, BaseException)]
    if failed:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise failed[0]
    return [_Started(s, f) for s, f in zip(streams, firsts)]


async def _finish_all(streams: list[_Started]) -> list[GenerationOutput]:
    """The outputs of every prompt's samples, prompt by prompt (OpenAI's choice order)."""
    per_prompt = await asyncio.gather(*(s.finish() for s in streams))
    return [out for outs in per_prompt for out in outs]


def _usage(prompts: list[list[int]], outs: list[GenerationOutput]) -> dict:
    """OpenAI's usage block; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache
    supplied (each prompt counted once, by its first sample, which ran its prefill)."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(o.token_ids) for o in outs)
    cached = sum(o.stats.prompt_tokens_cached for o in outs if o.sample == 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


async def _merged(streams: list[_Started]) -> AsyncIterator[tuple[int, StreamEvent]]:
    """Events of several requests as they come, tagged with their prompt's index."""
    if len(streams) == 1:
        async for ev in streams[0].events():
            yield 0, ev
        return
    inbox: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: _Started):
        try:
            async for ev in s.events():
                await inbox.put((i, ev, None))
            await inbox.put((i, None, None))          # this prompt's stream has ended
        except BaseException as e:
            await inbox.put((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        ended = 0
        while ended < len(streams):
            i, ev, err = await inbox.get()
            if err is not None:
                raise err
            if ev is None:
                ended += 1
                continue
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _prompt_logprobs(out: GenerationOutput, token_text: TokenText) -> dict:
    """The ``prompt_logprobs`` field of a choice (vLLM's extension), when the request asked for them."""
    if out.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": prompt_logprobs(out.prompt_logprobs, token_text)}


async def _completion_chunks(streams: list[_Started], rid: str, model: str, prompts: list[list[int]],
                             body: CompletionRequest, token_text: TokenText) -> AsyncIterator[dict]:
    n = body.n or 1
    outs: list[GenerationOutput] = []
    created = int(time.time())
    offsets: dict[int, int] = {}           # per choice: where its next token's text starts
    async for i, ev in _merged(streams):
        index = i * n + ev.sample
        logprobs = None
        if ev.logprobs is not None:
            logprobs = completion_logprobs(ev.logprobs, token_text, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
        choice = {"index": index, "text": ev.text or "", "logprobs": logprobs,
                  "finish_reason": ev.output.finish_reason if ev.finished else None,
                  "stop_reason": ev.output.stop_reason if ev.finished else None}
        if body.return_token_ids:
            choice["token_ids"] = ev.token_ids
        if ev.finished:
            choice.update(_prompt_logprobs(ev.output, token_text))
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
        if ev.finished:
            outs.append(ev.output)
    if body.include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": _usage(prompts, outs)}


async def _chat_chunks(stream: _Started, rid: str, model: str, prompt_ids: list[int],
                       body: ChatCompletionRequest, token_text: TokenText) -> AsyncIterator[dict]:
    created = int(time.time())

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None,
              **extra) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                             **extra}]}

    for j in range(body.n or 1):
        yield chunk(j, {"role": "assistant", "content": ""})
    outs = []
    async for ev in stream.events():
        extra = {"token_ids": ev.token_ids} if body.return_token_ids else {}
        if ev.text or ev.token_ids:
            logprobs = chat_logprobs(ev.logprobs, token_text) if ev.logprobs is not None else None
            yield chunk(ev.sample, {"content": ev.text or ""}, logprobs=logprobs, **extra)
        if ev.finished:
            outs.append(ev.output)
            yield chunk(ev.sample, {}, ev.output.finish_reason, stop_reason=ev.output.stop_reason)
    if body.include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": _usage([prompt_ids], outs)}


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: one ``data:`` line per chunk, an error object if the request fails midway,
    then ``data: [DONE]``. A client that disconnects closes ``chunks``, which aborts its requests."""
    async def body():
        try:
            async for c in chunks:
                yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
        except (RequestFailedError, EngineDeadError, EngineShutdownError) as e:
            yield f"data: {json.dumps(error_json(str(e), 'internal_error', code='request_failed'))}\n\n"
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# -- errors --------------------------------------------------------------------------------------

def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        if err.get("type") == "extra_forbidden":
            message = f"unknown parameter {'.'.join(loc)!r}: this server does not support it"
        else:
            message = f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid value')}"
        return JSONResponse(error_json(message, param=param), status_code=400)

    @app.exception_handler(UnsupportedParameter)
    async def unsupported(request: Request, exc: UnsupportedParameter):
        return JSONResponse(error_json(str(exc), param=exc.param), status_code=400)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError):
        return JSONResponse(error_json(str(exc), param=_named_param(str(exc))), status_code=400)

    @app.exception_handler(QueueFullError)
    async def overloaded(request: Request, exc: QueueFullError):
        return JSONResponse(error_json(str(exc), "server_overloaded", code="queue_full"), status_code=503)

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineShutdownError)
    async def not_serving(request: Request, exc: Exception):
        return JSONResponse(error_json(str(exc), "server_error", code="engine_unavailable"), status_code=503)

    @app.exception_handler(RequestFailedError)
    async def failed(request: Request, exc: RequestFailedError):
        return JSONResponse(error_json(str(exc), "internal_error", code="request_failed"), status_code=500)


_SAMPLING_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed", "stop": "stop",
                   "min_p": "min_p", "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty", "min_tokens": "min_tokens", "logit_bias": "logit_bias",
                   "stop_token_ids": "stop_token_ids", "timeout_s": "timeout_s", "max_new_tokens": "max_tokens",
                   "ignore_eos": "ignore_eos", "n": "n", "logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs"}


def _named_param(message: str) -> str | None:
    """The API parameter an engine refusal names ("top_p must be ..." -> "top_p")."""
    first = message.split(" ", 1)[0].split("=", 1)[0]
    if first in _SAMPLING_NAMES:
        return _SAMPLING_NAMES[first]
    if message.startswith(("prompt", "a token-id prompt", "the prompt")):
        return "prompt"
    return None
