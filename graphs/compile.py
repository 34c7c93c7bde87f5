"""Regional compilation of the step functions, and the torch.compile settings they share.

A step (decode, speculative round) is not compiled as one graph. Its repeated pieces are compiled
once each and reused: one graph per *kind* of decoder layer after the first (ShortConv, attention;
dense or MoE feed-forward; the draft layer), plus the step's heads and tails:

- heads (``Steps.decode_head``, ``draft_head``, ``verify_head``, runtime/steps.py): the glue before
  a model's layers (reading the rows' anchor and committed length from the slot state, the
  embedding lookup, the draft block's ``[x0, MASK, ...]``, the window's lens; the attention
  layers read the RoPE table themselves) together with the model's first layer. The first layer needs a graph of its own
  anyway, since it starts without a pending residual add (models/lfm2.py: each layer's last add
  is fused into the next layer's first norm, the last layer's into the tail's final norm), so
  folding the glue into it costs no extra graph;
- tails: LM head + pick for decode (``finish_decode``); LM head + Markov walk for the draft, which
  joins the verify's window ``[x0, d]`` (``finish_draft``); acceptance + commit for the round (``round_accept_commit``); the draft's
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

Inductor's on-disk caches (FX graph cache, autotuning results) live under ``LFMSPARK_CACHE_DIR``
(lfmspark/environment.py; default ``~/.cache/lfmspark/inductor``), and Triton's (the binaries of
Inductor's kernels and of the lfmspark ops) in its ``triton`` folder, so a restarted service warms
up from cache instead of recompiling (``import lfmspark`` sets both before anything else, so they
also hold for other ``torch.compile`` calls in the process; an explicit ``TORCHINDUCTOR_CACHE_DIR``
or ``TRITON_CACHE_DIR`` wins).

**One compile for every batch size.** The batch dimension is dynamic: a region is compiled at
batch 1 and once more, with its batch dimension symbolic, at the first larger size it sees, and
that graph then serves every size of two or more, as vLLM compiles once and captures a CUDA graph
per size. Batch 1 keeps a graph of its own (Dynamo specialises sizes 0 and 1; its products and
norms take other kernels anyway, ops/routing.py), and where a kernel choice depends on the rows
(1-16 rows on the weight-streaming products, the Markov walk's lanes) Dynamo guards on it and
compiles once per side of the threshold.

Dynamo's automatic dynamic shapes alone would not give this: they make a dimension symbolic once
they have seen it change, and an input a region never saw before enters static. Some inputs only
exist from batch 2 on: at batch 1 on CUDA the verify's and the draft's layers hand on a
``NormedCarry`` (models/layers.py: the window and the block fit the few-row kernels), at larger
sizes a plain pending tensor, so the first size of two or more
would compile with the batch fixed (``x + delta`` guards it equal to the static input's) and the
next size would compile again. So every compiled region is called through :class:`BatchDynamic`,
which marks the batch dimension of the row-indexed inputs dynamic before each call from batch 2 on.

**One compile for every verify width.** A round's width is a shape too (runtime/steps.py
``RoundInputs.columns``): the regions take the window's columns as a dimension of their inputs,
never as a Python int, and :class:`BatchDynamic` marks that dimension dynamic from the first
width of two or more on, where a region declares it (``region(window=...)``; the target layers'
hidden states in VERIFY mode), so one graph serves every width of two or more. Width 1 keeps its
own graphs (the decode step's kernels, and Dynamo specialises the size 1). What still splits:
the routes that read the rows (products of 1-16 rows count ``batch * width`` rows, the Markov walk
``batch * (width - 1)`` lanes), width 2 where a region works on its single draft (``g = 1``: Dynamo
specialises the size-1 checks of broadcasting and contiguity), and the draft's tail, which runs
the whole block's rows as they come at the full width and slices them otherwise
(``DSparkDraft.block_prefix``).

The warm-up compiles batch 1 first and then the largest size (graphs/capture.py), which gives the
symbolic graph a large size as its hint. Everything else (weights, caches, vocabulary) stays
static. The tails are compiled once per sampling mode too, so Dynamo's recompile limits are raised
to cover these variants.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ..environment import environment
from ..models.layers import NormedCarry

log = logging.getLogger(__name__)


# dynamic=None: static until a dimension changes between calls (or is marked: BatchDynamic), then
# symbolic (see the module doc)
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
    lasting = lasting_storages(steps)
    # the marks only serve the automatic policy; a caller that fixes dynamic (True or False) gets it as asked
    mark = COMPILE_OPTIONS.get("dynamic", None) is None

    def compiled(fn, window: dict[str, int] | None = None):
        region = torch.compile(fn, **COMPILE_OPTIONS)
        return BatchDynamic(region, fn, lasting, window) if mark else region

    for name in steps.region_names():
        fn = getattr(steps, name)
        setattr(steps, name, compiled(fn, getattr(fn, "window_inputs", None)))
    # a target layer's hidden states hold the verify window's columns in dimension 1 (decode: 1 column)
    steps.later_target_layers = [compiled(layer, TARGET_LAYER_WINDOW) for layer in steps.later_target_layers]
    steps.later_draft_layers = [compiled(layer) for layer in steps.later_draft_layers]


# the window dimension of a target layer's inputs (BatchDynamic)
TARGET_LAYER_WINDOW = {"h": 1, "delta": 1}


class BatchDynamic:
    """A compiled region (``compiled``, of ``fn``) whose row-indexed inputs get their batch dimension
    marked dynamic before each call of two rows or more, and whose inputs that hold a round's window
    their window dimension before each call of a window of two columns or more (module doc), so
    that the region's first compile there is already the symbolic one.

    The batch is the length of the call's ``slots``: an argument of that name, or a field of one
    (``RoundInputs.slots``, ``Rows.slots``); a call without one is passed through unmarked. The
    marked tensors are those of the arguments (through tuples, lists, dicts and dataclasses) whose
    first dimension has that length, except the weights and the caches (``lasting``, the storages of
    :func:`lasting_storages`), whose first dimension may have it by coincidence (the slots of the
    page table, a hidden size of 64) and must stay static. The marks are Dynamo's weak ones
    (``maybe_mark_dynamic``): a region that does specialise the batch compiles per size, which the
    warm-up report counts, instead of failing.

    ``window``: which inputs hold the window's columns, by path (``"drafted.window"``: the ``window``
    field of the ``drafted`` argument) and dimension (see :func:`_mark_window`). Declared, not
    guessed from sizes: a dimension that only equals the width by coincidence (the block's ``gamma``
    slots at width ``gamma``) would be marked at that width alone, and a graph compiled without a
    mark refuses a tensor that carries one (Dynamo's guard on the marked dimensions)."""

    def __init__(self, compiled: Callable, fn: Callable, lasting: frozenset[int],
                 window: dict[str, int] | None = None) -> None:
        self.compiled, self.lasting, self.window = compiled, lasting, window or {}
        # a module's call is its forward's (the module's own signature is __call__'s *args, **kwargs)
        self.signature = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arguments = self.signature.bind(*args, **kwargs).arguments
        batch = batch_of(arguments)
        if batch is not None and batch >= 2:
            for value in arguments.values():
                _mark_rows(value, batch, self.lasting)
        for path, dim in self.window.items():
            _mark_window(_at(arguments, path), dim)
        return self.compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # what callers read of a torch.compile wrapper (_torchdynamo_orig_callable, a module's attributes);
        # not before __init__ has set it (a copy), which would recurse
        if name == "compiled":
            raise AttributeError(name)
        return getattr(self.compiled, name)


def batch_of(arguments: dict[str, Any]) -> int | None:
    """The rows of a region call: the length of its ``slots`` argument, or of a ``slots`` field of one
    of its arguments; None when it has neither."""
    slots = arguments.get("slots")
    if not isinstance(slots, torch.Tensor):
        slots = next((v.slots for v in arguments.values() if isinstance(getattr(v, "slots", None), torch.Tensor)),
                     None)
    return None if slots is None or slots.dim() != 1 else slots.shape[0]


def _at(arguments: dict[str, Any], path: str) -> Any:
    """The value at ``path`` (an argument's name, then field names, dot-separated), None if absent."""
    name, *fields = path.split(".")
    value = arguments.get(name)
    for f in fields:
        value = getattr(value, f, None)
    return value


def _mark_window(value: Any, dim: int) -> None:
    """Mark the window dimension ``dim`` of ``value`` dynamic where it has two columns or more: a
    tensor's ``dim``; a tuple's or list's tensors' (the aux taps); a ``NormedCarry``'s flattened rows
    and columns instead (``scaled`` dim 0, ``ssq`` dim 1: ``batch * width`` rows); a dataclass's
    tensor fields' ``dim`` (the drafts' q: ``batch * (width - 1)`` rows in dim 0). None: nothing."""
    if isinstance(value, NormedCarry):
        _mark_window(value.scaled, 0)
        _mark_window(value.ssq, 1)
    elif isinstance(value, torch.Tensor):
        if value.dim() > dim and value.shape[dim] >= 2:
            torch._dynamo.maybe_mark_dynamic(value, dim)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _mark_window(item, dim)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if isinstance(item := getattr(value, f.name), torch.Tensor):
                _mark_window(item, dim)


def lasting_storages(steps) -> frozenset[int]:
    """The storages (data pointers) of what a step's regions take as inputs and that outlives the step:
    the models' parameters and buffers, and the caches' tensors (their one-layer slices and the page
    table are region inputs)."""
    tensors: list[torch.Tensor] = []
    for model in (steps.target, steps.draft):
        if model is not None:
            tensors += [*model.parameters(), *model.buffers()]
    for cache in (steps.tcache, steps.dcache):
        if cache is not None:
            tensors += [v for v in vars(cache).values() if isinstance(v, torch.Tensor)]
    return frozenset(p for t in tensors if (p := t.untyped_storage().data_ptr()))


def _mark_rows(value: Any, batch: int, lasting: frozenset[int], depth: int = 0) -> None:
    if isinstance(value, torch.Tensor):
        if value.dim() and value.shape[0] == batch and value.untyped_storage().data_ptr() not in lasting:
            torch._dynamo.maybe_mark_dynamic(value, 0)
    elif depth >= 3:
        return
    elif isinstance(value, (tuple, list)):
        for item in value:
            _mark_rows(item, batch, lasting, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            _mark_rows(item, batch, lasting, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _mark_rows(getattr(value, f.name), batch, lasting, depth + 1)


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
