"""Keep the Markov head's ``markov_w2`` resident in L2 across speculative rounds.

Why: the greedy Markov walk (ops/markov_walk.py) runs one launch per block slot, and every launch
reads the whole ``markov_w2 [V, r]`` (the LFM2.5 drafts: 65536 x 256 bf16, 32 MiB) because the
next token's bias depends on the previous one: 9 x 32 MiB per batch-1 round, 79 us of a 1.35 ms
round on the H200 (71 us at HBM bandwidth; docs/benchmarks.md). The matrix fits in the H200's
50 MB L2, yet the walk's steps run at HBM speed (8.2 us each against 7.9 at copy bandwidth):
normal caching keeps little of a 32 MiB stream in an L2 of two 25 MB partitions, and a round
streams ~3 GB of other weights between one walk and the next.

How: an L2 access policy window marks a kernel's accesses to one address range as *persisting*;
persisting lines live in a set-aside part of L2 (``CU_LIMIT_PERSISTING_L2_CACHE_SIZE``) that
normal accesses cannot evict. The window is a stream attribute (``cuStreamSetAttribute``,
``CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW``) that applies to the work submitted afterwards,
kernels captured into a CUDA graph included: the graph runner (graphs/capture.py) sets it on its
capture stream around the capture of the round graphs only, and the set-aside on the device's
context. Lines inside the window beyond the set-aside (``hitRatio`` < 1) stay normal. The rest of
a round needs little L2: its weights are read once per round, and the activations and split-K
partials it re-reads are kilobytes.

The policy changes where bytes are cached, never what a kernel computes. The CUDA driver API is
called through ``ctypes`` (``libcuda.so.1``, present wherever CUDA runs), since torch exposes no
binding for it. ``LFMSPARK_L2_PERSIST`` (``0`` default, ``1``) switches it on.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from collections.abc import Iterator

import torch

log = logging.getLogger("lfmspark")

_ATTR_MAX_PERSISTING_L2 = 108        # CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE
_ATTR_MAX_WINDOW = 109               # CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE
_LIMIT_PERSISTING_L2 = 0x06          # CU_LIMIT_PERSISTING_L2_CACHE_SIZE
_STREAM_ATTR_WINDOW = 1              # CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW
_NORMAL, _PERSISTING = 0, 2          # CUaccessProperty


class _AccessPolicyWindow(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hit_ratio", ctypes.c_float),
                ("hit_prop", ctypes.c_int), ("miss_prop", ctypes.c_int)]


class _StreamAttrValue(ctypes.Union):   # CUlaunchAttributeValue: a 64-byte union
    _fields_ = [("window", _AccessPolicyWindow), ("pad", ctypes.c_char * 64)]


def l2_persist_requested() -> bool:
    """``LFMSPARK_L2_PERSIST`` (default ``0``): whether the round graphs keep ``markov_w2`` in L2."""
    value = os.environ.get("LFMSPARK_L2_PERSIST", "0")
    if value not in ("0", "1"):
        raise ValueError(f"LFMSPARK_L2_PERSIST={value!r}: use 1 (keep the Markov head's markov_w2 in L2 during the "
                         "speculative round) or 0 (off)")
    return value == "1"


def window_plan(num_bytes: int, max_window: int, max_persisting: int) -> tuple[int, int, float]:
    """``(window bytes, set-aside bytes, hit ratio)`` for a tensor of ``num_bytes``: the window is
    capped by the device's largest window, the set-aside by its persisting capacity, and the hit
    ratio is the share of the window the set-aside holds (the rest stays normal, not thrashing)."""
    window = min(num_bytes, max_window)
    set_aside = min(window, max_persisting)
    return window, set_aside, (set_aside / window if window else 0.0)


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {result}")


def _device_attribute(attr: int, device: torch.device) -> int:
    value, handle = ctypes.c_int(), ctypes.c_int()
    _check(_driver().cuDeviceGet(ctypes.byref(handle), device.index), "cuDeviceGet")
    _check(_driver().cuDeviceGetAttribute(ctypes.byref(value), attr, handle), "cuDeviceGetAttribute")
    return value.value


def _set_stream_window(stream: torch.cuda.Stream, base: int, num_bytes: int, hit_ratio: float) -> None:
    value = _StreamAttrValue()
    value.window = _AccessPolicyWindow(base, num_bytes, hit_ratio, _PERSISTING if num_bytes else _NORMAL, _NORMAL)
    _check(_driver().cuStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream), _STREAM_ATTR_WINDOW,
                                          ctypes.byref(value)), "cuStreamSetAttribute(access policy window)")


def stream_window(stream: torch.cuda.Stream) -> tuple[int, int, float]:
    """``(base pointer, bytes, hit ratio)`` of ``stream``'s access policy window (bytes 0: none)."""
    value = _StreamAttrValue()
    _check(_driver().cuStreamGetAttribute(ctypes.c_void_p(stream.cuda_stream), _STREAM_ATTR_WINDOW,
                                          ctypes.byref(value)), "cuStreamGetAttribute(access policy window)")
    w = value.window
    return w.base_ptr or 0, w.num_bytes, w.hit_ratio


@contextlib.contextmanager
def persisting(stream: torch.cuda.Stream, tensor: torch.Tensor | None) -> Iterator[None]:
    """Within the block, kernels submitted to ``stream`` (or captured from it) keep ``tensor`` in
    L2 as persisting lines; the device's set-aside is sized for it. A no-op for ``None``, off CUDA,
    or on a device without persisting L2 (then logged once)."""
    if tensor is None or not tensor.is_cuda:
        yield
        return
    device = tensor.device
    window, set_aside, hit_ratio = window_plan(tensor.numel() * tensor.element_size(),
                                               _device_attribute(_ATTR_MAX_WINDOW, device),
                                               _device_attribute(_ATTR_MAX_PERSISTING_L2, device))
    if set_aside == 0:
        log.info("L2 persistence: this device sets no L2 aside for persisting accesses; LFMSPARK_L2_PERSIST has no "
                 "effect")
        yield
        return
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)    # the context is current on this thread: cuCtxSetLimit acts on it
        _check(_driver().cuCtxSetLimit(_LIMIT_PERSISTING_L2, ctypes.c_size_t(set_aside)),
               "cuCtxSetLimit(persisting L2)")
    _set_stream_window(stream, tensor.data_ptr(), window, hit_ratio)
    log.info("L2 persistence: %.1f MiB window, %.1f MiB set aside (hit ratio %.2f)", window / 2**20,
             set_aside / 2**20, hit_ratio)
    try:
        yield
    finally:
        _set_stream_window(stream, 0, 0, 0.0)
