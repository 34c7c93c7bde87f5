"""The round's draft context injection (runtime/steps.py ``Steps.round_verify``, ``round_commit``): a
region of its own for the whole verify window, forked from the verify once its last tapped layer has
run and run beside the remaining layers and the commit (on a side stream on CUDA; in program order
here), or, where the taps only exist after the last layer, forked at the commit. Nothing the draft
reads may depend on where it forks: rounds give the same tokens, state and caches either way (the
draft cache compared at the positions before each row's committed length, the only ones the draft
attends to as context). That the window's columns past the commit are never read as context is what
the lossless tests show (tests/e2e/test_lossless_greedy.py: speculative output equals target-only)."""

from __future__ import annotations

import pytest
import torch

from lfmspark.graphs.runner import StepKind
from lfmspark.runtime import Engine, SamplingParams
from lfmspark.runtime.distributions import SamplingMode
from engine_fixtures import map_slots
from spec_fixtures import TapsNeverReadyEarly, random_tiny_draft, random_tiny_target

GAMMA = 4
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]


@pytest.fixture(scope="module")
def models():
    # taps 0, 1, 2 of the 5-layer target: the last tapped layer's output is recorded when layer 3 runs
    # (here the pending add is a tensor, so the tap exists once the next layer has added it), which
    # leaves layer 4 for the early injection to run before
    return random_tiny_target(seed=5), random_tiny_draft(block=GAMMA, seed=6, taps=(0, 1, 2))


def _engine(models, early: bool = True, compile: bool = False) -> Engine:
    # imposed acceptance: accept lengths spread over 0..gamma (random drafts alone are almost never
    # accepted), so the window's columns past the commit are written in most rounds
    target, draft = models
    engine = Engine(target, draft, max_batch=len(PROMPTS), max_seq_len=96, compile=compile,
                    imposed_acceptance=[0.7] * GAMMA)
    if not early:
        engine.model_runner.steps.target = TapsNeverReadyEarly(target)
    return engine


def _record_injections(engine: Engine) -> list[int]:
    """Wrap the engine's injection, verify head and the verify's later layers (this engine's own
    attributes, not the shared models): each injection appends how many later layers the last verify
    had run by then."""
    calls, layers_run = [], [0]

    def counted(layer):
        def run(*args, **kwargs):
            layers_run[0] += 1
            return layer(*args, **kwargs)
        return run

    def head(*args, **kwargs):
        layers_run[0] = 0
        return verify_head(*args, **kwargs)

    engine.model_runner.steps.later_target_layers = [counted(layer) for layer in engine.model_runner.steps.later_target_layers]
    verify_head, inject = engine.model_runner.steps.verify_head, engine.model_runner.steps.round_inject
    engine.model_runner.steps.verify_head = head
    engine.model_runner.steps.round_inject = lambda aux, rows, side_stream: calls.append(layers_run[0]) or inject(aux, rows, side_stream)
    return calls


def _admit(engine: Engine, mode: SamplingMode) -> list[int]:
    params = [SamplingParams(max_new_tokens=60, temperature=0.9 if mode.sampling else 0.0, top_k=20, seed=i)
              for i in range(len(PROMPTS))]
    reqs = [r for p, q in zip(PROMPTS, params) for r in engine.prepare(p, q)]
    engine.submit(reqs)
    engine.prefill_step()           # prefill only: the test runs the rounds itself
    map_slots(engine, [r.slot for r in reqs])
    return [r.slot for r in reqs]


def _rounds(engine: Engine, slots: list[int], mode: SamplingMode, n: int) -> list[list[list[int]]]:
    out = []
    for _ in range(n):
        step = engine.model_runner.step_runner.run(StepKind.ROUND, slots, mode)
        out.append([step.tokens[i, :int(step.n_new[i])].tolist() for i in range(len(slots))])
    return out


def _check_same_state(on: Engine, off: Engine, slots: list[int]) -> None:
    for name in ("seq_len", "anchor"):
        assert torch.equal(getattr(on.model_runner.state, name)[slots], getattr(off.model_runner.state, name)[slots]), name
    assert torch.equal(on.model_runner.tcache.conv_state[:, slots], off.model_runner.tcache.conv_state[:, slots])
    for i, committed in zip(slots, off.model_runner.state.seq_len[slots].tolist()):
        for a, b in ((on.model_runner.tcache, off.model_runner.tcache), (on.model_runner.dcache, off.model_runner.dcache)):
            for x, y in zip(a.gather(i, committed), b.gather(i, committed)):
                assert torch.equal(x, y)


@pytest.mark.parametrize("mode", list(SamplingMode), ids=lambda m: m.value)
def test_early_injection_matches_the_injection_at_the_commit(models, mode):
    early, late = _engine(models), _engine(models, early=False)
    injected_early, injected_late = _record_injections(early), _record_injections(late)
    slots = _admit(early, mode)
    assert slots == _admit(late, mode)
    got, want = _rounds(early, slots, mode, 8), _rounds(late, slots, mode, 8)
    assert got == want
    # early: after the verify's layer 3 (the one that records tap 2), before layer 4 (3 of the 4 layers
    # after the head's); at the commit, after all of them
    assert injected_early == [3] * 8 and injected_late == [4] * 8
    lengths = {len(row) for rnd in want for row in rnd}
    assert len(lengths) >= 3 and min(lengths) <= GAMMA     # partial accepts: columns past the commit were written
    _check_same_state(early, late, slots)


def test_early_injection_waits_for_the_last_tap():
    """A draft tapping the target's last layer but one leaves no layer to fork before: the injection
    then runs at the commit (the last layer's output exists only after it ran)."""
    target, draft = random_tiny_target(seed=5), random_tiny_draft(block=GAMMA, seed=6, taps=(0, 2, 3))
    engine = _engine((target, draft))
    injected = _record_injections(engine)
    _rounds(engine, _admit(engine, SamplingMode.GREEDY), SamplingMode.GREEDY, 2)
    assert injected == [4, 4]


@pytest.mark.slow
def test_early_injection_matches_compiled(models):
    """The same with the regions compiled: the injection is a region of its own (graphs/compile.py)."""
    early, late = _engine(models, compile=True), _engine(models, early=False, compile=True)
    assert "round_inject" in vars(early.model_runner.steps)  # compiled wrapper
    slots = _admit(early, SamplingMode.GREEDY)
    assert slots == _admit(late, SamplingMode.GREEDY)
    want = _rounds(late, slots, SamplingMode.GREEDY, 6)
    assert _rounds(early, slots, SamplingMode.GREEDY, 1) == want[:1]           # compiles
    torch._dynamo.config.error_on_recompile = True
    try:
        assert _rounds(early, slots, SamplingMode.GREEDY, 5) == want[1:]
    finally:
        torch._dynamo.config.error_on_recompile = False
    _check_same_state(early, late, slots)


def test_target_only_engines_have_no_side_stream(models):
    engine = Engine(models[0], None, max_batch=1, max_seq_len=64)
    assert engine.model_runner.steps.side_stream is None and "round_inject" not in engine.model_runner.steps.region_names()


def test_bench_phase_split_runs_with_the_injection(models):
    """runtime/bench.py times the verify phase with the injection it forks (joined there), and the
    commit phase through ``Steps.round_commit``, which then injects nothing."""
    from lfmspark.tools.bench import time_round_phases

    engine = _engine(models)
    calls = _record_injections(engine)
    _admit(engine, SamplingMode.GREEDY)
    phases = time_round_phases(engine, len(PROMPTS), iters=2)
    assert set(phases) == {"draft_ms", "verify_ms", "commit_ms"} and calls
    assert calls == [3] * len(calls)     # one injection per verify; each phase runs once before its timed calls
