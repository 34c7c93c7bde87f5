"""Tool calling, structured output and reasoning through the server, with the official openai
client, on a tiny random-weight checkpoint whose tokenizer holds LFM2's tool tokens
(tool_fixtures.py). Random weights say nothing sensible, so the tests force what they check: a
named or required tool choice and a JSON schema are constraints, which the output must satisfy
whatever the weights; elsewhere the parsed message must be the parse of the raw tokens, streamed
or not."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch

from lfmspark.runtime import Engine
from lfmspark.serve import make_server_app
from lfmspark.serve.reasoning import split_reasoning
from lfmspark.serve.tool_calls import TOOL_CALL_END, TOOL_CALL_START, parse_tool_calls
from server_fixtures import Served
from tool_fixtures import ID, save_tool_checkpoint

MODEL = "tiny-tools"
WEATHER_ARGS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"], "additionalProperties": False}
TIME_ARGS = {"type": "object", "properties": {"tz": {"enum": ["CET", "UTC"]}}, "required": ["tz"],
             "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_ARGS}}]
ARGS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
CLOSE_BRACE = str(len(ID) + ord("}"))          # the byte token "}"


def serve(root, thinking: bool = False, **options) -> Served:
    target, draft = save_tool_checkpoint(root, thinking)
    engine = Engine.from_pretrained(target, draft, dtype=torch.float32, device="cpu", max_seq_len=1024, max_batch=2)
    return Served(make_server_app(engine, MODEL, warmup=False, **options))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = serve(tmp_path_factory.mktemp("tools"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A template that opens <think> in the generation prompt, served with the reasoning parser."""
    s = serve(tmp_path_factory.mktemp("thinking"), thinking=True, reasoning_parser="lfm2")
    yield s
    s.stop()


def raw_text(served: Served, token_ids: list[int]) -> str:
    """The output as the model wrote it, special tokens spelled, less the EOS that ended it."""
    ids = token_ids[:-1] if token_ids and token_ids[-1] == ID["<|im_end|>"] else token_ids
    return httpx.post(served.url + "/detokenize", json={"tokens": ids}).json()["prompt"]


def streamed(chunks) -> dict:
    """A streamed choice put together: content, reasoning, calls (by index) and the finish reason,
    checking OpenAI's order: a call's id and name come before its arguments."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "function_call": None}
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta
        out["content"] += d.content or ""
        out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
        for t in d.tool_calls or []:
            if t.index not in out["calls"]:
                assert t.id.startswith("call_") and t.function.name and t.type == "function"
                out["calls"][t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
            out["calls"][t.index]["arguments"] += t.function.arguments or ""
        if d.function_call is not None:
            fc = out["function_call"] or {"name": "", "arguments": ""}
            fc["name"] += d.function_call.name or ""
            fc["arguments"] += d.function_call.arguments or ""
            out["function_call"] = fc
        if c.finish_reason:
            out["finish"] = c.finish_reason
    assert TOOL_CALL_START not in out["content"] and TOOL_CALL_END not in out["content"]
    return out


@pytest.mark.parametrize("choice, parallel", [
    ({"type": "function", "function": {"name": "get_weather"}}, None),
    ({"type": "function", "function": {"name": "get_time"}}, True),
    ("required", False),
])
def test_a_forced_call_is_valid_and_parses_streamed_or_not(served, choice, parallel):
    c = served.client()
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=96, temperature=0.0)
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    whole = c.chat.completions.create(**kw)
    choice_out = whole.choices[0]
    assert choice_out.finish_reason == "tool_calls" and choice_out.message.content is None
    calls = choice_out.message.tool_calls
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
    if isinstance(choice, dict):
        assert calls[0].function.name == choice["function"]["name"]
    jsonschema.validate(json.loads(calls[0].function.arguments), ARGS[calls[0].function.name])
    s = streamed(c.chat.completions.create(stream=True, **kw))
    assert s["finish"] == "tool_calls" and s["content"] == ""
    assert [(v["name"], v["arguments"]) for v in s["calls"].values()] == [(calls[0].function.name,
                                                                           calls[0].function.arguments)]


def test_the_next_turn_takes_the_call_and_its_result(served):
    c = served.client()
    first = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=96, temperature=0.0,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sun"}'}]
    assert history[2]["role"] == "assistant" and "content" not in history[2]
    second = c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0.0)
    # the prompt the server ran is the template's rendering, the call written back in LFM2's form
    rendered = httpx.post(served.url + "/tokenize", json={"messages": history, "tools": TOOLS}).json()
    assert second.usage.prompt_tokens == rendered["count"]
    text = httpx.post(served.url + "/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    args = json.loads(call.function.arguments)
    assert f'{TOOL_CALL_START}[get_weather(city="{args["city"]}", days={args["days"]})]{TOOL_CALL_END}' in text
    assert '<|tool_response_start|>{"forecast": "sun"}<|tool_response_end|>' in text
    assert "List of tools: <|tool_list_start|>[" in text and '"name": "get_weather"' in text


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_what_the_model_wrote(served, stream):
    """Whatever random weights write, the message is the parse of the raw tokens (a call block is
    opened by biasing its start token: what follows is rarely a valid call, and stays text)."""
    c = served.client()
    for bias in ({}, {str(ID[TOOL_CALL_START]): 100}):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=24, temperature=0.0, logit_bias=bias,
                  extra_body={"return_token_ids": True})
        whole = c.chat.completions.create(**kw).choices[0]
        raw = raw_text(served, whole.model_extra["token_ids"])
        parsed = parse_tool_calls(raw)
        assert whole.message.content == parsed.content
        assert [(t.function.name, t.function.arguments) for t in whole.message.tool_calls or []] == \
            [(t.name, t.arguments) for t in parsed.tool_calls]
        if stream:
            s = streamed(c.chat.completions.create(stream=True, **kw))
            assert s["content"] == (parsed.content or "") and s["finish"] == whole.finish_reason
        if bias:
            assert whole.model_extra["token_ids"][0] == ID[TOOL_CALL_START]


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_bans_a_call(served):
    c = served.client()
    bias = {str(ID[TOOL_CALL_START]): 100}
    auto = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4, logit_bias=bias,
                                     extra_body={"return_token_ids": True})
    none = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4,
                                     logit_bias=bias, extra_body={"return_token_ids": True})
    assert ID[TOOL_CALL_START] in auto.choices[0].model_extra["token_ids"]
    assert ID[TOOL_CALL_START] not in none.choices[0].model_extra["token_ids"]
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens          # the same prompt, tools included
    assert none.choices[0].message.tool_calls is None


def test_legacy_functions_answer_with_function_call(served):
    c = served.client()
    kw = dict(model=MODEL, messages=ASK, functions=[t["function"] for t in TOOLS], function_call={"name": "get_time"},
              max_tokens=64, temperature=0.0)
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "function_call" and whole.message.tool_calls is None
    assert whole.message.function_call.name == "get_time"
    jsonschema.validate(json.loads(whole.message.function_call.arguments), TIME_ARGS)
    s = streamed(c.chat.completions.create(stream=True, **kw))
    assert s["finish"] == "function_call" and s["function_call"] == whole.message.function_call.model_dump()


@pytest.mark.parametrize("kw, param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools"),
    (dict(tools=TOOLS, functions=[TOOLS[0]["function"]]), "functions"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
          tool_choice="required"), "tool_choice"),
    (dict(messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), "messages"),
    (dict(messages=[*ASK, {"role": "user", "content": "x", "tool_calls": []}]), "messages"),
    (dict(extra_body={"chat_template_kwargs": {"tools": []}}), "chat_template_kwargs"),
])
def test_tool_requests_it_cannot_honour_are_400s_naming_the_parameter(served, kw, param):
    args = dict(model=MODEL, messages=ASK, max_tokens=4) | kw
    with pytest.raises(openai.BadRequestError) as err:
        served.client().chat.completions.create(**args)
    assert err.value.body["param"] == param and param in err.value.body["message"]
    assert served.engine.engine.scheduler.pool.in_use == 0


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_response_validates_on_chat_and_completions(served, stream):
    c = served.client()
    chat = dict(model=MODEL, messages=ASK, max_tokens=80, temperature=0.0, response_format=json_schema_format(PERSON))
    completion = dict(model=MODEL, prompt="A person:", max_tokens=80, temperature=0.7, seed=3,
                      extra_body={"response_format": json_schema_format(PERSON)})
    if stream:
        text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **chat)
                       if ch.choices)
        ctext = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **completion))
    else:
        text = c.chat.completions.create(**chat).choices[0].message.content
        ctext = c.completions.create(**completion).choices[0].text
    jsonschema.validate(json.loads(text), PERSON)
    jsonschema.validate(json.loads(ctext), PERSON)


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"json_object": True}},
])
def test_json_object_parses(served, extra):
    out = served.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0.0,
                                                  logit_bias={CLOSE_BRACE: 20}, extra_body=extra)
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
    ({"guided_regex": "[a-c]{3}-[0-9]"}, lambda t: len(t) == 5 and t[3] == "-" and t[4].isdigit()),
    ({"structured_outputs": {"grammar": 'start: "n=" /[0-9]{1,2}/'}}, lambda t: t.startswith("n=")),
    ({"guided_json": {"type": "integer", "minimum": 1, "maximum": 9}}, lambda t: 1 <= int(t) <= 9),
])
def test_vllm_fields_constrain_completions(served, extra, check):
    out = served.client().completions.create(model=MODEL, prompt="Answer:", max_tokens=16, temperature=0.0,
                                             extra_body=extra)
    assert check(out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize("endpoint, extra, param", [
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/missing"}}}},
     "response_format"),
    ("completions", {"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ("completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("chat", {"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(served, endpoint, extra, param):
    c = served.client()
    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "chat":
            c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
        else:
            c.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param and err.value.body["message"].startswith(param)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_splits_from_the_answer(thinking, stream):
    """The template opened <think>: the output is reasoning until </think>, whatever it says."""
    c = thinking.client()
    kw = dict(model=MODEL, messages=ASK, max_tokens=24, temperature=0.0, extra_body={"return_token_ids": True})
    whole = c.chat.completions.create(**kw).choices[0]
    reasoning, content = split_reasoning(raw_text(thinking, whole.model_extra["token_ids"]), opened=True)
    assert whole.message.model_extra["reasoning_content"] == reasoning and reasoning
    assert whole.message.content == (content or None)
    if stream:
        s = streamed(c.chat.completions.create(stream=True, **kw))
        assert s["reasoning"] == reasoning and s["content"] == content


@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_applies_to_the_answer_after_the_reasoning(thinking, stream):
    """A bias on </think> closes the reasoning at once; the answer after it follows the schema."""
    c = thinking.client()
    kw = dict(model=MODEL, messages=ASK, max_tokens=80, temperature=0.0, logit_bias={str(ID["</think>"]): 100},
              response_format=json_schema_format(PERSON))
    if stream:
        s = streamed(c.chat.completions.create(stream=True, **kw))
        content, reasoning = s["content"], s["reasoning"]
    else:
        message = c.chat.completions.create(**kw).choices[0].message
        content, reasoning = message.content, message.model_extra["reasoning_content"]
    assert reasoning == ""
    jsonschema.validate(json.loads(content), PERSON)


def test_a_forced_call_after_the_reasoning(thinking):
    out = thinking.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=64, temperature=0.0, logit_bias={str(ID["</think>"]): 100}).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.tool_calls[0].function.name == "get_time"
    jsonschema.validate(json.loads(out.message.tool_calls[0].function.arguments), TIME_ARGS)
