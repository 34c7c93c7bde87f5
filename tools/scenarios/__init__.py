"""The named scenarios of ``lfmspark bench``: each answers one question about the engine on one set
of weights, prints a table and writes JSON with ``--json``.

- ``sampling`` (sampling.py): speculative TPOT with the model card's sampling settings against
  greedy, OpenAI-style top-p and target-only;
- ``warmup`` (warmup.py): warm-up time at every default batch size, cold or warm compile cache,
  and the TPOT after it;
- ``multiturn`` (multiturn.py): multi-turn chat TTFT with the prefix cache on and off;
- ``exact`` (exact.py): exact mode's identity rates and TPOT cost against the default mode;
- ``structured`` (structured.py): speculative TPOT of JSON-schema requests against unconstrained
  ones, and the schema's compile time;
- ``fp8`` (fp8.py): the fp8 target's next-token distributions, weight errors and weight memory
  against the model dtype's.

Each module has ``NAME``, ``SUMMARY``, ``SHARED`` (the ``lfmspark bench`` flags it reads beside the
engine's, with its defaults for them), ``add_arguments(parser)`` (its own flags, in a group of its
own; returns their destinations), ``config(args, engine=..., fit=..., command=...)``, ``run(config)``
(the report) and ``table(report)``.
"""

from __future__ import annotations

from types import ModuleType

from . import exact, fp8, multiturn, sampling, structured, warmup

SCENARIOS: dict[str, ModuleType] = {m.NAME: m for m in (sampling, warmup, multiturn, exact, structured, fp8)}

__all__ = ["SCENARIOS"]
