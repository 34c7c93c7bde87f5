"""Tokenizers and oracles for the structured-output tests.

* :func:`token_tokenizer`: a ``PreTrainedTokenizerFast`` whose vocabulary is exactly the strings
  given (id == position; a string may be several characters), byte-level like LFM2's, so the
  grammar engine reads every token's bytes; the special ones are control tokens (the EOS). A
  string of several characters is also an added token: encoding text takes it whole, so it is the
  canonical tokenization of its text (llguidance lets a forced stretch of text, such as a JSON key,
  be generated only as the tokenizer itself would encode it).
* :func:`byte_vocabulary`: the tiny presets' vocabulary with extra (multi-character) tokens after it.
* :func:`finite_language` / :func:`allowed_next`: which tokens may follow a prefix in a finite
  language, found by enumerating the language with Python's ``re`` (independently of the grammar
  engine).
"""

from __future__ import annotations

import itertools
import re

from lfmspark.runtime.byte_tokenizer import _byte_symbols


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet), as the runtime's tokenizer uses."""
    return dict(enumerate(_byte_symbols()))


def token_tokenizer(tokens: list[str | bytes], specials: tuple[str, ...] = (), eos: str | None = None):
    """A fast tokenizer over ``tokens`` (id == position); ``specials`` among them are special tokens,
    ``eos`` (one of them) the EOS; a ``bytes`` token is those bytes (any byte value), a ``str`` its
    UTF-8. Encoding text takes the longer tokens whole and splits the rest
    into single characters (no merges); decoding any id sequence works."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = _bytes_to_unicode()
    vocab = {}
    for i, t in enumerate(tokens):
        key = t if t in specials else "".join(b2u[b] for b in (t if isinstance(t, bytes) else t.encode()))
        assert key not in vocab, f"token {t!r} twice"
        vocab[key] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in tokens
                    if isinstance(t, str) and t not in specials and len(t) > 1])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)


def finite_language(pattern: str, alphabet: str, max_len: int) -> set[str]:
    """Every string over ``alphabet`` of at most ``max_len`` characters that fully matches ``pattern``."""
    rx = re.compile(pattern)
    return {"".join(s) for n in range(max_len + 1) for s in itertools.product(alphabet, repeat=n)
            if rx.fullmatch("".join(s))}


def allowed_next(language: set[str], prefix: str) -> set[str]:
    """The characters that may follow ``prefix`` in ``language`` (``""`` standing for the end)."""
    out = {s[len(prefix)] for s in language if len(s) > len(prefix) and s.startswith(prefix)}
    if prefix in language:
        out.add("")
    return out


def byte_vocabulary(extra: list[str] = ()) -> list[str | bytes]:
    """The tiny presets' vocabulary (runtime/byte_tokenizer.py: LFM2's 8 special tokens at their ids,
    then the 256 bytes; EOS ``<|im_end|>`` = 7) followed by the ``extra`` tokens (ids 264 on)."""
    from lfmspark.runtime.byte_tokenizer import SPECIAL_TOKENS

    return [*SPECIAL_TOKENS, *(bytes([b]) for b in range(256)), *extra]
