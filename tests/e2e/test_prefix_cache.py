"""The prefix cache (runtime/prefix_cache.py): outputs with the cache equal outputs without it (the
tokens, and the log-probabilities up to batching roundings; bit for bit for a request run alone on
a dense target, hits on the chunk grid and off it), for multi-turn conversations and shared
prefixes, dense and MoE targets, with and without a draft, greedy and seeded sampling, under
eviction, and at the edges (a prefix shorter than a page, a prompt cached up to its last token, the
previous turn's output inside the next prompt).

Pages (cached blocks) of 4 tokens and prefill chunks aligned to 8 (``prefix_block``) keep the tiny
models' prompts several blocks long, with hits on the chunk grid (multiples of 8) and off it.
"""

from __future__ import annotations

import random

import pytest

from lfmspark.runtime import Engine, SamplingParams
from engine_fixtures import assert_no_page_leaked
from spec_fixtures import random_tiny_draft, random_tiny_target

PAGE = 4        # tokens per cached block: a KV page
ALIGN = 8       # prefix_block: prefill chunks never cross its multiples


def engine(target, draft, cache_tokens: int | None, max_batch: int = 4, **kw) -> Engine:
    return Engine(target, draft, max_batch=max_batch, max_seq_len=192, prefix_cache_tokens=cache_tokens,
                  prefix_block=ALIGN, page_size=PAGE, **kw)


def params(i: int, n: int = 9) -> SamplingParams:
    """Greedy and seeded sampling alternate (sampling with a repetition penalty, which reads the prompt);
    each token's log-probability comes back, so equal outputs mean equal logits, not just equal picks."""
    if i % 2 == 0:
        return SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=0)
    return SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.9, top_k=20, seed=100 + i,
                          repetition_penalty=1.1, logprobs=0)


def assert_same(got, want) -> None:
    """Equal tokens, and log-probabilities equal up to the roundings of how rows were batched (the
    forwards batch different rows with the cache, and a product's roundings follow the batch
    shape); a wrong reused state moves them far more (a conv state one position off: 1e-2)."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        assert [t.logprob for t in a.logprobs] == pytest.approx([t.logprob for t in b.logprobs], abs=1e-5)


def conversations(eng: Engine, n_conv: int, turns: int, seed: int) -> tuple[list, list]:
    """``n_conv`` chats sharing a system prompt, each turn adding a user message to the previous turn's
    prompt and output. Returns every output and the cached prompt tokens per turn."""
    rng = random.Random(seed)
    system = [rng.randrange(60) for _ in range(19)]
    chats = [list(system) for _ in range(n_conv)]
    tokens, cached = [], []
    for _ in range(turns):
        for chat in chats:
            chat += [rng.randrange(60) for _ in range(rng.randrange(3, 11))]
        outs = eng.generate([list(c) for c in chats], [params(i) for i in range(n_conv)])
        for chat, out in zip(chats, outs):
            chat += out.token_ids
        tokens += outs
        cached.append([o.stats.prompt_tokens_cached for o in outs])
    return tokens, cached


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
def test_multi_turn_conversations_equal_the_uncached_engine(moe, speculative):
    target = random_tiny_target(moe=moe, seed=3)
    draft = random_tiny_draft(block=4, seed=4) if speculative else None
    with_cache, cached = conversations(engine(target, draft, None), 3, 4, seed=1)
    without, none = conversations(engine(target, draft, 0), 3, 4, seed=1)
    assert_same(with_cache, without)
    assert all(c == 0 for c in none[0] + none[-1])
    assert all(c > 0 and c % PAGE == 0 for turn in cached[1:] for c in turn)   # every later turn hit
    assert any(c % ALIGN for turn in cached[1:] for c in turn)                 # some off the chunk grid


def test_eviction_under_a_tiny_budget_keeps_the_outputs_and_evicts():
    target, draft = random_tiny_target(seed=5), random_tiny_draft(block=4, seed=6)
    small = engine(target, draft, 6 * PAGE)
    with_cache, _ = conversations(small, 3, 4, seed=2)
    without, _ = conversations(engine(target, draft, 0), 3, 4, seed=2)
    assert_same(with_cache, without)
    stats = small.prefix_cache_stats
    assert stats["capacity_blocks"] == 6 and stats["evicted_blocks"] > 0 and stats["cached_blocks"] <= 6
    assert_no_page_leaked(small)


def test_shared_prefix_batches_and_a_prompt_cached_to_its_last_token():
    target, draft = random_tiny_target(seed=7), random_tiny_draft(block=4, seed=8)
    rng = random.Random(3)
    shared = [rng.randrange(60) for _ in range(8 * PAGE)]
    prompts = [shared + [rng.randrange(60) for _ in range(k)] for k in (1, 5, 13)]
    # inside a page (off the chunk grid), inside a page on it, one page and a bit, shorter than a page
    prompts += [shared[:7 * PAGE + 3], shared[:6 * PAGE + 1], shared[:PAGE + 2], shared[:PAGE - 1]]
    on = engine(target, draft, None)
    on.generate([shared + [7]], params(0))                         # caches the eight shared pages
    outs = on.generate(prompts, [params(i) for i in range(len(prompts))])
    ref = engine(target, draft, 0).generate(prompts, [params(i) for i in range(len(prompts))])
    assert_same(outs, ref)
    cached = [o.stats.prompt_tokens_cached for o in outs]
    assert cached == [8 * PAGE, 8 * PAGE, 8 * PAGE, 7 * PAGE, 6 * PAGE, PAGE, 0]   # the first: all but its last token


def test_outputs_are_cached_once_a_prompt_repeats_them():
    """By default a request's output is not stored (decode steps and verify windows round differently
    from a prefill); the next turn, whose prompt repeats it, prefills it, and the turn after reuses it."""
    target, draft = random_tiny_target(seed=9), random_tiny_draft(block=4, seed=10)
    on, off = engine(target, draft, None), engine(target, draft, 0)
    prompt = [3, 14, 15, 9, 2, 6]
    first = on.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    second_prompt = prompt + first.token_ids + [5, 5]
    second = on.generate([second_prompt], params(1))[0]
    assert second.stats.prompt_tokens_cached == PAGE                # the first prompt's one full page
    third_prompt = second_prompt + second.token_ids + [7]
    third = on.generate([third_prompt], params(0))[0]
    assert third.stats.prompt_tokens_cached == len(second_prompt) // PAGE * PAGE
    assert_same([second, third], [off.generate([p], q)[0] for p, q in ((second_prompt, params(1)),
                                                                        (third_prompt, params(0)))])


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
def test_finished_turns_are_cached_and_change_no_output(moe, speculative):
    """``prefix_cache_outputs=True``: each turn finds the previous turn's prompt and output cached up
    to their last full page (the output re-prefilled as it finished), and every output equals the
    uncached engine's."""
    target = random_tiny_target(moe=moe, seed=3)
    draft = random_tiny_draft(block=4, seed=4) if speculative else None
    n_conv = 3
    with_cache, cached = conversations(engine(target, draft, None, prefix_cache_outputs=True), n_conv, 4, seed=1)
    without, _ = conversations(engine(target, draft, 0), n_conv, 4, seed=1)
    assert_same(with_cache, without)
    for turn in range(1, 4):
        previous = with_cache[(turn - 1) * n_conv:turn * n_conv]
        want = [(len(o.prompt_token_ids) + len(o.token_ids)) // PAGE * PAGE for o in previous]
        assert cached[turn] == want
        assert any(w > len(o.prompt_token_ids) // PAGE * PAGE for w, o in zip(want, previous))


def test_cached_outputs_survive_eviction_and_need_the_cache():
    target, draft = random_tiny_target(seed=5), random_tiny_draft(block=4, seed=6)
    small = engine(target, draft, 6 * PAGE, prefix_cache_outputs=True)
    with_cache, _ = conversations(small, 3, 4, seed=2)
    without, _ = conversations(engine(target, draft, 0), 3, 4, seed=2)
    assert_same(with_cache, without)
    assert small.prefix_cache_stats["evicted_blocks"] > 0
    with pytest.raises(ValueError, match="prefix_cache_outputs=True needs the prefix cache"):
        engine(target, draft, 0, prefix_cache_outputs=True)
    with pytest.raises(ValueError, match="prefix_cache_outputs must be True or False"):
        engine(target, draft, None, prefix_cache_outputs="yes")


def test_finished_turns_wait_for_a_step_without_decoding_and_at_most_max_batch_of_them():
    """A finished turn's cache job never shares a forward with a decoding request (it would stall
    that stream): the short requests that finish while a long one decodes queue their jobs, then the
    long one its own, at most ``max_batch`` of them (the oldest dropped), which run once nothing
    decodes; a prompt that repeats a kept turn then finds its output cached, one that repeats a
    dropped turn only its prompt."""
    target = random_tiny_target(seed=16)
    eng = engine(target, None, 2 * 192, max_batch=2, prefix_cache_outputs=True)   # room for every page
    rng = random.Random(5)
    long = [rng.randrange(60) for _ in range(5)]
    shorts = [[rng.randrange(60) for _ in range(4 * PAGE - 3)] for _ in range(4)]   # + 9 tokens: 5 full pages
    forwards: list[tuple[int, int]] = []    # (cache-job rows, decoding requests) of each prefill forward
    real = eng.model_runner.prefill

    def spy(plan):
        forwards.append((sum(r.cache_only for r in plan.rows), len(eng.scheduler.running)))
        return real(plan)

    eng.model_runner.prefill = spy
    outs = eng.generate([long] + shorts, [SamplingParams(max_new_tokens=70, ignore_eos=True)]
                        + [SamplingParams(max_new_tokens=9, ignore_eos=True)] * 4)
    assert not eng.idle and not any(jobs for jobs, _ in forwards)     # two jobs wait; none ran yet
    while not eng.idle:
        eng.step()
    assert any(jobs for jobs, _ in forwards) and not any(jobs and decoding for jobs, decoding in forwards)
    follow_ups = [p + o.token_ids + [1, 2, 3] for p, o in zip([long] + shorts, outs)]
    cached = [o.stats.prompt_tokens_cached for o in eng.generate(follow_ups, SamplingParams(max_new_tokens=1))]
    # kept: the long one's and the last short's turn; the others only their prompt's three pages
    assert cached == [18 * PAGE, 3 * PAGE, 3 * PAGE, 3 * PAGE, 5 * PAGE]


@pytest.mark.parametrize("with_draft", [False, True], ids=["target-only", "speculative"])
def test_a_next_turn_added_as_the_last_one_finishes_finds_its_output_cached(with_draft):
    """The next turn is added at the step that ends the previous one (as a server's client sends it
    the moment the answer arrives), while that turn's last round may still be in flight (a
    speculative round is launched before the previous one is collected): the cache job still runs
    before the new prompt is admitted, so the prompt finds the previous output's full blocks."""
    target = random_tiny_target(seed=18)
    draft = random_tiny_draft(seed=19) if with_draft else None
    eng = engine(target, draft, None, max_batch=2, prefix_cache_outputs=True)

    def run(prompt: list[int], n: int, request_id: str):
        eng.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), request_id=request_id)
        while True:
            for event in eng.step():
                if event.finished:
                    return event.output

    prompt = list(range(1, 4 * PAGE - 2))                       # 13 tokens: three full pages
    first = run(prompt, 12, "first")
    assert eng.scheduler.cache_jobs                                      # its job waits (and, speculative, a round is out)
    second = run(prompt + first.token_ids + [5, 6, 7], 2, "second")   # the output completes 6 pages
    assert second.stats.prompt_tokens_cached == 6 * PAGE


def test_a_failing_cache_job_frees_its_slot_and_touches_no_request(caplog):
    """A cache job whose prefill raises is dropped with a warning: its slot comes back, the requests
    queued behind it run and answer as an engine without output caching does."""
    target = random_tiny_target(seed=17)
    eng = engine(target, None, 2 * 192, max_batch=2, prefix_cache_outputs=True)   # room for every page
    prompt = list(range(1, 4 * PAGE - 2))
    eng.generate([prompt], SamplingParams(max_new_tokens=9, ignore_eos=True))
    assert not eng.idle                                   # its cache job waits
    real = eng.model_runner.prefill

    def failing(plan):
        if any(r.cache_only for r in plan.rows):
            raise RuntimeError("injected failure")
        return real(plan)

    eng.model_runner.prefill = failing
    follow_up = [prompt + [5, 6, 7], list(range(3, 20))]
    with caplog.at_level("WARNING", logger="lfmspark"):
        outs = eng.generate(follow_up, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert "injected failure" in caplog.text
    ref = engine(target, None, 0, max_batch=2).generate(follow_up, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert all(o.finish_reason == "length" for o in outs)
    while not eng.idle:
        eng.step()
    assert eng.scheduler.pool.n_free == 2


def test_requests_reading_an_entry_that_gets_evicted_stay_correct():
    """Room for four blocks: two requests admitted together hit the same four-block entry, and a third
    one admitted with them, with another prompt, evicts that entry to store its own blocks while the
    two still run; every output equals the uncached engine's."""
    target, draft = random_tiny_target(seed=12), random_tiny_draft(block=4, seed=13)
    rng = random.Random(4)
    shared = [rng.randrange(60) for _ in range(4 * PAGE + 1)]
    on = engine(target, draft, 4 * PAGE)
    on.generate([shared], params(0))
    prompts = [shared[:-1] + [rng.randrange(60) for _ in range(4 * PAGE)] for _ in range(2)]
    prompts.append([rng.randrange(60) for _ in range(6 * PAGE)])
    outs = on.generate(prompts, [params(i, 20) for i in range(3)])
    ref = engine(target, draft, 0).generate(prompts, [params(i, 20) for i in range(3)])
    assert_same(outs, ref)
    assert [o.stats.prompt_tokens_cached for o in outs] == [4 * PAGE, 4 * PAGE, 0]
    assert on.prefix_cache_stats["evicted_blocks"] > 0


def test_chunks_end_at_block_boundaries_and_prompt_logprobs_never_hit():
    target = random_tiny_target(seed=14)
    eng = engine(target, None, None, prefill_chunk=100)
    forwards: list[tuple[list[int], list[int]]] = []
    real = eng.model_runner.prefill

    def spy(plan):
        forwards.append((list(plan.starts), [len(c) for c in plan.chunks]))
        return real(plan)

    eng.model_runner.prefill = spy
    prompt = list(range(1, 30))
    eng.generate([prompt], SamplingParams(max_new_tokens=2))
    assert forwards == [([0], [8]), ([8], [8]), ([16], [8]), ([24], [5])]
    forwards.clear()
    out = eng.generate([prompt], SamplingParams(max_new_tokens=2, prompt_logprobs=1))[0]
    assert out.stats.prompt_tokens_cached == 0 and forwards[0][0] == [0]
    again = eng.generate([prompt], SamplingParams(max_new_tokens=2))[0]
    assert again.stats.prompt_tokens_cached == 7 * PAGE
    forwards.clear()
    longer = eng.generate([prompt + [40, 41]], SamplingParams(max_new_tokens=2))[0]
    assert longer.stats.prompt_tokens_cached == 7 * PAGE
    assert forwards == [([28], [3])]         # a hit off the chunk grid runs to the next multiple of 8 or the end


def test_stats_clear_and_configuration_errors():
    target = random_tiny_target(seed=15)
    eng = engine(target, None, None)
    prompt = list(range(1, 20))
    eng.generate([prompt, prompt], SamplingParams(max_new_tokens=2))
    eng.generate([prompt], SamplingParams(max_new_tokens=2))
    stats = eng.prefix_cache_stats
    assert stats["queries"] == 3 * len(prompt) and stats["hits"] == 4 * PAGE
    assert stats["block"] == PAGE and stats["chunk_alignment"] == ALIGN
    assert eng.clear_prefix_cache() == stats["cached_blocks"] > 0
    assert eng.generate([prompt], SamplingParams(max_new_tokens=2))[0].stats.prompt_tokens_cached == 0
    assert engine(target, None, 0).prefix_cache_stats == {}
    default = Engine(target, None, max_batch=1, max_seq_len=64).prefix_cache_stats   # blocks of a page, chunks on 256
    assert default["block"] == 16 and default["chunk_alignment"] == 256
    assert Engine(target, None, max_batch=1, max_seq_len=16).model_runner.prefix_cache is None   # no page fills
    for bad in (dict(prefix_cache_tokens=-1), dict(prefix_cache_tokens=1.5), dict(prefix_block=0)):
        with pytest.raises(ValueError, match="prefix_"):
            Engine(target, None, max_batch=1, max_seq_len=64, **bad)


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "target-only"])
def test_a_request_alone_gets_the_bits_a_miss_computes_on_and_off_the_chunk_grid(speculative):
    """One request at a time on a dense target: a hit at any page multiple, on the chunk grid (a
    multiple of 8) or off it (the prefill then runs a chunk a miss never runs, to the next multiple
    of 8), and chunks cut by ``prefill_chunk`` too, give the tokens and log-probabilities of the
    uncached engine bit for bit, greedy and seeded sampling. On CPU every per-row product of the
    bucketed prefill rounds a row alike whatever the other rows; an MoE target's expert products
    do not (a forward's tokens are grouped by expert), which the conversation tests above bound."""
    target = random_tiny_target(seed=3)
    draft = random_tiny_draft(block=4, seed=4) if speculative else None
    rng = random.Random(1)
    shared = [rng.randrange(60) for _ in range(45)]
    for chunk in (2048, 6):
        # a budget for every page the prompts fill (the default's quarter of this small pool would evict)
        on, off = (Engine(target, draft, max_batch=1, max_seq_len=192, prefix_cache_tokens=t, prefix_block=ALIGN,
                          page_size=PAGE, prefill_chunk=chunk) for t in (192, 0))
        on.generate([shared + [1]], params(0, 1))
        hits = []
        for i, n in enumerate((8, 12, 20, 33, 44)):
            prompt = shared[:n] + [rng.randrange(60) for _ in range(rng.randrange(1, 20))]
            got, want = on.generate([prompt], params(i))[0], off.generate([prompt], params(i))[0]
            assert got.token_ids == want.token_ids
            assert [t.logprob for t in got.logprobs] == [t.logprob for t in want.logprobs]
            hits.append(got.stats.prompt_tokens_cached)
        assert hits == [8, 12, 20, 32, 44]
        assert_no_page_leaked(on)


def test_a_system_prompt_of_a_few_dozen_tokens_hits_with_the_defaults():
    """Pages of 16 tokens and chunks aligned to 256 (the defaults): a 40-token system prompt is found
    cached up to its last full page, every output equal to the uncached engine's, the stats count
    what was stored and found, and no page or conv row is left behind once the cache is cleared."""
    target, draft = random_tiny_target(seed=3), random_tiny_draft(block=4, seed=4)
    system = [(7 * i) % 60 for i in range(40)]
    prompts = [system + list(range(k, k + 5)) for k in (1, 9, 17)]
    on, off = (Engine(target, draft, max_batch=2, max_seq_len=128, prefix_cache_tokens=t) for t in (None, 0))
    first = on.generate([prompts[0]], params(0))
    rest = on.generate(prompts[1:], [params(1), params(2)])
    assert_same(first + rest, off.generate([prompts[0]], params(0)) + off.generate(prompts[1:], [params(1), params(2)]))
    assert [o.stats.prompt_tokens_cached for o in first + rest] == [0, 32, 32]
    stats = on.prefix_cache_stats
    assert stats["block"] == 16 and stats["chunk_alignment"] == 256
    assert stats["hits"] == 64 and stats["inserted_blocks"] == stats["cached_blocks"] == 2
    assert_no_page_leaked(on)
    cache = on.model_runner.prefix_cache
    assert on.clear_prefix_cache() == 2 and on.kv_pages.in_use == 0 and cache.cached_blocks == 0
