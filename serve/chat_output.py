"""One chat choice's output as the client sees it: its reasoning, content and tool calls, whole
(``message``) or as stream deltas (``delta``).

The text goes through the reasoning split first (serve/reasoning.py), then its answer through the
tool-call parser (serve/tool_calls.py): a call inside the reasoning is reasoning, not a call. A
streamed call comes as two deltas, OpenAI's order: its index, id, type and name (arguments empty),
then its arguments, whole. ``finish_reason`` is ``"tool_calls"`` (``"function_call"`` for a legacy
request) when the output ended by itself (``"stop"``) holding calls; an output cut short
(``"length"``) keeps its reason, and the calls it completed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .reasoning import ReasoningStream
from .tool_calls import ToolCall, ToolCallStream
from .tools import ToolRequest


@dataclass(frozen=True)
class OutputPlan:
    """How a chat request's outputs are read. ``reasoning``: None without a reasoning parser, else
    whether the prompt opened the reasoning block; ``tools``: the request's tools (parsed unless
    ``tool_choice`` is ``"none"``)."""

    reasoning: bool | None = None
    tools: ToolRequest | None = None

    @property
    def parses_tools(self) -> bool:
        return self.tools is not None and self.tools.parses

    @property
    def active(self) -> bool:
        """Anything to split out of the text: then special tokens are spelled (the delimiters and
        tags may be special tokens), and the text is parsed."""
        return self.reasoning is not None or self.parses_tools


class ChoiceParser:
    """One choice's text, parsed as it streams: :meth:`feed` and :meth:`finish` return deltas."""

    def __init__(self, plan: OutputPlan):
        self.reasoning = ReasoningStream(plan.reasoning) if plan.reasoning is not None else None
        self.tools = ToolCallStream(plan.tools.parallel) if plan.parses_tools else None
        self.legacy = plan.tools is not None and plan.tools.legacy

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        pieces = self.reasoning.feed(text) if self.reasoning is not None else [("content", text)]
        return self._deltas(pieces, final=False)

    def finish(self) -> list[dict]:
        pieces = self.reasoning.finish() if self.reasoning is not None else []
        return self._deltas(pieces, final=True)

    def finish_reason(self, reason: str | None) -> str | None:
        if self.calls and reason == "stop":
            return "function_call" if self.legacy else "tool_calls"
        return reason

    def _deltas(self, pieces: list[tuple[str, str]], final: bool) -> list[dict]:
        out: list[dict] = []
        for kind, text in pieces:
            if kind == "reasoning":
                _append(out, "reasoning_content", text)
            elif self.tools is None:
                _append(out, "content", text)
            else:
                self._answer(self.tools.feed(text), out)
        if final and self.tools is not None:
            self._answer(self.tools.finish(), out)
        return out

    def _answer(self, pieces: list[str | ToolCall], out: list[dict]) -> None:
        for piece in pieces:
            if isinstance(piece, str):
                _append(out, "content", piece)
            elif self.legacy:
                out.append({"function_call": {"name": piece.name, "arguments": ""}})
                out.append({"function_call": {"arguments": piece.arguments}})
            else:
                index = self.calls.index(piece)
                out.append({"tool_calls": [{"index": index, "id": piece.id, "type": "function",
                                            "function": {"name": piece.name, "arguments": ""}}]})
                out.append({"tool_calls": [{"index": index, "function": {"arguments": piece.arguments}}]})

    def message(self, text: str) -> dict:
        """The whole message of an output whose text is ``text`` (a fresh parser's)."""
        deltas = self.feed(text) + self.finish()
        content = "".join(d.get("content", "") for d in deltas)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        has_reasoning = self.reasoning is not None and self.reasoning.has_block
        message: dict = {"role": "assistant",
                         "content": content if content or not (self.calls or has_reasoning) else None}
        if has_reasoning:
            message["reasoning_content"] = reasoning
        if self.calls:
            if self.legacy:
                message["function_call"] = {"name": self.calls[0].name, "arguments": self.calls[0].arguments}
            else:
                message["tool_calls"] = [c.to_openai() for c in self.calls]
        return message


def _append(out: list[dict], key: str, text: str) -> None:
    """Add text to the last delta when it is of the same kind (one chunk per kind and event)."""
    if not text:
        return
    if out and set(out[-1]) == {key}:
        out[-1][key] += text
    else:
        out.append({key: text})
