"""Prefill inside the loop: while requests decode, an arrival's prompt is prefilled in
chunks of at most ``prefill_budget`` tokens per step, between their rounds. Nobody's tokens change:
not the decoding requests', not the arrival's (each equals its run alone); the budget holds on every
step; with nothing decoding a prompt is prefilled whole at once; a request aborted or timed out while
prefilling frees its slot, and a sample of its prompt waiting on it takes over."""

from __future__ import annotations

import pytest

from lfmspark.runtime import Engine, SamplingParams

RUNNING = [5, 9, 14, 3]
ARRIVAL = [(7 * i) % 50 + 11 for i in range(30)]      # 30 tokens: 8 steps at a budget of 4


def make(target, draft, spec: bool, **kw) -> Engine:
    return Engine(target, draft if spec else None, max_batch=4, max_seq_len=128, prefill_budget=4, **kw)


def params(sampled: bool, seed: int, n_tokens: int = 24, **kw) -> SamplingParams:
    extra = dict(temperature=0.9, top_k=20, seed=seed) if sampled else {}
    return SamplingParams(max_new_tokens=n_tokens, ignore_eos=True, **extra, **kw)


def alone(target, draft, spec: bool, prompt, p: SamplingParams) -> list[int]:
    return make(target, draft, spec).generate([prompt], p)[0].token_ids


class PrefillLog:
    """What each call of the engine's prefill runner ran: tokens, and how many requests were decoding."""

    def __init__(self, engine: Engine):
        self.calls: list[tuple[int, int]] = []
        self.padded: list[int] = []         # rows (to a power of two, as the buckets) x the widest chunk
        self.rows: list[int] = []
        real = engine.model_runner.prefill_runner.run

        def run(chunks, slots, starts):
            self.calls.append((sum(len(c) for c in chunks), len(engine.scheduler.running)))
            if engine.scheduler.running:
                self.padded.append((1 << (len(chunks) - 1).bit_length()) * max(len(c) for c in chunks))
                self.rows.append(len(chunks))
            return real(chunks, slots, starts)
        engine.model_runner.prefill_runner.run = run


def run_with_arrival(engine: Engine, running: SamplingParams, arrival: SamplingParams, arrive_after: int = 2):
    """A decodes; after ``arrive_after`` steps B arrives. Returns the tokens of each, the number of
    A's tokens that came out while B was prefilling, and the prefill log."""
    log = PrefillLog(engine)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    engine.add_request(RUNNING, running, request_id="a")
    for _ in range(arrive_after):
        for ev in engine.step():
            tokens[ev.request_id] += ev.token_ids
    engine.add_request(ARRIVAL, arrival, request_id="b")
    a_during = 0
    while not engine.idle:
        b_started = bool(tokens["b"])
        for ev in engine.step():
            tokens[ev.request_id] += ev.token_ids
            if ev.request_id == "a" and not b_started:
                a_during += len(ev.token_ids)
    return tokens, a_during, log


@pytest.mark.parametrize("spec", [False, True], ids=["target-only", "speculative"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_an_arrival_changes_no_ones_tokens_and_waits_its_chunks(target, draft, spec, sampled):
    pa, pb = params(sampled, 1, 40), params(sampled, 2, 12, repetition_penalty=1.3)
    tokens, a_during, log = run_with_arrival(make(target, draft, spec), pa, pb)
    assert tokens["a"] == alone(target, draft, spec, RUNNING, pa)
    assert tokens["b"] == alone(target, draft, spec, ARRIVAL, pb)
    b_calls = [n for n, active in log.calls if active]          # B's chunks, A decoding
    assert b_calls == [4] * 7 + [2]                             # 30 tokens at 4 a step
    assert a_during >= 7                                        # A went on decoding between them


def test_several_arrivals_share_the_budget_in_arrival_order(target, draft):
    """b (5 tokens) takes the whole budget of 4, then its last token leaves room for c's first two:
    a forward's rows x widest chunk stays within the budget; everyone's tokens are their own."""
    e = make(target, draft, True, prefill_chunk=8)
    log = PrefillLog(e)
    e.add_request(RUNNING, params(False, 0, 40), request_id="a")
    e.step()
    e.add_request(ARRIVAL[:5], params(False, 0, 4), request_id="b")
    e.add_request(ARRIVAL[5:12], params(False, 0, 4), request_id="c")
    outs = {}
    while not e.idle:
        for ev in e.step():
            if ev.finished:
                outs[ev.request_id] = ev.output.token_ids
    assert [n for n, active in log.calls if active] == [4, 1 + 2, 4, 1]
    assert log.rows == [1, 2, 1, 1] and max(log.padded) <= 4      # padding counted too
    assert sum(n for n, _ in log.calls) == len(RUNNING) + 5 + 7     # every prompt token prefilled once
    assert outs["b"] == alone(target, draft, True, ARRIVAL[:5], params(False, 0, 4))
    assert outs["c"] == alone(target, draft, True, ARRIVAL[5:12], params(False, 0, 4))


def test_with_nothing_decoding_a_prompt_is_prefilled_whole_in_its_first_step(target, draft):
    e = make(target, draft, True, prefill_chunk=8)
    log = PrefillLog(e)
    e.add_request(ARRIVAL, params(False, 0, 4), request_id="b")
    events = e.step()
    assert [n for n, _ in log.calls] == [8, 8, 8, 6]           # chunks back to back, budget not applied
    assert events and events[0].token_ids                     # the first token is out after one step


@pytest.mark.parametrize("how", ["abort", "timeout"])
def test_leaving_while_prefilling_frees_the_slot(target, draft, how):
    e = make(target, draft, True)
    e.add_request(RUNNING, params(False, 0, 60), request_id="a")
    e.step()
    ended = []
    e.add_request(ARRIVAL, params(False, 0, 8, timeout_s=0.05 if how == "timeout" else None), request_id="b",
                  on_event=ended.append)
    e.step()                                                   # b holds a slot, its prompt a quarter in
    assert e.num_running == 2 and e.scheduler.prefilling and not ended
    if how == "abort":
        assert e.abort("b")
    else:
        import time
        time.sleep(0.06)
        e.step()
    assert len(ended) == 1 and ended[0].output.finish_reason == ("cancelled" if how == "abort" else "timeout")
    assert ended[0].output.token_ids == []
    assert e.num_running == 1 and not e.scheduler.prefilling
    e.abort_all()
    assert e.scheduler.pool.in_use == 0


def test_a_sample_takes_over_when_the_one_prefilling_for_it_leaves(target, draft):
    """n=2 arriving while A decodes: sample 0 prefills for both; aborted midway, sample 1 prefills its
    own slot from the start and gives the lone request's tokens with its seed."""
    e = make(target, draft, True)
    e.add_request(RUNNING, params(False, 0, 60), request_id="a")
    e.step()
    p = params(True, 50, 10, n=2)
    e.add_request(ARRIVAL, p, request_id="g")
    e.step()
    assert e.abort("g-0")
    out = None
    while not e.idle:
        for ev in e.step():
            if ev.request_id == "g-1" and ev.finished:
                out = ev.output
        if out is not None:
            e.abort_all()
    assert out.finish_reason == "length"
    assert out.token_ids == alone(target, draft, True, ARRIVAL, params(True, 51, 10))
    assert e.scheduler.pool.in_use == 0


def test_a_bad_budget_is_refused(target):
    with pytest.raises(ValueError, match="prefill_budget"):
        Engine(target, prefill_budget=0)
