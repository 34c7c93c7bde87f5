"""Which kernel computes a product, a norm, an attention window or a Markov walk: every threshold in one place.

The models ask here and nowhere else (models/layers.py, models/lfm2.py, models/dspark.py), and so
does the walk op (ops/markov_walk). The thresholds follow the kernels' tiles:

- **Products** ``x [rows, K] @ W^T``: 1-16 rows on CUDA run lfmspark's weight-streaming kernels
  (ops/linear): one row the GEMV kernel, 2-16 the swap-AB ``tl.dot`` kernel, whose 16-row MMA tile
  holds the batch-1 verify (10 rows) and draft block (9). They beat cuBLAS at every served shape
  there (docs/decisions.md); more rows are cuBLAS's (``F.linear``).
- **Norms before a product**: at the one-row decode step the residual add + RMSNorm is the GEMV's
  prologue (``add_rmsnorm_gemv``); on 2-16 rows outside decode (the verify, the draft block, short
  prompt chunks) it rides in the products' epilogues (``skinny_linear_add_norm`` before a dense
  feed-forward; between layers a :class:`~lfmspark.models.layers.NormedCarry`); elsewhere the modules.
  Decode steps of 2-16 rows keep the modules, because a verify of such a batch is wider than 16
  rows and target-only decoding should round as that verify does.
- **Attention**: windows whose (token, head-in-group) rows fit one 64-row tile (decode, verify, the
  draft block) run ``qkv_window_attention`` in one launch; longer ones ``qkv_norm_rope_write`` then
  ``cache_attention``.
- **Markov walk** (greedy, vanilla head): ``jacobi`` (the default) where the block's (row, slot)
  lanes fit 16, else the sequential walk in one persistent launch for 2-16 rows, else one launch per
  slot; the walks in one launch need every SM resident (no MPS thread limit) and a rank of at most 256.

**Exact mode** (``Engine(exact=True)``): inside :func:`exact_scope` every product of the
target runs ``lfmspark::exact_linear`` (a dense SwiGLU's gate/up product ``exact_swiglu``, its
activation in the same launch), every norm ``lfmspark::exact_rms_norm`` (``exact_add_rms_norm``
with the layer's residual add in the same launch), attention the
two-launch path with ``cache_attention``'s exact plan and the MoE experts their exact tiles:
kernels whose per-row arithmetic does not depend on the rows sharing the launch, so a token's
target logits are the same bits in a decode step and in a verify window, alone or batched (greedy
speculative output == target-only output; a request's output independent of its batch). None of
the routes above is taken there. Not covered: the same token computed by a prefill chunk (eager
pointwise ops there, compiled ones in the steps) and, on the GPU, the sampling transforms (Inductor
reductions; their batch invariance is tested only under the interpreter, tests/test_exact_mode.py);
the attention's key slices follow the cache length, so compare engines of one ``max_seq_len``.
The draft keeps the default routes (``runtime/steps.py`` leaves the scope around it): its numerics
never reach the output. The scope is process-wide while it lasts (the engine enters it around its
steps and warm-up; compiled regions are traced, and guarded, under it): engines of both modes may
live in one process, but should not step concurrently from different threads.

Tests reach the CUDA routes on CPU by patching :func:`product_kernels` (the ops then run their
references, or their interpreted kernels).
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator

import torch

FEW_ROWS = 16           # products of up to this many rows stream their weights on lfmspark's kernels
NORM_GEMV_MAX_K = 8192  # add_rmsnorm_gemv holds the whole normalised row: LFM2 hidden sizes are 1024-2048
WINDOW_TILE_ROWS = 64   # one row tile of the attention kernel (ops/attention/cache_attention.py)
WALK_LANES = 16         # the Jacobi walk's (row, slot) lanes: one 16-row MMA tile
WALK_GRID_ROWS = (2, 16)  # the persistent walk's rows; one row: the step kernels are faster (docs/decisions.md)
WALK_MAX_RANK = 256     # a walk in one launch holds the whole rank in one tl.dot

WALKS = ("jacobi", "persistent", "steps")   # what Engine(markov_walk=...) takes

_exact = False   # inside exact_scope(True): exact mode's routes (module doc)


def exact_mode() -> bool:
    """Whether the current forward runs exact mode's kernels (module doc)."""
    return _exact


@contextlib.contextmanager
def exact_scope(on: bool) -> Iterator[None]:
    """Run the enclosed forwards in exact mode (``on``) or the default routes, restoring the previous
    setting on exit."""
    global _exact
    previous, _exact = _exact, bool(on)
    try:
        yield
    finally:
        _exact = previous


def rows_of(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def product_kernels(x: torch.Tensor) -> bool:
    """Whether products of ``x`` may run lfmspark's product kernels at all: on CUDA."""
    return x.is_cuda


def skinny_product(x: torch.Tensor) -> bool:
    """``x [..., K] @ W^T`` on ``lfmspark::skinny_linear`` (and a dense SwiGLU's gate/up product on
    ``skinny_swiglu``): 1 to ``FEW_ROWS`` rows."""
    return product_kernels(x) and 1 <= rows_of(x) <= FEW_ROWS and not _exact


def pair_product(x: torch.Tensor) -> bool:
    """Two weights' products in one ``skinny_linear_pair`` launch: 2 to ``FEW_ROWS`` rows (one row
    stays on the GEMV kernel, which has no pair variant)."""
    return skinny_product(x) and rows_of(x) >= 2


class NormRoute(enum.Enum):
    """Where a residual add + RMSNorm before a product runs."""

    MODULES = "modules"     # the add, RMSNorm and the product as separate modules
    GEMV = "gemv"           # the one-row GEMV's prologue (add_rmsnorm_gemv)
    EPILOGUE = "epilogue"   # the previous product's epilogue and the next product's row scale


def norm_route(h: torch.Tensor, decode: bool) -> NormRoute:
    """The route of the norm over ``h [..., K]`` in a forward of ``decode`` mode (the callers check
    that the tensors involved share one dtype, which a model in one dtype always does)."""
    if _exact or not skinny_product(h):
        return NormRoute.MODULES
    rows = rows_of(h)
    if decode:
        return NormRoute.GEMV if rows == 1 and h.shape[-1] <= NORM_GEMV_MAX_K else NormRoute.MODULES
    return NormRoute.EPILOGUE if rows >= 2 else NormRoute.MODULES


def window_attention(T: int, n_heads: int, n_kv: int) -> bool:
    """Whether a window of ``T`` tokens runs ``qkv_window_attention``: its rows fit one tile (never in
    exact mode, whose attention keeps one key order for every window)."""
    return T * (n_heads // n_kv) <= WINDOW_TILE_ROWS and not _exact


def one_launch_walk_possible(device: torch.device, rank: int) -> bool:
    """What a walk in one launch with grid barriers needs: a rank up to ``WALK_MAX_RANK``, NVIDIA (the
    barrier polls with PTX) and every SM available to this process (under an MPS thread limit fewer
    may be, and a grid that cannot be resident at once would never pass its barrier)."""
    mps = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    return (rank <= WALK_MAX_RANK and torch.version.hip is None
            and (device.type != "cuda" or mps in (None, "", "100")))


def walk_kernel(walk: str, device: torch.device, B: int, G: int, rank: int) -> str:
    """The kernel a greedy walk of ``B`` rows and ``G`` slots runs under the engine's ``walk``
    choice: ``"jacobi"``, ``"persistent"`` or ``"steps"``."""
    if walk not in WALKS:
        raise ValueError(f"markov_walk={walk!r}: use one of {', '.join(WALKS)}")
    one_launch = walk != "steps" and one_launch_walk_possible(device, rank)
    if one_launch and walk == "jacobi" and 1 <= B * G <= WALK_LANES:
        return "jacobi"
    if one_launch and WALK_GRID_ROWS[0] <= B <= WALK_GRID_ROWS[1]:
        return "persistent"
    return "steps"
