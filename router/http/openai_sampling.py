"""The sampling parameters of an OpenAI body -> generation_pb2.SamplingParams, and the typed
readers of body values both endpoints use (a wrong type or range: OpenAIError 400 naming it).

```
temperature, top_p, seed, penalties, top_k, min_p, min_tokens, stop, stop_token_ids,
ignore_eos, max_tokens, logprobs   -> their SamplingParams fields
prompt_logprobs (vLLM's, 0-20)     -> SamplingParams.prompt_logprobs
logit_bias {"token id": bias}      -> SamplingParams.logit_bias (range: SamplingParams')
response_format, guided_*, structured_outputs -> structured_output (openai_structured)
```
"""

from __future__ import annotations

from typing import Any

from pdserve.sampling_params import int_field_range
from pdserve.v1 import generation_pb2
from router.http import openai_structured
from router.http.openai_errors import OpenAIError

MAX_PROMPT_LOGPROBS = 20

# Parameters both endpoints take, with their sampling field (None: handled by the endpoint).
SAMPLING_PARAMS = {
    "temperature": (float, "temperature"),
    "top_p": (float, "top_p"),
    "seed": (int, "seed"),
    "presence_penalty": (float, "presence_penalty"),
    "frequency_penalty": (float, "frequency_penalty"),
    "top_k": (int, "top_k"),  # vLLM extras from here on
    "min_p": (float, "min_p"),
    "repetition_penalty": (float, "repetition_penalty"),
    "min_tokens": (int, "min_tokens"),
}


def sampling_params(
    body: dict[str, Any], max_tokens: int | None, logprobs: int | None
) -> generation_pb2.SamplingParams:
    sampling = generation_pb2.SamplingParams()
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if logprobs is not None:
        sampling.logprobs = logprobs
    for name, (kind, dest) in SAMPLING_PARAMS.items():
        if name in body:
            value: int | float | None
            if kind is int:
                value = read_int(body, name, *int_field_range(generation_pb2.SamplingParams, dest))
            else:
                value = read_number(body, name, kind)
            setattr(sampling, dest, value)
    stop = body.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise OpenAIError("stop must be a non-empty string or a list of them", "stop")
    sampling.stop.extend(stop)
    stop_ids = body.get("stop_token_ids", [])
    low, high = int_field_range(generation_pb2.SamplingParams, "stop_token_ids")
    if not isinstance(stop_ids, list) or not all(is_int(t) and low <= t <= high for t in stop_ids):
        raise OpenAIError("stop_token_ids must be a list of token ids", "stop_token_ids")
    sampling.stop_token_ids.extend(stop_ids)
    sampling.ignore_eos = read_bool(body, "ignore_eos")
    prompt_logprobs = read_int(body, "prompt_logprobs", 0, MAX_PROMPT_LOGPROBS)
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = prompt_logprobs
    sampling.logit_bias.update(_logit_bias(body.get("logit_bias", {})))
    spec = openai_structured.structured_output(body)
    if spec is not None:
        sampling.structured_output.CopyFrom(spec.to_proto())
    return sampling


def _logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's {"token id": bias}; the values' range is SamplingParams' to check."""
    low, high = int_field_range(generation_pb2.TokenIds, "ids")
    if not isinstance(bias, dict):
        raise OpenAIError('logit_bias must map token ids to biases: {"50256": -100}', "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and low <= int(key) <= high):
            raise OpenAIError(f"logit_bias: {key!r} is not a token id", "logit_bias")
        if not (is_int(value) or isinstance(value, float)):
            raise OpenAIError(f"logit_bias[{key!r}] must be a number", "logit_bias")
        out[int(key)] = float(value)
    return out


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_number(body: dict[str, Any], name: str, kind: type[int] | type[float]) -> int | float:
    value = body[name]
    ok = is_int(value) if kind is int else (is_int(value) or isinstance(value, float))
    if not ok:
        raise OpenAIError(f"{name} must be {'an integer' if kind is int else 'a number'}", name)
    return kind(value)


def read_int(body: dict[str, Any], name: str, low: int, high: int | None) -> int | None:
    if body.get(name) is None:
        return None
    value = int(read_number(body, name, int))
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise OpenAIError(f"{name} must be {bounds}, got {value}", name)
    return value


def read_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(f"{name} must be true or false", name)
    return value
