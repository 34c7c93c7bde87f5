"""The ``LFMSPARK_*`` environment switches, checked together when an engine is built.

Why: each switch is read where it acts (a kernel's launch, a region's trace), which on a CPU-only
machine may be never and on a GPU only during warm-up. Reading them all when an
:class:`~lfmspark.Engine` is constructed makes a misspelt value an error that names the switch and its
valid values before any compile or request. The README lists them.
"""

from __future__ import annotations

from ..graphs.compile import inductor_pdl_requested
from ..models.layers import (fused_norm_requested, head_argmax_requested, norm_carry_requested, norm_epilogue_requested,
                             skinny_rows)
from ..ops._dispatch import l2_hints, pdl_requested, pdl_trigger
from ..ops.markov_walk_persistent import walk_mode
from ..ops.tuning import tuning_overrides
from ..ops.window_attention import window_attention_requested
from .steps import commit_overlap_mode


def check_switches() -> None:
    """Raise ``ValueError`` for the first ``LFMSPARK_*`` switch with a value it does not take."""
    pdl_requested()
    pdl_trigger()
    l2_hints()
    inductor_pdl_requested()
    skinny_rows()
    fused_norm_requested()
    norm_epilogue_requested()
    norm_carry_requested()
    head_argmax_requested()
    tuning_overrides()
    commit_overlap_mode()
    walk_mode()
    window_attention_requested()
