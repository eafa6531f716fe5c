"""A chat request's `messages` -> the wire's ChatMessages (generation.proto).

```
{role, content, name}                               -> ChatMessage (developer -> system)
content: a string, null, or text parts              -> its text (other parts: OpenAIError 400)
assistant {tool_calls: [{id, type: "function", function: {name, arguments (JSON text)}}]}
                                                    -> ChatMessage.tool_calls
tool {tool_call_id, content}                        -> ChatMessage(role "tool", tool_call_id)
anything else                                       -> OpenAIError 400 naming it
```
"""

from __future__ import annotations

from typing import Any

from pdserve.v1 import generation_pb2
from router.http.openai_errors import OpenAIError

_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}


def chat_messages(messages: Any) -> list[generation_pb2.ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list of {role, content}", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise OpenAIError(f"messages[{i}] must be an object with a role", "messages")
        for key, value in message.items():
            if key not in _KEYS or (key == "refusal" and value is not None):
                raise OpenAIError(f"unsupported parameter: messages[{i}].{key}", "messages")
        role = "system" if message["role"] == "developer" else message["role"]
        chat = generation_pb2.ChatMessage(role=role, content=_content(i, message))
        name = message.get("name")
        if name is not None:
            chat.name = _string(i, "name", name)
        if message.get("tool_calls"):
            if role != "assistant":
                raise OpenAIError(f"messages[{i}]: only assistant messages carry tool_calls",
                                  "messages")  # fmt: skip
            chat.tool_calls.extend(_tool_calls(i, message["tool_calls"]))
        if role == "tool":
            chat.tool_call_id = _string(i, "tool_call_id", message.get("tool_call_id"))
        elif message.get("tool_call_id") is not None:
            raise OpenAIError(f"messages[{i}]: tool_call_id is for role tool", "messages")
        out.append(chat)
    return out


def _string(i: int, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"messages[{i}].{key} must be a non-empty string", "messages")
    return value


def _tool_calls(i: int, calls: Any) -> list[generation_pb2.ToolCall]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise OpenAIError(f"{where} must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments", ""), str)
        ):
            raise OpenAIError(
                f"{where}[{j}] must be {{id, type: 'function', function: {{name, arguments: "
                "a JSON string}}}}",
                "messages",
            )
        call_id = call.get("id") or f"call_{i}_{j}"
        if not isinstance(call_id, str):
            raise OpenAIError(f"{where}[{j}].id must be a string", "messages")
        out.append(
            generation_pb2.ToolCall(
                id=call_id, name=function["name"], arguments=function.get("arguments", "")
            )
        )
    return out


def _content(i: int, message: dict[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(
                    f"messages[{i}].content: only text parts are supported, got {kind!r}",
                    "messages",
                )
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise OpenAIError(f"messages[{i}].content must be a string or text parts", "messages")
