"""Logprobs in the OpenAI response shapes (and vLLM's ``prompt_logprobs``), from the engine's
:class:`~lfmspark.runtime.logprobs.TokenLogprobs`. A token is shown as its decoded text; without a
tokenizer as ``token_id:N`` (vLLM's ``return_tokens_as_token_ids`` form). JSON has no infinity: a
log-probability of ``-inf`` is written as -9999.0, as OpenAI does."""

from __future__ import annotations

import math

from ..runtime.logprobs import TokenLogprobs

_FLOOR = -9999.0


class TokenText:
    """Decoded text of single tokens, cached (a service shows the same tokens again and again)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._widths: dict[int, int] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            self._cache[token_id] = text
        return text

    def width(self, token_id: int) -> int:
        """The characters the token adds to the returned text, which skips special tokens (an EOS
        shows as ``<|im_end|>`` among the logprobs but adds nothing to the text)."""
        width = self._widths.get(token_id)
        if width is None:
            width = len(self.tokenizer.decode([token_id], skip_special_tokens=True)) if self.tokenizer else 0
            self._widths[token_id] = width
        return width


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


def completion_logprobs(records: list[TokenLogprobs], text: TokenText, offset: int = 0,
                        end: int | None = None) -> dict:
    """The legacy completions form: ``tokens``, ``token_logprobs``, ``top_logprobs`` (text -> logprob)
    and ``text_offset``: where each token's text starts in the returned text, counting from
    ``offset``, as vLLM counts (the lengths of the tokens before it), a skipped special token adding
    nothing, and never past ``end`` (the returned text's length: a stop string cuts the text, not
    the tokens)."""
    tokens = [text(r.token_id) for r in records]
    offsets = []
    for r in records:
        offsets.append(offset if end is None else min(offset, end))
        offset += text.width(r.token_id)
    return {"tokens": tokens, "token_logprobs": [_finite(r.logprob) for r in records],
            "top_logprobs": [{text(i): _finite(v) for i, v in r.top} for r in records], "text_offset": offsets}


def chat_logprobs(records: list[TokenLogprobs], text: TokenText) -> dict:
    """The chat form: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    def entry(token_id: int, logprob: float) -> dict:
        t = text(token_id)
        return {"token": t, "logprob": _finite(logprob), "bytes": list(t.encode("utf-8", errors="replace"))}

    return {"content": [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(i, v) for i, v in r.top]}
                        for r in records]}


def prompt_logprobs(records: list[TokenLogprobs | None], text: TokenText) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token ``None`` (the first) or ``{token id: {logprob,
    rank, decoded_token}}`` holding the prompt token and the most likely ones."""
    out: list[dict | None] = []
    for r in records:
        if r is None:
            out.append(None)
            continue
        entries = {str(i): {"logprob": _finite(v), "rank": k + 1, "decoded_token": text(i)}
                   for k, (i, v) in enumerate(r.top)}
        entries[str(r.token_id)] = {"logprob": _finite(r.logprob), "rank": r.rank, "decoded_token": text(r.token_id)}
        out.append(entries)
    return out
