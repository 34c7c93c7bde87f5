"""The scheduler: which request holds which slot, and what the next prefill forward runs.

Host-only bookkeeping, no tensors (the device work is the model runner's): the waiting queue, the
slot pool, admission, the prefill plan under the step's token budget, the finished turns queued for
the prefix cache, and release at finish or cancellation. Every request is in exactly one of
``waiting`` (no slot yet), ``prefilling`` (a slot, its prompt partly prefilled; the other samples of
an ``n > 1`` prompt wait as its followers, holding slots of their own, and start from its prefill)
and ``running`` (decoding) until :meth:`Scheduler.release`.

**Admission** is first come, first served: the head of the queue takes a free slot, the samples of
one prompt together (they share its prefill) or not at all, so a later small request never
overtakes an earlier large group. At a step where nothing decodes, prefills or is in flight, the
finished turns queued for the prefix cache (``Engine(prefix_cache_outputs=True)``) start first in
free slots, and the queue waits a step, so that its prompts can match those blocks.

**Pages** (runtime/pages.py). A slot's KV pages follow the request: its prefill takes pages as its
chunks go (:meth:`Scheduler.next_prefill`), each round's rows are covered before it launches
(:meth:`Scheduler.reserve_rounds`: the committed tokens, the round in flight and this round's
window), and :meth:`Scheduler.release` gives them all back. Admission waits until the pool can
hold the group's context and its first rounds, above a watermark of free pages kept for the
running requests to grow. When the pool runs dry anyway (the cache gives back what it can first),
the most recently admitted decoding request is **preempted** (vLLM's recompute policy): its pages
and slot are freed and it goes back to the head of the queue with its output so far, which its
next prefill recomputes after its prompt (``Request.context_ids``); its stream goes on where it
stopped, no token lost or repeated. With nothing decoding, a prompt that cannot get its pages
because later prompts hold them preempts those (:meth:`Scheduler._unblock`), so prefills never
wait on each other.

**The prefill plan** (:meth:`Scheduler.next_prefill`): while requests decode, one forward of at most
``prefill_budget`` tokens a step, padding included, so an arrival delays the decoding streams by one
such chunk per round however long its prompt; with nothing decoding, every prompt to its end, the
chunks back to back (the shortest time to first token). A chunk never crosses a multiple of
``prefix_block`` (the chunk alignment), cache on or off (runtime/prefix_cache.py "Chunks").
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from .pages import OutOfPagesError, SlotPages
from .requests import PrefillPlan, Request, RequestError
from .sampling import SamplingParams

# a cache job's prefill reads no sampling setting
_CACHE_JOB_PARAMS = SamplingParams()


class SlotsFullError(RuntimeError):
    pass


class SlotPool:
    """The free list of state slots. Slots are taken at admission and returned at finish, cancel
    or error; ``in_use`` lets tests assert that none leaked."""

    def __init__(self, n_slots: int):
        self._free = list(range(n_slots - 1, -1, -1))
        self.n_slots = n_slots

    def acquire(self) -> int:
        if not self._free:
            raise SlotsFullError("all slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.n_slots:
            raise RuntimeError(f"slot {slot} released twice or out of range")
        self._free.append(slot)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.n_slots - len(self._free)


class Scheduler:
    """Admission, slots and the prefill plan (module doc)."""

    def __init__(self, max_batch: int, prefill_chunk: int, prefill_budget: int, alignment: int, pages: SlotPages,
                 window: int):
        """``pages``: the slots' KV pages; ``window``: the most positions a round writes past a
        request's committed tokens (the verify window)."""
        self.pool = SlotPool(max_batch)
        self.pages, self.window = pages, window
        self.watermark = max(1, pages.pool.n_pages // 100)   # free pages admission leaves for growth
        self.preemptions = 0
        self.prefill_chunk, self.prefill_budget, self.alignment = prefill_chunk, prefill_budget, alignment
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []      # holding slots, prompt partly prefilled (arrival order)
        self.running: list[Request] = []         # decoding
        self.live: dict[str, Request] = {}       # every unfinished request by id
        self.cache_jobs: deque[Request] = deque()   # finished turns to prefill into the prefix cache
        self._followers: dict[int, list[Request]] = {}   # id(prefilling leader) -> the other samples of its prompt

    # -- submission ----------------------------------------------------------------------------
    def add(self, requests: list[Request]) -> None:
        """Queue requests (their ids unique among the live ones)."""
        ids = [r.request_id for r in requests]
        clash = sorted({i for i in ids if i in self.live or ids.count(i) > 1})
        if clash:
            raise RequestError(f"request ids {clash} are already in use: ids must be unique among live requests")
        for req in requests:
            self.live[req.request_id] = req
            self.waiting.append(req)

    def is_live(self, request_id: str) -> bool:
        """Whether a live request has this id, or a live ``n > 1`` group."""
        return request_id in self.live or any(r.group == request_id for r in self.live.values())

    def find(self, request_id: str) -> list[Request]:
        """The live request of this id, or the live samples of the group of this id."""
        req = self.live.get(request_id)
        return [req] if req is not None else [r for r in self.live.values() if r.group == request_id]

    def expired(self, now: float) -> list[Request]:
        """The live requests past their deadline."""
        return [r for r in self.live.values() if r.expired(now)]

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.cache_jobs)

    # -- admission -----------------------------------------------------------------------------
    def admit_cache_jobs(self, round_in_flight: bool) -> list[Request]:
        """Give the queued cache jobs free slots, at a step where no request decodes, prefills or
        rides a round in flight; the jobs that got one (their prefill starts with
        :meth:`begin_prefill` once their cached prefix is loaded)."""
        if self.running or self.prefilling or round_in_flight:
            return []
        jobs, promised = [], self._promised() + self.watermark
        while self.cache_jobs and self.pool.n_free:
            need = self._need([self.cache_jobs[0]])
            if not self._room(promised + need):
                break
            promised += need
            job = self.cache_jobs.popleft()
            job.slot = self.pool.acquire()
            jobs.append(job)
        return jobs

    def admit(self, round_in_flight: bool) -> list[list[Request]]:
        """Give queued requests free slots, first come first served, the samples of one prompt
        together; returns the groups admitted, the prompt's leader first (its prefill starts with
        :meth:`begin_prefill`). Waits while cache jobs wait for the last round to be collected, so
        that they still go first."""
        if self.cache_jobs and not self.running and not self.prefilling and round_in_flight:
            return []
        groups, now = [], time.perf_counter()
        promised = self._promised() + self.watermark
        while self.waiting and self.pool.n_free:
            head = self.waiting[0]
            members = [head] if head.group is None else [r for r in self.waiting if r.group == head.group]
            need = self._need(members)
            if len(members) > self.pool.n_free or not self._room(promised + need):
                break                        # wait for enough slots and pages
            promised += need
            for req in members:
                self.waiting.remove(req)
                req.slot = self.pool.acquire()
                req.admitted_at = now
            groups.append(members)
        return groups

    def _need(self, members: list[Request]) -> int:
        """The pages a prompt's samples take until they decode: the context and two rounds' windows
        of the first (less what its slot holds), two windows and a partly shared last page for each other."""
        lead = members[0]
        length = len(lead.context_ids) + 2 * self.window
        mine = self.pages.pages_needed(lead.slot, length) if lead.slot is not None else \
            -(-length // self.pages.page_size)
        return mine + (len(members) - 1) * (-(-2 * self.window // self.pages.page_size) + 1)

    def _room(self, pages: int) -> bool:
        """Whether the pool has ``pages`` free, or could with what the prefix cache gives back."""
        pool = self.pages.pool
        return pages <= pool.n_free or pages <= pool.available()

    def _promised(self) -> int:
        """Pages the requests already admitted still need before they decode."""
        return sum(self._need([lead, *self._followers.get(id(lead), ())]) for lead in self.prefilling)

    def begin_prefill(self, leader: Request, followers: Iterable[Request] = ()) -> None:
        """Start prefilling ``leader`` from ``leader.prefilled`` (after any cached prefix); a cache job
        whose tokens are all cached already has nothing to run and is released."""
        if leader.prefilled >= len(leader.context_ids) and leader.cache_only:
            self.release_job(leader)
            return
        self.prefilling.append(leader)
        followers = list(followers)
        if followers:
            self._followers[id(leader)] = followers

    # -- prefill -------------------------------------------------------------------------------
    def next_prefill(self) -> PrefillPlan | None:
        """The next prefill forward, or None. Unbudgeted (nothing decoding): every prefilling
        request, each up to ``prefill_chunk``. With a budget the forward's padded size stays within
        it: a forward runs ``rows x width`` tokens (shorter rows are padded, and the prefill buckets
        round the rows up to a power of two), so the ``n``-th row may take at most
        ``budget / next_pow2(n)`` tokens, and is not added once the rows taken are already wider than
        that. The first arrival takes the whole budget; a second joins only when the first's prompt
        is nearly in."""
        budget = self.prefill_budget if self.running else None
        rows, chunks, width = [], [], 0
        for req in list(self.prefilling):
            if req not in self.prefilling:
                continue                     # preempted to make room for an earlier row
            context = req.context_ids
            take = self.chunk_len(req.prefilled, len(context))
            if budget is not None:
                cap = budget // (1 << len(rows).bit_length())     # rows 1, 2, 3-4, 5-8, ...: budget / that
                if width > cap or cap == 0:
                    break
                take = min(take, cap)
            if not self._cover(req, req.prefilled + take) and not (
                    not rows and not self.running and self._unblock(req, req.prefilled + take)):
                break                        # the pool is dry: the rest waits for pages
            rows.append(req)
            chunks.append(context[req.prefilled:req.prefilled + take])
            width = max(width, take)
        if not rows:
            return None
        return PrefillPlan(rows, chunks, [r.prefilled for r in rows], budgeted=budget is not None)

    def chunk_len(self, done: int, total: int) -> int:
        """The tokens the next prefill chunk of ``total`` takes after ``done``: at most ``prefill_chunk``,
        ending no later than the next multiple of ``prefix_block``, cache on or off, so that a
        prefix-cache hit on that grid resumes where a miss cuts a chunk too, and one off it runs to
        the miss's next cut (runtime/prefix_cache.py "Chunks")."""
        block = self.alignment
        return min(total - done, self.prefill_chunk, (done // block + 1) * block - done)

    def prefilled(self, plan: PrefillPlan) -> list[Request]:
        """Book a prefill forward that ran: each row's prompt advanced; a cache job whose tokens are
        all in is released; returns the requests whose prompt is now complete (they leave the prefill:
        :meth:`start_running` them once their first token is picked)."""
        for req, end in zip(plan.rows, plan.ends):
            req.prefilled = end
        done = [r for r in plan.rows if r.prefilled == len(r.context_ids)]
        for job in [r for r in done if r.cache_only]:
            self.release_job(job)
        done = [r for r in done if not r.cache_only]
        self.prefilling = [r for r in self.prefilling if r not in done]
        return done

    def followers(self, leader: Request) -> list[Request]:
        """The other samples of ``leader``'s prompt, waiting for its prefill."""
        return list(self._followers.get(id(leader), ()))

    def drop_prefill(self, plan: PrefillPlan) -> list[Request]:
        """A prefill forward failed: its rows leave the prefill; returns them and their samples (the
        requests the failure concerns)."""
        concerned = [r for lead in plan.rows for r in (lead, *self._followers.pop(id(lead), []))]
        self.prefilling = [r for r in self.prefilling if r not in plan.rows]
        return concerned

    def start_running(self, req: Request) -> None:
        """``req`` has its first token: it decodes from the next round on."""
        self._followers.pop(id(req), None)
        self.running.append(req)

    # -- pages ---------------------------------------------------------------------------------
    def reserve_rounds(self, round_in_flight: bool) -> list[Request]:
        """Cover every decoding request's next round with pages: its committed tokens (prompt and
        output), the round in flight (``round_in_flight``: up to a window more) and this round's
        window, oldest request first, preempting the newest where the pool runs dry. Returns the
        requests preempted (back at the head of the queue)."""
        preempted: list[Request] = []
        ahead = self.window * (2 if round_in_flight else 1)
        for req in list(self.running):
            if req in self.running and not self._cover(req, len(req.prompt_ids) + len(req.output) + ahead,
                                                        preempted=preempted):
                self.preempt(req)
                preempted.append(req)
        return preempted

    def _cover(self, req: Request, length: int, preempted: list[Request] | None = None) -> bool:
        """Give ``req``'s slot pages up to ``length`` positions; with ``preempted`` (a list the
        preempted requests are added to), preempting decoding requests admitted after ``req``,
        newest first, while the pool cannot. False when that is not enough."""
        while True:
            try:
                self.pages.ensure(req.slot, length)
                return True
            except OutOfPagesError:
                newer = [r for r in self.running if r.admitted_at > req.admitted_at]
                if preempted is None or not newer:
                    return False
                victim = max(newer, key=lambda r: r.admitted_at)
                self.preempt(victim)
                preempted.append(victim)

    def _unblock(self, req: Request, length: int) -> bool:
        """Nothing decodes and ``req``, the first prompt in line, cannot get its pages: requests admitted
        after it hold them. Preempt those (newest first; not a prompt whose samples wait on it) until
        ``req`` is covered; False if that is not enough."""
        while True:
            victims = [r for r in self.prefilling if r is not req and id(r) not in self._followers]
            if not victims:
                return False
            victim = max(victims, key=lambda r: r.admitted_at)
            self.prefilling.remove(victim)
            if victim.cache_only:
                self.release_job(victim)           # only the cache misses out
            else:
                self._give_back(victim)
            try:
                self.pages.ensure(req.slot, length)
                return True
            except OutOfPagesError:
                continue

    def preempt(self, req: Request) -> None:
        """Take a decoding request's pages and slot back; it waits at the head of the queue and resumes
        by prefilling its prompt and output so far (module doc)."""
        self.running.remove(req)
        self._give_back(req)

    def _give_back(self, req: Request) -> None:
        """Free a request's pages and slot and queue it first again (a preemption)."""
        self.pages.release(req.slot)
        self.pool.release(req.slot)
        req.slot, req.prefilled, req.cached_tokens = None, 0, 0
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    # -- finishing -----------------------------------------------------------------------------
    def release(self, req: Request) -> None:
        """``req`` finished: its slot is free and it leaves every queue; a prefilling leader's first
        waiting sample takes its place, prefilling its own slot from the start."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req.slot is not None:
            self.pages.release(req.slot)
            self.pool.release(req.slot)
            req.slot = None
        if req in self.running:
            self.running.remove(req)
        self._leave_prefill(req)
        self.live.pop(req.request_id, None)

    def release_job(self, job: Request) -> None:
        """A cache job is done (or failed): its slot is free."""
        if job in self.prefilling:
            self.prefilling.remove(job)
        if job.slot is not None:
            self.pages.release(job.slot)
            self.pool.release(job.slot)
            job.slot = None

    def queue_cache_job(self, req: Request, block: int) -> None:
        """Queue the prefill of a finished request's prompt and output, up to its last full ``block`` (a
        prefix-cache block: one KV page), into the prefix cache. It runs as a prompt's prefill does, in the chunks any prefill of these tokens
        runs (:meth:`chunk_len`), after the longest cached prefix, so the stored state is what a later
        prompt's prefill would compute. Past ``max_batch`` queued jobs the oldest is dropped."""
        tokens = req.prompt_ids + req.output
        n = len(tokens) // block * block
        if n <= len(req.prompt_ids) // block * block:
            return                                  # the output completes no block beyond the prompt's
        if len(self.cache_jobs) >= self.pool.n_slots:
            self.cache_jobs.popleft()
        self.cache_jobs.append(Request(f"{req.request_id}:cache", 0, tokens[:n], _CACHE_JOB_PARAMS, frozenset(), 0,
                                       time.perf_counter(), cache_only=True))

    def _leave_prefill(self, req: Request) -> None:
        for followers in self._followers.values():
            if req in followers:
                followers.remove(req)
        if req not in self.prefilling:
            return
        i = self.prefilling.index(req)
        others = self._followers.pop(id(req), [])
        if others:
            self.prefilling[i] = others[0]
            if others[1:]:
                self._followers[id(others[0])] = others[1:]
        else:
            del self.prefilling[i]
