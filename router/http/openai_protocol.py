"""OpenAI request bodies -> the router's GenerateRequests (one per prompt and choice).

```
parse_completion(body) / parse_chat(body)
  unknown or unsupported parameter       -> OpenAIError 400 naming it (tools, response_format, ...)
  wrong type / value                     -> OpenAIError 400 naming the parameter
  prompt: str | [str] | [int] | [[int]]  -> one GenerateRequest per prompt (prompt or token ids)
  messages (text content)                -> GenerateRequest.messages (the model's chat template)
  sampling parameters                    -> generation_pb2.SamplingParams (validated later by
                                            the same InputProcessor the gRPC API uses)
  n                                      -> n choices per prompt (seed + i mod 2^64 when seeded)
  cache_salt (vLLM's)                    -> the prefix cache's namespace within the tenant's
  integers beyond their protobuf field, lone UTF-16 surrogates in strings -> OpenAIError 400
  prompts x n beyond max_choices, a token-id prompt beyond the context   -> OpenAIError 400
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.sampling_params import int_field_range
from pdserve.v1 import generation_pb2
from router.http.openai_errors import OpenAIError

MAX_N = 16
DEFAULT_MAX_CHOICES = 256  # prompts x n per request (--max-choices-per-request)
MAX_COMPLETION_LOGPROBS = 20
# Integers are checked against what their protobuf field holds (`int_field_range`); what the
# values mean is checked later, by the InputProcessor that also serves gRPC.
_MAX_TOKENS_MAX = int_field_range(generation_pb2.SamplingParams, "max_tokens")[1]
_SEED_END = int_field_range(generation_pb2.SamplingParams, "seed")[1] + 1  # seeds wrap here

# Parameters both endpoints take, with their sampling field (None: handled by the endpoint).
_SAMPLING = {
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
_COMMON = {"model", "n", "stop", "stream", "stream_options", "user", "ignore_eos",
           "stop_token_ids", "max_tokens", "cache_salt", *_SAMPLING}  # fmt: skip
_COMPLETION_ONLY = {"prompt", "logprobs", "echo", "best_of", "suffix", "logit_bias"}
_CHAT_ONLY = {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "logit_bias"}
# Accepted only at their no-op value: param -> what that value is.
_NO_OP: dict[str, tuple[object, ...]] = {
    "echo": (False,),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
}


@dataclass
class Choice:
    """One generation: its prompt's index and the request that runs it."""

    prompt_index: int
    request: generation_pb2.GenerateRequest


@dataclass
class OpenAIRequest:
    model: str
    choices: list[Choice]
    num_prompts: int
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives per token (0: sampled token only)
    chat: bool = False
    max_tokens_set: bool = True  # chat without max_tokens: filled to the context length
    max_tokens_param: str = "max_tokens"  # the name the body used (chat: or max_completion_tokens)
    extra: dict[str, Any] = field(default_factory=dict)


def parse_completion(
    body: Any, max_choices: int = DEFAULT_MAX_CHOICES, max_prompt_tokens: int | None = None
) -> OpenAIRequest:
    """`max_choices`: prompts x n at most; `max_prompt_tokens`: token ids a prompt may hold
    (the context length; None: unchecked here, the InputProcessor checks it)."""
    body = _check_keys(body, _COMMON | _COMPLETION_ONLY)
    prompts = _prompts(body.get("prompt"), max_prompt_tokens)
    logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    best_of = _int(body, "best_of", 1, MAX_N)
    n = _int(body, "n", 1, MAX_N) or 1
    _check_choices(len(prompts), n, max_choices)
    if best_of is not None and best_of != n:
        raise OpenAIError(f"best_of ({best_of}) other than n ({n}) is not supported", "best_of")
    max_tokens = _int(body, "max_tokens", 1, _MAX_TOKENS_MAX)
    sampling = _sampling(body, max_tokens, logprobs)  # unset: the model's default, else 16
    requests = []
    for prompt in prompts:
        request = generation_pb2.GenerateRequest()
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.ids.extend(prompt)
        requests.append(request)
    return _request(body, requests, sampling, n, logprobs, chat=False, max_tokens_set=True)


def parse_chat(
    body: Any, max_choices: int = DEFAULT_MAX_CHOICES, max_prompt_tokens: int | None = None
) -> OpenAIRequest:
    body = _check_keys(body, _COMMON | _CHAT_ONLY)
    request = generation_pb2.GenerateRequest()
    request.messages.messages.extend(_messages(body.get("messages")))
    want_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not want_logprobs:
        raise OpenAIError("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    max_tokens = _int(body, "max_completion_tokens", 1, _MAX_TOKENS_MAX)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, _MAX_TOKENS_MAX)
    n = _int(body, "n", 1, MAX_N) or 1
    _check_choices(1, n, max_choices)
    sampling = _sampling(body, max_tokens, logprobs)
    parsed = _request(body, [request], sampling, n, logprobs, True, max_tokens is not None)
    if "max_completion_tokens" in body:
        parsed.max_tokens_param = "max_completion_tokens"
    return parsed


def _request(
    body: dict[str, Any],
    prompts: list[generation_pb2.GenerateRequest],
    sampling: generation_pb2.SamplingParams,
    n: int,
    logprobs: int | None,
    chat: bool,
    max_tokens_set: bool,
) -> OpenAIRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("model is required: the served model's name (GET /v1/models)", "model")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise OpenAIError("stream_options needs stream: true", "stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise OpenAIError("stream_options takes only include_usage", "stream_options")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise OpenAIError("user must be a string", "user")
    cache_salt = body.get("cache_salt", "")
    if not isinstance(cache_salt, str) or ("cache_salt" in body and not cache_salt):
        raise OpenAIError("cache_salt must be a non-empty string", "cache_salt")
    choices = []
    for index, prompt in enumerate(prompts):
        for i in range(n):
            request = generation_pb2.GenerateRequest()
            request.CopyFrom(prompt)
            request.sampling.CopyFrom(sampling)
            request.cache_salt = cache_salt
            if sampling.HasField("seed"):  # distinct but reproducible choices
                request.sampling.seed = (sampling.seed + i) % _SEED_END
            choices.append(Choice(index, request))
    return OpenAIRequest(
        model=model,
        choices=choices,
        num_prompts=len(prompts),
        stream=stream,
        include_usage=bool(options and _bool(options, "include_usage")),
        logprobs=logprobs,
        chat=chat,
        max_tokens_set=max_tokens_set,
    )


def _check_choices(num_prompts: int, n: int, max_choices: int) -> None:
    if num_prompts * n > max_choices:
        raise OpenAIError(
            f"this request asks for {num_prompts * n} choices ({num_prompts} prompts x n={n}); "
            f"this server runs at most {max_choices} per request (--max-choices-per-request): "
            "send fewer prompts per request",
            "prompt" if num_prompts > 1 else "n",
        )


def _check_keys(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    for key, value in body.items():
        if key not in allowed:
            raise OpenAIError(f"unsupported parameter: {key!r} is not supported by pdserve", key)
        if key in _NO_OP and value not in _NO_OP[key]:
            raise OpenAIError(f"unsupported parameter: {key!r} is not supported by pdserve", key)
        _check_text(value, key)
    return {k: v for k, v in body.items() if v is not None}  # null means "not given"


def _check_text(value: Any, param: str) -> None:
    """Every string in `value` is text UTF-8 can carry: JSON's \\ud800-style escapes can spell
    a lone surrogate, which no protobuf string (nor the tokenizer) takes."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise OpenAIError(
                    f"{param} holds a lone UTF-16 surrogate ({item[error.start]!r} at character "
                    f"{error.start}), which is not text: send valid Unicode",
                    param,
                ) from None
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _sampling(
    body: dict[str, Any], max_tokens: int | None, logprobs: int | None
) -> generation_pb2.SamplingParams:
    sampling = generation_pb2.SamplingParams()
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if logprobs is not None:
        sampling.logprobs = logprobs
    for name, (kind, dest) in _SAMPLING.items():
        if name in body:
            value: int | float | None
            if kind is int:
                value = _int(body, name, *int_field_range(generation_pb2.SamplingParams, dest))
            else:
                value = _number(body, name, kind)
            setattr(sampling, dest, value)
    stop = body.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise OpenAIError("stop must be a non-empty string or a list of them", "stop")
    sampling.stop.extend(stop)
    stop_ids = body.get("stop_token_ids", [])
    low, high = int_field_range(generation_pb2.SamplingParams, "stop_token_ids")
    if not isinstance(stop_ids, list) or not all(_is_int(t) and low <= t <= high for t in stop_ids):
        raise OpenAIError("stop_token_ids must be a list of token ids", "stop_token_ids")
    sampling.stop_token_ids.extend(stop_ids)
    sampling.ignore_eos = _bool(body, "ignore_eos")
    return sampling


def _prompts(prompt: Any, max_prompt_tokens: int | None) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [_token_ids(prompt, max_prompt_tokens)]
        if all(isinstance(p, list) and p for p in prompt):
            return [_token_ids(p, max_prompt_tokens) for p in prompt]
    raise OpenAIError(
        "prompt must be a string, a list of strings, a list of token ids or a list of such "
        "lists (non-empty)",
        "prompt",
    )


def _token_ids(ids: list[Any], max_prompt_tokens: int | None) -> list[int]:
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise OpenAIError(
            f"a prompt of {len(ids)} token ids exceeds the model's context length of "
            f"{max_prompt_tokens} tokens: shorten it",
            "prompt",
        )
    low, high = int_field_range(generation_pb2.TokenIds, "ids")
    if not all(_is_int(t) and low <= t <= high for t in ids):
        raise OpenAIError("prompt token ids must be non-negative integers", "prompt")
    return list(ids)


def _messages(messages: Any) -> list[generation_pb2.ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list of {role, content}", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise OpenAIError(f"messages[{i}] must be an object with a role", "messages")
        for key in message:
            if key not in ("role", "content", "name"):
                raise OpenAIError(f"unsupported parameter: messages[{i}].{key}", "messages")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append(generation_pb2.ChatMessage(role=role, content=_content(i, message)))
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict[str, Any], name: str, kind: type[int] | type[float]) -> int | float:
    value = body[name]
    ok = _is_int(value) if kind is int else (_is_int(value) or isinstance(value, float))
    if not ok:
        raise OpenAIError(f"{name} must be {'an integer' if kind is int else 'a number'}", name)
    return kind(value)


def _int(body: dict[str, Any], name: str, low: int, high: int | None) -> int | None:
    if body.get(name) is None:
        return None
    value = int(_number(body, name, int))
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise OpenAIError(f"{name} must be {bounds}, got {value}", name)
    return value


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(f"{name} must be true or false", name)
    return value
