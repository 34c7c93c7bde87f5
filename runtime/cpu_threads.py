"""The intra-op thread count the engine runs with on a CPU.

A step on a CPU is hundreds of small ops, and torch's intra-op thread pool costs more than it gives
for them beside the engine's own thread: ``lfmspark generate`` on the tiny preset ran 13.9 tok/s
with torch's default threads and 319.6 tok/s with one, on a loaded 2-core machine. So an engine on
a CPU runs with one thread, unless the user chose: ``EngineConfig.cpu_threads``, ``OMP_NUM_THREADS``
in the environment, or ``torch.set_num_threads`` called after lfmspark was imported (the count then
differs from the one seen at import) are kept as they are.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("lfmspark")

_AT_IMPORT = torch.get_num_threads()


def set_cpu_threads(requested: int | None) -> None:
    """Set torch's intra-op threads for a CPU engine (module doc); process-wide, as torch's is."""
    if requested is not None:
        torch.set_num_threads(requested)
    elif "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() == _AT_IMPORT and _AT_IMPORT != 1:
        log.info("CPU engine: torch intra-op threads %d -> 1 (EngineConfig.cpu_threads or OMP_NUM_THREADS "
                 "choose otherwise)", _AT_IMPORT)
        torch.set_num_threads(1)
