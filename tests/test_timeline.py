"""runtime/timeline.py: each kernel's share of a replay's timeline when kernels overlap (PDL)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from lfmspark.runtime.timeline import critical_shares, cuda_kernel_intervals, timeline_lines


def test_shares_of_overlapping_waiting_and_idle_kernels() -> None:
    # gemv runs 0-10; attn starts early at 4 (PDL) and ends at 13: it adds 3; norm starts at 5
    # and ends at 12, inside the frontier: adds 0; gemv again after 2 us of idle, 15-25: adds 10
    shares, idle = critical_shares([("gemv", 0, 10), ("attn", 4, 13), ("norm", 5, 12), ("gemv", 15, 25)])
    by_name = {s.name: s for s in shares}
    assert [s.name for s in shares] == ["gemv", "attn", "norm"]
    assert by_name["gemv"].marginal_us == 20 and by_name["gemv"].own_us == 20 and by_name["gemv"].launches == 2
    assert by_name["attn"].marginal_us == 3 and by_name["attn"].own_us == 9
    assert by_name["norm"].marginal_us == 0 and by_name["norm"].own_us == 7
    assert idle == 2
    assert sum(s.marginal_us for s in shares) + idle == 25      # the span, 0 .. 25


def test_gaps_between_replays_are_not_the_steps() -> None:
    # two replays of [a 0-10, b 10-12], the second 500 us later (host time between replays)
    one = [("a", 0, 10), ("b", 10, 12)]
    two = [(n, s + 500, e + 500) for n, s, e in one]
    shares, idle = critical_shares(one + two, gap_limit_us=50)
    assert idle == 0 and {s.name: s.marginal_us for s in shares} == {"a": 20, "b": 4}
    lines = timeline_lines(one + two, replays=2)
    assert lines[0].startswith("timeline per replay: 12.0 us = 12.0 us extended by kernels + 0.0 us idle")
    assert lines[2].split() == ["10.0", "10.0", "1.0", "a"]


def test_intervals_keep_device_events_only() -> None:
    def event(name: str, device: DeviceType, start: float, end: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [event("aten::mm", DeviceType.CPU, 0, 5), event("_gemv_kernel", DeviceType.CUDA, 3, 9)]
    assert cuda_kernel_intervals(events) == [("_gemv_kernel", 3, 9)]


@pytest.mark.parametrize("intervals", [[], [("k", 1.0, 1.0)]])
def test_empty_and_zero_length(intervals: list) -> None:
    shares, idle = critical_shares(intervals)
    assert idle == 0 and all(s.marginal_us == 0 for s in shares)
