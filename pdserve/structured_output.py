"""What a request's output must match (structured outputs), checked without the grammar engine.

| kind          | spec                                              | choices             |
| ------------- | ------------------------------------------------- | ------------------- |
| `json_schema` | a JSON schema, as JSON text                       | -                   |
| `json_object` | "" (any JSON object)                              | -                   |
| `regex`       | a regular expression the whole output matches     | -                   |
| `grammar`     | a Lark grammar (llguidance's dialect: `start:`)   | -                   |
| `choice`      | ""                                                | the allowed outputs |

`validate()` is cheap and needs no grammar library, so the router refuses obviously bad specs
before a node sees them: size (`MAX_SPEC_BYTES`), a schema's JSON nesting (`MAX_JSON_DEPTH`) and
its enum/const values (`MAX_ENUM_VALUES`, also the number of choices), and the reach of counted
repetitions in a regex, a grammar or a schema's `pattern` (`MAX_REPETITION_REACH`: the bounds of
nested `{m,n}` multiplied). The engine compiles what passes (engine/structured/), under a time
limit and the library's own limits.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.errors import InvalidRequestError
from pdserve.v1 import generation_pb2

MAX_SPEC_BYTES = 128 * 1024
MAX_JSON_DEPTH = 64
MAX_ENUM_VALUES = 4096
MAX_REPETITION_REACH = 10_000
_PARAM = "structured_output"
_QUANTIFIER = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_KIND_PREFIX = "STRUCTURED_OUTPUT_KIND_"


class StructuredOutputKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"
    CHOICE = "choice"


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"structured output: {message}", _PARAM)


@dataclass(frozen=True)
class StructuredOutputParams:
    """One request's output constraint; `digest` identifies its compiled grammar."""

    kind: StructuredOutputKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", StructuredOutputKind(self.kind))
        except ValueError:
            kinds = ", ".join(k.value for k in StructuredOutputKind)
            raise _bad(f"kind must be one of {kinds}; got {self.kind!r}") from None
        object.__setattr__(self, "choices", tuple(self.choices))
        self.validate()

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str) -> StructuredOutputParams:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls(StructuredOutputKind.JSON_SCHEMA, text)

    @classmethod
    def json_object(cls) -> StructuredOutputParams:
        return cls(StructuredOutputKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputParams:
        return cls(StructuredOutputKind.REGEX, pattern)

    @classmethod
    def grammar(cls, lark: str) -> StructuredOutputParams:
        return cls(StructuredOutputKind.GRAMMAR, lark)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutputParams:
        return cls(StructuredOutputKind.CHOICE, "", tuple(choices))

    @property
    def digest(self) -> str:
        """sha256 of kind, spec and choices: the compiled grammar's cache key."""
        payload = json.dumps([self.kind.value, self.spec, list(self.choices)])
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def validate(self) -> None:
        """The caps of the module docstring; raises InvalidRequestError naming the problem."""
        if not isinstance(self.spec, str):
            raise _bad(f"spec must be a string, got {type(self.spec).__name__}")
        num_bytes = len(self.spec.encode("utf-8", "surrogatepass")) + sum(
            len(c.encode("utf-8", "surrogatepass")) for c in self.choices if isinstance(c, str)
        )
        if num_bytes > MAX_SPEC_BYTES:
            raise _bad(f"the spec has {num_bytes} bytes; at most {MAX_SPEC_BYTES} are accepted")
        if self.kind is not StructuredOutputKind.CHOICE and self.choices:
            raise _bad(f"choices are for kind 'choice', not {self.kind.value!r}")
        if self.kind is StructuredOutputKind.JSON_SCHEMA:
            _check_schema(self.spec)
        elif self.kind is StructuredOutputKind.JSON_OBJECT:
            if self.spec:
                raise _bad("json_object takes no spec (use json_schema for a schema)")
        elif self.kind is StructuredOutputKind.CHOICE:
            _check_choices(self.spec, self.choices)
        else:
            if not self.spec.strip():
                raise _bad(f"the {self.kind.value} is empty")
            check_repetition_reach(self.spec, self.kind.value)

    def to_proto(self) -> generation_pb2.StructuredOutput:
        kind = _KIND_PREFIX + self.kind.name  # the enum value's name
        return generation_pb2.StructuredOutput(kind=kind, spec=self.spec, choices=self.choices)

    @classmethod
    def from_proto(cls, message: generation_pb2.StructuredOutput) -> StructuredOutputParams:
        if message.kind == generation_pb2.STRUCTURED_OUTPUT_KIND_UNSPECIFIED:
            raise _bad("kind is unset: say json_schema, json_object, regex, grammar or choice")
        try:
            name = generation_pb2.StructuredOutputKind.Name(message.kind)
        except ValueError:
            raise _bad(f"unknown kind {message.kind}") from None
        kind = StructuredOutputKind(name.removeprefix(_KIND_PREFIX).lower())
        return cls(kind, message.spec, tuple(message.choices))


def _check_choices(spec: str, choices: tuple[str, ...]) -> None:
    if spec:
        raise _bad("choice takes its strings in choices, not in spec")
    if not choices:
        raise _bad("choice needs at least one string")
    if len(choices) > MAX_ENUM_VALUES:
        raise _bad(f"{len(choices)} choices; at most {MAX_ENUM_VALUES} are accepted")
    if any(not isinstance(c, str) or not c for c in choices):
        raise _bad("every choice must be a non-empty string")


def _check_schema(spec: str) -> None:
    """The schema parses as JSON, is an object or a boolean, nests at most MAX_JSON_DEPTH
    levels, has at most MAX_ENUM_VALUES enum/const values, and patterns of bounded reach."""
    try:
        schema = json.loads(spec)
    except RecursionError:
        raise _bad(f"the schema nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as error:
        raise _bad(f"the schema is not valid JSON: {error}") from None
    if not isinstance(schema, dict | bool):
        raise _bad(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    num_values = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _bad(f"the schema nests deeper than {MAX_JSON_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node
        if isinstance(node, dict):
            enum_values = node.get("enum")
            num_values += len(enum_values) if isinstance(enum_values, list) else 0
            num_values += "const" in node
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                check_repetition_reach(pattern, "pattern")
        if num_values > MAX_ENUM_VALUES:
            raise _bad(f"the schema has over {MAX_ENUM_VALUES} enum/const values")
        if isinstance(node, dict | list):
            stack.extend((child, depth + 1) for child in children)


def repetition_reach(pattern: str) -> int:
    """How many times one atom of `pattern` may repeat through counted repetitions: the
    largest product of the `{n}` / `{m,n}` bounds around an atom (`{m,}` counts m; `*` and `+`
    count 1: loops cost no expansion). Groups are parentheses; a class `[...]` and an escape are
    atoms. A conservative scan, not a parser: a `{` inside a class or a literal is skipped or
    read as a bound."""
    stack = [1]  # the largest reach inside each open group, the whole pattern at the bottom
    last = 1  # the reach of the item a quantifier would apply to
    i = 0
    while i < len(pattern):
        char = pattern[i]
        match = _QUANTIFIER.match(pattern, i) if char == "{" else None
        if match is not None:
            last *= max(1, int(match.group(2) or match.group(1)))
            i = match.end()
        elif char == "(":
            stack.append(1)
            i += 1
            continue
        elif char == ")" and len(stack) > 1:
            last = stack.pop()
            i += 1
        else:
            i = _skip_atom(pattern, i)
            last = 1
        stack[-1] = max(stack[-1], last)
    return max(stack)


def _skip_atom(pattern: str, i: int) -> int:
    """The index after the atom at `i`: an escape pair, a `[...]` class, or one character."""
    if pattern[i] == "\\":
        return i + 2
    if pattern[i] != "[":
        return i + 1
    j = i + 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def check_repetition_reach(pattern: str, what: str) -> None:
    reach = repetition_reach(pattern)
    if reach > MAX_REPETITION_REACH:
        raise _bad(
            f"the {what}'s counted repetitions reach {reach} repeats of one item (nested "
            f"{{m,n}} bounds multiplied); at most {MAX_REPETITION_REACH} are accepted"
        )
