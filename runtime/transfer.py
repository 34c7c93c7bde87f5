"""Small host-to-device copies that queue behind the stream instead of waiting for it.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and CUDA performs a stream
synchronisation before such a copy: the host waits for every kernel queued so far, so it launches
nothing while they run. The engine builds small index tensors (slots, positions, prefix-cache
blocks) between forwards; through pinned memory (PyTorch's caching host allocator, which keeps a
block until the copies reading it are done) their copies are queued like kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``, without waiting for the device's stream."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
