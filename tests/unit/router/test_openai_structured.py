"""The OpenAI / vLLM structured-output parameters and chat tool messages -> the wire: every
spelling maps to one StructuredOutput; conflicting, malformed and over-cap specs are a 400
naming the parameter, before any node sees them."""

from __future__ import annotations

import json

import pytest

from pdserve.structured_output import StructuredOutputParams
from router.http.openai_errors import OpenAIError
from router.http.openai_protocol import parse_chat, parse_completion

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def spec_of(body: dict) -> StructuredOutputParams | None:
    sampling = parse_chat({**BASE, **body}).choices[0].request.sampling
    if not sampling.HasField("structured_output"):
        return None
    return StructuredOutputParams.from_proto(sampling.structured_output)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputParams.json_object()),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "A", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputParams.json_schema(SCHEMA),
        ),  # fmt: skip
        ({"guided_json": SCHEMA}, StructuredOutputParams.json_schema(SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputParams.json_schema(SCHEMA)),
        ({"guided_regex": "[0-9]+"}, StructuredOutputParams.regex("[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputParams.choice(["yes", "no"])),
        ({"guided_grammar": 'start: "a"'}, StructuredOutputParams.grammar('start: "a"')),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputParams.json_schema(SCHEMA)),
        ({"structured_outputs": {"regex": "x+"}}, StructuredOutputParams.regex("x+")),
        ({"structured_outputs": {"choice": ["a"]}}, StructuredOutputParams.choice(["a"])),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputParams.json_object()),
        (
            {"guided_regex": "a", "guided_decoding_backend": "auto"},
            StructuredOutputParams.regex("a"),
        ),
    ],
)
def test_each_spelling_maps_to_one_spec(body, expected) -> None:
    assert spec_of(body) == expected


def test_completions_take_them_too() -> None:
    parsed = parse_completion({"model": "m", "prompt": "x", "guided_choice": ["a", "b"]})
    message = parsed.choices[0].request.sampling.structured_output
    assert StructuredOutputParams.from_proto(message) == StructuredOutputParams.choice(["a", "b"])


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"response_format": "json"}, "response_format", "object"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format",
            "name",
        ),  # fmt: skip
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex, guided_choice", "one"),
        (
            {"response_format": {"type": "json_object"}, "guided_json": SCHEMA},
            "response_format, guided_json",
            "one",
        ),  # fmt: skip
        ({"guided_json": {"enum": list(range(5000))}}, "guided_json", "enum"),
        ({"guided_json": 3}, "guided_json", "schema"),
        ({"guided_regex": "((x{1000}){1000}){1000}"}, "guided_regex", "repetition"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_json": "{'not': json"}, "guided_json", "JSON"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "one of"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
        (
            {"guided_decoding_backend": "outlines", "guided_regex": "a"},
            "guided_decoding_backend",
            "llguidance",
        ),  # fmt: skip
    ],
)
def test_bad_specs_are_400s_naming_the_parameter(body, param, words) -> None:
    with pytest.raises(OpenAIError) as refused:
        spec_of(body)
    assert refused.value.param == param
    assert words.lower() in refused.value.message.lower()


def test_hostile_schema_is_refused_quickly() -> None:
    """Deep nesting is refused by the cheap checks, not by a compile."""
    deep = '{"type":"object","properties":{"a":' * 3000 + "{}" + "}}" * 3000
    with pytest.raises(OpenAIError) as refused:
        spec_of({"guided_json": deep})
    assert "nest" in refused.value.message or "depth" in refused.value.message


def test_tool_messages_reach_the_wire() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    chat = parse_chat({**BASE, "messages": messages}).choices[0].request.messages.messages
    assert [m.role for m in chat] == ["user", "assistant", "tool"]
    (call,) = chat[1].tool_calls
    assert (call.id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert chat[2].tool_call_id == "call_1" and chat[2].content == "sunny"


@pytest.mark.parametrize(
    "message",
    [
        {"role": "tool", "content": "x"},  # no tool_call_id
        {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        {"role": "user", "content": "x", "audio": {}},
    ],
)
def test_bad_tool_messages_are_400s(message) -> None:
    with pytest.raises(OpenAIError) as refused:
        parse_chat({**BASE, "messages": [message]})
    assert refused.value.param == "messages"
