"""Which implementation an op runs on a given device.

Every op in this package has a Triton kernel (registered for ``cuda``) and a plain-PyTorch
reference (the CPU implementation and the test oracle). On a CPU-only machine the Triton kernels
can still run under Triton's interpreter (``TRITON_INTERPRET=1``); setting
``LFMSPARK_TRITON_ON_CPU=1`` as well routes the ops' CPU implementations through the Triton
launchers, which is how the test suite checks the kernels (and their compiled use) without a GPU.
"""

from __future__ import annotations

import os

import torch


def triton_on_cpu() -> bool:
    """True when CPU calls of the ops should run the Triton kernels in interpreter mode."""
    return os.environ.get("LFMSPARK_TRITON_ON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or (t.device.type == "cpu" and triton_on_cpu())
