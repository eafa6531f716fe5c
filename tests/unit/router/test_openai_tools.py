"""Tools in the chat API: `tools` / `tool_choice` parsing (a forced choice becomes a grammar),
the Hermes parser whole and streamed in any split, and OpenAI's tool_calls shape."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.structured_output import StructuredOutputParams
from router.http.openai_errors import OpenAIError
from router.http.openai_protocol import parse_chat
from router.http.tools.parsers import HermesParser, parse_all
from router.http.tools.tool_output import ToolOutput

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse(**body):
    return parse_chat({**BASE, **body})


def spec_of(parsed) -> StructuredOutputParams | None:
    sampling = parsed.choices[0].request.sampling
    if not sampling.HasField("structured_output"):
        return None
    return StructuredOutputParams.from_proto(sampling.structured_output)


def test_tools_reach_the_wire_and_auto_is_the_default() -> None:
    parsed = parse(tools=[WEATHER, TIME])
    assert parsed.tools.mode == "auto" and spec_of(parsed) is None
    wire = parsed.choices[0].request.messages.tools
    assert [t.name for t in wire] == ["get_weather", "get_time"]
    assert json.loads(wire[0].parameters) == WEATHER["function"]["parameters"]
    assert wire[1].parameters == ""


def test_empty_tools_and_none() -> None:
    assert parse(tools=[]).tools.mode == "none"
    assert parse(tools=[WEATHER], tool_choice="none").tools.mode == "none"
    assert spec_of(parse(tools=[WEATHER], tool_choice="none")) is None


def test_named_choice_forces_the_arguments_schema() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    parsed = parse(tools=[WEATHER, TIME], tool_choice=choice)
    assert parsed.tools.mode == "named"
    expected = StructuredOutputParams.json_schema(WEATHER["function"]["parameters"])
    assert spec_of(parsed) == expected


def test_required_forces_an_array_of_calls() -> None:
    parsed = parse(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(spec_of(parsed).spec)
    good = [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    jsonschema.validate(good, schema)
    for bad in ([], good * 2, [{"name": "nope", "arguments": {}}], [{"name": "get_weather"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [TIME, TIME]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),  # fmt: skip
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tools_are_400s(body, param) -> None:
    with pytest.raises(OpenAIError) as refused:
        parse(**body)
    assert refused.value.param == param


OUTPUT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_hermes_whole_output() -> None:
    parsed = parse_all(HermesParser(), OUTPUT)
    assert parsed.content == "Let me check.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    broken = parse_all(HermesParser(), "a <tool_call>{not json</tool_call> b <tool")
    assert broken.calls == [] and broken.content == "a <tool_call>{not json b <tool"


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_streamed_in_any_split_gives_the_whole_outputs_parts(size) -> None:
    parser = HermesParser()
    content, calls = "", []
    for i in range(0, len(OUTPUT), size):
        out = parser.feed(OUTPUT[i : i + size])
        assert "<" not in out.content  # a tag's start is held back, never leaked
        content += out.content
        calls += out.calls
    last = parser.finish()
    whole = parse_all(HermesParser(), OUTPUT)
    assert (content + last.content, calls + last.calls) == (whole.content, whole.calls)


def test_auto_message_and_stream_shapes() -> None:
    request = parse(tools=[WEATHER, TIME]).tools
    message, finish = ToolOutput(request).message(OUTPUT, "stop")
    assert finish == "tool_calls" and message["content"] == "Let me check.\n\n"
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    stream = ToolOutput(request)
    pieces = [OUTPUT[i : i + 5] for i in range(0, len(OUTPUT), 5)]
    deltas = [stream.delta(p, "stop" if i == len(pieces) - 1 else None) for i, p in
              enumerate(pieces)]  # fmt: skip
    assert deltas[-1][1] == "tool_calls"
    streamed = [c for d, _ in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in streamed] == [0, 1]
    assert "".join(d.get("content", "") for d, _ in deltas) == "Let me check.\n\n"


def test_named_stream_sends_the_name_once_then_argument_fragments() -> None:
    request = parse(tools=[WEATHER], tool_choice={"type": "function",
                                                  "function": {"name": "get_weather"}}).tools  # fmt: skip
    stream = ToolOutput(request)
    first, _ = stream.delta('{"city"', None)
    second, finish = stream.delta(': "Paris"}', "stop")
    (call,) = first["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert call["index"] == 0 and call["id"].startswith("call_")
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": ': "Paris"}'}}]}
    assert finish == "tool_calls"
    message, _ = ToolOutput(request).message('{"city": "Paris"}', "stop")
    assert message["content"] is None
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


def test_required_output_becomes_calls() -> None:
    request = parse(tools=[WEATHER, TIME], tool_choice="required").tools
    text = json.dumps([{"name": "get_time", "arguments": {}}])
    message, finish = ToolOutput(request).message(text, "stop")
    assert finish == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "get_time"
    stream = ToolOutput(request)
    assert stream.delta(text[:5], None) == ({}, None)
    delta, finish = stream.delta(text[5:], "stop")
    assert delta["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    cut, finish = ToolOutput(request).message(text[:8], "length")
    assert cut == {"role": "assistant", "content": text[:8]} and finish == "length"
