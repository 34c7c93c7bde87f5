"""``lfmspark serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncEngine.

Needs the ``serve`` extra: ``pip install 'lfmspark[serve]'``.
"""

from __future__ import annotations

import logging
import os
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
    FastAPI app serving them as ``model_name``. Once the engine is ready, the time to healthy is
    logged (:func:`ready_line`) and set in the ``lfmspark:startup_seconds`` gauge. ``api_key`` None
    takes ``LFMSPARK_API_KEY`` (unset: no key); the other options are :func:`~.app.build_app`'s
    (``reasoning_parser``: split ``<think>`` reasoning into ``reasoning_content``;
    ``tool_call_parser``: ``lfm2``)."""
    from .app import build_app
    from .metrics import ServerMetrics

    metrics = ServerMetrics(model_name, engine.block_size)

    def ready() -> None:
        age = process_age_s()
        phases = startup_phases(engine, age)
        metrics.set_startup(phases)
        log.info("%s", ready_line(engine, phases, age))

    async_engine = AsyncEngine(engine, max_waiting=max_waiting, warmup=warmup, observer=metrics.observe,
                               on_ready=ready)
    key = api_key if api_key is not None else environment().api_key
    return build_app(async_engine, model_name, metrics, api_key=key, allowed_origins=allowed_origins,
                     max_request_bytes=max_request_bytes, reasoning_parser=reasoning_parser,
                     tool_call_parser=tool_call_parser)


def run_server(engine: Engine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
               max_waiting: int = 256, warmup: bool = True, log_level: str = "info", api_key: str | None = None,
               allowed_origins: Sequence[str] = (), max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               reasoning_parser: str | None = None, tool_call_parser: str = "lfm2") -> None:
    """Serve until interrupted (uvicorn; Ctrl-C shuts the engine down, cancelling running requests).
    Logs :func:`startup_line` first, and :func:`ready_line` once the engine has warmed up, as
    ``/health`` turns to 200. A caller about to load an engine checks the port with
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


def process_age_s() -> float | None:
    """Seconds since this process started, from ``/proc`` (Linux); None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            # the fields after the command name (which may hold spaces) start at the third; starttime,
            # the 22nd, is in clock ticks since boot, as /proc/uptime's seconds are
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def startup_phases(engine: Engine, age_s: float | None) -> dict[str, float]:
    """Seconds per phase of the server's start: the engine's (``Engine.startup``: ``load``, ``build``,
    ``warmup_prefill``, ``warmup_steps``, ``warmup_profile``, those that ran) and, with the process's
    age ``age_s``, ``other``: the rest of it (the interpreter, imports, the server's set-up), so
    that the phases sum to the time from the process's start to ready."""
    phases = engine.startup.phases()
    if age_s is not None:
        phases["other"] = max(0.0, age_s - sum(phases.values()))
    return phases


def ready_line(engine: Engine, phases: dict[str, float], age_s: float | None) -> str:
    """One line saying how long the server took to get ready, and where the time went."""
    steps = "rounds" if engine.draft is not None else "decode steps"
    parts = [f"{name} {phases[name]:.1f} s" for name in ("load", "build") if name in phases]
    report = engine.startup.warmup
    if "warmup_steps" in phases and report is not None:
        warm = {"prefill": phases["warmup_prefill"], steps: phases["warmup_steps"], "profile": phases["warmup_profile"]}
        parts.append(f"warm-up {report.seconds:.1f} s ("
                     + ", ".join(f"{name} {s:.1f} s" for name, s in warm.items() if name != "profile" or s) + ")")
    else:
        parts.append("no warm-up")
    if "other" in phases:
        parts.append(f"other {phases['other']:.1f} s")
    when = f"{age_s:.1f} s after the process started" if age_s is not None else "(the process's start is unknown here)"
    return f"ready {when}: " + ", ".join(parts)


__all__ = ["PortInUseError", "check_port_free", "make_server_app", "process_age_s", "ready_line", "run_server",
           "startup_line", "startup_phases"]
