"""The engine people embed (``Engine``, ``AsyncEngine``, ``SamplingParams``), its outputs, and the CLI."""

from .async_engine import AsyncEngine, EngineShutdownError, QueueFullError
from .distributions import SamplingMode
from .engine import Engine
from .outputs import GenerationOutput, RequestStats, StreamEvent
from .requests import EngineDeadError, RequestError, RequestFailedError
from .sampling import SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineDeadError", "EngineShutdownError", "GenerationOutput", "QueueFullError",
           "RequestError", "RequestFailedError", "RequestStats", "SamplingMode", "SamplingParams", "StreamEvent"]
