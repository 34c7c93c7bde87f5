"""The scheduler on its own (runtime/scheduler.py): host bookkeeping driven with requests and no model.

Each test plays the engine's part by hand: admit, plan a prefill, book it as run, start the
requests whose prompt completed, release them; the expected plans are worked out from the rules
in the module doc, not computed by the scheduler.
"""

from __future__ import annotations

import time

import pytest

from lfmspark.runtime.pages import PagePool, SlotPages
from lfmspark.runtime.requests import Request, RequestError
from lfmspark.runtime.sampling import SamplingParams
from lfmspark.runtime.scheduler import Scheduler


def request(rid: str, prompt_len: int, group: str | None = None, sample: int = 0, timeout_s: float | None = None
            ) -> Request:
    params = SamplingParams(max_new_tokens=4, timeout_s=timeout_s)
    return Request(rid, 0, list(range(1, prompt_len + 1)), params, frozenset(), 0, time.perf_counter(),
                   group=group, sample=sample)


def scheduler(max_batch: int = 4, chunk: int = 2048, budget: int = 256, alignment: int = 256, n_pages: int = 4096,
              page_size: int = 16, window: int = 4) -> Scheduler:
    pages = SlotPages(PagePool(n_pages), max_batch, 1024, page_size, trash=n_pages)
    return Scheduler(max_batch, chunk, budget, alignment, pages, window)


def admit_all(s: Scheduler) -> list[list[Request]]:
    groups = s.admit(round_in_flight=False)
    for group in groups:
        s.begin_prefill(group[0], group[1:])
    return groups


def run_prefill(s: Scheduler) -> list[Request]:
    """Book every planned forward as run until the plan stops (one forward when budgeted); start the
    completed requests and their samples. Returns the requests started."""
    started = []
    while (plan := s.next_prefill()) is not None:
        for lead in s.prefilled(plan):
            for req in (lead, *s.followers(lead)):
                s.start_running(req)
                started.append(req)
        if plan.budgeted:
            break
    return started


def test_admission_is_first_come_first_served_and_slots_are_returned():
    s = scheduler(max_batch=2)
    reqs = [request(f"r{i}", 3) for i in range(3)]
    s.add(reqs)
    groups = admit_all(s)
    assert [g[0] for g in groups] == reqs[:2] and list(s.waiting) == [reqs[2]]
    assert {r.slot for r in reqs[:2]} == {0, 1} and s.pool.n_free == 0
    assert reqs[0].admitted_at >= reqs[0].submitted and reqs[2].admitted_at == 0.0
    assert run_prefill(s) == reqs[:2] and s.running == reqs[:2]
    s.release(reqs[0])
    assert reqs[0].slot is None and s.pool.n_free == 1 and reqs[0].request_id not in s.live
    assert [g[0] for g in admit_all(s)] == [reqs[2]]


def test_duplicate_ids_are_refused():
    s = scheduler()
    s.add([request("a", 3)])
    with pytest.raises(RequestError, match="already in use"):
        s.add([request("a", 3)])
    with pytest.raises(RequestError, match="already in use"):
        s.add([request("b", 3), request("b", 3)])
    assert list(s.live) == ["a"]


def test_a_group_is_admitted_whole_and_a_later_request_does_not_overtake_it():
    """Head-of-line: a 3-sample group that does not fit waits, and the single request behind it
    waits too (else a stream of small requests could starve the group forever)."""
    s = scheduler(max_batch=3)
    first = request("first", 3)
    s.add([first])
    admit_all(s)
    group = [request(f"g-{j}", 3, group="g", sample=j) for j in range(3)]
    small = request("small", 3)
    s.add(group + [small])
    assert s.admit(round_in_flight=False) == []          # 2 free slots, the group needs 3
    assert list(s.waiting) == group + [small]
    s.release(first)
    (admitted,) = admit_all(s)
    assert admitted == group and s.prefilling == [group[0]] and s.followers(group[0]) == group[1:]
    started = run_prefill(s)
    assert started == group                               # the leader's prefill starts its samples
    assert s.followers(group[0]) == []


def test_unbudgeted_prefill_runs_every_prompt_to_its_end_in_aligned_chunks():
    """Nothing decodes: every prompt to its end, chunks of at most ``prefill_chunk`` ending at
    multiples of the alignment."""
    s = scheduler(chunk=100, alignment=64)
    a, b = request("a", 150), request("b", 40)
    s.add([a, b])
    admit_all(s)
    plans = []
    while (plan := s.next_prefill()) is not None:
        plans.append((list(plan.starts), [len(c) for c in plan.chunks], plan.budgeted))
        for lead in s.prefilled(plan):
            s.start_running(lead)
    assert plans[0] == ([0, 0], [64, 40], False)         # a stops at the block boundary, b is whole
    assert plans[1:] == [([64], [64], True), ([128], [22], True)]   # b decodes now: budgeted


def while_one_decodes(*arrivals: Request) -> Scheduler:
    """A scheduler (budget 64) with one request decoding and ``arrivals`` admitted behind it."""
    s = scheduler(max_batch=4, budget=64, alignment=1024)
    s.add([request("decoding", 3)])
    admit_all(s)
    run_prefill(s)
    s.add(list(arrivals))
    admit_all(s)
    return s


def test_a_budgeted_forward_stays_within_the_budget_padding_included():
    """While requests decode, the n-th row of a forward takes at most budget / next_pow2(n) tokens,
    and joins only while the rows taken are no wider than that."""
    long, short = request("long", 100), request("short", 20)
    s = while_one_decodes(long, short)
    plan = s.next_prefill()
    assert plan.budgeted and plan.rows == [long] and [len(c) for c in plan.chunks] == [64]
    s.prefilled(plan)
    plan = s.next_prefill()      # long has 36 left: wider than 64 / 2, so short still waits
    assert plan.rows == [long] and [len(c) for c in plan.chunks] == [36]
    assert s.prefilled(plan) == [long]
    s.start_running(long)
    plan = s.next_prefill()
    assert plan.rows == [short] and [len(c) for c in plan.chunks] == [20]


def test_a_second_row_joins_a_budgeted_forward_when_the_first_is_narrow():
    a, b = request("a", 10), request("b", 50)
    s = while_one_decodes(a, b)
    plan = s.next_prefill()
    assert plan.rows == [a, b] and [len(c) for c in plan.chunks] == [10, 32]    # row 2: 64 / 2


def test_a_cancelled_leader_hands_the_prefill_to_its_first_sample():
    s = scheduler(max_batch=3, chunk=4, alignment=256)
    group = [request(f"g-{j}", 10, group="g", sample=j) for j in range(3)]
    s.add(group)
    admit_all(s)
    s.prefilled(s.next_prefill())                         # 4 of the leader's 10 tokens
    s.release(group[0])
    assert s.prefilling == [group[1]] and group[1].prefilled == 0 and s.followers(group[1]) == [group[2]]
    s.release(group[2])
    assert s.followers(group[1]) == [] and s.pool.n_free == 2


def test_a_failed_prefill_names_its_rows_and_their_samples():
    s = scheduler(max_batch=4)
    group = [request(f"g-{j}", 5, group="g", sample=j) for j in range(2)]
    other = request("other", 5)
    s.add(group + [other])
    admit_all(s)
    plan = s.next_prefill()
    assert plan.rows == [group[0], other]
    assert s.drop_prefill(plan) == [group[0], group[1], other] and s.prefilling == []


def test_expired_and_found_requests():
    s = scheduler()
    old = request("old", 3, timeout_s=0.0)
    group = [request(f"g-{j}", 3, group="g", sample=j) for j in range(2)]
    s.add([old] + group)
    assert s.expired(time.perf_counter()) == [old]
    assert s.find("g") == group and s.find("old") == [old] and s.find("nothing") == []
    assert s.is_live("g") and s.is_live("g-1") and not s.is_live("x")


def test_cache_jobs_start_only_when_nothing_else_runs_and_go_first():
    s = scheduler(max_batch=2, alignment=4)
    done = request("done", 5)
    done.output = [7, 8, 9, 10]                            # prompt + output = 9 tokens: 2 full blocks
    s.queue_cache_job(done, block=4)
    (job,) = s.cache_jobs
    assert job.cache_only and job.prompt_ids == done.prompt_ids + done.output[:3]
    waiting = request("next", 3)
    s.add([waiting])
    assert s.admit_cache_jobs(round_in_flight=True) == []            # a round is out: wait
    assert s.admit(round_in_flight=True) == []                        # and the queue waits with the job
    (started,) = s.admit_cache_jobs(round_in_flight=False)
    assert started is job and job.slot is not None
    job.prefilled = 4                                                # the cached prefix the runner loaded
    s.begin_prefill(job)
    plan = s.next_prefill()
    assert plan.rows == [job] and plan.starts == [4]
    assert s.prefilled(plan) == [] and job.slot is None              # done: released, no first token
    assert [g[0] for g in admit_all(s)] == [waiting]


def test_a_cache_job_whose_tokens_are_all_cached_is_released_at_once():
    s = scheduler(max_batch=1, alignment=4)
    done = request("done", 4)
    done.output = [1, 2, 3, 4]
    s.queue_cache_job(done, block=4)
    (job,) = s.admit_cache_jobs(round_in_flight=False)
    job.prefilled = len(job.prompt_ids)
    s.begin_prefill(job)
    assert s.prefilling == [] and s.pool.n_free == 1


def test_cache_jobs_past_the_slot_count_drop_the_oldest_and_short_outputs_queue_nothing():
    s = scheduler(max_batch=2, alignment=4)
    for i in range(3):
        done = request(f"d{i}", 4)
        done.output = [1, 2, 3, 4]
        s.queue_cache_job(done, block=4)
    assert [j.request_id for j in s.cache_jobs] == ["d1:cache", "d2:cache"]
    short = request("short", 4)
    short.output = [1, 2]                                   # completes no block past the prompt's
    s.queue_cache_job(short, block=4)
    assert len(s.cache_jobs) == 2


def test_an_idle_scheduler_after_everything_finishes():
    s = scheduler(max_batch=2)
    reqs = [request(f"r{i}", 3) for i in range(4)]
    s.add(reqs)
    while s.has_work():
        admit_all(s)
        for req in run_prefill(s):
            s.release(req)
    assert s.pool.n_free == 2 and not s.live and not s.running and not s.waiting


def test_admission_waits_for_pages_and_prefill_takes_them_as_its_chunks_go():
    """Pool of 8 pages of 16 tokens, window 4: a 60-token prompt needs ceil((60 + 8) / 16) = 5 pages
    and the watermark 1, so a second such prompt waits for pages although a slot is free."""
    s = scheduler(max_batch=4, chunk=32, alignment=32, n_pages=8, page_size=16, window=4)
    a, b = request("a", 60), request("b", 60)
    s.add([a, b])
    assert [g[0] for g in admit_all(s)] == [a] and list(s.waiting) == [b]
    plan = s.next_prefill()                  # one chunk of 32 tokens: 2 pages
    assert plan.chunks == [a.prompt_ids[:32]] and len(s.pages.pages[a.slot]) == 2
    s.prefilled(plan)
    run_prefill(s)
    assert s.running == [a] and len(s.pages.pages[a.slot]) == 4      # 60 tokens
    s.release(a)
    assert s.pages.pool.n_free == 8
    assert [g[0] for g in admit_all(s)] == [b]


def test_rounds_are_covered_oldest_first_and_the_newest_decoding_request_is_preempted():
    """Pool of 6 pages of 4 tokens, window 2. Two requests decode with 8 prompt tokens (2 pages each);
    a round with one in flight needs 8 + 2 * 2 = 12 positions, 3 pages each: 6 in all, which fit;
    after 4 output tokens each needs 16 positions, 4 pages: the older one takes them and the newer
    one is preempted, back at the head of the queue with its output to recompute."""
    s = scheduler(max_batch=2, chunk=64, alignment=64, n_pages=6, page_size=4, window=2)
    s.watermark = 0
    old, new = request("old", 8), request("new", 8)
    s.add([old])
    admit_all(s)
    run_prefill(s)
    s.add([new])
    admit_all(s)
    run_prefill(s)
    assert s.running == [old, new]
    assert s.reserve_rounds(round_in_flight=True) == [] and s.pages.pool.n_free == 0
    for req in (old, new):
        req.output += [7, 7, 7, 7]
    assert s.reserve_rounds(round_in_flight=True) == [new]
    assert s.running == [old] and list(s.waiting) == [new] and new.slot is None and new.preemptions == 1
    assert len(s.pages.pages[old.slot]) == 4 and s.preemptions == 1
    assert new.context_ids == new.prompt_ids + [7, 7, 7, 7] and new.prefilled == 0
    s.release(old)
    assert s.pages.pool.n_free == 6
    assert [g[0] for g in admit_all(s)] == [new]
    plan = s.next_prefill()
    assert plan.chunks == [new.prompt_ids + [7, 7, 7, 7]]     # the output is recomputed after the prompt


def test_prompts_that_block_each_other_do_not_deadlock():
    """Nothing decodes; two prompts prefill in 16-token chunks and each holds pages the other needs
    (a pool the cache's pages had seemed to leave room in): the newer one is preempted, the older
    one completes, and the newer one comes back after it."""
    s = scheduler(max_batch=2, chunk=16, alignment=16, n_pages=16, page_size=4, window=2)
    s.watermark = 0
    a, b = request("a", 24), request("b", 24)
    s.add([a, b])
    assert len(admit_all(s)) == 2                  # 7 pages each (24 tokens and two windows)
    s.prefilled(s.next_prefill())                  # both rows, 16 tokens each: 8 of the 16 pages
    s.pages.pool.allocate(7)                       # pages taken elsewhere (cached pages a hit mapped)
    assert s.pages.pool.n_free == 1
    plan = s.next_prefill()                        # a needs 2 more pages: b gives its 4 back
    assert plan.rows == [a] and list(s.waiting) == [b] and b.slot is None and b.preemptions == 1
    s.prefilled(plan)
    assert s.running == [] and a.prefilled == 24


def test_a_newer_request_that_cannot_grow_is_preempted_itself_not_an_older_one():
    """The older request fits its next round, the newer one does not: the newer one is preempted
    (the older one keeps its pages), whichever of them is covered first."""
    s = scheduler(max_batch=2, chunk=64, alignment=64, n_pages=7, page_size=4, window=2)
    s.watermark = 0
    old, new = request("old", 8), request("new", 8)
    for req in (old, new):
        s.add([req])
        admit_all(s)
        run_prefill(s)
    assert s.reserve_rounds(round_in_flight=True) == [] and s.pages.pool.n_free == 1   # 3 pages each
    old.output += [7] * 4        # needs 16 positions: 4 pages, the free one
    new.output += [7] * 4        # needs 4 pages too: none left
    assert s.reserve_rounds(round_in_flight=True) == [new]
    assert s.running == [old] and len(s.pages.pages[old.slot]) == 4 and new.slot is None
