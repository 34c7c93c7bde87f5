"""Which ATen (and lfmspark) ops a step runs *eagerly*, outside its compiled regions.

A captured step is one CUDA graph, but only its regions are compiled (graphs/compile.py): every op
that runs between two regions is a kernel node of its own, which cannot take part in the
programmatic-dependent-launch chain of the compiled kernels (ops/_dispatch.py). This helper
records them on CPU with a :class:`~torch.utils._python_dispatch.TorchDispatchMode`.

How compiled code is told apart: the mode declares ``ignore_compile_internals()``, so Dynamo still
runs the compiled regions while it is active (a plain mode makes Dynamo fall back to eager) and the
mode is off while anything compiles. At run time a compiled region does dispatch a few ops of its
own: its extern kernels (``aten.mm.out``), the custom ops it calls (``lfmspark.*``) and AOTAutograd's
input/output bookkeeping. Those all run below the region's runtime wrapper, so an op dispatched
while a frame of ``torch/_functorch/_aot_autograd`` (the runtime wrapper) or ``torch/_inductor``
(``CompiledFxGraph.__call__``, which calls the generated module) is on the Python stack is counted
as *inside* a region; every other op ran eagerly between regions.

Eager ops are split into ``compute`` (what launches a kernel on a GPU) and ``free`` (views and
aliases, which only make a new tensor header, and allocations without a fill: no kernel, no graph
node).
"""

from __future__ import annotations

import collections
import os
import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = os.path.dirname(torch.__file__)
_COMPILED_RUNTIME_DIRS = tuple(os.path.join(_TORCH_DIR, d) + os.sep
                               for d in ("_functorch/_aot_autograd", "_inductor"))
_ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default"}


def _inside_compiled_region() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_COMPILED_RUNTIME_DIRS):
            return True
        frame = frame.f_back
    return False


@dataclass
class EagerOps:
    compute: collections.Counter = field(default_factory=collections.Counter)   # op name -> count
    free: collections.Counter = field(default_factory=collections.Counter)
    inside: collections.Counter = field(default_factory=collections.Counter)    # dispatched by compiled code

    def table(self) -> str:
        rows = [f"  {n:4d}  {op}" for op, n in sorted(self.compute.items())]
        return f"{sum(self.compute.values())} eager compute ops outside compiled regions:\n" + "\n".join(rows)


class EagerOpRecorder(TorchDispatchMode):
    """Counts every op dispatched while active, sorted into :class:`EagerOps`."""

    def __init__(self):
        super().__init__()
        self.ops = EagerOps()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if _inside_compiled_region():
            self.ops.inside[name] += 1
        elif getattr(func, "is_view", False) or name in _ALLOCATIONS:
            self.ops.free[name] += 1
        else:
            self.ops.compute[name] += 1
        return func(*args, **(kwargs or {}))


def eager_ops(fn, *args, **kwargs) -> EagerOps:
    """Run ``fn(*args, **kwargs)`` once under :class:`EagerOpRecorder` (no grad) and return its counts."""
    recorder = EagerOpRecorder()
    with torch.no_grad(), recorder:
        fn(*args, **kwargs)
    return recorder.ops
