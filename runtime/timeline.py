"""Where a step replay's wall time goes when its kernels overlap.

Why: with programmatic dependent launch a kernel starts while its predecessor still runs and then
waits for it, so the profiler's per-kernel durations include that wait and add up to more than the
replay (session 6's decode: 1492 us of kernel time in a 0.83 ms replay). What a kernel costs the
step is how far it pushes the end of the GPU timeline past every kernel that started before it:
walking the kernels in start order with the latest end seen so far (the frontier), a kernel adds
``max(0, end - max(frontier, start))``, and a start past the frontier leaves the GPU idle for the
difference. Summed per kernel name over the replays, those shares and the idle time add up to the
timeline's span, so the table ranks the kernels by what removing or speeding them up could save.
Gaps longer than ``gap_limit_us`` are taken to lie between replays (host time) and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass
class KernelShare:
    name: str
    marginal_us: float   # how much this kernel's launches extended the timeline, in all
    own_us: float        # their summed durations (waiting included)
    launches: int


def critical_shares(intervals: Iterable[tuple[str, float, float]], gap_limit_us: float = 50.0
                    ) -> tuple[list[KernelShare], float]:
    """``(name, start_us, end_us)`` per kernel -> per-name shares, largest marginal first, and the
    idle time inside the timeline (gaps up to ``gap_limit_us``)."""
    shares: dict[str, KernelShare] = {}
    idle = 0.0
    frontier: float | None = None
    for name, start, end in sorted(intervals, key=lambda t: (t[1], t[2])):
        share = shares.setdefault(name, KernelShare(name, 0.0, 0.0, 0))
        share.own_us += end - start
        share.launches += 1
        if frontier is None or start - frontier > gap_limit_us:
            frontier = start          # the first kernel, or the first of the next replay
        elif start > frontier:
            idle += start - frontier
        share.marginal_us += max(0.0, end - max(frontier, start))
        frontier = max(frontier, end)
    return sorted(shares.values(), key=lambda s: -s.marginal_us), idle


def timeline_lines(intervals: list[tuple[str, float, float]], replays: int, name_width: int = 150) -> list[str]:
    """The table written under each per-kernel profile (runtime/bench.py ``profile_replays``)."""
    shares, idle = critical_shares(intervals)
    busy = sum(s.marginal_us for s in shares)
    lines = [f"timeline per replay: {(busy + idle) / replays:.1f} us = {busy / replays:.1f} us extended by kernels "
             f"+ {idle / replays:.1f} us idle (marginal: how far each kernel pushed the timeline's end)",
             f"{'marginal':>10} {'own':>10} {'n/replay':>8}  kernel (us per replay)"]
    lines += [f"{s.marginal_us / replays:10.1f} {s.own_us / replays:10.1f} {s.launches / replays:8.1f}  "
              f"{s.name[:name_width]}" for s in shares]
    return lines


def cuda_kernel_intervals(events) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of the device-side events of a ``torch.profiler`` run."""
    from torch.autograd import DeviceType

    return [(e.name, e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
