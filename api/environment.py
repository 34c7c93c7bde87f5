"""The ``LFMSPARK_*`` environment variables: every one lfmspark reads, declared here and read once.

They are infrastructure only, never a kernel choice: where compiled artefacts live, a way for the
test suite to run the Triton kernels on CPU, a kill switch for programmatic dependent launch when
debugging, the launch-parameter table for tuning, and the server's API key (kept out of the command
line, where other users of the machine can read it). Choices a user may legitimately make are
:class:`~lfmspark.Engine` arguments.

The variables are parsed together on first use (an :class:`~lfmspark.Engine` construction reads
them), so a misspelt value fails there with an error naming the variable and what it takes, even
on a machine where it would never act. Later changes to ``os.environ`` are not seen: a process
that wants other values calls :func:`reload` (the tests do).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = "LFMSPARK_CACHE_DIR"
TRITON_ON_CPU = "LFMSPARK_TRITON_ON_CPU"
PDL = "LFMSPARK_PDL"
TUNE = "LFMSPARK_TUNE"
API_KEY = "LFMSPARK_API_KEY"

VARIABLES: dict[str, str] = {
    CACHE_DIR: "the compile caches (default ~/.cache/lfmspark/inductor): importing lfmspark points "
               "TORCHINDUCTOR_CACHE_DIR there and TRITON_CACHE_DIR at its triton/ folder (the ops' Triton "
               "binaries), each unless it is set",
    TRITON_ON_CPU: "1: CPU calls of the ops run their Triton kernels under Triton's interpreter (with "
                   "TRITON_INTERPRET=1; the test suite's way to check the kernels without a GPU)",
    PDL: "0: no programmatic dependent launch (a debugging kill switch; default 1, used on sm90+)",
    TUNE: "launch-parameter overrides, kind.parameter=integer items separated by commas (ops/tuning.py)",
    API_KEY: "the key `lfmspark serve` requires as `Authorization: Bearer <key>` when --api-key is not given "
             "(vLLM's VLLM_API_KEY)",
}
# variables whose values are secrets: reports name them as set, never their value
SECRETS: frozenset[str] = frozenset({API_KEY})


@dataclass(frozen=True)
class Environment:
    """The parsed values (:func:`environment`)."""

    cache_dir: Path
    triton_on_cpu: bool
    pdl: bool
    tune: str                           # LFMSPARK_TUNE as given (checked by ops/tune_keys.py)
    api_key: str | None = None          # LFMSPARK_API_KEY (None: unset or empty)


def cache_dir() -> Path:
    """``LFMSPARK_CACHE_DIR``, read on its own: the package sets Inductor's cache directory at import,
    before anything else is parsed (a bad ``LFMSPARK_TUNE`` must not break ``import lfmspark``)."""
    return Path(os.environ.get(CACHE_DIR) or Path.home() / ".cache" / "lfmspark" / "inductor")


def triton_cache_dir() -> Path:
    """Where the package points Triton's cache at import (unless ``TRITON_CACHE_DIR`` is set): the
    ``triton`` folder of :func:`cache_dir`. Inductor only sets ``TRITON_CACHE_DIR`` (to its own
    folder) when it builds its first kernel, and the ops' kernels that compile before that (the
    prefill warm-up runs them eagerly first) would otherwise land in ``~/.triton/cache``, so that a
    restart carrying only ``LFMSPARK_CACHE_DIR`` compiled them again."""
    return cache_dir() / "triton"


def _flag(name: str, default: str, meaning: str) -> bool:
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: use 1 or 0 ({meaning})")
    return value == "1"


@functools.cache
def environment() -> Environment:
    """The variables, parsed on the first call (raises ``ValueError`` naming a bad value). Other
    ``LFMSPARK_*`` names in the environment (a typo, or a switch of an older version) draw a warning:
    nothing reads them."""
    from .ops.tune_keys import parse_tune   # the table's keys are the kernels' business

    unknown = sorted(name for name in os.environ if name.startswith("LFMSPARK_") and name not in VARIABLES)
    if unknown:
        logging.getLogger("lfmspark").warning("%s: not an lfmspark variable, ignored (lfmspark reads %s)",
                                              ", ".join(unknown), ", ".join(VARIABLES))

    return Environment(
        cache_dir=cache_dir(),
        triton_on_cpu=_flag(TRITON_ON_CPU, "0", "the ops' CPU calls on the interpreted Triton kernels, or not"),
        pdl=_flag(PDL, "1", "programmatic dependent launch on sm90+, or off"),
        tune=_checked(os.environ.get(TUNE, ""), parse_tune),
        api_key=os.environ.get(API_KEY) or None,
    )


def _checked(value: str, parse) -> str:
    parse(value)          # raises ValueError naming a bad item
    return value


def reload() -> Environment:
    """Parse the variables again (after a change to ``os.environ``) and return them."""
    environment.cache_clear()
    return environment()
