"""Paged KV end to end (models/cache.py, runtime/pages.py, runtime/scheduler.py): the page layout
changes no output, a pool too small for the load preempts and resumes requests without changing
their tokens or their streams, pages come back whatever happens, and prefixes are shared by
reference."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from lfmspark.runtime import Engine, SamplingParams
from lfmspark.runtime.model_runner import DEFAULT_CACHED_SHARE
from engine_fixtures import assert_no_page_leaked, cached_pages
from spec_fixtures import random_tiny_draft, random_tiny_target

GAMMA = 4


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def models(request):
    return random_tiny_target(moe=request.param, seed=3), random_tiny_draft(block=GAMMA, seed=4)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(60) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def greedy_and_seeded(n: int, max_new: int = 24) -> list[SamplingParams]:
    """Greedy and seeded sampling alternate; each token's logprob comes back, so equal outputs mean
    equal logits, not only equal picks."""
    return [SamplingParams(max_new_tokens=max_new, ignore_eos=True, logprobs=0) if i % 2 == 0 else
            SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=0.8, top_k=20, seed=50 + i,
                           logprobs=0) for i in range(n)]


def pool_pages(engine: Engine, pages: int) -> int:
    """``kv_cache_memory`` that buys ``pages`` pages (at the prefix cache's default budget each page
    is budgeted with a share of a conv snapshot) for an engine configured as ``engine``."""
    runner = engine.model_runner
    share = runner.snapshot_nbytes() // DEFAULT_CACHED_SHARE
    snapshot = share if runner.options.prefix_cache_tokens is None else 0
    return pages * (runner.page_nbytes(runner.pages.page_size) + snapshot)


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
def test_the_page_layout_changes_no_output(models, speculative):
    """Four-token pages (every window crosses page boundaries, rollbacks cross them back, rows'
    pages interleave in the pool) against one page per slot (the dense layout): the same tokens and
    log-probabilities, bit for bit on the CPU."""
    target, draft = models
    draft = draft if speculative else None
    ps, params = prompts(6), greedy_and_seeded(6)
    # 128 positions a slot either way (the prefill's bucket shapes follow the table's span), and
    # pages for twice the slots (admission never waits for pages: both batch the same rows); no
    # prefix cache (its snapshots are budgeted per page, whatever the page's size)
    length = 128 - (GAMMA + 1 if speculative else 1)
    kw = dict(max_seq_len=length, prefix_cache_tokens=0)
    probe = Engine(target, draft, max_batch=1, page_size=4, **kw)
    memory = pool_pages(probe, 2 * 4 * 128 // 4)
    paged = Engine(target, draft, max_batch=4, page_size=4, kv_cache_memory=memory, **kw)
    dense = Engine(target, draft, max_batch=4, page_size=128, kv_cache_memory=memory, **kw)
    assert dense.kv_pages.n_pages == 8
    paged, dense = paged.generate(ps, params), dense.generate(ps, params)
    for a, b in zip(paged, dense):
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]


def run_streams(engine: Engine, ps: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Each request's tokens as its stream delivered them; checks each stream ends with its output."""
    streamed: dict[int, list[int]] = {i: [] for i in range(len(ps))}
    for event in engine.stream(ps, params):
        streamed[event.index] += event.token_ids
        if event.finished:
            assert streamed[event.index] == event.output.token_ids      # no token lost or repeated
    return [streamed[i] for i in range(len(ps))]


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
def test_a_pool_too_small_preempts_and_every_request_equals_its_solo_run(models, speculative):
    """A pool of 24 four-token pages for six requests that grow to ~60 tokens each: requests are
    preempted and resume by recomputing their tokens; each one's tokens equal its run alone, its
    stream has each token once, and every page is back in the pool at the end."""
    target, draft = models
    draft = draft if speculative else None
    ps = prompts(6, seed=1)
    # greedy; target-only also seeded sampling (its draws are keyed by position, so a resumed
    # request draws what it would have; a speculative round's draws also depend on its drafts)
    params = [SamplingParams(max_new_tokens=36, ignore_eos=True) if speculative or i % 2 == 0 else
              SamplingParams(max_new_tokens=36, ignore_eos=True, temperature=0.8, top_k=20, seed=7 + i)
              for i in range(len(ps))]
    probe = Engine(target, draft, max_batch=1, max_seq_len=72, page_size=4, prefix_cache_tokens=0)
    small = Engine(target, draft, max_batch=6, max_seq_len=72, page_size=4, prefix_cache_tokens=0,
                   kv_cache_memory=pool_pages(probe, 24))
    assert small.kv_pages.n_pages == 24
    got = run_streams(small, ps, params)
    assert small.num_preemptions > 0
    for p, q, tokens in zip(ps, params, got):
        assert tokens == probe.generate(p, q)[0].token_ids
    assert small.kv_pages.in_use == 0 and small.num_running == 0


def test_a_soak_with_aborts_preemption_and_the_prefix_cache_leaks_no_page(models):
    """Waves of requests sharing prefixes, some aborted mid-stream, in a pool that preempts: at the
    end the only pages in use are the prefix cache's, each referenced once, and clearing the
    cache empties the pool."""
    target, draft = models
    probe = Engine(target, draft, max_batch=1, max_seq_len=96, page_size=4)
    engine = Engine(target, draft, max_batch=6, max_seq_len=96, page_size=4, prefix_block=8,
                    kv_cache_memory=pool_pages(probe, 40))
    rng = random.Random(5)
    shared = [rng.randrange(60) for _ in range(20)]
    for wave in range(3):
        ids = []
        for i in range(8):
            prompt = shared[:rng.randrange(4, 20)] + [rng.randrange(60) for _ in range(rng.randrange(1, 12))]
            params = SamplingParams(max_new_tokens=rng.randrange(8, 40), ignore_eos=True,
                                    temperature=0.0 if i % 2 else 0.7, seed=i)
            ids.append(engine.add_request(prompt, params))
        for step in range(200):
            if engine.idle:
                break
            engine.step()
            if step in (3, 9):
                engine.abort(ids[step % len(ids)])
        assert engine.idle
    assert engine.num_preemptions > 0
    pool = engine.kv_pages
    assert pool.in_use > 0
    assert_no_page_leaked(engine)
    engine.clear_prefix_cache()
    assert pool.in_use == 0 and pool.n_free == pool.n_pages


def test_a_shared_prefix_is_mapped_by_reference_and_never_written():
    """A 40-token system prompt with the defaults (16-token pages, chunks aligned to 256): the second
    request finds 32 tokens cached, and its page table maps the same physical pages as the first's
    (each referenced by both slots and the cache); once both have decoded, those pages hold what the
    first prefill wrote."""
    target, draft = random_tiny_target(seed=3), random_tiny_draft(block=GAMMA, seed=4)
    engine = Engine(target, draft, max_batch=2, max_seq_len=96)
    system = list(range(1, 41))
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    engine.add_request(system + [50, 51], params, request_id="a")
    engine.step()                                      # a's prefill (its pages go into the cache)
    runner = engine.model_runner
    slot_a = engine.scheduler.live["a"].slot
    shared = runner.pages.pages[slot_a][:2]            # the pages of the 32 cached tokens
    before = [t.clone() for t in (runner.tcache.k[:, shared], runner.tcache.v[:, shared],
                                  runner.dcache.k[:, shared], runner.dcache.v[:, shared])]
    engine.add_request(system + [52, 53, 54], params, request_id="b")
    engine.step()
    b = engine.scheduler.live["b"]
    assert b.cached_tokens == 32
    assert runner.pages.pages[b.slot][:2] == shared and (runner.pages.pool.refs[shared] == 3).all()
    assert runner.pages.pages[b.slot][2] not in runner.pages.pages[slot_a]    # its own page after the prefix
    while not engine.idle:
        engine.step()
    after = (runner.tcache.k[:, shared], runner.tcache.v[:, shared], runner.dcache.k[:, shared],
             runner.dcache.v[:, shared])
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert (runner.pages.pool.refs[shared] == 1).all()       # only the cache holds them now


def test_the_samples_of_a_prompt_share_its_full_pages():
    target, draft = random_tiny_target(seed=3), random_tiny_draft(block=GAMMA, seed=4)
    engine = Engine(target, draft, max_batch=3, max_seq_len=96, page_size=8, prefix_cache_tokens=0)
    engine.add_request(list(range(1, 21)), SamplingParams(n=3, max_new_tokens=10, temperature=0.8, seed=1),
                       request_id="g")
    engine.step()                                      # prefill; the samples get their first tokens
    pages = engine.model_runner.pages
    slots = [r.slot for r in engine.scheduler.find("g")]
    first = pages.pages[slots[0]][:2]                  # 20 tokens: two full pages and a partial one
    assert all(pages.pages[s][:2] == first for s in slots) and (pages.pool.refs[first] == 3).all()
    assert len({pages.pages[s][2] for s in slots}) == 3          # the partial page: a copy each
    while not engine.idle:
        engine.step()
    assert pages.pool.in_use == 0


def test_the_pool_and_the_context_length_are_checked():
    target = random_tiny_target(seed=3)
    probe = Engine(target, None, max_batch=1, max_seq_len=32, page_size=4)
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        Engine(target, None, max_batch=1, max_seq_len=64, page_size=4, kv_cache_memory=pool_pages(probe, 8))
    with pytest.raises(ValueError, match="no room for the KV cache"):
        Engine(target, None, max_batch=1, page_size=4, kv_cache_memory=1)
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        Engine(target, None, page_size=6)
    # unset, max_seq_len is the checkpoint's context length, or what the pool holds if less
    assert Engine(target, None, max_batch=2).max_seq_len == target.config.max_position_embeddings
    small = Engine(target, None, max_batch=2, page_size=4, kv_cache_memory=pool_pages(probe, 100))
    assert small.max_seq_len == 100 * 4 - small.verify_width


def test_a_context_past_the_models_is_served_with_a_warning():
    target = random_tiny_target(seed=3)
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("lfmspark")
    logger.addHandler(handler)       # a handler of its own: pytest's caplog may be off (-p no:logging)
    try:
        engine = Engine(target, None, max_batch=1, max_seq_len=target.config.max_position_embeddings + 16)
    finally:
        logger.removeHandler(handler)
    assert engine.max_seq_len == target.config.max_position_embeddings + 16
    assert any("never trained" in m for m in messages), messages


def check_page_counts(engine: Engine) -> None:
    """Every page's reference count equals the slots and cached blocks that map it, the free pages are
    the unreferenced ones, and every decoding request's pages cover its committed tokens."""
    pages = engine.model_runner.pages
    mapped = np.zeros(pages.pool.n_pages, dtype=np.int64)
    for held in (*pages.pages, cached_pages(engine)):
        np.add.at(mapped, held, 1)
    assert np.array_equal(mapped, pages.pool.refs) and pages.pool.n_free == int((mapped == 0).sum())
    for req in engine.scheduler.running:
        assert pages.covered(req.slot) >= len(req.prompt_ids) + len(req.output)


def test_page_counts_hold_at_every_step_of_a_random_load(models):
    """Random arrivals (shared prefixes, n of 1-3, greedy and sampled), aborts, the prefix cache with
    finished turns cached, a pool that preempts: the page bookkeeping is exact after every step."""
    target, draft = models
    probe = Engine(target, draft, max_batch=1, max_seq_len=96, page_size=4)
    engine = Engine(target, draft, max_batch=6, max_seq_len=96, page_size=4, prefix_block=8,
                    prefix_cache_outputs=True, kv_cache_memory=pool_pages(probe, 36))
    rng = random.Random(11)
    shared, ids = [rng.randrange(60) for _ in range(24)], []
    for step in range(150):
        if rng.random() < 0.3 and len(engine.scheduler.live) < 12:
            prompt = shared[:rng.randrange(0, 24)] + [rng.randrange(60) for _ in range(rng.randrange(1, 16))]
            params = SamplingParams(n=rng.choice([1, 1, 2, 3]), max_new_tokens=rng.randrange(4, 40), ignore_eos=True,
                                    temperature=rng.choice([0.0, 0.8]), seed=step)
            ids.append(engine.add_request(prompt, params))
        if rng.random() < 0.05 and ids:
            engine.abort(rng.choice(ids))
        engine.step()
        check_page_counts(engine)
    while not engine.idle:
        engine.step()
        check_page_counts(engine)
    assert engine.num_preemptions > 0
    assert_no_page_leaked(engine)


def test_many_short_requests_run_at_once_in_a_pool_far_smaller_than_slots_times_context():
    """32 slots of a 700-token context would reserve 22,400 positions; a pool of 1,200 holds 32 short
    chats at once, all admitted together, none preempted, outputs as each alone."""
    target = random_tiny_target(seed=3)
    probe = Engine(target, None, max_batch=1, max_seq_len=700, page_size=4)
    engine = Engine(target, None, max_batch=32, max_seq_len=700, page_size=4, prefix_cache_tokens=0,
                    kv_cache_memory=pool_pages(probe, 300))
    ps = prompts(32, seed=4)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for p in ps:
        engine.add_request(p, params)
    engine.step()
    assert engine.num_running == 32 and engine.num_waiting == 0
    outs = {}
    while not engine.idle:
        for event in engine.step():
            if event.finished:
                outs[event.request_id] = event.output.token_ids
    assert engine.num_preemptions == 0 and engine.kv_pages.in_use == 0
    assert [outs[f"req-{i}"] for i in range(32)] == [probe.generate(p, params)[0].token_ids for p in ps]
