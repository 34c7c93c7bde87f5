"""The request side of tool calling on ``/v1/chat/completions``: what ``tools`` / ``tool_choice``
/ ``parallel_tool_calls`` (and the legacy ``functions`` / ``function_call``) ask for, and the
conversation history made ready for the chat template.

``tool_choice``: ``"auto"`` (the default with tools) lets the model call or answer; ``"required"``
and a named function (``{"type": "function", "function": {"name": ...}}``) force a call by
constraining the output (serve/constraints.py); ``"none"`` keeps the tools in the prompt, as OpenAI
and vLLM do (vLLM leaves them out only with ``--exclude-tools-when-tool-choice-none``), but bans
the ``<|tool_call_start|>`` token, so no call can start, and the output is not parsed. Legacy
``functions`` become ``tools`` and ``function_call`` becomes ``tool_choice``; such a request is
answered in the legacy shape (``message.function_call``, ``finish_reason: "function_call"``).

History: an assistant turn's ``tool_calls`` (its ``content`` may be null) is written back into
LFM2's Python call form ahead of its content, since LFM2's template drops ``tool_calls`` (it would
render ``null``); a template that renders ``tool_calls`` itself gets them as they are, arguments
parsed into objects as transformers' templates expect. ``role: "tool"`` turns go to the template,
which wraps them in ``<|tool_response_start|>...<|tool_response_end|>``; legacy ``role: "function"``
turns become tool turns.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .protocol import UnsupportedParameter
from .tool_calls import render_calls

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")      # OpenAI's function names
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and how it may use them. ``choice``: ``"none"``, ``"auto"``,
    ``"required"`` or ``"named"`` (``named`` is the function); ``legacy``: asked through
    ``functions`` (answered with ``function_call``)."""

    tools: list[dict[str, Any]]
    choice: str
    named: str | None = None
    parallel: bool = True
    legacy: bool = False

    @property
    def parses(self) -> bool:
        """The output is read for calls (any choice but ``"none"``)."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """A call is forced by a grammar (``"required"`` or a named function)."""
        return self.choice in ("required", "named")

    @property
    def param(self) -> str:
        """The parameter a refusal of the forcing constraint names."""
        return "function_call" if self.legacy else "tool_choice"

    def functions(self) -> list[dict[str, Any]]:
        """The function definitions a forced call may use (the named one, or all)."""
        fns = [t["function"] for t in self.tools]
        return [f for f in fns if f["name"] == self.named] if self.choice == "named" else fns


def tool_request(tools: list | None, tool_choice: Any, parallel_tool_calls: bool | None,
                 functions: list | None, function_call: Any) -> ToolRequest | None:
    """The request's tools, checked (a 400 naming the parameter), or None without tools."""
    legacy = functions is not None or function_call is not None
    if tools is not None and functions is not None:
        raise UnsupportedParameter("functions", "functions is the legacy form of tools: send one of them")
    if tool_choice is not None and function_call is not None:
        raise UnsupportedParameter("function_call", "function_call is the legacy form of tool_choice: send one "
                                   "of them")
    if functions is not None:
        if not isinstance(functions, list):
            raise UnsupportedParameter("functions", "functions must be a list of function definitions")
        tools = [{"type": "function", "function": f} for f in functions]
        tool_choice = _legacy_choice(function_call)
    param = "functions" if legacy else "tools"
    checked = _check_tools(tools, param) if tools is not None else []
    names = {t["function"]["name"] for t in checked}
    choice, named = _check_choice(tool_choice, names, "function_call" if legacy else "tool_choice")
    if not checked:
        if choice not in (None, "none"):
            which = "function_call" if legacy else "tool_choice"
            raise UnsupportedParameter(which, f"{which} {choice!r} needs {param}: none were given")
        if parallel_tool_calls is not None and not legacy:
            raise UnsupportedParameter("parallel_tool_calls", "parallel_tool_calls is only allowed with tools")
        return None
    return ToolRequest(checked, choice or "auto", named, parallel=parallel_tool_calls is not False and not legacy,
                       legacy=legacy)


def _legacy_choice(function_call: Any) -> Any:
    if function_call is None or isinstance(function_call, str):
        return function_call
    if isinstance(function_call, dict) and set(function_call) == {"name"}:
        return {"type": "function", "function": {"name": function_call["name"]}}
    raise UnsupportedParameter("function_call", "function_call must be 'none', 'auto' or {'name': ...}")


def _check_tools(tools: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise UnsupportedParameter(param, f"{param} must be a non-empty list of function tools")
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise UnsupportedParameter(param, f"{where} must be {{'type': 'function', 'function': {{...}}}}: only "
                                       "function tools are supported")
        extra = set(tool) - {"type", "function"}
        if extra:
            raise UnsupportedParameter(param, f"{where} has unknown fields {sorted(extra)}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise UnsupportedParameter(param, f"{where}.function.name must be 1-64 letters, digits, '_', '.' or "
                                       f"'-', got {name!r}")
        if name in seen:
            raise UnsupportedParameter(param, f"{where}: the function name {name!r} is given twice")
        seen.add(name)
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise UnsupportedParameter(param, f"{where}.function has unknown fields {sorted(unknown)}")
        if "description" in fn and not isinstance(fn["description"], str):
            raise UnsupportedParameter(param, f"{where}.function.description must be a string")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise UnsupportedParameter(param, f"{where}.function.parameters must be a JSON schema object")
        if "strict" in fn and not isinstance(fn["strict"], bool) and fn["strict"] is not None:
            raise UnsupportedParameter(param, f"{where}.function.strict must be true or false")
        out.append({"type": "function", "function": fn})
    return out


def _check_choice(choice: Any, names: set[str], param: str) -> tuple[str | None, str | None]:
    if choice is None:
        return None, None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise UnsupportedParameter(param, f"{param} must be one of {', '.join(CHOICES)} or a named function, "
                                       f"got {choice!r}")
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
        if names and name not in names:
            raise UnsupportedParameter(param, f"{param} names the function {name!r}, which is not among the tools "
                                       f"({', '.join(sorted(names))})")
        return "named", name
    raise UnsupportedParameter(param, f"{param} must be 'none', 'auto', 'required' or "
                               "{'type': 'function', 'function': {'name': ...}}")


# -- the history ------------------------------------------------------------------------------------

def prepare_messages(messages: list[dict[str, Any]], template_renders_calls: bool) -> list[dict[str, Any]]:
    """The messages as the chat template should see them (module doc); a malformed call in the
    history is a 400 naming ``messages``. Messages without calls pass unchanged."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        if m.get("role") == "function":                     # legacy function result
            m = {**m, "role": "tool"}
        calls = _history_calls(m, i)
        if calls is None:
            out.append(m)
            continue
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "function_call")}
        text = _text(m.get("content"), i)
        if template_renders_calls:
            m["content"] = text
            m["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}, **({"id": c} if c else {})}
                               for n, a, c in calls]
        else:
            try:
                m["content"] = render_calls([(n, a) for n, a, _ in calls]) + text
            except RecursionError:
                raise UnsupportedParameter("messages", f"messages[{i}].tool_calls: arguments nested too deeply") \
                    from None
        out.append(m)
    return out


def _history_calls(m: dict[str, Any], i: int) -> list[tuple[str, dict, str | None]] | None:
    """An assistant turn's calls (name, arguments, id), from ``tool_calls`` or a legacy ``function_call``."""
    raw = m.get("tool_calls")
    legacy = m.get("function_call")
    if raw is None and legacy is None:
        return None
    where = f"messages[{i}]"
    if m.get("role") != "assistant":
        raise UnsupportedParameter("messages", f"{where}: only assistant messages carry tool_calls")
    if raw is None:
        raw = [{"type": "function", "function": legacy}]
    if not isinstance(raw, list):
        raise UnsupportedParameter("messages", f"{where}.tool_calls must be a list")
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise UnsupportedParameter("messages", f"{where}.tool_calls[{j}] must be {{'type': 'function', "
                                       "'function': {'name': ..., 'arguments': ...}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError) as e:
                raise UnsupportedParameter("messages", f"{where}.tool_calls[{j}].function.arguments is not valid "
                                           f"JSON: {e}") from None
        if not isinstance(args, dict):
            raise UnsupportedParameter("messages", f"{where}.tool_calls[{j}].function.arguments must be a JSON "
                                       "object")
        call_id = call.get("id")
        calls.append((fn["name"], args, call_id if isinstance(call_id, str) else None))
    return calls


def _text(content: Any, i: int) -> str:
    """An assistant turn's content as text (null with calls is empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise UnsupportedParameter("messages", f"messages[{i}].content must be a string, text parts or null")
