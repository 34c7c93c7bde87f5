"""The engine people embed (``Engine``, ``SamplingParams``), its outputs, and the CLI."""

from .engine import Engine
from .outputs import GenerationOutput, RequestStats, StreamEvent
from .requests import EngineDeadError, RequestError, RequestFailedError
from .sampling import SamplingParams

__all__ = ["Engine", "RequestError", "RequestFailedError", "EngineDeadError", "GenerationOutput", "RequestStats",
           "StreamEvent", "SamplingParams"]
