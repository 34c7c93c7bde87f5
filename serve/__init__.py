"""``lfmspark serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncEngine.

Needs the ``serve`` extra: ``pip install 'lfmspark[serve]'``.
"""

from __future__ import annotations

from ..runtime.async_engine import AsyncEngine
from ..runtime.engine import Engine


def make_server_app(engine: Engine, model_name: str, *, max_waiting: int = 256, warmup: bool = True):
    """An AsyncEngine over ``engine`` (warmed up in its thread when ``warmup``), its metrics, and the
    FastAPI app serving them as ``model_name``."""
    from .app import build_app
    from .metrics import ServerMetrics

    metrics = ServerMetrics(model_name, engine.block_size)
    async_engine = AsyncEngine(engine, max_waiting=max_waiting, warmup=warmup, observer=metrics.observe)
    return build_app(async_engine, model_name, metrics)


def run_server(engine: Engine, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
               max_waiting: int = 256, warmup: bool = True, log_level: str = "info") -> None:
    """Serve until interrupted (uvicorn; Ctrl-C shuts the engine down, cancelling running requests)."""
    import uvicorn

    app = make_server_app(engine, model_name, max_waiting=max_waiting, warmup=warmup)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


__all__ = ["make_server_app", "run_server"]
