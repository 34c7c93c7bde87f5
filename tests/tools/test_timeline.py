"""runtime/timeline.py: each kernel's share of a replay's timeline when kernels overlap (PDL)."""

from __future__ import annotations

import pytest

from lfmspark.tools.timeline import (critical_path, launch_lines, split_replays, timeline_lines,
                                       trace_kernel_launches)

# one replay: gemv runs 0-10; attn starts early at 4 (PDL) and ends at 13: it adds 3; norm starts at
# 5 and ends at 12, inside the frontier: adds 0; gemv again after 2 us of idle, 15-25: adds 10
REPLAY = [("gemv", 0, 10), ("attn", 4, 13), ("norm", 5, 12), ("gemv", 15, 25)]


def test_shares_of_overlapping_waiting_and_idle_kernels() -> None:
    t = critical_path([REPLAY])
    by_name = {s.name: s for s in t.shares}
    assert [s.name for s in t.shares] == ["gemv", "attn", "norm"]
    assert (by_name["gemv"].marginal_us, by_name["gemv"].own_us, by_name["gemv"].launches) == (20, 20, 2)
    assert (by_name["attn"].marginal_us, by_name["attn"].own_us) == (3, 9)
    assert (by_name["norm"].marginal_us, by_name["norm"].own_us) == (0, 7)
    assert (t.idle_us, t.span_us, t.between_us) == (2, 25, 0)


def test_replays_split_by_count_and_gaps_between_them_are_apart() -> None:
    second = [(n, s + 40, e + 40) for n, s, e in REPLAY]        # starts 15 us after the first ends
    replays = split_replays(second[::-1] + REPLAY, 2)           # any order in, start order out
    assert replays == [REPLAY, second]
    t = critical_path(replays)
    assert (t.idle_us, t.span_us, t.between_us) == (4, 50, 15)
    assert {s.name: s.marginal_us for s in t.shares} == {"gemv": 40, "attn": 6, "norm": 0}
    lines = timeline_lines(second + REPLAY, replays=2)
    assert lines[0].startswith("timeline per replay: span 25.0 us = 23.0 us extended by kernels + 2.0 us idle; "
                               "15.0 us between replays")
    assert lines[2].split() == ["20.0", "20.0", "2.0", "gemv"]


def test_counts_that_do_not_split_give_no_table() -> None:
    with pytest.raises(ValueError, match="4 kernels do not split into 3 replays"):
        split_replays(REPLAY, 3)
    assert timeline_lines(REPLAY, 3) == ["(no timeline table: 4 kernels do not split into 3 replays of equal count)"]


def test_empty_and_zero_length() -> None:
    assert critical_path([]).shares == [] and critical_path([[]]).span_us == 0
    t = critical_path([[("k", 1.0, 1.0)]])
    assert [(s.launches, s.own_us, s.marginal_us) for s in t.shares] == [(1, 0.0, 0.0)] and t.idle_us == 0


def test_launch_lines_list_each_position_of_the_replay() -> None:
    """Position by position, averaged over replays: the second replay's attn ends 2 us later (adds 5)."""
    first = [(n, s, e, f"grid {i}") for i, (n, s, e) in enumerate(REPLAY)]
    second = [(n, s + 40, e + 40 + (2 if n == "attn" else 0), t) for n, s, e, t in first]
    lines = launch_lines(second + first, replays=2)
    at = next(i for i, line in enumerate(lines) if line.startswith("per launch, in order of mean start"))
    rows = [line.split() for line in lines[at + 2:]]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"] and [r[-1] for r in rows] == ["gemv", "attn", "norm", "gemv"]
    assert [(float(r[2]), float(r[3])) for r in rows] == [(10.0, 10.0), (4.0, 10.0), (0.0, 7.0), (10.0, 10.0)]
    assert [r[4:6] for r in rows] == [["grid", "0"], ["grid", "1"], ["grid", "2"], ["grid", "3"]]
    assert launch_lines(first, replays=3)[0].startswith("(no per-launch table: 4 kernels do not split")
    swapped = [second[0], (second[1][0], 43.0, 44.0, "grid 1"), (second[2][0], 46.0, 47.0, "grid 2"), second[3]]
    swapped[1], swapped[2] = ("norm", *swapped[1][1:]), ("attn", *swapped[2][1:])   # order differs
    assert launch_lines(swapped + first, replays=2) == ["(no per-launch table: the launches differ between replays)"]


def test_launches_on_two_streams_match_by_stream_order_not_position() -> None:
    """The side stream's cat starts before the main stream's head in one replay and after it in the
    other: matched as the first cat and the first head of each replay, averaged, listed by mean start."""
    one = [("proj", 0.0, 10.0, "s7"), ("cat", 10.0, 13.0, "s9"), ("head", 11.0, 30.0, "s7")]
    two = [("proj", 100.0, 110.0, "s7"), ("head", 110.0, 129.0, "s7"), ("cat", 112.0, 117.0, "s9")]
    lines = launch_lines(two + one, replays=2)
    at = next(i for i, line in enumerate(lines) if line.startswith("per launch, in order of mean start"))
    rows = [line.split() for line in lines[at + 2:]]
    assert [r[-1] for r in rows] == ["proj", "head", "cat"]   # mean starts 0, 10.5, 11
    # marginals: cat 3 then 0 (head covers it), head 17 then 19; own: cat 3 and 5, head 19 and 19
    assert [(float(r[1]), float(r[2]), float(r[3])) for r in rows] == [(0.0, 10.0, 10.0), (10.5, 18.0, 19.0),
                                                                        (11.0, 1.5, 4.0)]


def test_trace_kernel_launches_read_kernels_with_grid_and_shared_memory() -> None:
    trace = {"traceEvents": [
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 3},
        {"cat": "kernel", "name": "_skinny_linear_kernel", "ts": 10.5, "dur": 4.25,
         "args": {"grid": [32, 4, 1], "shared memory": 122880, "stream": 7}},
        {"cat": "kernel", "name": "triton_red_fused", "ts": 12, "dur": 1, "args": {"grid": [10, 1, 1]}},
    ]}
    assert trace_kernel_launches(trace) == [("_skinny_linear_kernel", 10.5, 14.75, "grid 32x4x1 smem 120K stream 7"),
                                            ("triton_red_fused", 12.0, 13.0, "grid 10x1x1")]
    assert trace_kernel_launches({}) == []
    odd = {"traceEvents": [{"cat": "kernel", "name": "k", "ts": 1, "dur": 2, "args": None},
                           {"cat": "kernel", "name": "no_dur", "ts": 1},
                           {"cat": "kernel", "name": "smem_only", "ts": 5, "dur": 1, "args": {"shared memory": 2048}}]}
    assert trace_kernel_launches(odd) == [("k", 1.0, 3.0, ""), ("smem_only", 5.0, 6.0, "smem 2K")]


def test_launch_shapes_sum_the_launches_of_each_kernel_and_tag() -> None:
    """Per (kernel, tag), largest total first: the two gemv launches share a tag here, so they sum."""
    replay = [("gemv", 0, 10, "grid 4"), ("attn", 4, 13, "grid 1"), ("norm", 5, 12, "grid 2"),
              ("gemv", 15, 25, "grid 4")]
    lines = launch_lines(replay, replays=1)
    assert lines[0].startswith("per launch shape")
    rows = [line.split() for line in lines[2:lines.index("")]]
    assert [(r[-1], float(r[0]), int(r[1]), float(r[2]), float(r[3])) for r in rows] == [
        ("gemv", 20.0, 2, 10.0, 10.0), ("attn", 3.0, 1, 3.0, 9.0), ("norm", 0.0, 1, 0.0, 7.0)]
