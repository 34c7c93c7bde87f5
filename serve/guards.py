"""What the server checks before a request reaches a route: its API key and its body's size.

Both are plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which buffers streamed
answers and hides a client's disconnect from the routes), answering in OpenAI's error shape:

- :class:`ApiKeyCheck`: with an API key (``--api-key``, else ``LFMSPARK_API_KEY``; vLLM's
  ``--api-key`` / ``VLLM_API_KEY``), every route but :data:`OPEN_PATHS` needs
  ``Authorization: Bearer <key>``, else 401. CORS preflights (``OPTIONS``) pass: a browser sends
  them without credentials.
- :class:`BodyLimit`: a body over ``--max-request-bytes`` is a 413 without being read whole: a
  ``Content-Length`` over the limit is refused before any of it is read, and a chunked body is
  counted as it arrives and refused at the chunk that crosses the limit (:class:`RequestTooLarge`,
  which the app answers with the 413).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .protocol import dumps, error_json

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_REQUEST_BYTES = 16 << 20   # 16 MiB: far above any prompt a context of 128k tokens holds
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})   # what probes and scrapers read without a key


class RequestTooLarge(Exception):
    """A chunked body crossed the size limit while it was being read (the app answers 413)."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is over {limit} bytes, the most this server takes "
                         "(--max-request-bytes)")
        self.limit = limit


async def send_error(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Answer with ``body`` (an :func:`~.protocol.error_json`) before any route has run."""
    payload = dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *headers]})
    await send({"type": "http.response.body", "body": payload})


class ApiKeyCheck:
    """401 for a request without the API key, except on :data:`OPEN_PATHS` and for preflights."""

    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("the API key is empty")
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS \
                or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await send_error(send, 401, error_json(
            "Incorrect or missing API key: send it as `Authorization: Bearer <key>`", "invalid_request_error",
            code="invalid_api_key"), [(b"www-authenticate", b"Bearer")])

    def _authorized(self, scope: Scope) -> bool:
        """The Authorization header is ``Bearer <key>`` (compared in constant time)."""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False


class BodyLimit:
    """413 for a body over ``max_bytes``: refused by its ``Content-Length`` before it is read, or
    at the chunk that crosses the limit (module doc)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_request_bytes must be an integer >= 1, got {max_bytes!r}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await send_error(send, 413, too_large(declared, self.max_bytes))
            return
        seen = 0

        async def counted() -> MutableMapping[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)


def too_large(size: int | None, limit: int) -> dict:
    """The 413's body."""
    size_text = f"is {size} bytes" if size is not None else "is over the limit"
    return error_json(f"the request body {size_text}; this server takes at most {limit} bytes "
                      "(--max-request-bytes)", "invalid_request_error", code="request_too_large")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None           # the HTTP server refuses a malformed one itself
    return None
