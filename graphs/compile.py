"""Regional compilation of the step functions, and the torch.compile settings they share.

A step (decode, speculative round) is not compiled as one graph. Its repeated pieces are compiled
once each and reused: one graph per *kind* of decoder layer after the first (ShortConv, attention;
dense or MoE feed-forward; the draft layer), plus the step's heads and tails:

- heads (``Steps.decode_head``, ``draft_head``, ``verify_head``, runtime/steps.py): the glue before
  a model's layers (reading the rows' anchor and committed length from the slot state, the
  embedding lookup, the verify's ``[x0, d]`` concat, the draft block's ``[x0, MASK, ...]``, the
  window's lens; the attention layers read the RoPE table themselves) together with the model's
  first layer. The first layer needs a graph of its own
  anyway, since it starts without a pending residual add (models/lfm2.py: each layer's last add
  is fused into the next layer's first norm, the last layer's into the tail's final norm), so
  folding the glue into it costs no extra graph;
- tails: LM head + pick for decode (``finish_decode``); LM head + Markov walk for the draft
  (``finish_draft``); acceptance + commit for the round (``round_accept_commit``); the draft's
  context injection (``round_inject``), run on a side stream beside the verify's last layers and
  the commit: the stream fork and join live in the uncompiled glue, ``Steps.fork_injection`` and
  ``Steps.round_commit``, since Dynamo's ``fullgraph`` regions hold no stream switches.

The step module declares its regions (``@region`` in runtime/steps.py); :func:`compile_regions`
compiles what it declares, plus every layer after the first.

A 16-layer target then costs three layer compiles instead of sixteen inlined layers, which make a
whole-step compile take about a minute per batch size. Per batch size: decode compiles its head,
one graph per later layer kind and its tail (4 for a dense LFM2 whose later layers have both
kinds); a greedy round the draft head, the later draft layer, the draft tail, the
verify head, the later target layer kinds, the injection and the commit (8). The step as a
whole is still captured into one CUDA graph per batch size (graphs/capture.py). Between regions
the step runs no tensor computation, only the per-layer cache slicing (views, no kernels;
tests/runtime/test_step_glue.py checks this): every kernel of the captured step is launched by compiled
code (Inductor's kernels, the lfmspark ops, extern GEMMs), so the chain of PDL kernels
(ops/_dispatch.py) is not cut by loose ATen kernels, each of which would be a CUDA-graph node of
its own launched without PDL and cost its full launch latency. Each layer receives its one-layer
cache slices as inputs (models/cache.py), so nothing in a compiled layer depends on which layer it is.

Inductor's on-disk caches (FX graph cache, autotuning results, Triton binaries) live under
``LFMSPARK_CACHE_DIR`` (lfmspark/environment.py; default ``~/.cache/lfmspark/inductor``) so a restarted service warms up
from cache instead of recompiling (``import lfmspark`` sets it before anything else, so it also holds
for other ``torch.compile`` calls in the process; an explicit ``TORCHINDUCTOR_CACHE_DIR`` wins).

**One compile for every batch size.** The batch dimension is dynamic: a region is compiled at
the first batch size it sees, and at the second its batch dimension becomes symbolic (Dynamo's
automatic dynamic shapes), so one graph then serves every larger size, as vLLM compiles once and
captures a CUDA graph per size. Batch 1 keeps a graph of its own (Dynamo specialises sizes 0 and
1; its products and norms take other kernels anyway, ops/routing.py), and where a kernel choice
depends on the rows (1-16 rows on the weight-streaming products, the Markov walk's lanes) Dynamo
guards on it and compiles once per side of the threshold. The warm-up therefore compiles batch 1
first and then the largest size (graphs/capture.py), which gives the symbolic graph a large size
as its hint. Everything else (weights, caches, vocabulary) stays static. The tails are compiled
once per sampling mode too, so Dynamo's recompile limits are raised to cover these variants.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..environment import environment

log = logging.getLogger(__name__)


# dynamic=None: static until a dimension changes between calls, then symbolic (see the module doc)
COMPILE_OPTIONS = dict(fullgraph=True, dynamic=None)


def compile_regions(steps, n_batch_sizes: int) -> None:
    """Swap a :class:`~lfmspark.runtime.steps.Steps`' regions for compiled versions (see the module
    doc). Only that object changes: the models stay plain, and prefill runs their layers directly."""
    # each region is compiled per batch-size range (batch 1, then each side of a kernel threshold) and,
    # for the tails, sampling mode; a later target layer per range, kind and mode (decode, verify): up to
    # 4 kinds (ShortConv / attention x dense / MoE). The limits allow a compile per size: should a size
    # ever be specialised, the warm-up gets slower (its report counts the graphs) but never falls back
    # to running a region uncompiled.
    configure_compile(n_variants=10 * n_batch_sizes)

    def compiled(fn):
        return torch.compile(fn, **COMPILE_OPTIONS)

    for name in steps.region_names():
        setattr(steps, name, compiled(getattr(steps, name)))
    steps.later_target_layers = [compiled(layer) for layer in steps.later_target_layers]
    steps.later_draft_layers = [compiled(layer) for layer in steps.later_draft_layers]


def configure_compile(n_variants: int) -> None:
    inductor = torch._inductor.config
    inductor.fx_graph_cache = True
    if not isinstance(inductor.post_grad_custom_post_pass, CacheKeyOfOps):  # keeps a pass the process set
        inductor.post_grad_custom_post_pass = CacheKeyOfOps(inductor.post_grad_custom_post_pass)
    inductor.triton.enable_pdl = inductor_pdl_enabled()
    # Eager numerics in the compiled regions: keep the bf16 rounding between fused ops (the residual
    # add before its RMSNorm, silu(gate) before the product) that Inductor would otherwise elide. The
    # fused decode kernels (add_rmsnorm_gemv, skinny_swiglu) round there, as HF eager does; with the
    # rounding elided, a verify's compiled unfused layers computed slightly different numbers than
    # the decode step's kernels, and bf16 speculation diverged from target-only decoding far more
    # often (tests/graphs/test_graphs_gpu.py: 1 of 8 sequences identical).
    inductor.emulate_precision_casts = True
    dynamo = torch._dynamo.config
    dynamo.automatic_dynamic_shapes = True     # the batch dimension (module doc)
    dynamo.recompile_limit = max(dynamo.recompile_limit, n_variants + 8)
    if hasattr(dynamo, "accumulated_recompile_limit"):
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * n_variants + 64)


class CacheKeyOfOps(CustomGraphPass):
    """A post-grad pass that changes nothing: its ``uuid`` adds to Inductor's FX-graph cache key what
    that key does not see: the ``LFMSPARK_*`` values that reach the kernels (PDL, the tuning table;
    lfmspark/environment.py) and the source of lfmspark's ops and models.

    Why: a compiled region checks every custom op's outputs against the shapes the op's fake kernel
    gave when it was compiled, and some of those follow launch parameters (the ssq partials of
    ``lfmspark::skinny_linear_add_norm`` have one row per column tile, whose width ``LFMSPARK_TUNE``
    may change). A graph cached under another tuning table, or by an older heuristic, would then
    fail its size assert at the first run.

    ``inner``: a pass the process had installed in this slot; it still runs, and its ``uuid`` joins
    the key (none, or a plain callable without one, turns Inductor's caching off, as it would alone)."""

    def __init__(self, inner: Callable[[torch.fx.graph.Graph], None] | None = None) -> None:
        self.inner = inner

    def __call__(self, graph: torch.fx.graph.Graph) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self) -> str | None:
        inner = None
        if self.inner is not None:
            inner = self.inner.uuid() if hasattr(self.inner, "uuid") else None
            if inner is None:
                return None
        env = environment()
        package = Path(__file__).resolve().parent.parent
        sources = get_hash_for_files(tuple(sorted(str(p) for d in ("ops", "models") for p in (package / d).rglob("*.py"))))
        return hashlib.sha256(repr((env.pdl, env.triton_on_cpu, env.tune, sources, inner)).encode()).hexdigest()


def inductor_pdl_enabled() -> bool:
    """Whether Inductor's kernels follow the PDL contract too: with lfmspark's (unless ``LFMSPARK_PDL=0``;
    it takes ~0.1 ms off the batch-1 round: docs/decisions.md, "Launch parameters and PDL").

    Inductor's PDL codegen (``triton.enable_pdl``) skips ``gdc_wait`` in a kernel that does not
    touch what the kernel scheduled just before it wrote. That breaks the chain: such a kernel can
    finish while an earlier one is still running, and its successor, which waits for it alone, may
    then read the earlier kernel's output too soon. :func:`_make_inductor_kernels_always_wait`
    makes every generated kernel wait before its first load or store; where this PyTorch lacks the
    hooks it patches, Inductor's PDL stays off."""
    if not environment().pdl:
        return False
    if not _make_inductor_kernels_always_wait():
        log.warning("this PyTorch's Inductor has no PDL hooks lfmspark can make safe: its kernels launch without PDL")
        return False
    return True


@functools.lru_cache(maxsize=None)
def _make_inductor_kernels_always_wait() -> bool:
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.virtualized import V

    if not hasattr(torch._inductor.config.triton, "enable_pdl") or not hasattr(TritonKernel,
                                                                                "_handle_pdl_before_access"):
        return False
    original = TritonKernel._handle_pdl_before_access

    def always_wait(self, wait_buffer, *dependencies, consider_reads=False):
        # with no previous node, Inductor's rule is "wait" (it cannot rule out a dependency)
        scheduler = V.graph.scheduler
        saved = getattr(scheduler, "previous_node", None)
        if scheduler is not None:
            scheduler.previous_node = None
        try:
            return original(self, wait_buffer, *dependencies, consider_reads=consider_reads)
        finally:
            if scheduler is not None:
                scheduler.previous_node = saved

    TritonKernel._handle_pdl_before_access = always_wait
    return True
