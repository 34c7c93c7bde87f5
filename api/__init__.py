"""lfmspark: serve LFM2 / LFM2-MoE models with DSpark block speculative decoding.

The package is assembled from the repository's root folders (DESIGN §2): ``lfmspark.runtime``
(the engine), ``lfmspark.graphs`` (CUDA graph capture), ``lfmspark.models`` (modules, configs,
loading, presets) and ``lfmspark.ops`` (Triton kernels as ``torch.library`` ops).
"""

__version__ = "0.1.0"

from .runtime import (AsyncEngine, Engine, EngineConfig, EngineDeadError, GenerationOutput, RequestError,  # noqa: E402
                      RequestFailedError, RequestStats, SamplingMode, SamplingParams, StreamEvent)

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "EngineDeadError", "GenerationOutput", "RequestError",
           "RequestFailedError", "RequestStats", "SamplingMode", "SamplingParams", "StreamEvent", "__version__"]
