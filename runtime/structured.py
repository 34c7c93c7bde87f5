"""Structured output: a constraint on what a request may generate, under vLLM's names.

``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`` (or ``json_object``,
``regex``, ``choice``, ``grammar``) constrains the output to a JSON value valid against the schema,
any JSON object, a match of the regular expression, one of the strings, or a sentence of the Lark
grammar. The grammar engine is llguidance (docs/decisions.md says why): a constraint is compiled
into a grammar once per distinct constraint and tokenizer (:class:`GrammarCache`), and each request
gets its own matcher (:class:`Matcher`), whose state follows the request's committed tokens and
which gives, for any position of a verify window, the tokens allowed there once the window's earlier
drafts are consumed.

How a constraint reaches the tokens (runtime/model_runner.py): it is a logit transform like the
others. At every position the target's logits outside the allowed set are ``-inf``, so the target's
distribution is the constrained one; the draft proposes unconstrained (an invalid draft has
probability 0 under the target and is always rejected, so losslessness holds; it costs acceptance).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


# llguidance's JSON options (overridable per schema through its "x-guidance" key)
JSON_DEFAULTS = {"whitespace_flexible": False}


class StructuredOutputError(ValueError):
    """A constraint that cannot be used; the message names what is wrong."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint (exactly one field set), as vLLM's ``StructuredOutputsParams``."""

    json: dict | str | None = None          # a JSON schema (a dict, or its JSON text)
    json_object: bool = False               # any JSON object
    regex: str | None = None                # a regular expression the whole output matches
    choice: tuple[str, ...] | None = None   # exactly one of these strings
    grammar: str | None = None              # a Lark grammar (llguidance's dialect)

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, (str, bytes)) and hasattr(self.choice, "__iter__"):
            object.__setattr__(self, "choice", tuple(self.choice))

    def validate(self) -> None:
        """Refuse an empty or ambiguous constraint, or one of the wrong type, naming the field."""
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is True:
            given.append("json_object")
        elif self.json_object is not False:
            raise StructuredOutputError(f"json_object must be True or False, got {self.json_object!r}")
        if len(given) != 1:
            raise StructuredOutputError("structured_outputs takes exactly one of json, json_object, regex, choice, "
                                        f"grammar; got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise StructuredOutputError(f"json must be a JSON schema (an object or its JSON text), got "
                                        f"{type(self.json).__name__}")
        # the schema is read as JSON before it is compiled (key(), to_grammar()): text that does not
        # parse, or a dict holding what JSON cannot hold, must be refused here by name, not escape
        # from the grammar cache as a bare JSONDecodeError / TypeError
        if self.json is not None:
            try:
                json.loads(self.json) if isinstance(self.json, str) else json.dumps(self.json)
            except (TypeError, ValueError) as e:
                raise StructuredOutputError(f"json is not a JSON schema: {e}") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise StructuredOutputError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")

    def key(self) -> str:
        """A stable text identifying the constraint (the grammar cache's key)."""
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return "json:" + json.dumps(schema, sort_keys=True)
        if self.json_object:
            return "json_object"
        if self.regex is not None:
            return "regex:" + self.regex
        if self.choice is not None:
            return "choice:" + json.dumps(list(self.choice))
        return "grammar:" + self.grammar

    def to_grammar(self) -> str:
        """llguidance's grammar text for the constraint (raises :class:`StructuredOutputError`)."""
        import llguidance

        try:
            if self.json is not None or self.json_object:
                schema = {"type": "object"} if self.json_object else self.json
                schema = json.loads(schema) if isinstance(schema, str) else schema
                # compact JSON unless the schema's "x-guidance" says otherwise: free whitespace lets a
                # model pad forever (one of vLLM's streaming json_schema failures)
                return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)
            if self.regex is not None:
                return llguidance.LLMatcher.grammar_from_regex(self.regex)
            if self.choice is not None:
                alternatives = " | ".join(json.dumps(c) for c in self.choice)
                return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
            return llguidance.LLMatcher.grammar_from_lark(self.grammar)
        except (ValueError, TypeError) as e:
            raise StructuredOutputError(f"structured_outputs: {e}") from e


class GrammarCache:
    """Compiled constraints for one tokenizer, least recently used dropped past ``size``: a
    constraint compiles once however many requests use it (each request's matcher is a copy of the
    constraint's fresh one: building it from the grammar text takes about a millisecond). Thread-safe (requests are prepared on
    the server's worker threads). The grammar engine's view of the tokenizer is built on first use
    (it takes up to a second for a large vocabulary); ``eos`` are the tokens a finished output ends
    with (the engine's stop tokens)."""

    def __init__(self, tokenizer, vocab_size: int, eos: tuple[int, ...] = (), size: int = 256):
        self._hf_tokenizer, self._eos = tokenizer, list(eos)
        self.vocab_size = vocab_size
        self.size = size
        self._llg_tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()   # key -> a fresh llguidance matcher
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        """llguidance's tokenizer (raises :class:`StructuredOutputError` for one it cannot read)."""
        with self._lock:
            if self._llg_tokenizer is None:
                import llguidance.hf

                try:
                    self._llg_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                                       eos_token=self._eos or None)
                except (ValueError, TypeError) as e:
                    raise StructuredOutputError(f"structured outputs cannot use this tokenizer: {e}") from e
            return self._llg_tokenizer

    def compile(self, params: StructuredOutputsParams):
        """The constraint's fresh matcher, compiled on first use (raises :class:`StructuredOutputError`
        naming the problem)."""
        import llguidance

        key = params.key()
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        grammar = params.to_grammar()
        tokenizer = self.tokenizer
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise StructuredOutputError(f"structured_outputs: the constraint does not compile: {error.strip()}")
        fresh = llguidance.LLMatcher(tokenizer, grammar)
        if fresh.is_error():
            raise StructuredOutputError(f"structured_outputs: {fresh.get_error()}")
        with self._lock:
            self._compiled[key] = fresh
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        return fresh

    def matcher(self, params: StructuredOutputsParams) -> Matcher:
        """A new request's matcher for ``params``."""
        fresh = self.compile(params)
        with self._lock:           # the copy reads the shared fresh matcher
            return Matcher(fresh.deep_copy(), (self.vocab_size + 31) // 32)


class Matcher:
    """One request's grammar state: it consumes the committed tokens and gives the allowed tokens
    of the next positions as bit masks (``[n, ceil(V / 32)]`` int32, bit ``v % 32`` of word
    ``v // 32`` set where token ``v`` is allowed)."""

    def __init__(self, matcher, words: int):
        self._matcher, self.words = matcher, words

    def consume(self, tokens: list[int]) -> None:
        """Advance past committed tokens (the target drew them from the masked distribution, so they
        are allowed; the tokens after the grammar ended, such as EOS after its EOS, are ignored)."""
        # one at a time: a round may commit tokens past the grammar's end (EOS after EOS, with
        # ignore_eos), and the grammar engine refuses those as a parse error (and says so on stderr)
        for token in tokens:
            if self._matcher.is_stopped():
                return
            self._matcher.consume_tokens([token])

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped()

    def masks(self, drafts: list[int]) -> np.ndarray:
        """``[len(drafts) + 1, words]``: row ``j`` the tokens allowed after consuming ``drafts[:j]``
        (the rows past a draft the grammar refuses allow everything: that draft is rejected before
        they are read; the rows past the grammar's end allow what the ended grammar allows). The
        matcher's state is left as it was."""
        import llguidance.numpy as lnp

        out = np.full((len(drafts) + 1, self.words), -1, dtype=np.int32)
        taken = 0
        for j in range(len(drafts) + 1):
            lnp.fill_next_token_bitmask(self._matcher, out, j)
            if self._matcher.is_stopped():
                # an ended grammar (a draft was its EOS) allows the EOS alone at every later column, as
                # target-only decoding of a request that goes on past the EOS (ignore_eos) sees it: a
                # column left open there would let the target draw freely after an accepted EOS draft
                out[j + 1:] = out[j]
                break
            if j == len(drafts) or not self._matcher.try_consume_tokens([drafts[j]]):
                break
            taken += 1
        if taken:
            self._matcher.rollback(taken)
        return out
