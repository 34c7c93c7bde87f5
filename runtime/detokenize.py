"""A request's output text, built as tokens arrive: incremental decoding and stop strings.

Re-decoding the whole output on every event costs O(n) per event, O(n^2) per request, on the
thread that runs the loop (the real LFM2 tokenizer: 1.56 ms for 4,096 tokens, so 64 long streams
would spend ~100 ms of host time per 4 ms round). :class:`TextStream` decodes a sliding window
instead, as vLLM's detokenizer does: the text the new tokens add is ``decode(window + new)`` minus
``decode(window)``, where the window is the few tokens since the last complete character. Both
decodes start at the same token, so a tokenizer that drops a leading space or merges across token
boundaries treats them alike, and the deltas concatenate to the full decode. A trailing U+FFFD (a
character whose UTF-8 bytes are split across tokens, not all generated yet) is held back until
the character completes.

Stop strings are searched in the text as it grows (from just before the previous end, so a match
that spans two rounds is found); the text is cut at the match (after it with
``include_stop_str_in_output``), and the last ``len(longest stop) - 1`` characters are held back
from the stream until it is decided whether they start a stop string.

Special tokens are left out of the text unless ``skip_special_tokens`` is off (a server that parses
LFM2's tool-call delimiters, which are special tokens, needs them spelled).
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._prefix = 0          # window start: tokens before it are fully in ``text``
        self._read = 0            # tokens up to here are in ``text`` (up to a held-back partial character)
        self._partial = 0         # characters of the window's unfinished piece already in ``text``
        self.text = ""            # the output text so far (cut at a stop string once one matched)
        self.sent = 0             # characters of ``text`` already handed to the stream
        self.stop_string: str | None = None

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def push(self, ids: list[int]) -> bool:
        """Bring ``text`` up to ``ids`` (the whole output so far); True if a stop string matched (``text``
        is then cut there and no later call changes it)."""
        if self.stop_string is not None:
            return True
        before = len(self.text)
        decode = self._decode
        prefix_text = decode(ids[self._prefix:self._read])
        new_text = decode(ids[self._prefix:])
        complete = not new_text.endswith(_REPLACEMENT)
        if not complete:
            new_text = new_text.rstrip(_REPLACEMENT)
        piece = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self.text += piece[self._partial:]
        if complete:
            # the window moves past text that is in; a span that decoded to nothing (special tokens)
            # stays in it, so the next piece is still decoded after real text (joins and spaces)
            if piece:
                self._prefix = self._read
            self._read, self._partial = len(ids), 0
        else:
            self._partial = max(self._partial, len(piece))
        return self._match(before)

    def finish(self, ids: list[int]) -> None:
        """The request ended: whatever was held back as a partial character is final (as a full
        decode renders it)."""
        if self.stop_string is None and ids[self._prefix:]:
            prefix_text = self._decode(ids[self._prefix:self._read])
            new_text = self._decode(ids[self._prefix:])
            piece = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
            before = len(self.text)
            self.text += piece[self._partial:]
            self._match(before)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def take(self, final: bool) -> str:
        """The text not yet streamed; while running, minus what might still start a stop string."""
        decided = final or self.stop_string is not None
        end = len(self.text) if decided else max(self.sent, len(self.text) - self._holdback)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta

    def _match(self, before: int) -> bool:
        if not self._stop:
            return False
        start = max(0, before - self._holdback)
        best = None
        for s in self._stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.stop_string = s
        self.text = self.text[:i + len(s) if self._include_stop else i]
        return True
