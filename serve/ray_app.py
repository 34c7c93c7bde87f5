"""Data-parallel replicas of the OpenAI-compatible server on Ray Serve (the ``ray`` extra).

    lfmspark serve --replicas 2 --target DIR --draft DIR          # one engine per GPU, on this machine
    serve run lfmspark.serve.ray_app:app_builder target=DIR draft=DIR replicas=2   # the same, Ray's CLI

Two deployments:

- ``Replica`` (``replicas`` of them, one GPU each, or CPU workers): an :class:`Engine` with its
  :class:`AsyncEngine` and the whole single-server app of serve/app.py, run in process for each
  request (:func:`asgi_exchange`): every route, check and error of ``lfmspark serve`` is the same.
  A replica warms up in its constructor, so Ray sends it nothing before it is ready; Ray's health
  check calls :meth:`Replica.check_health`, which fails once the engine has hit a device error, and
  Ray then replaces the replica. ``max_ongoing_requests`` is the engine's slot count, so requests
  beyond it wait in Ray's router, not in a replica: a replica that dies loses only the requests it
  had started.
- ``Ingress`` (one, light): FastAPI on Ray's HTTP proxy, forwarding every request to a replica
  through a deployment handle, streaming the answer back as the replica produces it, with the
  serving replica's id in the ``x-lfmspark-replica`` header; ``/metrics`` gathers every live
  replica's metrics, each sample labelled with its replica.

**Routing** (:class:`PrefixAffinityRouter`, a Ray Serve request router): a replica's prefix cache
(runtime/prefix_cache.py) only helps requests that reach it, so a request goes to the replica that
already served the longest prefix of its prompt (the concatenated chat messages, or the completion
prompt, compared in blocks of characters), unless that replica is busier than the least loaded by
more than ``imbalance`` requests; otherwise, or with no such replica, to the least loaded (Ray's
own choice among all). Why prefix-aware rather than session ids: a conversation's next turn starts
with the previous turn's messages, so it matches there without any client cooperation, and
requests that share only a system prompt still spread by load (every replica matches them alike).
"""

# no `from __future__ import annotations`: FastAPI reads the ingress routes' parameter types at runtime,
# and Ray Serve's wrapping of class routes keeps string annotations unresolved
import argparse
import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from ..runtime.config import EngineConfig
from ..runtime.engine import Engine
from .protocol import error_json

log = logging.getLogger("lfmspark.serve")

ROUTING_BLOCK_CHARS = 256      # prompts are compared in blocks of this many characters
ROUTING_MEMORY = 20000         # prefix blocks remembered per replica (least recently used dropped)
METRICS_PUSH_S = 1.0           # how often a replica posts its metrics for the ingress
METRICS_STALE_S = 15.0         # a replica not heard from for this long is left out of /metrics
REPLICA_HEADER = "x-lfmspark-replica"


# -- routing ---------------------------------------------------------------------------------

def routing_text(path: str, body: bytes) -> str:
    """What a request's prompt starts with, as text: the chat messages in order (role and content),
    or the completion prompt; empty for other routes or a body that is not JSON."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    if path.endswith("/chat/completions") and isinstance(data.get("messages"), list):
        return "".join(f"{m.get('role')}\x1f{json.dumps(m.get('content'))}\x1e" for m in data["messages"]
                       if isinstance(m, dict))
    if path.endswith("/completions"):
        prompt = data.get("prompt")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    return ""


def prefix_keys(text: str, block: int = ROUTING_BLOCK_CHARS) -> list[bytes]:
    """One key per whole block of ``text``: the digest of everything up to that block's end."""
    keys, h = [], hashlib.blake2b(digest_size=16)
    for end in range(block, len(text) + 1, block):
        h.update(text[end - block:end].encode("utf-8", "surrogatepass"))
        keys.append(h.copy().digest())
    return keys


class PrefixAffinityRouter(RequestRouter):
    """Sends a request to the replica that served the longest prefix of its prompt unless that one is
    much busier than the least loaded (module doc). Reads the prompt text from the request's first
    argument (the ingress passes it there)."""

    def initialize_state(self, imbalance: int = 4, memory: int = ROUTING_MEMORY) -> None:
        self.imbalance, self.memory = imbalance, memory
        self.served: dict[ReplicaID, OrderedDict[bytes, None]] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        keys = self._keys(pending_request)
        best, best_len = None, 0
        for replica in candidate_replicas:
            seen = self.served.get(replica.replica_id)
            if not seen:
                continue
            n = 0
            while n < len(keys) and keys[n] in seen:
                n += 1
            if n > best_len:
                best, best_len = replica, n
        if best is None:
            return [candidate_replicas]
        loads = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) for r in candidate_replicas}
        known = [q for q in loads.values() if q is not None]
        if loads[best.replica_id] is not None and known and loads[best.replica_id] - min(known) > self.imbalance:
            return [candidate_replicas]
        return [[best], [r for r in candidate_replicas if r is not best]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        seen = self.served.setdefault(replica_id, OrderedDict())
        for key in self._keys(pending_request):
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.memory:
            seen.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.served.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)

    @staticmethod
    def _keys(pending_request: PendingRequest | None) -> list[bytes]:
        if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], str):
            return []
        return prefix_keys(pending_request.args[0])


# -- one request through an ASGI app in this process -------------------------------------------

async def asgi_exchange(app, method: str, path: str, query: bytes, headers: Sequence[tuple[bytes, bytes]],
                        body: bytes) -> AsyncIterator[Any]:
    """Run one HTTP request through the ASGI ``app``. Yields ``(status, headers)`` first, then the
    body's chunks as the app sends them (an SSE stream arrives event by event). Closing the
    generator early tells the app the client disconnected."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": list(headers), "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    task = asyncio.create_task(app(scope, receive, messages.put))
    try:
        while True:
            getter = asyncio.create_task(messages.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                if messages.empty():
                    task.result()          # re-raises what the app raised
                    return
                continue
            message = getter.result()
            if message["type"] == "http.response.start":
                yield message["status"], [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    return
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()


# -- the deployments -------------------------------------------------------------------------

@ray.remote(num_cpus=0)
class MetricsBoard:
    """Where replicas post their Prometheus text for the ingress's ``/metrics``."""

    def __init__(self) -> None:
        self.texts: "dict[str, tuple[str, float]]" = {}

    def post(self, replica: str, text: str) -> None:
        self.texts[replica] = (text, time.time())

    def collect(self, stale_s: float) -> dict[str, str]:
        now = time.time()
        return {r: text for r, (text, at) in self.texts.items() if now - at <= stale_s}


def board_name() -> str:
    return f"lfmspark-metrics-{serve.get_replica_context().app_name}"


def merge_metrics(texts: dict[str, str]) -> str:
    """The replicas' Prometheus texts as one exposition, each sample labelled ``replica``."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            doc, kind, lines = families.setdefault(family.name, (family.documentation, family.type, []))
            for s in family.samples:
                labels = {**s.labels, "replica": replica}
                rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{s.name}{{{rendered}}} {s.value!r}")
    out = []
    for name, (doc, kind, lines) in families.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Replica:
    """One engine and the single-server app (module doc)."""

    def __init__(self, config: EngineConfig, model_name: str, warmup: bool = True, max_waiting: int = 256,
                 server_options: dict[str, Any] | None = None) -> None:
        from . import make_server_app

        self.app = make_server_app(Engine.from_config(config), model_name, max_waiting=max_waiting, warmup=warmup,
                                   **(server_options or {}))
        self.engine = self.app.state.engine
        self.metrics = self.app.state.metrics
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self._board_name = f"lfmspark-metrics-{context.app_name}"
        self._poster: asyncio.Task | None = None
        # Ray routes to a replica once its constructor returns: the warm-up (in the engine's thread)
        # finishes first
        while not self.engine.ready and self.engine.failure is None:
            time.sleep(0.05)
        if self.engine.failure is not None:
            raise RuntimeError(f"the engine failed while warming up: {self.engine.failure}")

    def _start_posting(self) -> None:
        if self._poster is None:
            self._poster = asyncio.get_running_loop().create_task(self._post_metrics())

    async def forward(self, routing_key: str, method: str, path: str, query: bytes,
                      headers: list[tuple[bytes, bytes]], body: bytes) -> AsyncIterator[Any]:
        """Serve one HTTP request (``routing_key``: read by the router only); yields the response start,
        then its body chunks, with this replica's id among the headers."""
        self._start_posting()
        async for item in asgi_exchange(self.app, method, path, query, headers, body):
            if isinstance(item, tuple):
                status, response_headers = item
                item = status, [*response_headers, (REPLICA_HEADER, self.replica_id)]
            yield item

    async def _post_metrics(self) -> None:
        board = None
        while True:
            try:
                if board is None:
                    board = ray.get_actor(self._board_name)
                await board.post.remote(self.replica_id, self.metrics.render().decode())
            except Exception:                  # the ingress (and its board) may be restarting
                board = None
            await asyncio.sleep(METRICS_PUSH_S)

    async def check_health(self) -> None:
        self._start_posting()
        if self.engine.failure is not None:
            raise RuntimeError(f"engine failed: {self.engine.failure}")

    async def __del__(self) -> None:
        if self._poster is not None:
            self._poster.cancel()
        await self.engine.shutdown()


# defined before the ingress class: Ray Serve captures the routes' globals when the class is decorated
def _replica_failed(error: BaseException) -> JSONResponse:
    log.warning("a replica failed a request before answering it: %s", error)
    return JSONResponse(error_json(f"the replica serving this request failed: {type(error).__name__}",
                                   "service_unavailable", code="replica_failed"), status_code=503)


async def relay(stream: AsyncIterator[Any]) -> Response:
    """The client's response from a replica's :func:`asgi_exchange` stream (``(status, headers)``, then
    the body's chunks). An event stream is passed on as it comes; any other body is read whole first,
    so that a replica dying between its response's start and its body (Ray replaces it) is a clean 503,
    as a death before the start is, not a 200 whose body breaks off."""
    try:
        status, response_headers = await stream.__anext__()
    except Exception as e:         # the replica died or failed before answering
        return _replica_failed(e)
    keep = {k: v for k, v in response_headers if k.lower() not in ("content-length", "transfer-encoding")}
    if keep.get("content-type", "").startswith("text/event-stream"):
        return StreamingResponse(stream, status_code=status, headers=keep)
    try:
        content = b"".join([chunk async for chunk in stream])
    except Exception as e:
        return _replica_failed(e)
    return Response(content, status_code=status, headers=keep)


ingress_app = FastAPI(title="lfmspark (Ray Serve)")


@serve.ingress(ingress_app)
class Ingress:
    """Forwards every request to a replica (module doc)."""

    def __init__(self, replicas) -> None:
        self.replicas = replicas
        self.board = MetricsBoard.options(name=board_name(), get_if_exists=True).remote()

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        texts = await self.board.collect.remote(METRICS_STALE_S)
        return Response(merge_metrics(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        headers = [(k.encode(), v.encode()) for k, v in request.headers.items()]
        stream = self.replicas.options(stream=True).forward.remote(
            routing_text("/" + path, body), request.method, "/" + path, request.url.query.encode(), headers, body)
        return await relay(stream)


def deployments(config: EngineConfig, model_name: str, replicas: int, *, warmup: bool = True, max_waiting: int = 256,
                imbalance: int = 4, gpus_per_replica: float | None = None, server_options: dict[str, Any] | None = None):
    """The Ray Serve application: ``replicas`` engines behind one ingress (see the module doc);
    ``server_options`` go to each replica's app (``make_server_app``: api_key, allowed_origins,
    max_request_bytes, reasoning_parser, tool_call_parser), which checks and reads every request as
    ``lfmspark serve`` does."""
    import torch

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if gpus_per_replica is None:
        gpus_per_replica = 1 if torch.cuda.is_available() else 0
    replica = serve.deployment(
        Replica, num_replicas=replicas, max_ongoing_requests=config.max_batch,
        ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": 0 if gpus_per_replica else 1},
        health_check_period_s=5, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                  request_router_kwargs={"imbalance": imbalance}),
    ).bind(config, model_name, warmup, max_waiting, server_options)
    return serve.deployment(Ingress, max_ongoing_requests=10000, ray_actor_options={"num_cpus": 0}).bind(replica)


def app_builder(args: dict[str, str]):
    """For ``serve run lfmspark.serve.ray_app:app_builder key=value ...``: every engine flag of
    ``lfmspark serve`` by its name (``target=DIR draft=DIR``, or ``preset=NAME``; ``max_batch=16``,
    ``exact=true``, ...), ``replicas`` (default 1), ``name`` (the model name clients send) and
    ``reasoning_parser`` / ``tool_call_parser`` (as ``lfmspark serve``'s flags)."""
    args = dict(args)
    replicas, name = int(args.pop("replicas", 1)), args.pop("name", None)
    options = {k: args.pop(k) for k in ("reasoning_parser", "tool_call_parser") if k in args}
    parser = argparse.ArgumentParser(prog="app_builder", add_help=False, exit_on_error=False)
    EngineConfig.add_arguments(parser)
    flags = parser._option_string_actions
    argv = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if flag not in flags:
            raise ValueError(f"app_builder: unknown key {key!r}: keys are lfmspark serve's engine flags (max_batch=16, "
                             "...), replicas, name, reasoning_parser and tool_call_parser")
        if flags[flag].nargs == 0:           # a switch: key=true turns it on
            if str(value).lower() in ("true", "1", "yes"):
                argv.append(flag)
        else:
            argv += [flag, str(value)]
    try:
        config = EngineConfig.from_args(parser.parse_args(argv))
    except argparse.ArgumentError as e:
        raise ValueError(f"app_builder: {e}") from None
    if config.target is None and config.preset is None:
        raise ValueError("app_builder needs target=DIR (and draft=DIR) or preset=NAME")
    name = name or (config.target or config.preset).rstrip("/").split("/")[-1]
    return deployments(config, name, replicas, server_options=options or None)
