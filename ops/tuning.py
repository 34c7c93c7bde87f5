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
import re

from ..environment import environment

log = logging.getLogger(__name__)

_ZERO_OK = ("resident",)
_POWER_OF_TWO = ("block_n", "block_k", "block_v", "block_r", "num_warps")
KNOBS: dict[str, tuple[str, ...]] = {
    "gemv": ("block_n", "block_k", "num_warps", "num_stages"),
    "tile": ("block_n", "block_k", "split_k", "num_warps", "num_stages"),
    "tile_swiglu": ("block_n", "block_k", "split_k", "num_warps", "num_stages"),
    "norm_gemv": ("block_n", "num_warps"),
    "norm_swiglu": ("block_n", "num_warps"),
    "walk": ("block_v", "block_r", "num_warps"),
    "walk_grid": ("block_v", "resident", "num_warps", "num_stages"),
    "walk_jacobi": ("block_v", "resident", "num_warps", "num_stages"),
    "attention": ("num_splits",),
}


SHAPED_KINDS = ("gemv", "tile", "tile_swiglu")   # kinds whose launchers know the product's N and K
_SHAPE = re.compile(r"[1-9][0-9]*x[1-9][0-9]*")


def parse_tune(value: str) -> dict[str, int]:
    """An ``LFMSPARK_TUNE`` value parsed: ``{"kind.param" or "kind@NxK.param": value}`` (raises
    ``ValueError`` naming a bad item). lfmspark/environment.py reads the variable."""
    valid = ", ".join(f"{kind}.{p}" for kind, params in KNOBS.items() for p in params)
    overrides: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, sep, number = item.partition("=")
        key = key.strip()
        scope, _, param = key.partition(".")
        kind, at, shape = scope.partition("@")
        if not sep or param not in KNOBS.get(kind, ()):
            raise ValueError(f"LFMSPARK_TUNE: {item!r} is not kind.parameter=integer with a known key; valid keys: "
                             f"{valid} (the product kinds {', '.join(SHAPED_KINDS)} also as kind@NxK.parameter)")
        if at and (kind not in SHAPED_KINDS or not _SHAPE.fullmatch(shape)):
            raise ValueError(f"LFMSPARK_TUNE: {key!r}: a shape-scoped key is kind@NxK.parameter with positive "
                             f"integers N and K, for the kinds {', '.join(SHAPED_KINDS)}")
        try:
            n = int(number)
        except ValueError:
            raise ValueError(f"LFMSPARK_TUNE: {key} needs an integer, got {number!r}") from None
        if n < (0 if param in _ZERO_OK else 1) or (param in _POWER_OF_TWO and n & (n - 1)):
            sign = "non-negative" if param in _ZERO_OK else "positive"
            raise ValueError(f"LFMSPARK_TUNE: {key} must be a {sign} integer"
                             f"{' and a power of two' if param in _POWER_OF_TWO else ''}, got {n}")
        if key in overrides:
            raise ValueError(f"LFMSPARK_TUNE: {key} is given twice")
        overrides[key] = n
    return overrides


def tuning_overrides() -> dict[str, int]:
    """The overrides in force (``LFMSPARK_TUNE``, read once: lfmspark/environment.py)."""
    return dict(environment().tune)


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
def _overrides(items: tuple[tuple[str, int], ...]) -> dict[str, int]:
    return dict(items)


@functools.lru_cache(maxsize=None)
def _log_applied(key: str, value: int) -> None:
    # once per key: a shape-scoped key that never shows up here matched no launch (e.g. N and K swapped)
    log.info("LFMSPARK_TUNE: %s=%d applied", key, value)
