"""``LFMSPARK_TUNE``: override the launch parameters the kernels' heuristics choose, to tune them
inside a real step.

Why: a kernel timed alone and the same kernel inside the decode step's PDL chain can rank launch
parameters differently: the one-row GEMV's 1024-wide K steps are the best timed alone, yet
2048-wide steps make the whole LFM2.5-1.2B decode step 5% faster (docs/decisions.md). So parameters are tuned by timing the whole step once per variant, one process each, e.g. with
``scripts/device_run.sh``'s ``ab`` step::

    AB_VARIANTS="base:LFMSPARK_TUNE= k256:LFMSPARK_TUNE=tile.block_k=256" STEPS=ab bash scripts/device_run.sh

The value is a comma-separated list of ``kind.parameter=integer``; each replaces what the heuristic
would choose for every launch of that kind (the heuristic's later choices, e.g. the pipeline depth
that fits a K step, follow the replaced value). Kinds: ``gemv`` (one-row products,
ops/linear/skinny_linear.py), ``tile`` and ``tile_swiglu`` (the several-row swap-AB products and the fused
gate/up product), ``norm_gemv`` and ``norm_swiglu`` (the one-row products with the add + RMSNorm
prologue, ops/linear/add_rmsnorm_gemv.py), ``walk`` (the Markov walk step, ops/markov_walk/op.py), ``walk_grid``
(the persistent walk: ``resident`` column blocks kept on chip, 0-2, ops/markov_walk/persistent.py),
``walk_jacobi`` (the Jacobi walk, the same keys, ops/markov_walk/jacobi.py), ``attention`` (``num_splits``: the key-range splits of the attention launches the heuristic splits,
i.e. the few-row decode / verify / draft windows, not prefill; ops/attention/cache_attention.py).

The product kinds (``gemv``, ``tile``, ``tile_swiglu``) also take ``kind@NxK.parameter=integer``:
it applies only to products with ``N`` output columns (gate columns for ``tile_swiglu``) and
reduction length ``K``, at any row count, and wins over the kind-wide key. Why: inside the
speculative round the products' distance from their bandwidth floor ranges from 40% to 97% of the
copy bandwidth by shape, and a kind-wide override that helps the
small products hurts the large ones, so they are tuned one shape at a time. Parameters
are read at launch, i.e. when a graph is captured. An override is not checked against the kernel's
resources: too many stages fail at launch with Triton's out-of-resources error. K steps are capped
at the next power of two of K, like the heuristics' own. The benchmark's JSON records the value;
the kernel microbenchmarks' "default" rows (benchmarks/kernels) follow it too, so unset it for those.
"""

from __future__ import annotations

import functools
import logging

from ..environment import environment
from .tune_keys import KNOBS, parse_tune

log = logging.getLogger(__name__)

def tuning_overrides() -> dict[str, int]:
    """The overrides in force (``LFMSPARK_TUNE``, read once: lfmspark/environment.py)."""
    return _overrides(environment().tune)


def tuned(kind: str, param: str, default: int, shape: tuple[int, int] | None = None) -> int:
    """``default`` unless ``LFMSPARK_TUNE`` overrides ``kind.param``, or, for a product of ``shape =
    (N, K)``, ``kind@NxK.param`` (which wins)."""
    assert param in KNOBS[kind], (kind, param)
    overrides = _overrides(environment().tune)
    if shape is not None and (scoped := f"{kind}@{shape[0]}x{shape[1]}.{param}") in overrides:
        _log_applied(scoped, overrides[scoped])
        return overrides[scoped]
    return overrides.get(f"{kind}.{param}", default)


@functools.lru_cache(maxsize=8)
def _overrides(value: str) -> dict[str, int]:
    return parse_tune(value)


@functools.lru_cache(maxsize=None)
def _log_applied(key: str, value: int) -> None:
    # once per key: a shape-scoped key that never shows up here matched no launch (e.g. N and K swapped)
    log.info("LFMSPARK_TUNE: %s=%d applied", key, value)
