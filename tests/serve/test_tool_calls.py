"""The LFM2 tool-call parser and the reasoning split, on crafted outputs: whole, and streamed in
every split (each streamed result equals the whole one); the history's calls rendered back."""

from __future__ import annotations

import json

import pytest

from lfmspark.serve.chat_output import ChoiceParser, OutputPlan
from lfmspark.serve.reasoning import ReasoningStream, prompt_opens_reasoning, split_reasoning
from lfmspark.serve.tool_calls import (TOOL_CALL_END, TOOL_CALL_START, ToolCall, ToolCallStream, parse_calls,
                                       parse_tool_calls, render_calls)
from lfmspark.serve.tools import ToolRequest, prepare_messages

S, E = TOOL_CALL_START, TOOL_CALL_END


def calls_of(text: str, **kw) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(text, **kw).tool_calls]


def test_a_single_call():
    out = parse_tool_calls(f'{S}[get_weather(location="Paris")]{E}')
    assert out.content is None and len(out.tool_calls) == 1
    call = out.tool_calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"location": "Paris"}
    assert call.id.startswith("call_") and len(call.id) == 29
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": call.arguments}}


def test_parallel_calls_and_the_text_around_them():
    out = parse_tool_calls(f'Let me check. {S}[get_weather(location="Paris"), get_time(tz="CET")]{E}Checking both.')
    assert out.content == "Let me check. Checking both."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"location": "Paris"}), ("get_time", {"tz": "CET"})]
    assert len({c.id for c in out.tool_calls}) == 2
    # two blocks, and parallel_tool_calls=false keeping the first call
    two = f"{S}[a(x=1)]{E}{S}[b(y=2)]{E}"
    assert calls_of(two) == [("a", {"x": 1}), ("b", {"y": 2})]
    assert calls_of(two, parallel=False) == [("a", {"x": 1})]


def test_nested_values_and_literals():
    text = f'{S}[f(a=1, b=-2.5, c=[1, "x", None], d={{"k": {{"n": True}}}}, e=(1, 2), g=true, h=null, i=false)]{E}'
    assert calls_of(text) == [("f", {"a": 1, "b": -2.5, "c": [1, "x", None], "d": {"k": {"n": True}},
                                     "e": [1, 2], "g": True, "h": None, "i": False})]


@pytest.mark.parametrize("payload, args", [
    ('[run(cmd="echo \\"hi\\"")]', {"cmd": 'echo "hi"'}),                      # escaped quotes
    ("[run(cmd='it\\'s', other=\"a'b\")]", {"cmd": "it's", "other": "a'b"}),   # mixed quotes
    ('[run(cmd="say "hi" now", n=2)]', {"cmd": 'say "hi" now', "n": 2}),        # nested unescaped quotes
    ('[run(cmd="line1\nline2\tend")]', {"cmd": "line1\nline2\tend"}),            # raw newline inside a string
    ('[run(cmd="""multi\nline""")]', {"cmd": "multi\nline"}),
    ('[run(text="a, b=c)")]', {"text": "a, b=c)"}),
])
def test_quoted_arguments(payload, args):
    assert calls_of(S + payload + E) == [("run", args)]


def test_python_keyword_names():
    text = f'{S}[book(from="Paris", to="Oslo", class="eco", lambda=1, import=True)]{E}'
    assert calls_of(text) == [("book", {"from": "Paris", "to": "Oslo", "class": "eco", "lambda": 1, "import": True})]
    # a keyword inside a string stays as it is
    assert calls_of(f'{S}[say(text="from=here", from="x")]{E}') == [("say", {"text": "from=here", "from": "x"})]


def test_the_json_form():
    text = f'{S}[{{"name": "f", "arguments": {{"a": 1}}}}, {{"name": "g", "arguments": "{{\\"b\\": [2]}}"}}]{E}'
    assert calls_of(text) == [("f", {"a": 1}), ("g", {"b": [2]})]
    assert calls_of(f'{S}{{"name": "f", "arguments": {{}}}}{E}') == [("f", {})]
    assert calls_of(f'{S}[{{"name":"f","arguments":{{"s":"x\ny"}}}}]{E}') == [("f", {"s": "x\ny"})]


def test_dotted_names_and_calls_without_brackets():
    assert calls_of(f'{S}[math.add(a=1)]{E}') == [("math.add", {"a": 1})]
    assert calls_of(f'{S}f(a=1){E}') == [("f", {"a": 1})]


@pytest.mark.parametrize("payload", [
    "[f(a=1]", "[f(1, 2)]", "[f(**x)]", "[f(a=os.system('x'))]", "[f(a=g())]", "[f(a=x)]", "[]", "[1, 2]",
    "not a call", "[f(a=1)] trailing", '[{"name": 3}]', '[{"name": "f", "arguments": [1]}]', "[f(a=1e999)]",
    "[f(a=b'x')]", "", "   ",
])
def test_malformed_calls_stay_text(payload):
    assert parse_calls(payload) is None
    out = parse_tool_calls(f"Before {S}{payload}{E} after")
    assert out.tool_calls == [] and out.content == f"Before {payload} after"      # the delimiters are dropped


def test_a_bare_bracket_never_opens_a_call():
    for text in ["See [1] and [f(a=1)].", "[get_weather(location='Paris')]", "a [ b", "[{\"name\": \"f\"}]"]:
        out = parse_tool_calls(text)
        assert out.tool_calls == [] and out.content == text


def test_an_unclosed_block_at_the_end():
    assert calls_of(f'{S}[f(a=1)]') == [("f", {"a": 1})]                 # the model stopped after the list
    out = parse_tool_calls(f'Hi {S}[f(a="unfinish')
    assert out.tool_calls == [] and out.content == 'Hi [f(a="unfinish'


def test_an_orphan_end_delimiter_is_dropped():
    assert parse_tool_calls(f"text{E} more").content == "text more"
    assert parse_tool_calls(f"{S}{S}[x{S}").content == "[x"


def stream_pieces(text: str, cuts: list[int], parallel: bool = True) -> tuple[str, list[ToolCall]]:
    s = ToolCallStream(parallel)
    pieces = []
    last = 0
    for cut in [*cuts, len(text)]:
        new = s.feed(text[last:cut])
        for p in new:                 # never a delimiter or a piece of a block in the content
            if isinstance(p, str):
                assert S not in p and E not in p
        pieces += new
        last = cut
    pieces += s.finish()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]


STREAMED = [
    f'Sure {S}[get_weather(location="Paris"), f(from=1)]{E} done',
    f'{S}[{{"name": "f", "arguments": {{"a": "x]y"}}}}]{E}',
    f'  \n{S}[f(a=1)]{E}\n',
    'Text with [brackets] and <|tool partial-looking text <|tool_call_en',
    f'{S}[f(a=1]{E}tail',
    f'{S}[f(a="unclosed',
]


@pytest.mark.parametrize("text", STREAMED)
def test_streaming_equals_the_whole_parse_in_every_split(text):
    whole = parse_tool_calls(text)
    for step in (1, 2, 3, 7, len(text)):
        content, calls = stream_pieces(text, list(range(step, len(text), step)))
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
        assert (content or None if calls else content) == whole.content


def test_streaming_holds_a_block_until_it_closes():
    s = ToolCallStream()
    assert s.feed("Hi ") == ["Hi "]
    assert s.feed(S + "[f(a=") == []
    assert s.feed("1)]") == []
    out = s.feed(E + " ok")
    assert isinstance(out[0], ToolCall) and out[0].name == "f" and out[1:] == [" ok"]
    assert s.finish() == []


def test_history_calls_render_back_into_lfm2s_form_and_parse():
    args = {"from": "Paris", "n": 2, "ok": True, "none": None, "l": [1, 'a"b'], "d": {"k": False}, "s": "x\ny"}
    block = render_calls([("book", args), ("g", {})])
    assert block.startswith(S + '[book(from="Paris", n=2, ok=True') and block.endswith("g()]" + E)
    assert calls_of(block) == [("book", args), ("g", {})]


def test_prepare_messages_writes_calls_into_the_assistant_turn():
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
                {"role": "function", "name": "get_weather", "content": "legacy"}]
    out = prepare_messages(messages, template_renders_calls=False)
    assert out[1] == {"role": "assistant", "content": f'{S}[get_weather(city="Paris")]{E}'}
    assert out[2] == messages[2] and out[3]["role"] == "tool" and out[0] is messages[0]
    native = prepare_messages(messages, template_renders_calls=True)[1]
    assert native["content"] == "" and native["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


@pytest.mark.parametrize("opened, text, reasoning, content", [
    (False, "<think>Let me see.</think>\n\nThe answer.", "Let me see.", "The answer."),
    (False, "\n<think>a</think>b", "a", "b"),
    (False, "No reasoning here. <think>x</think>", None, "No reasoning here. <think>x</think>"),
    (False, "<think>cut short", "cut short", ""),
    (True, "still thinking</think>  Answer", "still thinking", "Answer"),
    (True, "never closed", "never closed", ""),
    (False, "<thinker>", None, "<thinker>"),
    (False, "", None, ""),
])
def test_reasoning_split_whole_and_streamed(opened, text, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)
    for step in (1, 2, 5):
        s = ReasoningStream(opened)
        pieces = []
        for i in range(0, len(text), step):
            pieces += s.feed(text[i:i + step])
        pieces += s.finish()
        assert "".join(t for k, t in pieces if k == "reasoning") == (reasoning or "")
        assert "".join(t for k, t in pieces if k == "content") == content


def test_a_prompt_that_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<think>a</think><|im_start|>assistant\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_a_call_inside_reasoning_is_reasoning_and_the_answer_is_parsed():
    tools = ToolRequest([{"type": "function", "function": {"name": "f"}}], "auto")
    text = f"<think>maybe {S}[f(a=0)]{E}?</think>\n{S}[f(a=1)]{E}"
    parser = ChoiceParser(OutputPlan(reasoning=False, tools=tools))
    message = parser.message(text)
    assert message["reasoning_content"] == f"maybe {S}[f(a=0)]{E}?" and message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"a": 1}]
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"
    # streamed: the call as two deltas (name first, then the arguments), OpenAI's order
    streamed = ChoiceParser(OutputPlan(reasoning=False, tools=tools))
    deltas = [d for ch in text for d in streamed.feed(ch)] + streamed.finish()
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "f", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert calls[1] == {"index": 0, "function": {"arguments": '{"a": 1}'}}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert not any("content" in d for d in deltas)
