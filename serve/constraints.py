"""Structured output on the API, and the grammars the server writes for forced tool calls and for
a constraint that follows a reasoning block.

A request names its constraint in one of these fields (a 400 names the field when two are given):
``response_format`` (OpenAI: ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}``; ``{"type": "text"}`` is none), vLLM's ``structured_outputs``
(``{json | json_object | regex | choice | grammar}``) and its older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``. Each maps onto the engine's
:class:`StructuredOutputsParams`, which the engine enforces at every position with speculation on
(runtime/structured.py). The server compiles it before submitting (off the event loop), so a
constraint the grammar engine refuses is a 400 naming the field, with llguidance's message.

Forced tool calls (``tool_choice: "required"`` or a named function) are a Lark grammar in
llguidance's dialect: ``<|tool_call_start|>`` then a JSON list of calls, each
``{"name": <one of the allowed functions>, "arguments": <valid against its parameters>}`` (an
embedded ``%json`` schema), then ``<|tool_call_end|>``; the tool parser reads that JSON form back.
One call, or one or more for ``"required"`` with ``parallel_tool_calls``. JSON is compact, as for
every schema the engine compiles: free whitespace lets a model pad forever.

With a reasoning parser on, the constraint applies to the answer only: the grammar lets a
``<think>`` block of free text come first (or, when the chat template opened the block, requires
the rest of it and its ``</think>``), then at most 8 whitespace characters, then the answer. When
the tags are special tokens the grammar names them as tokens, which free text cannot contain, so
the block ends exactly at ``</think>``; when they are plain text the block is a lazy regex that
ends at the first ``</think>``. The answer is the constraint as a Lark rule: an embedded ``%json``
schema, a regex, the choices, or the request's own grammar nested with ``%lark { ... }``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..runtime.structured import JSON_DEFAULTS, StructuredOutputsParams
from .protocol import UnsupportedParameter
from .reasoning import THINK_END, THINK_START
from .tool_calls import TOOL_CALL_END, TOOL_CALL_START
from .tools import ToolRequest

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
THINK_WHITESPACE = 8          # characters of whitespace allowed between </think> and a constrained answer


@dataclass(frozen=True)
class Constraint:
    """A request's constraint and the parameter it came from (the one a refusal names)."""

    params: StructuredOutputsParams
    param: str


def request_constraint(response_format: dict | None, structured_outputs: dict | None,
                       guided: dict[str, Any]) -> Constraint | None:
    """The constraint a request asks for, checked for shape (a 400 naming the field), or None."""
    if response_format is not None and response_format.get("type") == "text":
        _only(response_format, {"type"}, "response_format")
        response_format = None
    given = [name for name, value in (("response_format", response_format), ("structured_outputs", structured_outputs),
                                      *guided.items()) if value is not None]
    if len(given) > 1:
        raise UnsupportedParameter(given[1], f"{given[1]} and {given[0]} both constrain the output: send one")
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        params = _response_format(response_format)
    elif name == "structured_outputs":
        params = _structured_outputs(structured_outputs)
    else:
        value = guided[name]
        params = StructuredOutputsParams(**{GUIDED[name]: tuple(value) if isinstance(value, list) else value})
    try:
        params.validate()
    except ValueError as e:
        raise UnsupportedParameter(name, f"{name}: {e}") from None
    if params.json is not None:
        _schema(params.json, name)
    return Constraint(params, name)


def _response_format(rf: dict) -> StructuredOutputsParams:
    kind = rf.get("type")
    if kind == "json_object":
        _only(rf, {"type"}, "response_format")
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        _only(rf, {"type", "json_schema"}, "response_format")
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise UnsupportedParameter("response_format", "response_format.json_schema must be an object "
                                       "{'name', 'schema', 'strict'}")
        _only(spec, {"name", "description", "schema", "strict"}, "response_format", "response_format.json_schema")
        schema = spec.get("schema")
        if schema is None:
            return StructuredOutputsParams(json_object=True)
        if not isinstance(schema, dict):
            raise UnsupportedParameter("response_format", "response_format.json_schema.schema must be a JSON schema "
                                       "object")
        return StructuredOutputsParams(json=schema)
    raise UnsupportedParameter("response_format", f"response_format type must be 'text', 'json_object' or "
                               f"'json_schema', got {kind!r}")


def _structured_outputs(so: dict) -> StructuredOutputsParams:
    _only(so, set(_STRUCTURED_KEYS), "structured_outputs")
    fields = {k: v for k, v in so.items() if v is not None}
    if isinstance(fields.get("choice"), list):
        fields["choice"] = tuple(fields["choice"])
    return StructuredOutputsParams(**fields)


def _only(obj: dict, allowed: set[str], param: str, where: str | None = None) -> None:
    extra = set(obj) - allowed
    if extra:
        raise UnsupportedParameter(param, f"{where or param} has unknown fields {sorted(extra)} (it takes "
                                   f"{', '.join(sorted(allowed))})")


def _schema(schema: dict | str, param: str) -> dict:
    """A JSON schema as an object (its JSON text parsed)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise UnsupportedParameter(param, f"{param}: the schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise UnsupportedParameter(param, f"{param}: a JSON schema must be an object")
    return schema


# -- grammars --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tags:
    """How a grammar writes LFM2's tags: as special tokens (``<|tool_call_start|>``, llguidance's
    token syntax) where the tokenizer has them as such, else as quoted text."""

    tool_start: str = json.dumps(TOOL_CALL_START)
    tool_end: str = json.dumps(TOOL_CALL_END)
    think_start: str = json.dumps(THINK_START)
    think_end: str = json.dumps(THINK_END)

    @classmethod
    def of(cls, tokenizer) -> Tags:
        specials = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                    if getattr(t, "special", False)}
        pick = lambda text: text if text in specials else json.dumps(text)   # noqa: E731
        return cls(pick(TOOL_CALL_START), pick(TOOL_CALL_END), pick(THINK_START), pick(THINK_END))

    @property
    def think_tokens(self) -> bool:
        return not self.think_start.startswith('"') and not self.think_end.startswith('"')


def tool_call_grammar(tools: ToolRequest, tags: Tags, reasoning: bool | None) -> StructuredOutputsParams:
    """The forced call of ``tools`` (module doc); ``reasoning``: None without a reasoning parser,
    else whether the prompt opened the reasoning block."""
    calls = [_call_schema(fn, tools.param) for fn in tools.functions()]
    array: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                             "minItems": 1}
    if tools.choice == "named" or not tools.parallel:
        array["maxItems"] = 1
    answer = f"answer: {tags.tool_start} calls {tags.tool_end}\ncalls: %json {_json_text(array)}"
    return StructuredOutputsParams(grammar=_with_reasoning(answer, tags, reasoning))


def _call_schema(fn: dict[str, Any], param: str) -> dict[str, Any]:
    args = dict(fn.get("parameters") or {"type": "object"})
    if args.get("type", "object") != "object":
        raise UnsupportedParameter(param, f"{param}: the function {fn['name']!r} takes parameters of type "
                                   f"{args['type']!r}, and a forced call's parameters must be an object schema")
    args.setdefault("type", "object")
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": args},
            "required": ["name", "arguments"], "additionalProperties": False}


def after_reasoning(constraint: Constraint, tags: Tags, opened: bool) -> Constraint:
    """``constraint`` applied to the answer that follows a reasoning block (module doc)."""
    p = constraint.params
    if p.json is not None or p.json_object:
        schema = {"type": "object"} if p.json_object else _schema(p.json, constraint.param)
        answer = f"answer: %json {_json_text(schema)}"
    elif p.regex is not None:
        import llguidance

        answer = f"answer: /{llguidance.regex_to_lark(p.regex)}/"
    elif p.choice is not None:
        answer = "answer: " + " | ".join(json.dumps(c) for c in p.choice)
    else:
        answer = f"answer: %lark {{\n{p.grammar}\n}}"
    return Constraint(StructuredOutputsParams(grammar=_with_reasoning(answer, tags, opened)), constraint.param)


def _json_text(schema: dict[str, Any]) -> str:
    """A schema for ``%json``, with the engine's JSON defaults (compact) unless it sets its own."""
    options = {**JSON_DEFAULTS, **(schema.get("x-guidance") or {})}
    return json.dumps({**schema, "x-guidance": options})


def _with_reasoning(answer: str, tags: Tags, opened: bool | None) -> str:
    """The grammar: ``answer`` alone, or after a reasoning block (module doc)."""
    if opened is None:
        return f"start: answer\n{answer}"
    space = f"THINK_WS: /[ \\t\\r\\n]{{0,{THINK_WHITESPACE}}}/"
    if tags.think_tokens:
        rest = f"REASONING {tags.think_end} THINK_WS"
        rules = f"REASONING: /(.|\\n)*/\n{space}"
    else:
        rest = "think_body THINK_WS"
        end = THINK_END.replace("/", "\\/")
        rules = f"think_body[lazy]: /(.|\\n)*{end}/\n{space}"
    if opened:
        return f"start: {rest} answer\n{rules}\n{answer}"
    return f"start: think? answer\nthink: {tags.think_start} {rest}\n{rules}\n{answer}"
