"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls` -> `ToolRequest`.

```
tools: [{type: "function", function: {name, description?, parameters?, strict?}}]  ([]: none)
tool_choice "none"      the model is shown the tools; its output is plain content
            "auto"      (the default with tools) its calls are parsed from its output
                        (parsers.py: the Hermes <tool_call> format)
            "required"  forced: a JSON array of {"name", "arguments"} (one call at most with
                        parallel_tool_calls false), each a tool's name and its parameters'
                        schema -> structured_output
            {"type": "function", "function": {"name"}}   forced: that tool's arguments
                        (its parameters' schema) -> structured_output
anything malformed, an unknown tool named                  -> OpenAIError 400 naming it
```
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import InvalidRequestError
from pdserve.structured_output import StructuredOutputParams
from pdserve.v1 import generation_pb2
from router.http.openai_errors import OpenAIError

PARAMS = {"tools", "tool_choice", "parallel_tool_calls"}
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolRequest:
    """What a chat request asked of tools; `mode`: none, auto, required or named."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # the `function` objects
    mode: str = "none"
    name: str = ""  # the forced function (mode "named")
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def wire_tools(self) -> list[generation_pb2.Tool]:
        return [
            generation_pb2.Tool(
                name=tool["name"],
                description=tool.get("description") or "",
                parameters=json.dumps(tool["parameters"]) if "parameters" in tool else "",
            )
            for tool in self.tools
        ]

    def structured_output(self) -> StructuredOutputParams | None:
        """The grammar a forced choice generates under; None for none and auto."""
        try:
            if self.mode == "named":
                (tool,) = (t for t in self.tools if t["name"] == self.name)
                return StructuredOutputParams.json_schema(tool.get("parameters") or _ANY_OBJECT)
            if self.mode == "required":
                return StructuredOutputParams.json_schema(self._calls_schema())
        except InvalidRequestError as error:
            raise OpenAIError(f"tools: {error}", "tools") from None
        return None

    def _calls_schema(self) -> dict[str, Any]:
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["name"]},
                    "arguments": tool.get("parameters") or _ANY_OBJECT,
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def tool_request(body: dict[str, Any]) -> ToolRequest:
    """The body's tools and tool choice (absent: no tools, mode none)."""
    tools = _tools(body.get("tools", []))
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise OpenAIError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    choice = body.get("tool_choice", "auto" if tools else "none")
    names = [tool["name"] for tool in tools]
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise OpenAIError("tool_choice 'required' needs at least one tool", "tool_choice")
        return ToolRequest(tools, choice if tools else "none", "", parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(function, dict)
        or choice.get("type") != "function"
        or not isinstance(function.get("name"), str)
    ):
        raise OpenAIError(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if function["name"] not in names:
        raise OpenAIError(
            f"tool_choice names {function['name']!r}, which is not among the tools", "tool_choice"
        )
    return ToolRequest(tools, "named", function["name"], parallel)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise OpenAIError(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise OpenAIError(
                f"tools[{i}] must be {{type: 'function', function: {{...}}}}", "tools"
            )
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise OpenAIError(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -", "tools"
            )
        if any(t["name"] == name for t in out):
            raise OpenAIError(f"tools[{i}]: a second function named {name!r}", "tools")
        extra = set(function) - {"name", "description", "parameters", "strict"}
        if extra:
            raise OpenAIError(f"tools[{i}].function has unexpected keys {sorted(extra)}", "tools")
        if not isinstance(function.get("description", ""), str | None):
            raise OpenAIError(f"tools[{i}].function.description must be a string", "tools")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise OpenAIError(f"tools[{i}].function.parameters must be a JSON schema", "tools")
        out.append({k: v for k, v in function.items() if k != "strict" and v is not None})
    return out
