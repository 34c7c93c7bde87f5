"""Which implementation an op runs on a given device, and how its kernels are launched.

Every op in this package has a Triton kernel (registered for ``cuda``) and a plain-PyTorch
reference (the CPU implementation and the test oracle). On a CPU-only machine the Triton kernels
can still run under Triton's interpreter (``TRITON_INTERPRET=1``); setting
``LFMSPARK_TRITON_ON_CPU=1`` as well routes the ops' CPU implementations through the Triton
launchers, which is how the test suite checks the kernels (and their compiled use) without a GPU.

Programmatic dependent launch (PDL, Hopper and newer): a decode step is a chain of ~150 short
kernels, each of which would otherwise wait for its predecessor to drain and then pay its own
launch and ramp-up. Launched with PDL, a kernel may start while its predecessor is still running:
it does the work that depends on nothing earlier (address math, the first tile of its weights),
then executes ``gdc_wait`` — which returns once the predecessor has completed and its writes are
visible — before it reads anything an earlier kernel wrote. Every kernel here follows that
contract (``PDL`` constexpr: wait before the first dependent load, ``gdc_launch_dependents`` as
early as possible). A kernel launched without PDL, or a CUDA-graph node of another library, simply
starts after its predecessor as usual (``gdc_wait`` is a no-op there). The chain holds only if
every PDL-launched kernel waits before it finishes: a kernel that skipped the wait could complete
before an earlier kernel, and its successor waits for it alone (graphs/compile.py makes Inductor's
kernels wait for that reason). ``LFMSPARK_PDL=0`` turns it off (graphs/compile.py does the same for Inductor's
kernels).

When the successor's programs may launch (``LFMSPARK_PDL_TRIGGER``): ``entry`` executes
``gdc_launch_dependents`` first thing in every kernel, so the successor's programs launch as soon as
SM resources allow and request their first weights early; ``late`` moves it, in the weight-streaming
products (``skinny_linear``, ``swiglu_gemv``, ``add_rmsnorm_gemv``), to after the program has read its
weights, so only the product's tail overlaps the successor. Measured on the H200 (docs/benchmarks.md,
session 7): ``late`` took the one-row decode step from 0.815 to 0.781 ms per token but the round
(9-10-row tile products) from 1.365 to 1.388 ms, so the default, ``auto``, triggers late in the
one-row products (``_gemv_kernel``, ``swiglu_gemv``, ``add_rmsnorm_gemv``) and at entry everywhere
else. The ``PDL`` constexpr carries the choice: 0 off, 1 on with the trigger at entry, 2 on with the
trigger late (kernels without a late trigger point treat any nonzero value as 1). Where the
trigger sits changes only timing, never results: a successor still waits for the completion of its
predecessor.
"""

from __future__ import annotations

import functools
import os

import torch


def triton_on_cpu() -> bool:
    """True when CPU calls of the ops should run the Triton kernels in interpreter mode."""
    return os.environ.get("LFMSPARK_TRITON_ON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or (t.device.type == "cpu" and triton_on_cpu())


@functools.lru_cache(maxsize=None)
def _supports_pdl(device: torch.device) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_requested() -> bool:
    """``LFMSPARK_PDL`` (default on): whether kernels may use programmatic dependent launch."""
    value = os.environ.get("LFMSPARK_PDL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"LFMSPARK_PDL={value!r}: use 1 (programmatic dependent launch) or 0 (off)")
    return value == "1"


_TRIGGERS = ("auto", "entry", "late")


def pdl_trigger(one_row_product: bool = False) -> int:
    """``LFMSPARK_PDL_TRIGGER`` (``auto`` default, ``entry``, ``late``): the ``PDL`` constexpr value of a
    PDL launch of a kernel (``one_row_product``: one of the one-row weight-streaming products); see
    the module doc."""
    value = os.environ.get("LFMSPARK_PDL_TRIGGER", "auto")
    if value not in _TRIGGERS:
        raise ValueError(f"LFMSPARK_PDL_TRIGGER={value!r}: use 'auto' (the default: late in the one-row products, "
                         "at entry elsewhere), 'entry' (launch_dependents first thing) or 'late' (after a "
                         "product's weights are read)")
    if value == "auto":
        return 2 if one_row_product else 1
    return 1 if value == "entry" else 2


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels working on ``t`` launch with PDL: CUDA on sm90+, unless ``LFMSPARK_PDL=0``.
    Launchers pass the result both as ``launch_pdl=`` and as the kernels' ``PDL`` constexpr."""
    return t.device.type == "cuda" and pdl_requested() and _supports_pdl(t.device)


def pdl_kwargs(t: torch.Tensor, one_row_product: bool = False) -> dict[str, int | bool]:
    """Launch keywords for a kernel following the PDL contract, working on ``t``'s device: the
    ``PDL`` constexpr (0 off, else :func:`pdl_trigger`) and ``launch_pdl``."""
    pdl = use_pdl(t)
    return {"PDL": pdl_trigger(one_row_product) if pdl else 0, "launch_pdl": pdl}


L2_HINTS = {"1": ("evict_first", "evict_last"), "0": ("", "")}


def l2_hints() -> tuple[str, str]:
    """``LFMSPARK_L2_HINTS`` (default ``1``): the L2 eviction priorities ``(weights, markov_w2)`` of the
    several-row products' weight loads and the one-launch Markov walks' ``markov_w2`` loads.

    Why: the batch-1 round streams ~3.2 GB of weights through the H200's 50 MB L2, each byte read
    once, and then the draft's walk reads ``markov_w2`` (33.5 MB) from HBM again, right after the LM
    head's 268 MB evicted it. Marked ``evict_first``, the streamed weights leave L2 before
    ``markov_w2``, marked ``evict_last``, which may then still be there at the next round's walk.
    Measured on the H200 (docs/benchmarks.md, session 22): the replay-timed round 1.160 -> 1.137 ms
    and the products' profile marginal 992 -> 981 us, but the walk no faster (``markov_w2`` does not
    survive a round) and the generation loop's TPOT unchanged. Hints only: values never change.
    ``0``: plain loads."""
    value = os.environ.get("LFMSPARK_L2_HINTS", "1")
    if value not in L2_HINTS:
        raise ValueError(f"LFMSPARK_L2_HINTS={value!r}: use 1 (streamed weights evict first, markov_w2 last) or 0 "
                         "(plain loads)")
    return L2_HINTS[value]
