"""Tools in the chat template: a template that reads `tools` gets them as transformers passes
them; one that does not (ChatML, SmolLM2's) gets the Hermes rendering (a system message with
the tools, calls in <tool_call> tags, results in <tool_response> tags)."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.chat_tools import chat_inputs, hermes_messages
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import generation_pb2
from tests.unit.pdserve.text_fixtures import build_byte_level_tokenizer

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def wire_chat() -> generation_pb2.ChatMessages:
    chat = generation_pb2.ChatMessages()
    chat.messages.add(role="user", content="Weather in Paris?")
    assistant = chat.messages.add(role="assistant")
    assistant.tool_calls.add(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    chat.messages.add(role="tool", content="sunny", tool_call_id="call_1")
    function = TOOL["function"]
    chat.tools.add(
        name=function["name"],
        description=function["description"],
        parameters=json.dumps(function["parameters"]),
    )
    return chat


def test_wire_chat_becomes_template_inputs() -> None:
    messages, tools = chat_inputs(wire_chat())
    assert tools == [TOOL]
    assert messages[1]["tool_calls"] == [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]  # fmt: skip
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_template_without_tools_gets_hermes_rendering(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(build_byte_level_tokenizer(tmp_path))  # ChatML
    assert not tokenizer.template_takes_tools
    messages, tools = chat_inputs(wire_chat())
    text = tokenizer.apply_chat_template(messages, True, tools)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_template_with_tools_gets_them(tmp_path: Path) -> None:
    template = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[-1].content }}"
    folder = build_byte_level_tokenizer(tmp_path, chat_template=template)
    tokenizer = Tokenizer.from_dir(folder)
    assert tokenizer.template_takes_tools
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], True, [TOOL])
    assert text == "get_weather;hi"


def test_hermes_keeps_the_conversations_system_message() -> None:
    out = hermes_messages([{"role": "system", "content": "Be brief."}], [TOOL])
    assert len(out) == 1 and out[0]["content"].startswith("Be brief.\n\n# Tools")
