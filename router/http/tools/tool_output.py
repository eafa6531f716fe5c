"""One chat choice's output in OpenAI's tool-call shape, whole (`message`) or streamed (`delta`).

```
mode none       {content}                                      (finish_reason as generated)
mode auto       the parser's content; its calls -> tool_calls  ("tool_calls" if any and the
                                                                 output ended with "stop")
mode named      the output is the arguments: one call of the named function, content null
mode required   the output is [{"name", "arguments"}, ...]: one call each, content null
tool_calls      [{id: "call_<24 hex>", type: "function", function: {name, arguments: JSON text}}]
stream deltas   {content} as it comes; a call: {tool_calls: [{index, id, type, function:
                {name, arguments}}]} once, then {tool_calls: [{index, function: {arguments}}]}
                fragments (named: each text chunk; auto: a call once its closing tag is in;
                required: every call at the end)
```
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from router.http.tools.parsers import PARSERS, Parsed, ParsedCall, ToolCallParser, parse_all
from router.http.tools.tool_choice import ToolRequest


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolOutput:
    def __init__(self, request: ToolRequest, parser: str = "hermes") -> None:
        self._request = request
        self._parser: ToolCallParser = PARSERS[parser]()
        self._num_calls = 0  # calls streamed so far (their indices)
        self._buffer: list[str] = []  # required: the whole array
        self._named_id = ""  # named: the call's id once its first delta went out

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The full response's message, and its finish_reason."""
        mode = self._request.mode
        if mode == "none":
            return {"role": "assistant", "content": text}, finish_reason
        if mode == "named":
            parsed = Parsed("", [ParsedCall(self._request.name, text)])
        elif mode == "required":
            parsed = _array_calls(text)
        else:
            parsed = parse_all(self._parser, text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
        if parsed.calls:
            message["tool_calls"] = [_call(i, c, _call_id(), full=True) for i, c in
                                     enumerate(parsed.calls)]  # fmt: skip
        return message, _finish(finish_reason, bool(parsed.calls))

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A stream chunk's delta for this new text, and its finish_reason."""
        mode = self._request.mode
        if mode == "none":
            return ({"content": text} if text else {}), finish_reason
        if mode == "named":
            return self._named_delta(text), _finish(finish_reason, True)
        if mode == "required":
            self._buffer.append(text)
            if finish_reason is None:
                return {}, None
            parsed = _array_calls("".join(self._buffer))
        else:
            parsed = self._parser.feed(text)
            if finish_reason is not None:
                last = self._parser.finish()
                parsed = Parsed(parsed.content + last.content, parsed.calls + last.calls)
        delta: dict[str, Any] = {"content": parsed.content} if parsed.content else {}
        if parsed.calls:
            delta["tool_calls"] = [
                _call(self._num_calls + i, c, _call_id(), full=False)
                for i, c in enumerate(parsed.calls)
            ]
            self._num_calls += len(parsed.calls)
        return delta, _finish(finish_reason, self._num_calls > 0)

    def _named_delta(self, text: str) -> dict[str, Any]:
        if not self._named_id:
            self._named_id = _call_id()
            call = ParsedCall(self._request.name, text)
            return {"tool_calls": [_call(0, call, self._named_id, full=False)]}
        if not text:
            return {}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}


def _call(index: int, call: ParsedCall, call_id: str, full: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": call_id, "type": "function",
                             "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
    if not full:
        entry = {"index": index, **entry}
    return entry


def _array_calls(text: str) -> Parsed:
    """`required`'s output: a JSON array of calls (cut short: the text stays content)."""
    try:
        value = json.loads(text)
    except ValueError:
        return Parsed(text, [])
    if not isinstance(value, list):
        return Parsed(text, [])
    calls = [
        ParsedCall(item["name"], json.dumps(item.get("arguments", {}), ensure_ascii=False))
        for item in value
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    ]
    return Parsed("", calls)


def _finish(finish_reason: str | None, called: bool) -> str | None:
    return "tool_calls" if finish_reason == "stop" and called else finish_reason
