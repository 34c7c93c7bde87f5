"""The keys ``LFMSPARK_TUNE`` takes and its parser (ops/tuning.py says what the overrides do); kept
apart from the launchers' lookups so that lfmspark/environment.py can check a value when it reads
the variables without importing the kernels.
"""

from __future__ import annotations

import re

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
