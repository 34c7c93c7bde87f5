"""The request fields that constrain an output, and the grammars the server writes: a forced tool
call and a constraint after a reasoning block, checked with llguidance's matcher on the tool
checkpoint's tokenizer (tags as special tokens) and on the presets' byte tokenizer (tags as text)."""

from __future__ import annotations

import json

import pytest

from lfmspark.runtime.byte_tokenizer import byte_tokenizer
from lfmspark.runtime.structured import GrammarCache, StructuredOutputsParams
from lfmspark.serve.constraints import Constraint, Tags, after_reasoning, request_constraint, tool_call_grammar
from lfmspark.serve.protocol import UnsupportedParameter
from lfmspark.serve.tool_calls import TOOL_CALL_END, TOOL_CALL_START, parse_tool_calls
from lfmspark.serve.tools import tool_request
from tool_fixtures import ID, VOCAB, tool_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["h"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tagged():
    """The tool tokenizer (tags are special tokens) and its grammar cache."""
    tok = tool_tokenizer()
    return tok, GrammarCache(tok, VOCAB, (ID["<|im_end|>"],))


@pytest.fixture(scope="module")
def plain():
    """The presets' byte tokenizer (no tool or think tokens: the tags are text)."""
    tok = byte_tokenizer()
    return tok, GrammarCache(tok, 264, (7,))


def accepts(setup, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the grammar takes ``text`` whole and may end there."""
    tok, cache = setup
    matcher = cache.compile(params).deep_copy()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("fields, expected, param", [
    (dict(response_format={"type": "json_object"}), StructuredOutputsParams(json_object=True), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                   "strict": True}}),
     StructuredOutputsParams(json={"type": "object"}), "response_format"),
    (dict(structured_outputs={"regex": "[a-z]+"}), StructuredOutputsParams(regex="[a-z]+"), "structured_outputs"),
    (dict(structured_outputs={"choice": ["a", "b"]}), StructuredOutputsParams(choice=("a", "b")), "structured_outputs"),
    (dict(guided={"guided_json": {"type": "string"}}), StructuredOutputsParams(json={"type": "string"}),
     "guided_json"),
    (dict(guided={"guided_choice": ["x"]}), StructuredOutputsParams(choice=("x",)), "guided_choice"),
    (dict(guided={"guided_grammar": 'start: "a"'}), StructuredOutputsParams(grammar='start: "a"'), "guided_grammar"),
])
def test_each_field_maps_onto_the_engines_constraint(fields, expected, param):
    guided = {"guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None}
    guided.update(fields.get("guided", {}))
    got = request_constraint(fields.get("response_format"), fields.get("structured_outputs"), guided)
    assert got == Constraint(expected, param)


def test_text_and_nothing_are_no_constraint():
    assert request_constraint({"type": "text"}, None, {}) is None
    assert request_constraint(None, None, {"guided_json": None}) is None


@pytest.mark.parametrize("args, param", [
    (({"type": "xml"}, None, {}), "response_format"),
    (({"type": "json_schema", "json_schema": {"schema": 3}}, None, {}), "response_format"),
    (({"type": "json_schema", "json_schema": {"name": "x", "bogus": 1}}, None, {}), "response_format"),
    (({"type": "json_object", "x": 1}, None, {}), "response_format"),
    ((None, {"regex": "a", "choice": ["b"]}, {}), "structured_outputs"),
    ((None, {"whitespace_pattern": " "}, {}), "structured_outputs"),
    ((None, {"choice": []}, {}), "structured_outputs"),
    (({"type": "json_object"}, {"regex": "a"}, {}), "structured_outputs"),
    ((None, None, {"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
    ((None, None, {"guided_json": "{not json"}), "guided_json"),
])
def test_malformed_constraints_are_400s_naming_the_field(args, param):
    with pytest.raises(UnsupportedParameter) as err:
        request_constraint(*args)
    assert err.value.param == param and param in str(err.value)


def forced(tools, choice="required", parallel=None):
    return tool_request(tools, choice, parallel, None, None)


def block(*calls) -> str:
    body = ",".join(json.dumps({"name": n, "arguments": a}, separators=(",", ":")) for n, a in calls)
    return f"{TOOL_CALL_START}[{body}]{TOOL_CALL_END}"


@pytest.mark.parametrize("setup_name", ["tagged", "plain"])
def test_a_named_function_is_forced_with_valid_arguments(setup_name, request):
    setup = request.getfixturevalue(setup_name)
    named = forced([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    grammar = tool_call_grammar(named, Tags.of(setup[0]), None)
    good = block(("get_weather", {"city": "Paris"}))
    assert accepts(setup, grammar, good)
    assert parse_tool_calls(good).tool_calls[0].name == "get_weather"          # the parser reads it back
    for bad in [block(("get_time", {"h": 3})), block(("get_weather", {"city": "Rome"})),
                block(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})),
                block(("get_weather", {"city": "Paris", "x": 1})), '[get_weather(city="Paris")]',
                block(("get_weather", {"city": "Paris"})).replace('":"', '": "')]:        # JSON is compact
        assert not accepts(setup, grammar, bad), bad


def test_required_takes_any_tool_and_parallel_calls_unless_told_not_to(tagged):
    tags = Tags.of(tagged[0])
    required = tool_call_grammar(forced([WEATHER, TIME]), tags, None)
    two = block(("get_time", {"h": 23}), ("get_weather", {"city": "Oslo"}))
    assert accepts(tagged, required, block(("get_time", {"h": 7}))) and accepts(tagged, required, two)
    assert not accepts(tagged, required, block(("get_time", {"h": 24})))
    assert not accepts(tagged, required, f"{TOOL_CALL_START}[]{TOOL_CALL_END}")
    single = tool_call_grammar(forced([WEATHER, TIME], parallel=False), tags, None)
    assert accepts(tagged, single, block(("get_time", {"h": 7}))) and not accepts(tagged, single, two)
    assert [c.name for c in parse_tool_calls(two).tool_calls] == ["get_time", "get_weather"]


def test_tags_follow_the_tokenizer(tagged, plain):
    assert Tags.of(tagged[0]).tool_start == TOOL_CALL_START and Tags.of(tagged[0]).think_tokens
    assert Tags.of(plain[0]).tool_start == json.dumps(TOOL_CALL_START) and not Tags.of(plain[0]).think_tokens


def test_parameters_that_are_not_an_object_are_refused():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    with pytest.raises(UnsupportedParameter) as err:
        tool_call_grammar(forced([bad]), Tags(), None)
    assert err.value.param == "tool_choice"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.mark.parametrize("setup_name", ["tagged", "plain"])
@pytest.mark.parametrize("constraint, answer, wrong", [
    (StructuredOutputsParams(json=SCHEMA), '{"a":1}', '{"a":"x"}'),
    (StructuredOutputsParams(json_object=True), '{"k":[1]}', "[1]"),
    (StructuredOutputsParams(regex="[a-c]+/x"), "abc/x", "abd/x"),
    (StructuredOutputsParams(choice=("yes", "no")), "no", "maybe"),
    (StructuredOutputsParams(grammar='start: "n=" NUM\nNUM: /[0-9]+/'), "n=42", "n=x"),
])
def test_a_constraint_applies_after_the_reasoning(setup_name, constraint, answer, wrong, request):
    setup = request.getfixturevalue(setup_name)
    tags = Tags.of(setup[0])
    closed = after_reasoning(Constraint(constraint, "response_format"), tags, opened=False)
    assert closed.param == "response_format"
    assert accepts(setup, closed.params, answer)                                    # no reasoning block
    assert accepts(setup, closed.params, f"<think>free {{ text\n</think>\n\n{answer}")
    assert not accepts(setup, closed.params, f"<think>free</think>\n\n{wrong}")
    assert not accepts(setup, closed.params, f"<think>free</think>{' ' * 9}{answer}")   # bounded whitespace
    opened = after_reasoning(Constraint(constraint, "response_format"), tags, opened=True)
    assert accepts(setup, opened.params, f"the rest of it</think>\n{answer}")
    assert not accepts(setup, opened.params, answer)                                # the block must close


def test_a_forced_call_after_the_reasoning(tagged):
    grammar = tool_call_grammar(forced([WEATHER]), Tags.of(tagged[0]), True)
    assert accepts(tagged, grammar, "thinking...</think>\n" + block(("get_weather", {"city": "Paris"})))
