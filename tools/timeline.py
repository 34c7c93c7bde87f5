"""Where a step replay's wall time goes when its kernels overlap.

Why: with programmatic dependent launch a kernel starts while its predecessor still runs and then
waits for it, so the profiler's per-kernel durations include that wait and add up to more than the
replay (a batch-1 decode: 868 us of kernel time in a 0.75 ms replay). What a kernel costs the
step is how far it pushes the end of the GPU timeline past every kernel that started before it:
walking a replay's kernels in start order with the latest end seen so far (the frontier), a kernel
adds ``max(0, end - max(frontier, start))``, and a start past the frontier leaves the GPU idle for
the difference. Per replay, those shares and the idle time add up to the replay's span (its first
start to its last end); summed per kernel name, the table ranks the kernels by what removing or
speeding them up could save. A graph replay launches the same kernels every time, so the profiled
kernels, in start order, split into replays of equal count; the gaps between replays (host time)
are reported apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class KernelShare:
    name: str
    marginal_us: float   # how much this kernel's launches extended their replays' timelines, in all
    own_us: float        # their summed durations (waiting included)
    launches: int


@dataclass
class Timeline:
    shares: list[KernelShare]   # largest marginal first
    idle_us: float              # GPU idle inside the replays, in all
    span_us: float              # the replays' spans, summed
    between_us: float           # gaps between consecutive replays, summed


def split_replays(intervals: list[tuple[str, float, float]], replays: int) -> list[list[tuple[str, float, float]]]:
    """``(name, start_us, end_us)`` kernels of ``replays`` identical replays -> one list per replay
    (equal counts, in start order); ``ValueError`` when the count does not divide."""
    ordered = sorted(intervals, key=lambda t: (t[1], t[2]))
    if replays < 1 or len(ordered) % replays:
        raise ValueError(f"{len(ordered)} kernels do not split into {replays} replays of equal count")
    per = len(ordered) // replays
    return [ordered[i * per:(i + 1) * per] for i in range(replays)]


def replay_marginals(kernels: Sequence[tuple]) -> tuple[list[float], float, float]:
    """One replay's kernels (start order; ``[1]``, ``[2]`` = start, end) -> each one's marginal share
    (the module doc), the idle time and the span."""
    if not kernels:
        return [], 0.0, 0.0
    frontier, idle, shares = kernels[0][1], 0.0, []
    for kernel in kernels:
        start, end = kernel[1], kernel[2]
        idle += max(0.0, start - frontier)
        shares.append(max(0.0, end - max(frontier, start)))
        frontier = max(frontier, end)
    return shares, idle, frontier - kernels[0][1]


def critical_path(replays: list[list[tuple[str, float, float]]]) -> Timeline:
    """Each kernel's share of its replay's span (the module doc), summed per name over ``replays``."""
    shares: dict[str, KernelShare] = {}
    idle = span = between = 0.0
    previous_end: float | None = None
    for kernels in replays:
        if not kernels:
            continue
        if previous_end is not None:
            between += max(0.0, kernels[0][1] - previous_end)
        marginals, replay_idle, replay_span = replay_marginals(kernels)
        for (name, start, end, *_), marginal in zip(kernels, marginals):
            share = shares.setdefault(name, KernelShare(name, 0.0, 0.0, 0))
            share.own_us += end - start
            share.launches += 1
            share.marginal_us += marginal
        idle += replay_idle
        span += replay_span
        previous_end = kernels[0][1] + replay_span
    return Timeline(sorted(shares.values(), key=lambda s: -s.marginal_us), idle, span, between)


def timeline_lines(intervals: Sequence[tuple], replays: int, name_width: int = 150) -> list[str]:
    """The table written under each per-kernel profile (runtime/bench.py ``profile_replays``)."""
    try:
        t = critical_path(split_replays(intervals, replays))
    except ValueError as err:
        return [f"(no timeline table: {err})"]
    busy = sum(s.marginal_us for s in t.shares)
    lines = [f"timeline per replay: span {t.span_us / replays:.1f} us = {busy / replays:.1f} us extended by kernels "
             f"+ {t.idle_us / replays:.1f} us idle; {t.between_us / max(replays - 1, 1):.1f} us between replays "
             "(marginal: how far each kernel pushed its replay's end)",
             f"{'marginal':>10} {'own':>10} {'n/replay':>8}  kernel (us per replay)"]
    lines += [f"{s.marginal_us / replays:10.1f} {s.own_us / replays:10.1f} {s.launches / replays:8.1f}  "
              f"{s.name[:name_width]}" for s in t.shares]
    return lines


@dataclass
class Launch:
    name: str
    tag: str             # launch shape, e.g. grid and shared memory (and stream)
    marginal_us: float   # mean over replays
    own_us: float        # mean over replays
    start_us: float      # mean start after the replay's first kernel started


def mean_launches(launches: list[tuple[str, float, float, str]], replays: int) -> list[Launch]:
    """The launches of one replay, with their marginal and own times averaged over ``replays``
    (``(name, start_us, end_us, tag)`` in, any order), in order of their mean start. A launch is
    matched across replays as the k-th of its ``(name, tag)`` in start order, not by its position
    among all launches: kernels on two streams (the round's context injection) interleave
    differently from replay to replay, but each stream's own order is fixed, and the tag names the
    stream where the trace gives it. ``ValueError`` when the count does not split or a replay
    launches other ``(name, tag)`` pairs than the first, rather than rows that mix two kernels."""
    split = split_replays(launches, replays)
    sums: dict[tuple[str, str, int], list[float]] = {}
    for kernels in split:
        marginals = replay_marginals(kernels)[0]
        seen: dict[tuple[str, str], int] = {}
        keys = []
        for (name, start, end, tag), marginal in zip(kernels, marginals):
            k = seen[name, tag] = seen.get((name, tag), -1) + 1
            keys.append((name, tag, k))
            acc = sums.setdefault((name, tag, k), [0.0, 0.0, 0.0, 0])
            acc[0] += marginal
            acc[1] += end - start
            acc[2] += start - kernels[0][1]
            acc[3] += 1
        if len(sums) != len(keys):
            raise ValueError("the launches differ between replays")
    if any(acc[3] != replays for acc in sums.values()):
        raise ValueError("the launches differ between replays")
    means = [Launch(name, tag, m / replays, own / replays, at / replays)
             for (name, tag, _), (m, own, at, _) in sums.items()]
    return sorted(means, key=lambda launch: launch.start_us)


def launch_lines(launches: list[tuple[str, float, float, str]], replays: int, name_width: int = 90) -> list[str]:
    """Two tables from :func:`mean_launches`: per launch shape (kernel and tag, largest total
    marginal first: which product shapes are worth speeding up), then every launch of a replay in
    order of its mean start (which product of which layer costs what inside the chain, and when it
    starts)."""
    try:
        means = mean_launches(launches, replays)
    except ValueError as err:
        return [f"(no per-launch table: {err})"]
    groups: dict[tuple[str, str], list[Launch]] = {}
    for launch in means:
        groups.setdefault((launch.name, launch.tag), []).append(launch)
    lines = ["per launch shape (us per replay; mean: per launch)",
             f"{'marginal':>9} {'n':>4} {'mean':>7} {'own mean':>8}  {'launch':<38} kernel"]
    for (name, tag), group in sorted(groups.items(), key=lambda kv: -sum(g.marginal_us for g in kv[1])):
        total, n = sum(g.marginal_us for g in group), len(group)
        own = sum(g.own_us for g in group) / n
        lines.append(f"{total:9.2f} {n:4d} {total / n:7.2f} {own:8.2f}  {tag:<38} {name[:name_width]}")
    lines += ["", "per launch, in order of mean start (us, mean over replays; at: start after the replay's first kernel)",
              f"{'#':>4} {'at':>8} {'marginal':>9} {'own':>8}  {'launch':<38} kernel"]
    lines += [f"{i:4d} {m.start_us:8.1f} {m.marginal_us:9.2f} {m.own_us:8.2f}  {m.tag:<38} {m.name[:name_width]}"
              for i, m in enumerate(means)]
    return lines


def trace_kernel_launches(trace: dict) -> list[tuple[str, float, float, str]]:
    """``(name, start_us, end_us, tag)`` of the kernels in a ``torch.profiler`` Chrome trace
    (``export_chrome_trace``), the tag naming the grid, the dynamic + static shared memory and the
    stream when the trace gives them. Kernels only: device copies and memsets, which the per-kernel table of
    ``profile_replays`` counts, are left out (the steps' graphs launch none). Events without a duration are skipped."""
    launches = []
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel" or "dur" not in event:
            continue
        args = event.get("args") or {}
        grid, smem, stream = args.get("grid"), args.get("shared memory"), args.get("stream")
        tag = " ".join(([f"grid {'x'.join(str(g) for g in grid)}"] if grid else [])
                       + ([f"smem {smem / 1024:.0f}K"] if isinstance(smem, (int, float)) else [])
                       + ([f"stream {stream}"] if isinstance(stream, int) else []))
        start = float(event["ts"])
        launches.append((event["name"], start, start + float(event["dur"]), tag))
    return launches
