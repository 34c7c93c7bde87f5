"""LFM2's tool calls, read out of a model's output text: whole (:func:`parse_tool_calls`) or as the
text streams (:class:`ToolCallStream`, which the whole form runs too, so both agree).

LFM2 writes a call block between the special tokens ``<|tool_call_start|>`` and
``<|tool_call_end|>`` (the server has them spelled in the text: ``skip_special_tokens=False``). The
block holds a Python-style list of calls, ``[get_weather(location="Paris"), f(a=1)]``, or, when the
system prompt asks for JSON (and when the server constrains a call: serve/constraints.py), a JSON
list ``[{"name": "f", "arguments": {...}}]``. Text outside the blocks is the message's content.

The Python form is read with :mod:`ast` and literals only (strings, numbers, booleans, ``None``,
lists, tuples, dicts, and JSON's ``true`` / ``false`` / ``null``); nothing is ever evaluated. What a
model writes that Python does not parse is repaired before giving up, each repair tried only when
the text still fails: raw newlines and control characters inside strings are escaped, keyword names
that are Python keywords (``from=``) are renamed and restored, and a quote inside a string that
cannot close it (``cmd="say "hi" now"``) is escaped. A block that is still not a list of calls
(or an unclosed block at the end that is not one) stays text: its payload becomes content, without
the delimiters, as if special tokens had been skipped. Nothing but the start token opens a block,
so a bare ``[`` in prose never does, and the stream never lets a delimiter or a partial call into
the content: it holds back a block until it closes and a trailing prefix of a delimiter until it
is decided.
"""

from __future__ import annotations

import ast
import json
import keyword
import logging
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("lfmspark.serve")

TOOL_CALL_START = "<|tool_call_start|>"
TOOL_CALL_END = "<|tool_call_end|>"

_RENAMED = "_lfmspark_kw_"                      # a keyword name's stand-in while ast parses the text
_KEYWORD_ARG = re.compile(r"(?<![\w.])(" + "|".join(keyword.kwlist) + r")(\s*=)(?!=)")
_NEXT_ITEM = re.compile(r"\s*(?:[A-Za-z_][\w.]*\s*[=(]|[\"'\[{(\-0-9]|True\b|False\b|None\b|true\b|false\b|null\b)")


def new_call_id() -> str:
    """OpenAI's shape: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI's ``arguments``)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _NotACall(ValueError):
    """A block's payload is not a list of calls made of literals."""


# -- one block's payload --------------------------------------------------------------------------

def parse_calls(payload: str) -> list[ToolCall] | None:
    """The calls a block's payload holds (JSON or Python form), or None if it is not a call list
    (whatever the text: a model's output never makes this raise)."""
    text = payload.strip()
    if not text:
        return None
    try:
        if text.startswith("{") or (text.startswith("[") and text[1:].lstrip().startswith("{")):
            calls = _json_calls(text)
            if calls is not None:
                return calls
        return _python_calls(text)
    except Exception:                     # a parser bug must not fail the request: the block stays text
        log.warning("a tool-call block could not be read; it is returned as text", exc_info=True)
        return None


def _json_calls(text: str) -> list[ToolCall] | None:
    """``[{"name": ..., "arguments": {...}}, ...]`` (or one such object); ``arguments`` may be an
    object or its JSON text (``parameters`` is taken for it too). Raw control characters inside
    strings are accepted (``strict=False``)."""
    try:
        value = json.loads(text, strict=False)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args, strict=False)
            except (ValueError, RecursionError):
                return None
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall(item["name"], _arguments_json(args)))
    return calls or None


def _python_calls(text: str) -> list[ToolCall] | None:
    """The Python form, with the repairs of the module doc tried in turn while the text fails."""
    renamed = False
    for step in range(4):
        if step == 1:
            text = _escape_controls(text)
        elif step == 2:
            text, count = _rename_keywords(text)
            renamed = count > 0
        elif step == 3:
            text = _escape_controls(_requote(text))
            text, count = _rename_keywords(text)
            renamed = renamed or count > 0
        try:
            tree = ast.parse(text, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        try:
            return _calls_from_ast(tree.body, renamed)
        except (_NotACall, RecursionError):
            return None
    return None


def _calls_from_ast(node: ast.AST, renamed: bool) -> list[ToolCall]:
    nodes = node.elts if isinstance(node, ast.List) else [node]
    if not nodes:
        raise _NotACall("an empty list")
    calls = []
    for call in nodes:
        if not isinstance(call, ast.Call) or call.args:
            raise _NotACall("not a call with keyword arguments")
        name = _dotted_name(call.func)
        args: dict[str, Any] = {}
        for kw in call.keywords:
            if kw.arg is None:
                raise _NotACall("**kwargs")
            key = kw.arg
            if renamed and key.startswith(_RENAMED) and keyword.iskeyword(key[len(_RENAMED):]):
                key = key[len(_RENAMED):]
            args[key] = _literal(kw.value)
        calls.append(ToolCall(name, _arguments_json(args)))
    return calls


def _dotted_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise _NotACall("the called thing is not a name")


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST) -> Any:
    """A literal's value (the module doc lists what counts); anything else raises :class:`_NotACall`."""
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, float) and not math.isfinite(value):
            raise _NotACall("a non-finite number")
        if value is None or isinstance(value, (str, bool, int, float)):
            return value
        raise _NotACall(f"a {type(value).__name__} literal")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        value = node.operand.value
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if k is None:
                raise _NotACall("** in a dict")
            key = _literal(k)
            if isinstance(key, (dict, list)):
                raise _NotACall("a dict key that is not a scalar")
            out[key if isinstance(key, str) else json.dumps(key)] = _literal(v)
        return out
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise _NotACall(f"{type(node).__name__} is not a literal")


def _arguments_json(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


# -- repairs (each a no-op on text Python already parses) -------------------------------------------

def _string_spans(text: str) -> list[tuple[int, int]]:
    """Where the string literals are (start and end, quotes included; an unclosed one runs to the
    end), read as Python reads them but letting a single-quoted string cross a newline."""
    spans, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c not in "\"'":
            i += 1
            continue
        quote = text[i:i + 3] if text[i:i + 3] in ('"""', "'''") else c
        j = i + len(quote)
        while j < n and not text.startswith(quote, j):
            j += 2 if text[j] == "\\" else 1
        end = min(n, j + len(quote))
        spans.append((i, end))
        i = end
    return spans


def _escape_controls(text: str) -> str:
    """Raw newlines, tabs and other control characters inside string literals, escaped."""
    out, last = [], 0
    for start, end in _string_spans(text):
        out.append(text[last:start])
        out.append(re.sub(r"[\x00-\x1f]", lambda m: _CONTROL_ESCAPES.get(m.group(), f"\\x{ord(m.group()):02x}"),
                          text[start:end]))
        last = end
    out.append(text[last:])
    return "".join(out)


_CONTROL_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _rename_keywords(text: str) -> tuple[str, int]:
    """``from=`` -> ``_lfmspark_kw_from=`` outside string literals (restored after parsing)."""
    out, last, count = [], 0, 0
    for start, end in [*_string_spans(text), (len(text), len(text))]:
        code, n = _KEYWORD_ARG.subn(lambda m: _RENAMED + m.group(1) + m.group(2), text[last:start])
        out.append(code)
        out.append(text[start:end])
        count += n
        last = end
    return "".join(out), count


def _requote(text: str) -> str:
    """Escape each quote inside a single-quoted string that cannot close it: a closing quote is
    followed by the end, ``)``, ``]``, ``}`` or ``:``, or by a comma and what may follow one in a
    call list (a keyword name, a call, a value)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c not in "\"'" or text[i:i + 3] in ('"""', "'''"):
            out.append(c)
            i += 1
            continue
        out.append(c)
        j = i + 1
        while j < n:
            d = text[j]
            if d == "\\":
                out.append(text[j:j + 2])
                j += 2
                continue
            if d == c:
                rest = text[j + 1:].lstrip()
                if not rest or rest[0] in ")]}:" or (rest[0] == "," and _NEXT_ITEM.match(rest[1:])):
                    break
                out.append("\\" + c)
                j += 1
                continue
            out.append(d)
            j += 1
        if j < n:
            out.append(c)
        i = j + 1
    return "".join(out)


# -- the output: blocks among text ------------------------------------------------------------------

@dataclass
class ParsedOutput:
    """A whole output: its content (None when it holds calls and nothing but whitespace besides)
    and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


class ToolCallStream:
    """Splits text, as it streams, into content and calls. :meth:`feed` and :meth:`finish` return
    pieces in order: ``str`` for content, :class:`ToolCall` for a call (whole: a call is handed
    out once its block has closed, or at the end for an unclosed block that parses). Content that
    is only whitespace so far is held: at the end it is dropped if there were calls (a message
    whose content is whitespace around calls has none). ``parallel=False`` keeps the first call
    only (OpenAI's ``parallel_tool_calls``)."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._in_block = False
        self._blank = ""               # whitespace-only content held while no other content was sent
        self._sent_text = False

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        pieces: list[str | ToolCall] = []
        while True:
            if self._in_block:
                end = self._buffer.find(TOOL_CALL_END)
                if end < 0:
                    return pieces
                self._close_block(self._buffer[:end], pieces)
                self._buffer = self._buffer[end + len(TOOL_CALL_END):]
                self._in_block = False
                continue
            start = self._buffer.find(TOOL_CALL_START)
            if start >= 0:
                self._content(self._buffer[:start], pieces)
                self._buffer = self._buffer[start + len(TOOL_CALL_START):]
                self._in_block = True
                continue
            keep = _partial_delimiter(self._buffer)
            self._content(self._buffer[:len(self._buffer) - keep], pieces)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return pieces

    def finish(self) -> list[str | ToolCall]:
        """The end of the text: an unclosed block is read as it stands, held text is let go."""
        pieces: list[str | ToolCall] = []
        if self._in_block:
            self._close_block(self._buffer, pieces)
        else:
            self._content(self._buffer, pieces)
        self._buffer, self._in_block = "", False
        if self._blank and not self.calls:
            pieces.append(self._blank)
        self._blank = ""
        return pieces

    def _close_block(self, payload: str, pieces: list) -> None:
        calls = parse_calls(payload)
        if calls is None:
            self._content(payload, pieces)
            return
        for call in calls:
            if self.parallel or not self.calls:
                self.calls.append(call)
                pieces.append(call)

    def _content(self, text: str, pieces: list) -> None:
        # an orphan end delimiter (LFM2 sometimes repeats one), a start inside a block that failed
        text = text.replace(TOOL_CALL_END, "").replace(TOOL_CALL_START, "")
        if not text:
            return
        if not self._sent_text and not text.strip():
            self._blank += text
            return
        if self._blank:
            text, self._blank = self._blank + text, ""
        self._sent_text = True
        pieces.append(text)


def _partial_delimiter(text: str) -> int:
    """How many trailing characters of ``text`` begin a delimiter (held until the next text decides)."""
    for k in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        tail = text[-k:]
        if TOOL_CALL_START.startswith(tail) or TOOL_CALL_END.startswith(tail):
            return k
    return 0


def parse_tool_calls(text: str, parallel: bool = True) -> ParsedOutput:
    """A whole output's content and calls (the stream's pieces, joined)."""
    stream = ToolCallStream(parallel)
    pieces = stream.feed(text) + stream.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    if stream.calls and not content.strip():
        return ParsedOutput(None, stream.calls)
    return ParsedOutput(content, stream.calls)


# -- the other way: calls written back into a conversation's history --------------------------------

def render_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """A block in LFM2's Python form, for an assistant turn of the history whose calls the chat
    template does not render (LFM2's drops ``tool_calls``):
    ``<|tool_call_start|>[f(a=1, b="x")]<|tool_call_end|>``."""
    body = ", ".join(f"{name}({', '.join(f'{k}={_python_literal(v)}' for k, v in args.items())})"
                     for name, args in calls)
    return f"{TOOL_CALL_START}[{body}]{TOOL_CALL_END}"


def _python_literal(value: Any) -> str:
    """A JSON value as a Python literal (a JSON string's escapes are valid in Python too)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {_python_literal(v)}"
                               for k, v in value.items()) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")
