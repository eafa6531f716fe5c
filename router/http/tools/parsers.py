"""Tool-call parsers: a model's output text -> its content and its calls, whole or streamed.
One parser per chat-template family, behind `ToolCallParser`; `PARSERS` names them.

```
hermes   (Hermes, Qwen2.5, and pdserve's rendering for templates without tools)
         content <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> ...
         streamed: content goes out as it comes (held back while it may be the start of a
         tag); a call goes out once its closing tag (or the output's end) is in
```
A call whose JSON does not parse, or names no function, stays in the content as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall]


class ToolCallParser(Protocol):
    def feed(self, text: str) -> Parsed:
        """The content and the complete calls that this new text (appended to what came
        before) makes final; held-back text comes out of later calls or `finish`."""
        ...

    def finish(self) -> Parsed:
        """Whatever is still held back, at the output's end."""
        ...


def parse_all(parser: ToolCallParser, text: str) -> Parsed:
    """The whole output at once."""
    first, last = parser.feed(text), parser.finish()
    return Parsed(first.content + last.content, first.calls + last.calls)


class HermesParser:
    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed("", [])
        while True:
            if self._in_call:
                end = self._buffer.find(self.END)
                if end < 0:
                    return out
                self._emit_call(self._buffer[:end], out)
                self._buffer = self._buffer[end + len(self.END) :]
                self._in_call = False
                continue
            start = self._buffer.find(self.START)
            if start >= 0:
                out.content += self._buffer[:start]
                self._buffer = self._buffer[start + len(self.START) :]
                self._in_call = True
                continue
            keep = _partial_tag_len(self._buffer, self.START)
            out.content += self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return out

    def finish(self) -> Parsed:
        out = Parsed("", [])
        if self._in_call:
            self._emit_call(self._buffer, out)
        else:
            out.content = self._buffer
        self._buffer, self._in_call = "", False
        return out

    def _emit_call(self, body: str, out: Parsed) -> None:
        call = _call_of(body)
        if call is None:  # not a call after all: its text stays content
            out.content += self.START + body
        else:
            out.calls.append(call)


def _call_of(body: str) -> ParsedCall | None:
    try:
        value: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(value["name"], text)


def _partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


PARSERS: dict[str, type[HermesParser]] = {"hermes": HermesParser}
