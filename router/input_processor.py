"""InputProcessor: a client's GenerateRequest -> a validated, tokenized ProcessedRequest.

Every failure is an `InvalidRequestError` whose message says what to fix (the servicer returns
it as INVALID_ARGUMENT). A model without a tokenizer (`synthetic:*`) takes token ids only: no
`prompt`, `messages` or stop strings.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from dataclasses import dataclass, field

from pdserve.block_hash import BlockHash, block_hashes
from pdserve.chat_tools import chat_inputs
from pdserve.sampling_defaults import defaults_from_proto
from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import generation_pb2, node_pb2

_SEED_BITS = 63
CHARS_PER_TOKEN_CAP = 32  # no tokenizer packs more characters than this into a token, in practice
NO_TOKENIZER = "this model has no tokenizer: send prompt_token_ids"
MAX_REQUEST_ID_CHARS = 256  # a client request id: what every log line of the request carries
# Requests this small are processed on the event loop (tens of microseconds); larger ones, and
# every chat template (Jinja), on a worker thread, so a long prompt never stalls other requests.
INLINE_PROMPT_CHARS = 4096
INLINE_PROMPT_TOKENS = 4096


@dataclass(frozen=True)
class ProcessedRequest:
    request_id: str  # the router's own, unique: what nodes see (Abort names it)
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # validated; `seed` always set
    node_sampling: node_pb2.NodeSamplingParams  # the same values, as the nodes receive them
    client_request_id: str = ""  # the client's (echoed in responses); "" -> request_id
    cache_salt: str = ""  # its prefix-cache namespace, as the nodes get it (router.tenancy)
    # the prompt's block hashes by (block size, root): hashed once, whoever asks
    _block_hashes: dict[tuple[int, BlockHash], list[BlockHash]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if not self.client_request_id:
            object.__setattr__(self, "client_request_id", self.request_id)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def block_hashes(self, block_size: int, root: BlockHash) -> list[BlockHash]:
        """The prompt's full blocks' digests (pdserve.block_hash), computed once per request."""
        key = (block_size, root)
        hashes = self._block_hashes.get(key)
        if hashes is None:
            hashes = self._block_hashes[key] = block_hashes(self.prompt_token_ids, block_size, root)
        return hashes


class InputProcessor:
    """Validates and tokenizes requests for one served model."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        model_info: node_pb2.NodeInfo,
        max_prompt_chars: int = 0,
    ) -> None:
        """`tokenizer` None: the model has none; requests must be token ids. Prompts (or
        chat messages) longer than `max_prompt_chars` characters are refused before
        tokenizing (0: CHARS_PER_TOKEN_CAP x the context length)."""
        self._tokenizer = tokenizer
        # the model's sampling defaults: what a field the client left unset becomes
        self._sampling_defaults = defaults_from_proto(model_info.default_sampling)
        self._max_model_len = model_info.max_model_len
        self._vocab_size = model_info.vocab_size
        self._max_prompt_chars = max_prompt_chars or CHARS_PER_TOKEN_CAP * self._max_model_len

    def process(
        self, request: generation_pb2.GenerateRequest, cache_salt: str = ""
    ) -> ProcessedRequest:
        """`cache_salt`: the request's prefix-cache namespace (`CacheSalts.salt`)."""
        _check_request_id(request.request_id)
        params = SamplingParams.from_proto(request.sampling, self._sampling_defaults)
        if params.seed is None:  # P and a falling-back D must draw the same first token
            params = dataclasses.replace(params, seed=random.getrandbits(_SEED_BITS))
        self._check_token_ids("sampling.stop_token_ids", params.stop_token_ids)
        if params.stop and self._tokenizer is None:
            raise InvalidRequestError(
                f"{NO_TOKENIZER}, and stop strings cannot be matched without text: use "
                "sampling.stop_token_ids"
            )
        prompt_token_ids = self._prompt_token_ids(request)
        if len(prompt_token_ids) >= self._max_model_len:  # the prompt alone is too long
            kind = request.WhichOneof("input") or "prompt"
            raise InvalidRequestError(
                f"the {kind} is {len(prompt_token_ids)} tokens; the model's context length of "
                f"{self._max_model_len} tokens must hold it and at least one generated token: "
                "shorten it",
                kind,
            )
        total_len = len(prompt_token_ids) + params.max_tokens
        if total_len > self._max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total_len} exceeds the model's context length of {self._max_model_len} "
                "tokens; shorten the prompt or lower max_tokens",
                "max_tokens",
            )
        return ProcessedRequest(
            # Unique per call: concurrent requests reusing a client id all run, and no client
            # can name (abort) another's request on a node.
            # (the client's id leads, so a request's log lines on every node still carry it)
            request_id=_internal_id(request.request_id),
            client_request_id=request.request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            node_sampling=params.to_proto(node_pb2.NodeSamplingParams),
            cache_salt=cache_salt,
        )

    def _prompt_token_ids(self, request: generation_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidRequestError("set one of prompt, prompt_token_ids or messages")
        if kind == "prompt_token_ids":
            token_ids = list(request.prompt_token_ids.ids)
            if not token_ids:
                raise InvalidRequestError(
                    "prompt_token_ids is empty; send at least one token", "prompt_token_ids"
                )
            self._check_token_ids("prompt_token_ids", token_ids)
            return token_ids
        if self._tokenizer is None:
            raise InvalidRequestError(f"{NO_TOKENIZER} (got {kind})")
        self._check_prompt_size(request, kind)
        if kind == "prompt":
            if not request.prompt:
                raise InvalidRequestError("prompt is empty; send at least one character", kind)
            token_ids = self._tokenizer.encode(request.prompt)
        else:
            messages, tools = chat_inputs(request.messages)
            text = self._tokenizer.apply_chat_template(messages, True, tools)
            token_ids = self._tokenizer.encode(text, add_special_tokens=False)  # in the template
        if not token_ids:
            raise InvalidRequestError(f"the {kind} tokenizes to no tokens", kind)
        return token_ids

    def _check_prompt_size(self, request: generation_pb2.GenerateRequest, kind: str) -> None:
        if kind == "prompt":
            num_chars = len(request.prompt)
        else:
            num_chars = _chat_chars(request.messages)
        if num_chars > self._max_prompt_chars:
            raise InvalidRequestError(
                f"the {kind} has {num_chars} characters; this router refuses more than "
                f"{self._max_prompt_chars} before tokenizing (the context is "
                f"{self._max_model_len} tokens): shorten it",
                kind,
            )

    def _check_token_ids(self, name: str, token_ids: list[int]) -> None:
        for i, token_id in enumerate(token_ids):
            if token_id >= self._vocab_size:
                raise InvalidRequestError(
                    f"{name}[{i}] = {token_id} is not a token id: the vocabulary has "
                    f"{self._vocab_size} tokens (ids 0..{self._vocab_size - 1})",
                    name.removeprefix("sampling."),
                )


def processes_inline(request: generation_pb2.GenerateRequest) -> bool:
    """Whether `request` is cheap enough to validate and tokenize on the event loop: token
    ids or a text prompt within INLINE_PROMPT_TOKENS / INLINE_PROMPT_CHARS, and a structured
    output spec (parsed and walked when checked) within INLINE_PROMPT_CHARS (a thread hop
    costs more than that work)."""
    constraint = request.sampling.structured_output
    if len(constraint.spec) + sum(map(len, constraint.choices)) > INLINE_PROMPT_CHARS:
        return False
    kind = request.WhichOneof("input")
    if kind == "prompt_token_ids":
        return len(request.prompt_token_ids.ids) <= INLINE_PROMPT_TOKENS
    return kind == "prompt" and len(request.prompt) <= INLINE_PROMPT_CHARS


def _chat_chars(chat: generation_pb2.ChatMessages) -> int:
    """The characters of a conversation's text: messages, their tool calls, the tools."""
    num_chars = sum(len(t.name) + len(t.description) + len(t.parameters) for t in chat.tools)
    for m in chat.messages:
        num_chars += len(m.role) + len(m.content) + len(m.name) + len(m.tool_call_id)
        num_chars += sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.tool_calls)
    return num_chars


def _request_id_ok(request_id: str) -> bool:
    """The client's id goes into every log line of the request on every node: short and
    printable only (a newline in it would forge log lines)."""
    return len(request_id) <= MAX_REQUEST_ID_CHARS and request_id.isprintable()


def _check_request_id(request_id: str) -> None:
    if not _request_id_ok(request_id):
        raise InvalidRequestError(
            f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable characters (no "
            f"newlines or other control characters); got {len(request_id)} characters: "
            f"{loggable_request_id(request_id)}",
            "request_id",
        )


def loggable_request_id(request_id: str) -> str:
    """The client's id as a rejected request's log line may carry it: as sent when valid,
    else escaped and cut short (`repr`: no raw control characters reach the log)."""
    return request_id if _request_id_ok(request_id) else repr(request_id[:40])


def _internal_id(client_id: str) -> str:
    """The id nodes see: the client's id (if any) plus an unguessable suffix."""
    suffix = uuid.uuid4().hex
    return f"{client_id}.{suffix}" if client_id else suffix
