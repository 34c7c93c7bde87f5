"""The OpenAI-compatible HTTP server: FastAPI routes over one :class:`AsyncEngine`.

``/v1/completions`` and ``/v1/chat/completions`` (JSON or SSE streams, as OpenAI and vLLM send
them; on chat, tool calls in LFM2's format and a reasoning split: serve/tools.py,
serve/chat_output.py; structured output on both: serve/constraints.py), ``/v1/models`` and
``/v1/models/{id}``, vLLM's ``/tokenize``, ``/detokenize`` and ``/reset_prefix_cache``,
``/version``, ``/health`` (503 while warming up or after a device failure) and ``/metrics``
(Prometheus). Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``:
400 for a request the engine refuses or a parameter it cannot honour (named), 401 without the API
key, 404 for another model, 413 for a body over the size limit, 503 when the queue is full or the
engine is not serving, 500 when a running request failed.

The event loop only moves bytes: decoding and validating a body, the chat template and the
tokenizer run in worker threads (``asyncio.to_thread``), and a text that cannot fit the context is
refused by its length before it is tokenized, so ``/health`` and running streams answer while a
large request is being read, parsed or refused. A client that disconnects, streaming or not, has
its requests aborted: their slots are free before the engine's next round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.middleware.cors import CORSMiddleware

from .. import __version__
from ..runtime.async_engine import AsyncEngine, EngineShutdownError, QueueFullError
from ..runtime.outputs import GenerationOutput, StreamEvent
from ..runtime.prompts import PromptError, check_messages
from ..runtime.requests import EngineDeadError, RequestError, RequestFailedError
from ..runtime.sampling import SamplingParams
from ..runtime.structured import StructuredOutputError
from .chat_output import ChoiceParser, OutputPlan
from .constraints import Constraint, Tags, after_reasoning, request_constraint, tool_call_grammar
from .guards import DEFAULT_MAX_REQUEST_BYTES, ApiKeyCheck, BodyLimit, RequestTooLarge, too_large
from .logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs
from .metrics import CountResponses, ServerMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       UnsupportedParameter, dumps, error_json, invalid_body, parse_body)
from .reasoning import REASONING_PARSERS, prompt_opens_reasoning
from .tool_calls import TOOL_CALL_START
from .tools import ToolRequest, prepare_messages, tool_request

log = logging.getLogger("lfmspark.serve")

T = TypeVar("T")


class SafeJSONResponse(JSONResponse):
    """JSON answers through :func:`~.protocol.dumps`: a NaN statistic becomes ``null``, not a 500."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


class ModelNotFound(Exception):
    """A request names a model this server does not serve (404)."""

    def __init__(self, requested: str, served: str):
        super().__init__(f"The model `{requested}` does not exist (this server serves `{served}`).")


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; its requests have been aborted."""


TOOL_CALL_PARSERS = ("lfm2",)


def build_app(engine: AsyncEngine, model_name: str, metrics: ServerMetrics | None = None, *,
              api_key: str | None = None, allowed_origins: Sequence[str] = (),
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, reasoning_parser: str | None = None,
              tool_call_parser: str = "lfm2") -> FastAPI:
    """The app serving ``engine`` as ``model_name``. Shutting the app down shuts the engine down
    (running requests are cancelled and every waiter answered). ``api_key``: required as
    ``Authorization: Bearer`` on every route but ``/health``, ``/metrics`` and ``/version`` (None:
    open); ``allowed_origins``: the origins browsers may call from (CORS; none by default);
    ``max_request_bytes``: larger bodies are a 413 (serve/guards.py). With ``metrics``, every
    response is counted by route and status (serve/metrics.py ``CountResponses``).
    ``reasoning_parser``: ``lfm2`` / ``qwen3`` / ``deepseek_r1`` (one ``<think>`` parser,
    serve/reasoning.py) splits chat reasoning into ``reasoning_content``; None leaves it in the
    content, as vLLM does without ``--reasoning-parser``. ``tool_call_parser``: how tool calls are
    read (``lfm2``, the only format; tools are always parsed when a request sends them)."""
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} or None, got "
                         f"{reasoning_parser!r}")
    if tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {tool_call_parser!r}")
    if metrics is not None:
        metrics.attach(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown()

    app = FastAPI(title="lfmspark", version=__version__, lifespan=lifespan, default_response_class=SafeJSONResponse)
    app.state.engine, app.state.metrics = engine, metrics
    _install_error_handlers(app)
    _install_guards(app, api_key, allowed_origins, max_request_bytes)
    if metrics is not None:          # outside the guards: their 401 / 413 are counted too
        app.add_middleware(CountResponses, metrics=metrics, router=app.router)
    front = Frontend(engine, model_name, reasoning=reasoning_parser is not None)
    _info_routes(app, front, metrics)
    _generation_routes(app, front)
    _token_routes(app, front)
    return app


def _install_guards(app: FastAPI, api_key: str | None, allowed_origins: Sequence[str], max_request_bytes: int) -> None:
    """Outermost first: CORS (a preflight is answered before the key is asked for), the API key
    (an unauthorised body is never read), the body's size."""
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])


# -- what a request must satisfy before it reaches the engine -----------------------------------

class Frontend:
    """The engine as the routes see it: the model's name and card, and the synchronous steps of a
    request (decode and validate its body, render and tokenize its prompt, bound its length) that
    the routes run in worker threads.

    ``context``: the most tokens a request's prompt and ``max_tokens`` may total, which
    ``/v1/models`` advertises as ``max_model_len``: the engine's ``max_model_len``. ``max_chars``: a text longer than this cannot
    fit ``context`` tokens whatever it says, since no token spells more characters than the
    vocabulary's longest entry (a byte-level entry spells its bytes, a SentencePiece one its
    characters); such a text is refused without being tokenized. ``reasoning``: a reasoning
    parser is on (serve/reasoning.py).
    """

    def __init__(self, engine: AsyncEngine, model_name: str, reasoning: bool = False):
        self.engine, self.model_name, self.reasoning = engine, model_name, reasoning
        self.created = int(time.time())
        tokenizer = engine.tokenizer
        self.token_text = TokenText(tokenizer)
        self.context = engine.max_new_tokens(0)
        self.max_chars = self.context * _longest_token(tokenizer)
        self.tags = Tags.of(tokenizer)
        template = getattr(tokenizer, "chat_template", None) or ""
        if isinstance(template, dict):          # several named templates
            template = " ".join(map(str, template.values()))
        self.template_renders_calls = "tool_calls" in template
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        self.tool_start_id: int | None = vocab.get(TOOL_CALL_START)

    def card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lfmspark",
                "max_model_len": self.context}

    def check_model(self, requested: str | None) -> None:
        if requested not in (None, self.model_name):
            raise ModelNotFound(requested, self.model_name)

    # -- generation requests (worker threads) --------------------------------------------------
    def completion(self, raw: bytes) -> tuple[CompletionRequest, list[list[int]], int, Constraint | None]:
        """The body, its prompts' token ids, its max_tokens and its constraint (400 / 404 if refused)."""
        body = parse_body(raw, CompletionRequest)
        self.check_model(body.model)
        body.check()
        constraint = request_constraint(body.response_format, body.structured_outputs, body.guided())
        prompts = [self.encode(p, chat=False, param="prompt") for p in body.prompts()]
        defaults = self.engine.sampling_defaults
        max_tokens = body.max_tokens if body.max_tokens is not None else defaults.get("max_new_tokens", 16)
        for ids in prompts:
            self.check_room(len(ids), max_tokens, "prompt", "max_tokens")
        self.check_constraint(constraint)
        return body, prompts, max_tokens, constraint

    def chat(self, raw: bytes) -> ChatJob:
        """The request, its prompt's token ids, its max_tokens (by default what the context leaves),
        how its output is constrained and read (400 / 404 if refused)."""
        body = parse_body(raw, ChatCompletionRequest)
        self.check_model(body.model)
        body.check()
        tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, body.functions, body.function_call)
        constraint = request_constraint(body.response_format, body.structured_outputs, body.guided())
        if tools is not None and tools.forced and constraint is not None:
            raise UnsupportedParameter(constraint.param, f"{constraint.param} cannot be combined with {tools.param} "
                                       f"{tools.choice!r}: a forced call is a constraint of its own")
        messages = prepare_messages(body.messages, self.template_renders_calls)
        prompt_ids = self.encode(messages, chat=True, param="messages", tools=tools.tools if tools else None,
                                 template_kwargs=body.chat_template_kwargs)
        defaults = self.engine.sampling_defaults
        max_tokens = body.requested_max_tokens or min(self.engine.max_new_tokens(len(prompt_ids)),
                                                      defaults.get("max_new_tokens", 1 << 30))
        named = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        self.check_room(len(prompt_ids), max_tokens, "messages", named)
        opened = self._opens_reasoning(prompt_ids) if self.reasoning else None
        if tools is not None and tools.forced:
            constraint = Constraint(tool_call_grammar(tools, self.tags, opened), tools.param)
        elif constraint is not None and opened is not None:
            constraint = after_reasoning(constraint, self.tags, opened)
        self.check_constraint(constraint)
        return ChatJob(body, prompt_ids, max_tokens, OutputPlan(opened, tools), constraint, self._ban(tools))

    def check_constraint(self, constraint: Constraint | None) -> None:
        """Compile the constraint now (cached for the request), a refusal naming its parameter."""
        if constraint is None:
            return
        try:
            self.engine.check_constraint(constraint.params)
        except StructuredOutputError as e:
            detail = str(e).removeprefix("structured_outputs: ")
            raise UnsupportedParameter(constraint.param, f"{constraint.param}: {detail}") from None

    def _opens_reasoning(self, prompt_ids: list[int]) -> bool:
        """Whether the rendered prompt ends inside a ``<think>`` block (serve/reasoning.py)."""
        tail = self.engine.tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False)
        return prompt_opens_reasoning(tail)

    def _ban(self, tools: ToolRequest | None) -> int | None:
        """The token ``tool_choice: "none"`` bans (``<|tool_call_start|>``), when it is one token."""
        return self.tool_start_id if tools is not None and tools.choice == "none" else None

    def encode(self, prompt, chat: bool, param: str, tools: list[dict] | None = None,
               template_kwargs: dict | None = None) -> list[int]:
        """A prompt's token ids, its text first bounded by length (class doc), a token-id list by
        its length before its ids are checked one by one; ``tools`` and ``template_kwargs`` go to
        the chat template."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            self.check_room(len(prompt), 1, param, "max_tokens")
        self.check_text(_text_chars(prompt) + (len(dumps(tools)) if tools else 0), param)
        try:
            return self.engine.encode(prompt, chat=chat, tools=tools, template_kwargs=template_kwargs)
        except PromptError as e:
            raise UnsupportedParameter(param, f"{param}: {e}") from e

    def check_text(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise UnsupportedParameter(param, f"{param}: {chars} characters of text cannot fit this model's "
                                       f"context of {self.context} tokens (max_model_len): texts over "
                                       f"{self.max_chars} characters are refused without being tokenized")

    def check_room(self, prompt_len: int, max_tokens: int, prompt_param: str, max_param: str) -> None:
        """Prompt + max_tokens within ``context``, blaming the prompt only when it leaves no room at all."""
        if prompt_len + max_tokens <= self.context:
            return
        if prompt_len >= self.context:
            raise UnsupportedParameter(prompt_param, f"{prompt_param}: the prompt is {prompt_len} tokens, and this "
                                       f"model's context is {self.context} tokens (max_model_len), prompt and "
                                       "output together: shorten the prompt")
        raise UnsupportedParameter(max_param, f"{max_param}: the prompt ({prompt_len} tokens) + {max_param} "
                                   f"({max_tokens}) = {prompt_len + max_tokens} tokens exceeds this model's "
                                   f"context of {self.context} tokens (max_model_len): lower {max_param} to at "
                                   f"most {self.context - prompt_len}")

    # -- /tokenize and /detokenize (worker threads) ---------------------------------------------
    def tokenize(self, raw: bytes) -> dict:
        """vLLM's answer: ``tokens``, ``count``, ``max_model_len`` (and ``token_strs`` if asked)."""
        body = parse_body(raw, TokenizeRequest)
        self.check_model(body.model)
        body.check()
        param = "prompt" if body.prompt is not None else "messages"
        tokenizer = self._tokenizer(param)
        if body.messages is not None:
            text = self._render(tokenizer, body)
        else:
            self.check_text(len(body.prompt), "prompt")
            text = body.prompt
        _check_unicode(text, param)
        ids = list(tokenizer(text, add_special_tokens=body.special_tokens)["input_ids"])
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.context, "tokens": ids, "token_strs": strs}

    def detokenize(self, raw: bytes) -> dict:
        """vLLM's answer: ``{"prompt": text}`` (special tokens shown, as vLLM decodes)."""
        body = parse_body(raw, DetokenizeRequest)
        self.check_model(body.model)
        tokenizer = self._tokenizer("tokens")
        if body.tokens:
            try:
                self.engine.encode(body.tokens, chat=False)         # ids inside the vocabulary
            except PromptError as e:
                raise UnsupportedParameter("tokens", f"tokens: {e}") from e
        return {"prompt": tokenizer.decode(body.tokens)}

    def _tokenizer(self, param: str):
        if self.engine.tokenizer is None:
            raise UnsupportedParameter(param, "this model has no tokenizer (no tokenizer files in its "
                                       "directory): it serves token-id prompts only")
        return self.engine.tokenizer

    def _render(self, tokenizer, body: TokenizeRequest) -> str:
        """The chat template's text for ``body.messages`` (and its tools), checked as a chat
        request's are."""
        tools = tool_request(body.tools, None, None, None, None) if body.tools is not None else None
        messages = prepare_messages(body.messages, self.template_renders_calls)
        try:
            check_messages(messages)
        except PromptError as e:
            raise UnsupportedParameter("messages", f"messages: {e}") from e
        self.check_text(_text_chars(messages) + (len(dumps(body.tools)) if body.tools else 0), "messages")
        if not getattr(tokenizer, "chat_template", None):
            raise UnsupportedParameter("messages", "this model's tokenizer has no chat template")
        options = dict(body.chat_template_kwargs or {})
        if body.continue_final_message:
            options["continue_final_message"] = True
        if tools is not None:
            options["tools"] = tools.tools
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                 tokenize=False, **options)
        except TemplateError as e:
            raise UnsupportedParameter("messages", f"messages: the chat template refused them: {e}") from e


class ChatJob:
    """A chat request ready to run: its body, prompt, max_tokens, how its output is read, its
    constraint and the token it bans (``tool_choice: "none"``)."""

    def __init__(self, body: ChatCompletionRequest, prompt_ids: list[int], max_tokens: int, plan: OutputPlan,
                 constraint: Constraint | None, banned: int | None):
        self.body, self.prompt_ids, self.max_tokens, self.plan = body, prompt_ids, max_tokens, plan
        self.constraint, self.banned = constraint, banned

    def sampling(self, defaults: dict) -> SamplingParams:
        """The engine's parameters: the body's, the constraint, special tokens spelled when the
        output is parsed, and the banned token's bias."""
        params = self.body.sampling(self.max_tokens, defaults, logprobs=self.body.logprobs_count)
        return with_constraint(params, self.constraint, skip_special_tokens=not self.plan.active, banned=self.banned)


def with_constraint(params: SamplingParams, constraint: Constraint | None, skip_special_tokens: bool = True,
                    banned: int | None = None) -> SamplingParams:
    """``params`` with the request's constraint, whether special tokens are spelled in the text, and
    ``banned`` (a token the request may not draw) biased by -100, the most the engine takes."""
    bias = params.logit_bias
    if banned is not None:
        bias = {**(bias or {}), banned: -100.0}
    return dataclasses.replace(params, structured_outputs=constraint.params if constraint is not None else None,
                               skip_special_tokens=skip_special_tokens, logit_bias=bias)


def _longest_token(tokenizer) -> int:
    """Characters in the vocabulary's longest entry (1 without a tokenizer: no text is served)."""
    if tokenizer is None:
        return 1
    return max(1, max(map(len, tokenizer.get_vocab()), default=1))


def _text_chars(prompt) -> int:
    """Characters of text in a prompt: a string's, or the contents of chat messages (a token-id list
    has none). Malformed messages count what they hold; the engine names what is wrong."""
    if isinstance(prompt, str):
        return len(prompt)
    total = 0
    for m in prompt if isinstance(prompt, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


def _check_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnsupportedParameter(param, f"{param} is not valid Unicode text (a lone surrogate at "
                                   f"character {e.start})") from None


# -- routes ----------------------------------------------------------------------------------------

def _info_routes(app: FastAPI, front: Frontend, metrics: ServerMetrics | None) -> None:
    engine = front.engine

    @app.get("/health")
    async def health():
        if engine.failure is not None:
            return SafeJSONResponse({"status": "unhealthy", "error": f"{type(engine.failure).__name__}: "
                                     f"{engine.failure}"}, status_code=503)
        if not engine.ready:
            return SafeJSONResponse({"status": "warming up"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Drop every cached prefix (vLLM's endpoint of that name); running requests are unaffected."""
        dropped = await engine.clear_prefix_cache()
        return {"status": "ok", "dropped_blocks": dropped}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [front.card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        front.check_model(model_id)
        return front.card()

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return SafeJSONResponse(error_json("metrics are off in this server", "not_found"), status_code=404)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _generation_routes(app: FastAPI, front: Frontend) -> None:
    engine, model_name, token_text = front.engine, front.model_name, front.token_text

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, prompts, max_tokens, constraint = await asyncio.to_thread(front.completion, await request.body())
        rid = f"cmpl-{uuid.uuid4().hex}"
        params = with_constraint(body.sampling(max_tokens, engine.sampling_defaults, logprobs=body.logprobs),
                                 constraint)
        streams = await _unless_disconnected(request, _start(engine, prompts, params, rid))
        if body.stream:
            return _sse(_completion_chunks(streams, rid, model_name, prompts, body, token_text))
        outs = await _unless_disconnected(request, _finish_all(streams))
        n = body.n or 1
        choices = [{"index": i, "text": out.text or "", "logprobs": _completion_logprobs(out, token_text),
                    "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                    **({"token_ids": out.token_ids, "prompt_token_ids": prompts[i // n]} if body.return_token_ids
                       else {}),
                    **_prompt_logprobs(out, token_text)}
                   for i, out in enumerate(outs)]
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage(prompts, outs)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        job = await asyncio.to_thread(front.chat, await request.body())
        body, prompt_ids = job.body, job.prompt_ids
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        params = job.sampling(engine.sampling_defaults)
        streams = await _unless_disconnected(request, _start(engine, [prompt_ids], params, rid))
        if body.stream:
            return _sse(_chat_chunks(streams[0], rid, model_name, prompt_ids, body, token_text, job.plan))
        outs = await _unless_disconnected(request, _finish_all(streams))
        choices = [{"index": j, **_chat_message(out, job.plan),
                    "logprobs": chat_logprobs(out.logprobs, token_text) if out.logprobs is not None else None,
                    "stop_reason": out.stop_reason,
                    **({"token_ids": out.token_ids} if body.return_token_ids else {}),
                    **_prompt_logprobs(out, token_text)}
                   for j, out in enumerate(outs)]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": choices, "usage": _usage([prompt_ids], outs)}


def _token_routes(app: FastAPI, front: Frontend) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await asyncio.to_thread(front.tokenize, await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await asyncio.to_thread(front.detokenize, await request.body())


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
    """Submit every prompt and wait for each one's first event; if one is refused, or the wait is
    cancelled (a client that left), abort the others."""
    streams = [engine.generate(p, params, request_id=f"{rid}-{i}") for i, p in enumerate(prompts)]
    try:
        firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
    except asyncio.CancelledError:
        await _close(streams)         # those whose first event came wait at a yield: close them
        raise
    failed = [f for f in firsts if isinstance(f, BaseException)]
    if failed:
        await _close(streams)
        raise failed[0]
    return [_Started(s, f) for s, f in zip(streams, firsts)]


async def _close(streams: Iterable[AsyncIterator[StreamEvent]]) -> None:
    """Leave each generate iterator (which aborts its request if it has not finished)."""
    await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled, which
    leaves the engine's generate iterators it is reading, so their requests are aborted and their
    slots free before the engine's next round, and :class:`ClientDisconnected` is raised. (A
    streamed answer needs no watch: Starlette stops it at the disconnect, closing its iterators.)"""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)     # its aborts are sent once it returns
    if task.cancelled():
        raise ClientDisconnected("the client disconnected")
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return once the client has gone. The body has been read, so the server's next message for
    this request is its ``http.disconnect``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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


def _completion_logprobs(out: GenerationOutput, token_text: TokenText) -> dict | None:
    """A whole completion's logprobs, their offsets within its text."""
    if out.logprobs is None:
        return None
    return completion_logprobs(out.logprobs, token_text, end=len(out.text or ""))


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
    sent: dict[int, int] = {}              # per choice: the characters of text sent so far
    async for i, ev in _merged(streams):
        index = i * n + ev.sample
        sent[index] = sent.get(index, 0) + len(ev.text or "")
        logprobs = None
        if ev.logprobs is not None:
            logprobs = completion_logprobs(ev.logprobs, token_text, offsets.get(index, 0), end=sent[index])
            offsets[index] = offsets.get(index, 0) + sum(token_text.width(r.token_id) for r in ev.logprobs)
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


def _chat_message(out: GenerationOutput, plan: OutputPlan) -> dict:
    """A whole choice's ``message`` and ``finish_reason``: the text as it is, or parsed (reasoning,
    content, tool calls) when the plan reads it."""
    if not plan.active:
        return {"message": {"role": "assistant", "content": out.text or ""}, "finish_reason": out.finish_reason}
    parser = ChoiceParser(plan)
    return {"message": parser.message(out.text or ""), "finish_reason": parser.finish_reason(out.finish_reason)}


async def _chat_chunks(stream: _Started, rid: str, model: str, prompt_ids: list[int],
                       body: ChatCompletionRequest, token_text: TokenText, plan: OutputPlan) -> AsyncIterator[dict]:
    created = int(time.time())

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None,
              **extra) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                             **extra}]}

    for j in range(body.n or 1):
        yield chunk(j, {"role": "assistant", "content": ""})
    outs = []
    parsers: dict[int, ChoiceParser] = {}
    async for ev in stream.events():
        extra = {"token_ids": ev.token_ids} if body.return_token_ids else {}
        logprobs = chat_logprobs(ev.logprobs, token_text) if ev.logprobs is not None else None
        if not plan.active:
            deltas = [{"content": ev.text or ""}] if ev.text or ev.token_ids else []
        else:
            parser = parsers.get(ev.sample) or parsers.setdefault(ev.sample, ChoiceParser(plan))
            deltas = parser.feed(ev.text or "") + (parser.finish() if ev.finished else [])
            if not deltas and ev.token_ids and (logprobs is not None or extra):
                deltas = [{}]                   # the tokens' logprobs / ids, while their text is held
        for k, delta in enumerate(deltas):
            yield chunk(ev.sample, delta, **({"logprobs": logprobs, **extra} if k == 0 else {}))
        if ev.finished:
            outs.append(ev.output)
            reason = ev.output.finish_reason
            if plan.active:
                reason = parsers[ev.sample].finish_reason(reason)
            yield chunk(ev.sample, {}, reason, stop_reason=ev.output.stop_reason)
    if body.include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": _usage([prompt_ids], outs)}


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events: one ``data:`` line per chunk, an error object if the request fails midway,
    then ``data: [DONE]``. A client that disconnects closes ``chunks``, which aborts its requests."""
    async def body():
        try:
            async for c in chunks:
                yield f"data: {dumps(c)}\n\n"
        except (RequestFailedError, EngineDeadError, EngineShutdownError) as e:
            yield f"data: {dumps(error_json(str(e), 'internal_error', code='request_failed'))}\n\n"
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# -- errors --------------------------------------------------------------------------------------

def _install_error_handlers(app: FastAPI) -> None:
    def answer(status: int, body: dict) -> SafeJSONResponse:
        return SafeJSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        e = invalid_body(exc.errors())
        return answer(400, error_json(str(e), param=e.param))

    @app.exception_handler(UnsupportedParameter)
    async def unsupported(request: Request, exc: UnsupportedParameter):
        return answer(400, error_json(str(exc), param=exc.param))

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError):
        return answer(400, error_json(str(exc), param=_named_param(str(exc))))

    @app.exception_handler(ModelNotFound)
    async def not_found(request: Request, exc: ModelNotFound):
        return answer(404, error_json(str(exc), "invalid_request_error", "model", "model_not_found"))

    @app.exception_handler(RequestTooLarge)
    async def too_big(request: Request, exc: RequestTooLarge):
        return answer(413, too_large(None, exc.limit))

    @app.exception_handler(ClientDisconnected)
    async def gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)        # nginx's "client closed request": nobody reads it

    @app.exception_handler(QueueFullError)
    async def overloaded(request: Request, exc: QueueFullError):
        return answer(503, error_json(str(exc), "server_overloaded", code="queue_full"))

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineShutdownError)
    async def not_serving(request: Request, exc: Exception):
        return answer(503, error_json(str(exc), "server_error", code="engine_unavailable"))

    @app.exception_handler(RequestFailedError)
    async def failed(request: Request, exc: RequestFailedError):
        return answer(500, error_json(str(exc), "internal_error", code="request_failed"))


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
