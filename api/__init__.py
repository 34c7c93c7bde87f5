"""lfmspark: serve LFM2 / LFM2-MoE models with DSpark block speculative decoding.

The package is assembled from the repository's root folders (DESIGN §2): ``lfmspark.runtime``
(the engine), ``lfmspark.graphs`` (CUDA graph capture), ``lfmspark.models`` (modules, configs,
loading, presets) and ``lfmspark.ops`` (Triton kernels as ``torch.library`` ops).
"""

__version__ = "0.1.0"

import os as _os  # noqa: E402

from .environment import cache_dir as _cache_dir  # noqa: E402
from .environment import triton_cache_dir as _triton_cache_dir  # noqa: E402

# Inductor fixes its cache directory the first time anything asks for one, and importing the rest of
# the package can ask (torch._inductor modules do on some builds): so it is pointed at
# LFMSPARK_CACHE_DIR first, and Triton's (the ops' kernels: environment.triton_cache_dir says why)
# at its triton/ folder, before any kernel compiles. An explicit TORCHINDUCTOR_CACHE_DIR or
# TRITON_CACHE_DIR wins.
_os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_cache_dir()))
_os.environ.setdefault("TRITON_CACHE_DIR", str(_triton_cache_dir()))

from .runtime import (AsyncEngine, Engine, EngineConfig, EngineDeadError, GenerationOutput, RequestError,  # noqa: E402
                      RequestFailedError, RequestStats, SamplingMode, SamplingParams, StreamEvent)

__all__ = ["AsyncEngine", "Engine", "EngineConfig", "EngineDeadError", "GenerationOutput", "RequestError",
           "RequestFailedError", "RequestStats", "SamplingMode", "SamplingParams", "StreamEvent", "__version__"]
