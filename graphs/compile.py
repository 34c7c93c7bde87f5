"""Regional compilation of the step functions, and the torch.compile settings they share.

A step (decode, speculative round) is not compiled as one graph. Its repeated pieces are compiled
once each and reused: one graph per *kind* of decoder layer (ShortConv, attention; dense or MoE
feed-forward; the draft layer), one more for the first target layer and the first draft layer,
which start without a pending residual add (models/lfm2.py: each layer's last add is fused into
the next layer's first norm, the last layer's into the tail's final norm), plus the step's tail
functions (LM head + pick for decode; LM head + Markov walk for the draft; acceptance + commit for
the round). A 16-layer target then costs three layer compiles instead of sixteen inlined layers,
which is what made whole-step compiles take about a minute per batch size on the H200
(docs/benchmarks.md). The step as a whole is still captured into one CUDA graph per batch size
(graphs/capture.py), so the uncompiled glue between regions (a few index ops) costs kernel nodes,
not Python. Each layer receives its one-layer cache slices as inputs (models/cache.py), so nothing
in a compiled layer depends on which layer it is.

Inductor's on-disk caches (FX graph cache, autotuning results, Triton binaries) live under
``LFMSPARK_CACHE_DIR`` (default ``~/.cache/lfmspark/inductor``) so a restarted service warms up
from cache instead of recompiling (set at import, so it also holds for other ``torch.compile``
calls in the process; an explicit ``TORCHINDUCTOR_CACHE_DIR`` wins). Each region is compiled once
per static shape (batch size) and, for the tails, sampling mode, so Dynamo's recompile limits are
raised to cover them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..ops._dispatch import pdl_requested


def cache_dir() -> Path:
    return Path(os.environ.get("LFMSPARK_CACHE_DIR", Path.home() / ".cache" / "lfmspark" / "inductor"))


COMPILE_OPTIONS = dict(fullgraph=True, dynamic=False)


def compile_regions(steps, n_batch_sizes: int) -> None:
    """Swap a :class:`~lfmspark.runtime.steps.Steps`' regions for compiled versions (see the module
    doc). Only that object changes: the models stay plain, and prefill runs their layers directly."""
    # each region is compiled per batch size and sampling mode; a target layer per batch size, kind
    # and mode (decode, verify): up to 5 kinds (ShortConv / attention x dense / MoE, the first layer)
    configure_compile(n_variants=10 * n_batch_sizes)
    steps.target_layers = [torch.compile(layer, **COMPILE_OPTIONS) for layer in steps.target.model.layers]
    steps.finish_decode = torch.compile(steps.finish_decode, **COMPILE_OPTIONS)
    if steps.draft is not None:
        steps.draft_layers = [torch.compile(layer, **COMPILE_OPTIONS) for layer in steps.draft.layers]
        steps.finish_draft = torch.compile(steps.finish_draft, **COMPILE_OPTIONS)
        steps.round_accept_commit = torch.compile(steps.round_accept_commit, **COMPILE_OPTIONS)


# Set when lfmspark is imported: Inductor fixes its cache directory the first time it needs one
# (any compile, or a Triton launch through it), which may happen before an engine compiles.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir()))


def configure_compile(n_variants: int) -> None:
    inductor = torch._inductor.config
    inductor.fx_graph_cache = True
    # Coordinate-descent tuning is what makes Inductor decompose M = 1 matmuls into tuned GEMV
    # reductions (with the norms fused in). On the H200 that decode step was only ~1% faster than
    # with cuBLAS GEMVs while every compile took 2-4x longer (docs/benchmarks.md), so it is off by
    # default; LFMSPARK_COORDINATE_DESCENT=1 turns it on.
    inductor.coordinate_descent_tuning = os.environ.get("LFMSPARK_COORDINATE_DESCENT", "0") == "1"
    # Inductor's own kernels can follow the PDL contract too (ops/_dispatch.py); it is opt-in
    # (LFMSPARK_INDUCTOR_PDL=1) because a kernel that stores without loading is emitted without a
    # gdc_wait, and a dependent of it then waits for that kernel only, not for the ones before it.
    if hasattr(inductor.triton, "enable_pdl"):
        inductor.triton.enable_pdl = pdl_requested() and os.environ.get("LFMSPARK_INDUCTOR_PDL", "0") == "1"
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, n_variants + 8)
    if hasattr(dynamo, "accumulated_recompile_limit"):
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * n_variants + 64)
