"""The engine people embed (``Engine``, ``SamplingParams``), its outputs, and the CLI."""

from .engine import Engine, RequestError
from .outputs import GenerationOutput, RequestStats, StreamEvent
from .sampling import SamplingParams

__all__ = ["Engine", "RequestError", "GenerationOutput", "RequestStats", "StreamEvent", "SamplingParams"]
