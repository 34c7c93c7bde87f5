"""Which implementation an op runs on a given device, and how its kernels are launched.

Every op in this package has a Triton kernel (registered for ``cuda``) and a plain-PyTorch
reference (the CPU implementation and the test oracle). On a CPU-only machine the Triton kernels
can still run under Triton's interpreter (``TRITON_INTERPRET=1``); ``LFMSPARK_TRITON_ON_CPU=1`` as
well routes the ops' CPU implementations through the Triton launchers, which is how the test suite
checks the kernels (and their compiled use) without a GPU.

Programmatic dependent launch (PDL, Hopper and newer): a decode step is a chain of ~150 short
kernels, each of which would otherwise wait for its predecessor to drain and then pay its own
launch and ramp-up. Launched with PDL, a kernel may start while its predecessor is still running:
it does the work that depends on nothing earlier (address math, the first tile of its weights),
then executes ``gdc_wait``, which returns once the predecessor has completed and its writes are
visible, before it reads anything an earlier kernel wrote. Every kernel here follows that contract
(``PDL`` constexpr: wait before the first dependent load). The chain holds only if every
PDL-launched kernel waits before it finishes: a kernel that skipped the wait could complete before
an earlier kernel, and its successor waits for it alone (graphs/compile.py makes Inductor's kernels
wait for that reason). A kernel launched without PDL, or a CUDA-graph node of another library,
starts after its predecessor as usual. ``LFMSPARK_PDL=0`` turns PDL off everywhere (debugging).

When the successor's programs may launch (``gdc_launch_dependents``): first thing in every kernel,
so the successor's programs launch as soon as SM resources allow and request their first weights
early; except in the one-row weight-streaming products (the GEMV kernels), which trigger after
reading their weights, so only their tail overlaps the successor. That split is the
fastest: triggering late everywhere slowed the round's several-row products, at entry everywhere
the one-row decode (docs/decisions.md). The ``PDL`` constexpr carries it: 0 off, 1 on with the
trigger at entry, 2 on with the trigger late (kernels without a late trigger point treat any
nonzero value as 1). Where the trigger sits changes only timing, never results.
"""

from __future__ import annotations

import functools
import os

import torch

from ..environment import environment


def triton_on_cpu() -> bool:
    """True when CPU calls of the ops should run the Triton kernels in interpreter mode."""
    return environment().triton_on_cpu and os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or (t.device.type == "cpu" and triton_on_cpu())


@functools.lru_cache(maxsize=None)
def _supports_pdl(device: torch.device) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels working on ``t`` launch with PDL: CUDA on sm90+, unless ``LFMSPARK_PDL=0``.
    Launchers pass the result both as ``launch_pdl=`` and as the kernels' ``PDL`` constexpr."""
    return t.device.type == "cuda" and environment().pdl and _supports_pdl(t.device)


def pdl_kwargs(t: torch.Tensor, one_row_product: bool = False) -> dict[str, int | bool]:
    """Launch keywords for a kernel following the PDL contract, working on ``t``'s device: the
    ``PDL`` constexpr (0 off; 2, the late trigger, for ``one_row_product``; else 1) and ``launch_pdl``."""
    pdl = use_pdl(t)
    return {"PDL": (2 if one_row_product else 1) if pdl else 0, "launch_pdl": pdl}
