"""L2 prefetch of the *next* product's weights, issued by the kernel before it.

Why: a decode step (and a speculative round) is a chain of weight-streaming products with small
latency-bound kernels between them (the short convolution, attention, norms). Each product alone
reaches 80-88% of copy bandwidth on the H200, and almost all of the loss is at its two ends: the
first weight requests go out only when its programs start, and the last ones drain while the memory
system idles; during a latency-bound kernel it idles altogether. Programmatic dependent launch
(ops/_dispatch.py) only overlaps the first K block of each program with its predecessor's tail.
So a product's programs, once they have issued their own weight loads, also ask L2 to fetch the
first bytes of the weight that will be read next (``cp.async.bulk.prefetch.L2``: fire and forget,
no registers, no shared memory, no completion to wait for). The memory system then stays busy
through the tail, the kernels in between and the next product's start, whose first loads hit L2.

Contract: a kernel taking a prefetch range requests bytes ``[0, n_bytes)`` of ``base`` into L2, split
evenly over its programs, and nothing else: results never depend on it (a prefetch is a hint that
reads memory, never writes it). The caller chooses what to prefetch, a view of at most
``l2_prefetch_budget()`` bytes of the next weight (models/layers.py ``prefetch_view``); the launcher
(:func:`prefetch_args`) turns it into kernel arguments, or disables the prefetch where it cannot run
(not CUDA, or no sm90 bulk prefetch, or a base address or size not 16-byte aligned).

``LFMSPARK_L2_PREFETCH_MB`` sets the budget (megabytes per product; ``0`` turns prefetching off).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_ALIGN = 16  # cp.async.bulk: 16-byte aligned address and size


@triton.jit
def prefetch_l2(base_ptr, n_bytes, pid, n_programs, NUM_THREADS: tl.constexpr, MODE: tl.constexpr):
    """Program ``pid`` of ``n_programs`` requests its share of bytes ``[0, n_bytes)`` at ``base_ptr``
    into L2 (``n_bytes`` a multiple of 16). The share index counts down from the last program, so
    in a grid of several waves the prefetch goes out during the final one, not so early that the
    kernel's own stream evicts it from L2 again. ``MODE`` (:data:`MODES`): 1, one bulk prefetch per
    thread of a 16-byte aligned chunk; 2, one bulk prefetch per program (its first thread); 3, one
    ``prefetch.global.L2`` per 128-byte line, spread over the threads. Call only with the launcher's
    mode on (inline PTX: the interpreter cannot run it)."""
    index = (n_programs - 1 - pid).to(tl.int64)
    if MODE & 7 == 1:
        share = tl.cdiv(tl.cdiv(n_bytes, n_programs), NUM_THREADS * 16) * (NUM_THREADS * 16)
        chunk = share // NUM_THREADS
        start = index * share + tl.arange(0, NUM_THREADS).to(tl.int64) * chunk
        size = tl.maximum(tl.minimum(chunk, n_bytes - start), 0).to(tl.int32)
        # threads whose chunk starts past the end skip the request (predicate), nothing is read there
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base_ptr.to(tl.pointer_type(tl.int8)) + start, size], dtype=tl.int32, is_pure=False, pack=1)
    elif MODE & 7 == 2:
        share = tl.cdiv(tl.cdiv(n_bytes, n_programs), 16) * 16
        start = index * share
        size = tl.maximum(tl.minimum(share, n_bytes - start), 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; .reg .b64 pol; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "setp.gt.and.s32 p, $2, 0, p; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r", [base_ptr.to(tl.pointer_type(tl.int8)) + start, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        share = tl.cdiv(tl.cdiv(n_bytes, n_programs), 128) * 128
        start = index * share
        end = tl.minimum(start + share, n_bytes)
        for line in range(start, end, NUM_THREADS * 128):
            offs = line + tl.arange(0, NUM_THREADS).to(tl.int64) * 128
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.lt.s64 p, $2, $3; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                "=r,l,l,l", [base_ptr.to(tl.pointer_type(tl.int8)) + offs, offs, end + offs * 0], dtype=tl.int32,
                is_pure=False, pack=1)


MODES = {"threads": 1, "program": 2, "lines": 3}
EVICT_FIRST = 8  # mode bit: the kernel's own weight loads evict first (``LFMSPARK_WEIGHT_EVICT_FIRST=1``)


def l2_prefetch_budget() -> int:
    """Bytes of the next weight a product prefetches (``LFMSPARK_L2_PREFETCH_MB``, default 8; 0: off).
    Read when a model builds its prefetch views (under compile: at trace time)."""
    value = os.environ.get("LFMSPARK_L2_PREFETCH_MB", "8")
    try:
        mb = float(value)
    except ValueError:
        mb = -1.0
    if mb < 0:
        raise ValueError(f"LFMSPARK_L2_PREFETCH_MB={value!r}: use a number of megabytes >= 0 (0 turns the L2 "
                         "prefetch off)")
    return int(mb * (1 << 20)) // _ALIGN * _ALIGN


@functools.lru_cache(maxsize=None)
def _supports_bulk_prefetch(device: torch.device) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def prefetch_args(prefetch: torch.Tensor | None, fallback: torch.Tensor) -> dict:
    """Keyword arguments ``pf_ptr, pf_bytes, PREFETCH`` of a kernel for an optional prefetch view:
    the whole view, rounded down to 16 bytes; ``PREFETCH`` False (nothing requested) where it
    cannot run (see the module doc), with ``fallback`` (any tensor of the launch) as the unread
    pointer."""
    device = fallback.device
    off = {"pf_ptr": fallback, "pf_bytes": 0, "PREFETCH": 0}
    if prefetch is None or device.type != "cuda" or prefetch.device != device or not _supports_bulk_prefetch(device):
        return off
    if not prefetch.is_contiguous():
        raise ValueError("an L2 prefetch view must be contiguous (a leading slice of a weight: prefetch_view)")
    n_bytes = prefetch.numel() * prefetch.element_size() // _ALIGN * _ALIGN
    if n_bytes == 0 or prefetch.data_ptr() % _ALIGN:
        return off
    return {"pf_ptr": prefetch, "pf_bytes": n_bytes, "PREFETCH": prefetch_mode()}


def prefetch_mode() -> int:
    """``LFMSPARK_L2_PREFETCH_MODE`` (``threads``, ``program``, ``lines``): how a kernel issues it."""
    value = os.environ.get("LFMSPARK_L2_PREFETCH_MODE", "program")
    if value not in MODES:
        raise ValueError(f"LFMSPARK_L2_PREFETCH_MODE={value!r}: use one of {sorted(MODES)}")
    return MODES[value] | (EVICT_FIRST if os.environ.get("LFMSPARK_WEIGHT_EVICT_FIRST") == "1" else 0)

