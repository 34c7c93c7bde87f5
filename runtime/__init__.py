"""The engine people embed (``Engine``, ``AsyncEngine``, ``EngineConfig``, ``SamplingParams``) and its outputs."""

from .async_engine import AsyncEngine, EngineShutdownError, QueueFullError
from .config import EngineConfig
from .distributions import SamplingMode
from .engine import Engine
from .outputs import GenerationOutput, RequestStats, StreamEvent
from .requests import EngineDeadError, RequestError, RequestFailedError
from .sampling import SamplingParams

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "EngineDeadError", "EngineShutdownError", "GenerationOutput",
           "QueueFullError", "RequestError", "RequestFailedError", "RequestStats", "SamplingMode", "SamplingParams",
           "StreamEvent"]
