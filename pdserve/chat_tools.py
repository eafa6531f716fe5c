"""Tools in a chat: the wire's messages and tools as a chat template takes them, and the
Hermes-style rendering for templates that take no tools.

```
ChatMessages (generation.proto) ──chat_inputs──► (messages, tools) as transformers'
    apply_chat_template takes them: tool_calls [{id, type: "function", function: {name,
    arguments: a dict when the JSON text is an object}}], tool_call_id, name; tools
    [{type: "function", function: {name, description, parameters}}]
a template that reads `tools` ──► rendered with them as they are
a template that does not (SmolLM2's) ──hermes_messages──► the same conversation in the
    Hermes format (the one Qwen2.5's and Hermes' templates render, and the router's "hermes"
    tool-call parser reads back):
    tools             a system message listing them in <tools></tools>, asking for calls as
                      <tool_call>{"name": ..., "arguments": {...}}</tool_call> (after the
                      conversation's own system message, if it has one)
    assistant calls   its content, then one <tool_call>...</tool_call> per call
    tool results      role "tool", content inside <tool_response></tool_response>
```
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.v1 import generation_pb2

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

Message = dict[str, Any]


def chat_inputs(
    chat: generation_pb2.ChatMessages,
) -> tuple[list[Message], list[dict[str, Any]] | None]:
    """(messages, tools or None) for the chat template. A tool's parameters and a call's
    arguments are JSON text on the wire; text that does not parse stays a string."""
    messages = [_message(m) for m in chat.messages]
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": _json_or_text(tool.parameters) if tool.parameters else {},
            },
        }  # fmt: skip
        for tool in chat.tools
    ]
    return messages, tools or None


def _message(message: generation_pb2.ChatMessage) -> Message:
    out: Message = {"role": message.role, "content": message.content}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": _json_or_text(call.arguments)}}
            for call in message.tool_calls
        ]  # fmt: skip
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _json_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def uses_tools(messages: list[Message], tools: list[dict[str, Any]] | None) -> bool:
    """Whether the conversation has anything about tools to render."""
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def hermes_messages(messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Message]:
    """The conversation in the Hermes format, for a template that takes no tools (see the
    module docstring)."""
    out: list[Message] = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            parts = [message.get("content") or ""] if message.get("content") else []
            parts.extend(hermes_call(call["function"]) for call in calls)
            message["content"] = "\n".join(parts)
        if message.get("role") == "tool":
            message.pop("tool_call_id", None)
            message["content"] = (
                f"{TOOL_RESPONSE_START}\n{message.get('content') or ''}\n{TOOL_RESPONSE_END}"
            )
        out.append(message)
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{out[0].get('content') or ''}\n\n{prompt}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def hermes_call(function: dict[str, Any]) -> str:
    """One call, as the model writes it: <tool_call>{"name", "arguments"}</tool_call>."""
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = _json_or_text(arguments)
    call = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}"


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """A system message's text offering `tools` in the Hermes format."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\n"
        "You can call the functions below to help answer. Their signatures are inside "
        f"<tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and arguments inside "
        f"{TOOL_CALL_START}{TOOL_CALL_END} tags, one block per call:\n"
        f'{TOOL_CALL_START}\n{{"name": <function name>, "arguments": <arguments as a JSON '
        f"object>}}\n{TOOL_CALL_END}"
    )
