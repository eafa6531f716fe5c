"""The OpenAI / vLLM ways to ask for structured output -> one `StructuredOutputParams`.

```
response_format {"type": "text"}                             -> none
                {"type": "json_object"}                      -> json_object
                {"type": "json_schema", "json_schema": {"name", "schema", "strict",
                 "description"}}                             -> json_schema (enforced, strict or not)
guided_json (object or JSON text) / guided_regex / guided_choice / guided_grammar (Lark)
                                                             -> json_schema / regex / choice / grammar
structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": true}  (vLLM >= 0.10)
more than one of them, an unknown key or kind                -> OpenAIError 400 naming it
a spec the cheap checks refuse (size, nesting, enum, repetition reach)   -> OpenAIError 400
```

The grammar itself is compiled by the node that samples (a spec the grammar library refuses
or that compiles too slowly comes back INVALID_ARGUMENT: HTTP 400).
"""

from __future__ import annotations

from typing import Any

from pdserve.errors import InvalidRequestError
from pdserve.structured_output import StructuredOutputParams
from router.http.openai_errors import OpenAIError

PARAMS = {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "structured_outputs", "guided_decoding_backend", "guided_whitespace_pattern"}  # fmt: skip
_STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "choice", "grammar", "json_object"}
# vLLM's tuning knobs, accepted at their default (they do not change what the output matches)
_IGNORED_DEFAULTS = {"disable_fallback": (False,), "disable_any_whitespace": (False,),
                     "disable_additional_properties": (False,), "whitespace_pattern": (None,),
                     "backend": (None, "auto", "guidance", "llguidance")}  # fmt: skip


def structured_output(body: dict[str, Any]) -> StructuredOutputParams | None:
    """The body's one output constraint, or None; raises OpenAIError naming the parameter."""
    found: list[tuple[str, StructuredOutputParams | None]] = []
    if "response_format" in body:
        found.append(("response_format", _response_format(body["response_format"])))
    for name, build in (("guided_json", _json), ("guided_regex", _regex),
                        ("guided_choice", _choice), ("guided_grammar", _grammar)):  # fmt: skip
        if name in body:
            found.append((name, _spec(name, build, body[name])))
    if "structured_outputs" in body:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    backend = body.get("guided_decoding_backend")
    if backend not in _IGNORED_DEFAULTS["backend"]:
        raise OpenAIError(
            f"guided_decoding_backend {backend!r} is not available: pdserve compiles every "
            "grammar with llguidance",
            "guided_decoding_backend",
        )
    if body.get("guided_whitespace_pattern") is not None:
        raise OpenAIError("guided_whitespace_pattern is not supported", "guided_whitespace_pattern")
    constraints = [(name, spec) for name, spec in found if spec is not None]
    if len(constraints) > 1:
        names = ", ".join(name for name, _ in constraints)
        raise OpenAIError(f"ask for one output constraint, not several ({names})", names)
    return constraints[0][1] if constraints else None


def _spec(param: str, build: Any, value: Any) -> StructuredOutputParams:
    try:
        spec: StructuredOutputParams = build(param, value)
    except InvalidRequestError as error:
        raise OpenAIError(f"{param}: {error}", param) from None
    return spec


def _json(param: str, value: Any) -> StructuredOutputParams:
    if isinstance(value, bool) or not isinstance(value, dict | str):
        raise OpenAIError(f"{param} must be a JSON schema (an object, or its JSON text)", param)
    return StructuredOutputParams.json_schema(value)


def _regex(param: str, value: Any) -> StructuredOutputParams:
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"{param} must be a non-empty regular expression", param)
    return StructuredOutputParams.regex(value)


def _choice(param: str, value: Any) -> StructuredOutputParams:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise OpenAIError(f"{param} must be a non-empty list of strings", param)
    return StructuredOutputParams.choice(value)


def _grammar(param: str, value: Any) -> StructuredOutputParams:
    if not isinstance(value, str) or not value.strip():
        raise OpenAIError(f"{param} must be a grammar in Lark syntax (start: ...)", param)
    return StructuredOutputParams.grammar(value)


def _response_format(value: Any) -> StructuredOutputParams | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise OpenAIError(f"{param} must be an object with a type", param)
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra or (kind != "json_schema" and "json_schema" in value):
        raise OpenAIError(f"{param} has unexpected keys {sorted(extra or {'json_schema'})}", param)
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputParams.json_object()
    if kind != "json_schema":
        raise OpenAIError(
            f"{param}.type must be text, json_object or json_schema; got {kind!r}", param
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or set(spec) - {"name", "schema", "strict", "description"}:
        raise OpenAIError(
            f"{param}.json_schema must be an object of name, schema, strict, description", param
        )
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise OpenAIError(f"{param}.json_schema.name is required (a string)", param)
    if not isinstance(spec.get("strict", False), bool | None):
        raise OpenAIError(f"{param}.json_schema.strict must be true or false", param)
    schema = spec.get("schema", {})  # OpenAI: no schema means any JSON value
    return _spec(param, _json, schema)


def _structured_outputs(value: Any) -> StructuredOutputParams | None:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise OpenAIError(f"{param} must be an object (json, regex, choice, grammar, ...)", param)
    for key, setting in value.items():
        if key in _IGNORED_DEFAULTS:
            if setting not in _IGNORED_DEFAULTS[key]:
                raise OpenAIError(f"{param}.{key} is not supported", param)
        elif key not in _STRUCTURED_OUTPUTS_KEYS and setting is not None:
            raise OpenAIError(f"unsupported parameter: {param}.{key}", param)
    given = {k: v for k, v in value.items() if k in _STRUCTURED_OUTPUTS_KEYS and v is not None}
    if given.get("json_object") is False:
        del given["json_object"]
    if len(given) > 1:
        raise OpenAIError(f"{param} takes one of {sorted(given)}, not several", param)
    if not given:
        return None
    ((key, setting),) = given.items()
    if key == "json_object":
        if setting is not True:
            raise OpenAIError(f"{param}.json_object must be true", param)
        return StructuredOutputParams.json_object()
    builds = {"json": _json, "regex": _regex, "choice": _choice, "grammar": _grammar}
    return _spec(f"{param}.{key}", builds[key], setting)
