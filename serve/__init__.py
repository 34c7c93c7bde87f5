"""``lfmspark serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncEngine.

Needs the ``serve`` extra: ``pip install 'lfmspark[serve]'``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence

from ..environment import environment
from ..runtime.async_engine import AsyncEngine
from ..runtime.engine import Engine
from .guards import DEFAULT_MAX_REQUEST_BYTES

log = logging.getLogger("lfmspark.serve")


class PortInUseError(OSError):
    """The server's address cannot be listened on (another server holds it, or it is not this host's)."""


def make_server_app(engine: Engine, model_name: str, *, max_waiting: int = 256, warmup: bool = True,
                    api_key: str | None = None, allowed_origins: Sequence[str] = (),
                    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, reasoning_parser: str | None = None,
                    tool_call_parser: str = "lfm2"):
    """An AsyncEngine over ``engine`` (warmed up in its thread when ``warmup``), its metrics, and the
    FastAPI app serving them as ``model_name``. ``api_key`` None takes ``LFMSPARK_API_KEY`` (unset:
    no key); the other options are :func:`~.app.build_app`'s (``reasoning_parser``: split
    ``<think>`` reasoning into ``reasoning_content``; ``tool_call_parser``: ``lfm2``)."""
    from .app import build_app
    from .metrics import ServerMetrics

    metrics = ServerMetrics(model_name, engine.block_size)
    async_engine = AsyncEngine(engine, max_waiting=max_waiting, warmup=warmup, observer=metrics.observe)
    key = api_key if api_key is not None else environment().api_key
    return build_app(async_engine, model_name, metrics, api_key=key, allowed_origins=allowed_origins,
                     max_request_bytes=max_request_bytes, reasoning_parser=reasoning_parser,
                     tool_call_parser=tool_call_parser)


def run_server(engine: Engine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
               max_waiting: int = 256, warmup: bool = True, log_level: str = "info", api_key: str | None = None,
               allowed_origins: Sequence[str] = (), max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               reasoning_parser: str | None = None, tool_call_parser: str = "lfm2") -> None:
    """Serve until interrupted (uvicorn; Ctrl-C shuts the engine down, cancelling running requests).
    Logs :func:`startup_line` first. A caller about to load an engine checks the port with
    :func:`check_port_free` before, so that a busy port fails in a second, not after the load."""
    import uvicorn

    app = make_server_app(engine, model_name, max_waiting=max_waiting, warmup=warmup, api_key=api_key,
                          allowed_origins=allowed_origins, max_request_bytes=max_request_bytes,
                          reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level)   # sets up uvicorn's loggers
    keyed = api_key is not None or environment().api_key is not None
    logging.getLogger("uvicorn.error").info("%s", startup_line(engine, model_name, host, port, keyed))
    uvicorn.Server(config).run()


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`PortInUseError` unless ``host:port`` can be listened on now (bound as uvicorn
    binds, with ``SO_REUSEADDR``, then released)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise PortInUseError(f"cannot listen on {host}:{port}: {host!r} does not resolve ({e.strerror})") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise PortInUseError(f"cannot listen on {host}:{port}: {e.strerror} (another server there? "
                                 "choose another --port)") from None


def startup_line(engine: Engine, model_name: str, host: str, port: int, api_key: bool = False) -> str:
    """One line saying what is served where: model, draft, dtype, device, the context a request can
    use, slots, CUDA graphs, and whether a key is required."""
    from ..runtime.loader import draft_preset_name, preset_name

    cfg = engine.config
    model = cfg.target or f"preset {preset_name(cfg)}"
    if engine.draft is None:
        draft = "none (target only)"
    else:
        draft = cfg.draft or f"preset {draft_preset_name(cfg)}"
    dtype = str(engine.dtype).removeprefix("torch.")
    graphs = "on" if engine.cuda_graphs else "off"
    return (f"serving {model_name!r} on http://{host}:{port}: model {model}, draft {draft}, {dtype} on "
            f"{engine.device}, context {engine.max_seq_len} tokens, "
            f"{engine.max_batch} slots, CUDA graphs {graphs}, API key {'required' if api_key else 'off'}")


__all__ = ["PortInUseError", "check_port_free", "make_server_app", "run_server", "startup_line"]
