"""Incremental output text: ``TextStream`` deltas concatenate to a full decode whatever
the chunking (byte-level characters split across tokens, special tokens in the middle), each push
decodes a window that does not grow with the output, and stop strings cut the text where they
match, across pushes and inside multi-byte characters, never streaming what might start one."""

from __future__ import annotations

import random

import pytest

from lfmspark.runtime.detokenize import TextStream
from engine_fixtures import IM_START, TOKEN_ID, VOCAB, byte_tokenizer, word_tokenizer


def stream_all(tokenizer, ids: list[int], chunks: list[int], **kw) -> tuple[list[str], TextStream]:
    ts = TextStream(tokenizer, **kw)
    deltas, n = [], 0
    for size in chunks:
        n = min(len(ids), n + size)
        stopped = ts.push(ids[:n])
        deltas.append(ts.take(final=False))
        if stopped or n == len(ids):
            break
    ts.finish(ids[:n])
    deltas.append(ts.take(final=True))
    return deltas, ts


@pytest.mark.parametrize("make", [byte_tokenizer, word_tokenizer], ids=["byte-level", "word-level"])
def test_deltas_concatenate_to_the_full_decode(make):
    tok = make()
    tok = tok[0] if isinstance(tok, tuple) else tok
    rng = random.Random(0)
    for trial in range(60):
        ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        chunks = [rng.randint(1, 6) for _ in range(len(ids))]
        deltas, ts = stream_all(tok, ids, chunks)
        full = tok.decode(ids, skip_special_tokens=True)
        assert "".join(deltas) == ts.text == full, (trial, ids)


def test_a_character_split_across_tokens_is_held_back_until_complete():
    tok, (e1, e2) = byte_tokenizer()
    a = tok.convert_tokens_to_ids("a")
    ts = TextStream(tok)
    ts.push([a, e1])
    assert ts.take(final=False) == "a"                      # the first half of é waits
    ts.push([a, e1, e2])
    assert ts.take(final=False) == "é"
    ts2 = TextStream(tok)                                   # a request that ends inside the character
    ts2.push([a, e1])
    ts2.finish([a, e1])
    assert ts2.take(final=False) + ts2.take(final=True) == tok.decode([a, e1]) == "a\ufffd"


def test_text_after_special_tokens_keeps_its_separator():
    tok = word_tokenizer()
    ids = [TOKEN_ID["w3"], IM_START, IM_START, TOKEN_ID["w5"], TOKEN_ID["w6"]]
    deltas, ts = stream_all(tok, ids, [1] * len(ids))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "w3 w5 w6"


class CountingTokenizer:
    """Decodes word tokens, counting how many ids each call is given."""

    def __init__(self):
        self.inner, self.sizes = word_tokenizer(), []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_the_cost_of_a_push_does_not_grow_with_the_output():
    tok = CountingTokenizer()
    ts = TextStream(tok)
    ids = [TOKEN_ID[f"w{i % 50}"] for i in range(2000)]
    for n in range(1, len(ids) + 1):
        ts.push(ids[:n])
        ts.take(final=False)
    assert ts.text == tok.inner.decode(ids, skip_special_tokens=True)
    assert max(tok.sizes) <= 3 and len(tok.sizes) == 2 * len(ids)     # two decodes of a 1-2 token window


def words(*ws: str) -> list[int]:
    return [TOKEN_ID[w] for w in ws]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_cuts_the_text_where_it_matches_across_pushes(include):
    tok = word_tokenizer()
    ids = words("w3", "w4", "w5", "w6", "w7")
    # "w4 w5" spans two tokens, pushed in separate calls
    deltas, ts = stream_all(tok, ids, [1, 1, 1, 1, 1], stop=("w4 w5", "w9"), include_stop=include)
    assert ts.stop_string == "w4 w5"
    assert ts.text == ("w3 w4 w5" if include else "w3 ")
    assert "".join(deltas) == ts.text
    assert "w6" not in ts.text


def test_the_stream_never_shows_what_might_start_a_stop_string():
    tok = word_tokenizer()
    ids = words("w3", "w4", "w5", "w6")
    ts = TextStream(tok, stop=("w5 w6",))
    ts.push(ids[:3])                        # "w3 w4 w5": its last 4 characters could begin "w5 w6"
    assert ts.take(final=False) == "w3 w"
    assert ts.push(ids) and ts.take(final=False) == "4 "
    assert ts.text == "w3 w4 " and ts.take(final=True) == ""


def test_a_stop_string_inside_a_multibyte_character_sequence():
    tok, (e1, e2) = byte_tokenizer()
    t = lambda c: tok.convert_tokens_to_ids(c)  # noqa: E731
    ids = [t("a"), t("b"), e1, e2, t("c"), t("d")]
    deltas, ts = stream_all(tok, ids, [1] * 6, stop=("bé",))
    assert ts.stop_string == "bé" and ts.text == "a" and "".join(deltas) == "a"
    deltas, ts = stream_all(tok, ids, [3, 3], stop=("éc",), include_stop=True)
    assert ts.text == "abéc" and "".join(deltas) == "abéc"


def test_special_tokens_are_spelled_when_asked():
    """``skip_special_tokens=False`` (a server parsing LFM2's tool-call delimiters): the deltas
    concatenate to the decode that spells special tokens, whatever the chunking."""
    from tool_fixtures import ID, VOCAB as TOOL_VOCAB, tool_tokenizer

    tok = tool_tokenizer()
    rng = random.Random(1)
    for trial in range(40):
        ids = [rng.choice([rng.randrange(TOOL_VOCAB), ID["<|tool_call_start|>"], ID["<think>"]])
               for _ in range(rng.randint(1, 30))]
        deltas, ts = stream_all(tok, ids, [rng.randint(1, 5) for _ in ids], skip_special_tokens=False)
        assert "".join(deltas) == ts.text == tok.decode(ids, skip_special_tokens=False), (trial, ids)


def test_an_engine_spells_special_tokens_but_not_the_stop_token(tmp_path):
    """``SamplingParams(skip_special_tokens=False)`` through the engine: special tokens are in the
    text, the stop token that ended the output is not (unless ``include_stop_str_in_output``)."""
    import torch

    from lfmspark.runtime import Engine, SamplingParams
    from tool_fixtures import ID, save_tool_checkpoint

    target, _ = save_tool_checkpoint(tmp_path)
    engine = Engine.from_pretrained(target, dtype=torch.float32, device="cpu", max_seq_len=256, max_batch=1)
    think, start = ID["<think>"], ID["<|tool_call_start|>"]

    def text(**kw) -> str:
        return engine.generate([[1, 40, 41]], SamplingParams(max_new_tokens=2, **kw))[0].text

    assert text(logit_bias={think: 100}, skip_special_tokens=False) == "<think><think>"
    assert text(logit_bias={think: 100}) == ""
    stop = dict(logit_bias={start: 100}, stop_token_ids=[start], skip_special_tokens=False)
    assert text(**stop) == ""
    assert text(include_stop_str_in_output=True, **stop) == "<|tool_call_start|>"
