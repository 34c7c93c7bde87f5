"""Stop strings through the engine: a bigram target whose greedy continuation spells a
known text, so where each stop string falls is known in advance. The match may span rounds, fall
inside a speculative block (the oracle draft has every draft accepted) or inside a character
split across tokens; the output ends exactly there, the streamed text never shows the stop
string (unless asked to) and equals the final text."""

from __future__ import annotations

import pytest
import torch

from lfmspark.runtime import Engine, RequestError, SamplingParams
from engine_fixtures import byte_tokenizer
from spec_fixtures import V, bigram_target, oracle_draft

TOK, (E1, E2) = byte_tokenizer()


def ids_of(chars: str) -> list[int]:
    """One token per ASCII character (the byte tokenizer has no merges)."""
    ids = [t for c in chars for t in TOK(c, add_special_tokens=False)["input_ids"]]
    assert len(ids) == len(chars)
    return ids


# the greedy continuation cycles through "abc défghijk" (no token twice), then every other token
SPELLED = ids_of("abc d") + [E1, E2] + ids_of("fghijk")
ORDER = SPELLED + [t for t in range(V) if t not in SPELLED]


@pytest.fixture(scope="module")
def perm() -> torch.Tensor:
    perm = torch.empty(V, dtype=torch.int64)
    for i, t in enumerate(ORDER):
        perm[t] = ORDER[(i + 1) % V]
    return perm


def engine(perm, spec: bool) -> Engine:
    return Engine(bigram_target(perm), oracle_draft(perm) if spec else None, tokenizer=TOK, max_batch=2,
                  max_seq_len=96, chat=False)


def run(e: Engine, params: SamplingParams):
    deltas, out = [], None
    for ev in e.stream([ORDER[0]], params):          # the prompt is "a": the output starts at "b"
        deltas.append(ev.text)
        if ev.finished:
            out = ev.output
    return "".join(deltas), out


@pytest.mark.parametrize("spec", [False, True], ids=["target-only", "speculative"])
@pytest.mark.parametrize("stop, include, text, n_tokens", [
    ("c d", False, "b", 4),            # spans three tokens (rounds apart target-only, in one block speculative)
    ("c d", True, "bc d", 4),
    ("dé", False, "bc ", 6),           # ends inside the two-token é
    ("éf", True, "bc déf", 7),
    ("hi", False, "bc défg", 10),
    ("zzz", False, None, 20),          # never matches: max_new_tokens
])
def test_the_output_ends_exactly_at_the_stop_string(perm, spec, stop, include, text, n_tokens):
    e = engine(perm, spec)
    params = SamplingParams(max_new_tokens=20, stop=[stop, "never"], include_stop_str_in_output=include,
                            ignore_eos=True)
    streamed, out = run(e, params)
    assert len(out.token_ids) == n_tokens and out.token_ids == ORDER[1:1 + n_tokens]
    if text is None:
        assert out.finish_reason == "length" and out.stop_reason is None
        assert out.text == TOK.decode(out.token_ids)
    else:
        assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text
    assert streamed == out.text
    assert e.scheduler.pool.in_use == 0


def test_the_earliest_of_several_stop_strings_wins(perm):
    params = SamplingParams(max_new_tokens=20, stop=["fg", "c"], ignore_eos=True)
    _, out = run(engine(perm, True), params)
    assert out.stop_reason == "c" and out.text == "b"


def test_stop_strings_need_a_tokenizer(perm):
    e = Engine(bigram_target(perm), None, max_batch=1, max_seq_len=64)
    with pytest.raises(RequestError, match="stop strings need a tokenizer"):
        e.generate([ORDER[0]], SamplingParams(max_new_tokens=8, stop=["x"]))


@pytest.mark.parametrize("stop", [[""], [3], b"x", 5])
def test_bad_stop_values_are_refused(perm, stop):
    with pytest.raises(RequestError, match="stop"):
        engine(perm, False).generate([ORDER[0]], SamplingParams(stop=stop))
