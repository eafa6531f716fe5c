"""JSON request bodies, parsed in bounded steps: no body, however large or hostile, holds the
event loop (or, in a worker thread, the GIL) for long, and every malformed one is a 400.

```
parse_json(body)                    bytes -> Python objects, or OpenAIError(400) saying why
  containers                        walked in Python on an explicit stack: at most MAX_DEPTH
                                    levels (json.loads recurses: 100,000 levels were a 500),
                                    MAX_CONTAINERS in all
  strings                           the json module's C scanner, a piece of at most CHUNK
                                    characters per call (a 30 MiB string is many short calls)
  numbers                           at most MAX_NUMBER_CHARS characters (Python's int() takes
                                    4,300 digits; no field holds more than 20); finite only: no
                                    NaN, Infinity or 1e999
  runs of integers (token ids)      one regex and int() per CHUNK characters
```

`json.loads` is one C call: a 29 MiB body of 3.9 M token ids held the GIL for 0.5-1.2 s here,
in a worker thread too. Here no single C call sees more than CHUNK characters, and the parser
hands the GIL over (time.sleep(0)) after each chunk and every _VALUES_PER_YIELD values, not only
every switch interval (5 ms): the event loop waits a millisecond or so for it. The HTTP app
parses bodies larger than INLINE_BYTES on a worker thread (router/http/app.py).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from typing import Any

from router.http.openai_errors import OpenAIError

# The json module's C string scanner (typeshed does not declare it): (text, index after the
# opening quote) -> (the string, index after its closing quote).
scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]

MAX_DEPTH = 128
# Arrays and objects per body: the garbage collector walks each one (2 M of them made a single
# collection hold the GIL for 60 ms); strings and numbers it never walks.
MAX_CONTAINERS = 1 << 16
MAX_NUMBER_CHARS = 64
CHUNK = 1 << 16  # characters one C call sees at most
INLINE_BYTES = 16 << 10  # bodies up to this size parse on the event loop (a few ms at most)
_VALUES_PER_YIELD = 1024  # on a worker thread, the GIL goes to the loop at least this often

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_INT_RUN = re.compile(r"[0-9 \t\n\r,-]*")  # what a run of integers in an array is made of
_INT_RUN_OK = re.compile(r"[ \t\n\r]*-?(?:0|[1-9][0-9]{0,19})[ \t\n\r]*")
_SURROGATE = re.compile("[\ud800-\udfff]")
_LITERALS = {"true": True, "false": False, "null": None}


def parse_json(body: bytes) -> Any:
    """The body's JSON value; OpenAIError(400) when it is not JSON or breaks a bound."""
    return _Parser(_decode(body)).parse()


def _decode(body: bytes) -> str:
    """The body as text (UTF-8, or the UTF-16/32 json.loads detects): one C call, as long as
    copying the body (--max-request-bytes bounds it: 16 MiB, ~25 ms on a loaded 2-core VM)."""
    try:
        return body.decode(json.detect_encoding(body[:4]), "surrogatepass")  # as json.loads
    except UnicodeDecodeError as error:
        raise _not_json(f"it is not UTF-8 text ({error.reason} at byte {error.start})") from None


def _not_json(why: str) -> OpenAIError:
    return OpenAIError(f"the request body is not JSON: {why}")


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.num_containers = 0

    def parse(self) -> Any:
        value = self._value()
        self._skip()
        if self.pos != len(self.text):
            raise self._error("extra data after the JSON value")
        return value

    def _error(self, why: str) -> OpenAIError:
        return _not_json(f"{why} at character {self.pos}")

    def _skip(self) -> None:
        self.pos = _WHITESPACE.match(self.text, self.pos).end()  # type: ignore[union-attr]

    def _value(self) -> Any:
        """One value; containers with an explicit stack of (container, key) frames."""
        stack: list[tuple[list[Any] | dict[str, Any], str | None]] = []
        num_values = 0
        while True:
            num_values += 1
            if num_values % _VALUES_PER_YIELD == 0:
                time.sleep(0)  # the GIL to a waiting thread (the event loop) now
            value, opened = self._scalar_or_open()
            if opened is not None:
                if len(stack) >= MAX_DEPTH:
                    raise self._error(f"more than {MAX_DEPTH} nested arrays or objects")
                self.num_containers += 1
                if self.num_containers > MAX_CONTAINERS:
                    raise self._error(f"more than {MAX_CONTAINERS} arrays and objects")
                key = self._first_key(opened)
                if key is _EMPTY:
                    value = opened  # "[]" or "{}": a finished value
                else:
                    stack.append((opened, key if isinstance(key, str) else None))
                    continue
            while True:  # add the value to its container; close finished containers
                if not stack:
                    return value
                container, key = stack[-1]
                if isinstance(container, list):
                    container.append(value)
                    if type(value) is int:
                        self._int_run(container)
                else:
                    container[key] = value  # type: ignore[index]
                nxt = self._next_member(container)
                if nxt is _CLOSED:
                    stack.pop()
                    value = container
                    continue
                stack[-1] = (container, nxt if isinstance(nxt, str) else None)
                break

    def _scalar_or_open(self) -> tuple[Any, list[Any] | dict[str, Any] | None]:
        self._skip()
        if self.pos >= len(self.text):
            raise self._error("the body ends where a value should be")
        char = self.text[self.pos]
        if char in "[{":
            self.pos += 1
            return None, [] if char == "[" else {}
        if char == '"':
            return self._string(), None
        for word, literal in _LITERALS.items():
            if self.text.startswith(word, self.pos):
                self.pos += len(word)
                return literal, None
        return self._number(), None

    def _first_key(self, opened: list[Any] | dict[str, Any]) -> object:
        """After "[" or "{": _EMPTY when it closes at once; an object's first key."""
        self._skip()
        closer = "]" if isinstance(opened, list) else "}"
        if self.text.startswith(closer, self.pos):
            self.pos += 1
            return _EMPTY
        return None if isinstance(opened, list) else self._key()

    def _next_member(self, container: list[Any] | dict[str, Any]) -> object:
        """After a member: _CLOSED at the container's end; else past the comma (and, in an
        object, the next key and its colon)."""
        self._skip()
        closer = "]" if isinstance(container, list) else "}"
        char = self.text[self.pos : self.pos + 1]
        if char == closer:
            self.pos += 1
            return _CLOSED
        if char != ",":
            raise self._error(f"expected ',' or '{closer}'")
        self.pos += 1
        return None if isinstance(container, list) else self._key()

    def _key(self) -> str:
        self._skip()
        if not self.text.startswith('"', self.pos):
            raise self._error("expected a property name in double quotes")
        key = self._string()
        self._skip()
        if not self.text.startswith(":", self.pos):
            raise self._error("expected ':'")
        self.pos += 1
        return key

    def _string(self) -> str:
        """The string opening at self.pos; pieces of at most CHUNK characters per C call."""
        start = self.pos + 1
        end = self._string_end(start)
        pieces = []
        while start < end:
            stop = _piece_end(self.text, start, min(start + CHUNK, end), end)
            try:
                piece, _ = scanstring(f'"{self.text[start:stop]}"', 1)
            except json.JSONDecodeError as error:
                self.pos = start + error.pos - 1
                raise self._error(error.msg.lower()) from None
            pieces.append(piece)
            if stop - start >= CHUNK // 2:
                time.sleep(0)  # a long string's piece: the loop's turn
            start = stop
        self.pos = end + 1
        value = "".join(pieces)
        if len(pieces) > 1 and _SURROGATE.search(value):  # a \\uXXXX pair split by a cut
            value = value.encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")
        return value

    def _string_end(self, start: int) -> int:
        """The index of the closing quote of the string whose text starts at `start`."""
        text, at = self.text, start
        while True:
            quote = text.find('"', at, at + CHUNK)
            if quote == -1:
                at += CHUNK
                if at >= len(text):
                    self.pos = start - 1
                    raise self._error("unterminated string")
                continue
            if _backslashes_before(text, quote, start) % 2 == 0:
                return quote
            at = quote + 1

    def _number(self) -> int | float:
        match = _NUMBER.match(self.text, self.pos, self.pos + MAX_NUMBER_CHARS + 1)
        if match is None:
            raise self._error("expected a value")
        after = self.text[match.end() : match.end() + 1]
        if match.end() - self.pos > MAX_NUMBER_CHARS or after.isdigit():
            raise self._error(f"a number longer than {MAX_NUMBER_CHARS} characters")
        self.pos = match.end()
        if match.group(1) is None and match.group(2) is None:
            return int(match.group())
        value = float(match.group())
        if not math.isfinite(value):
            raise self._error(f"the number {match.group()} is too large")
        return value

    def _int_run(self, container: list[Any]) -> None:
        """After an integer in an array: the following run of integers, CHUNK characters at
        a time (token ids), up to (not past) the last comma of the run."""
        text = self.text
        while text.startswith(",", self.pos):
            found = _INT_RUN.match(text, self.pos + 1, self.pos + 1 + CHUNK)
            run = found.group() if found is not None else ""
            cut = run.rfind(",")
            if cut <= 0:
                return
            items = run[:cut].split(",")
            if not all(_INT_RUN_OK.fullmatch(item) for item in items):
                return  # not a plain run: the general path says what is wrong
            container.extend(map(int, items))
            self.pos += 1 + cut
            if cut >= CHUNK // 2:
                time.sleep(0)  # a long run: the loop's turn


def _piece_end(text: str, start: int, stop: int, end: int) -> int:
    """Where to cut the string text[start:end] at or before `stop`: never inside an escape
    (one starts at a backslash, and is at most 6 characters long)."""
    if stop >= end:
        return end
    backslash = text.rfind("\\", max(start, stop - 6), stop)
    if backslash == -1:
        return stop
    run_start = start + len(text[start:backslash].rstrip("\\"))
    if run_start > start:
        return run_start  # before the run of backslashes: its escapes stay whole
    return start + CHUNK // 2  # inside a run of CHUNK - 6 or more: between two "\\\\" pairs


def _backslashes_before(text: str, index: int, floor: int) -> int:
    """How many backslashes end text[floor:index] (CHUNK characters a call)."""
    count = 0
    while index > floor:
        low = max(floor, index - CHUNK)
        piece = text[low:index]
        kept = len(piece.rstrip("\\"))
        count += len(piece) - kept
        if kept:
            break
        index = low
    return count


_EMPTY = object()
_CLOSED = object()
