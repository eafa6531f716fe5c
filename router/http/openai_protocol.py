"""OpenAI request bodies -> the router's GenerateRequests (one per prompt and choice).

```
parse_completion(body) / parse_chat(body)
  unknown or unsupported parameter       -> OpenAIError 400 naming it (suffix, ...)
  wrong type / value                     -> OpenAIError 400 naming the parameter
  prompt: str | [str] | [int] | [[int]]  -> one GenerateRequest per prompt (prompt or token ids)
  messages (text content)                -> GenerateRequest.messages (the model's chat template;
                                            openai_messages: tool calls and results too)
  response_format, guided_*, structured_outputs -> SamplingParams.structured_output
                                            (openai_structured)
  sampling parameters                    -> generation_pb2.SamplingParams (openai_sampling;
                                            logit_bias, prompt_logprobs too; validated later
                                            by the same InputProcessor the gRPC API uses)
  echo (completions)                     -> the prompt before the text; with logprobs, its
                                            prompt_logprobs asked for (openai_responses)
  tools, tool_choice (chat)              -> tools/tool_choice.py
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
from router.http.openai_messages import chat_messages
from router.http.openai_sampling import (
    SAMPLING_PARAMS,
    is_int,
    read_bool,
    read_int,
    sampling_params,
)
from router.http.openai_structured import PARAMS as STRUCTURED_PARAMS
from router.http.tools.tool_choice import PARAMS as TOOL_PARAMS
from router.http.tools.tool_choice import ToolRequest, tool_request

MAX_N = 16
DEFAULT_MAX_CHOICES = 256  # prompts x n per request (--max-choices-per-request)
MAX_COMPLETION_LOGPROBS = 20
# Integers are checked against what their protobuf field holds (`int_field_range`); what the
# values mean is checked later, by the InputProcessor that also serves gRPC.
_MAX_TOKENS_MAX = int_field_range(generation_pb2.SamplingParams, "max_tokens")[1]
_SEED_END = int_field_range(generation_pb2.SamplingParams, "seed")[1] + 1  # seeds wrap here

_COMMON = {"model", "n", "stop", "stream", "stream_options", "user", "ignore_eos",
           "stop_token_ids", "max_tokens", "cache_salt", "prompt_logprobs", *SAMPLING_PARAMS,
           *STRUCTURED_PARAMS}  # fmt: skip
_COMPLETION_ONLY = {"prompt", "logprobs", "echo", "best_of", "suffix", "logit_bias"}
_CHAT_ONLY = {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "logit_bias",
              *TOOL_PARAMS}  # fmt: skip
_STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
# Accepted only at their no-op value: param -> what that value is.
_NO_OP: dict[str, tuple[object, ...]] = {"suffix": (None, "")}


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
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage on every chunk
    echo: bool = False  # completions: the prompt comes back before the text (its logprobs too)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for: on each choice
    logprobs: int | None = None  # top alternatives per token (0: sampled token only)
    chat: bool = False
    max_tokens_set: bool = True  # chat without max_tokens: filled to the context length
    max_tokens_param: str = "max_tokens"  # the name the body used (chat: or max_completion_tokens)
    tools: ToolRequest | None = None  # chat: its tools and tool_choice
    extra: dict[str, Any] = field(default_factory=dict)


def parse_completion(
    body: Any, max_choices: int = DEFAULT_MAX_CHOICES, max_prompt_tokens: int | None = None
) -> OpenAIRequest:
    """`max_choices`: prompts x n at most; `max_prompt_tokens`: token ids a prompt may hold
    (the context length; None: unchecked here, the InputProcessor checks it)."""
    body = _check_keys(body, _COMMON | _COMPLETION_ONLY)
    prompts = _prompts(body.get("prompt"), max_prompt_tokens)
    logprobs = read_int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    best_of = read_int(body, "best_of", 1, MAX_N)
    n = read_int(body, "n", 1, MAX_N) or 1
    _check_choices(len(prompts), n, max_choices)
    if best_of is not None and best_of != n:
        raise OpenAIError(f"best_of ({best_of}) other than n ({n}) is not supported", "best_of")
    max_tokens = read_int(body, "max_tokens", 1, _MAX_TOKENS_MAX)
    sampling = sampling_params(body, max_tokens, logprobs)  # unset: the model's default, else 16
    echo = read_bool(body, "echo")
    if echo and logprobs is not None:  # the prompt's logprobs, as many alternatives
        sampling.prompt_logprobs = max(logprobs, sampling.prompt_logprobs)
    requests = []
    for prompt in prompts:
        request = generation_pb2.GenerateRequest()
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.ids.extend(prompt)
        requests.append(request)
    parsed = _request(body, requests, sampling, n, logprobs, chat=False, max_tokens_set=True)
    parsed.echo = echo
    return parsed


def parse_chat(
    body: Any, max_choices: int = DEFAULT_MAX_CHOICES, max_prompt_tokens: int | None = None
) -> OpenAIRequest:
    body = _check_keys(body, _COMMON | _CHAT_ONLY)
    request = generation_pb2.GenerateRequest()
    request.messages.messages.extend(chat_messages(body.get("messages")))
    want_logprobs = read_bool(body, "logprobs")
    top = read_int(body, "top_logprobs", 0, 20)
    if top is not None and not want_logprobs:
        raise OpenAIError("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    max_tokens = read_int(body, "max_completion_tokens", 1, _MAX_TOKENS_MAX)
    if max_tokens is None:
        max_tokens = read_int(body, "max_tokens", 1, _MAX_TOKENS_MAX)
    n = read_int(body, "n", 1, MAX_N) or 1
    _check_choices(1, n, max_choices)
    sampling = sampling_params(body, max_tokens, logprobs)
    tools = tool_request(body)
    request.messages.tools.extend(tools.wire_tools())
    forced = tools.structured_output()
    if forced is not None:
        if sampling.HasField("structured_output"):
            raise OpenAIError(f"tool_choice {tools.mode!r} forces the output's shape: send no "
                              "response_format or guided_* beside it", "tool_choice")  # fmt: skip
        sampling.structured_output.CopyFrom(forced.to_proto())
    parsed = _request(body, [request], sampling, n, logprobs, True, max_tokens is not None)
    parsed.tools = tools
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
    stream = read_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise OpenAIError("stream_options needs stream: true", "stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - _STREAM_OPTIONS):
        raise OpenAIError(
            "stream_options takes only include_usage and continuous_usage_stats", "stream_options"
        )
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
        include_usage=bool(options and read_bool(options, "include_usage")),
        continuous_usage=bool(options and read_bool(options, "continuous_usage_stats")),
        prompt_logprobs="prompt_logprobs" in body,
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


def _prompts(prompt: Any, max_prompt_tokens: int | None) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(is_int(t) for t in prompt):
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
    if not all(is_int(t) and low <= t <= high for t in ids):
        raise OpenAIError("prompt token ids must be non-negative integers", "prompt")
    return list(ids)
