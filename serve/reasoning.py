"""Reasoning split from the answer: ``<think>...</think>`` (``--reasoning-parser``).

LFM2.5's thinking models (and Qwen3, DeepSeek-R1) write their reasoning between ``<think>`` and
``</think>``, then the answer. With a reasoning parser on, the server returns the reasoning as
``message.reasoning_content`` (streamed as ``delta.reasoning_content``) and the answer as
``content``. vLLM names the parsers ``qwen3`` and ``deepseek_r1``; lfmspark takes those names and
``lfm2`` for one parser that reads both layouts: the output opens with ``<think>`` (Qwen3), or the
chat template already opened it at the end of the prompt (DeepSeek-R1: the server reads the
prompt's last tokens, :func:`prompt_opens_reasoning`), so the output starts inside the reasoning
and only closes it. An output that neither opens nor continues a reasoning block is all content.
An unclosed block (the output ran out mid-thought) is all reasoning. Whitespace between
``</think>`` and the answer is dropped.

The split is a stream (:class:`ReasoningStream`), which the whole form (:func:`split_reasoning`)
runs too, so both agree: a tag split across deltas is held back until it is decided.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("lfm2", "qwen3", "deepseek_r1")


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether a rendered prompt (its last characters, special tokens spelled) leaves a reasoning
    block open for the output: its last ``<think>`` comes after its last ``</think>``."""
    start = prompt_tail.rfind(THINK_START)
    return start >= 0 and prompt_tail.rfind(THINK_END) < start


class ReasoningStream:
    """Splits text, as it streams, into ``("reasoning", text)`` and ``("content", text)`` pieces.
    ``opened``: the prompt opened the block (module doc)."""

    def __init__(self, opened: bool = False):
        self._state = "reasoning" if opened else "start"
        self._buffer = ""
        self.has_block = opened             # a reasoning block was opened (by the prompt or the output)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buffer += text
        pieces: list[tuple[str, str]] = []
        while self._buffer:
            if self._state == "start":
                head = self._buffer.lstrip()
                if head.startswith(THINK_START):
                    self._buffer = head[len(THINK_START):]
                    self._state = "reasoning"
                    self.has_block = True
                elif THINK_START.startswith(head):
                    break                                   # undecided: "<thi" or only whitespace so far
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                end = self._buffer.find(THINK_END)
                if end >= 0:
                    _add(pieces, "reasoning", self._buffer[:end])
                    self._buffer = self._buffer[end + len(THINK_END):]
                    self._state = "after"
                    continue
                keep = _partial(self._buffer, THINK_END)
                _add(pieces, "reasoning", self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            elif self._state == "after":
                self._buffer = self._buffer.lstrip()
                if self._buffer:
                    self._state = "content"
            else:
                _add(pieces, "content", self._buffer)
                self._buffer = ""
        return pieces

    def finish(self) -> list[tuple[str, str]]:
        """The end of the text: what was held back is let go as what it was part of."""
        pieces: list[tuple[str, str]] = []
        if self._state == "start":
            _add(pieces, "content", self._buffer)
        elif self._state == "reasoning":
            _add(pieces, "reasoning", self._buffer)
        self._buffer = ""
        return pieces

    @property
    def in_answer(self) -> bool:
        """Past the reasoning (or there was none): what comes now is the answer."""
        return self._state in ("after", "content")


def _add(pieces: list[tuple[str, str]], kind: str, text: str) -> None:
    if text:
        pieces.append((kind, text))


def _partial(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` begin ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """A whole output's reasoning (None without a block) and content."""
    stream = ReasoningStream(opened)
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return (reasoning if stream.has_block else None), content
