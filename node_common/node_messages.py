"""Wire conversions both node roles need.

a Prefill/Decode request ──to_engine_request──► the engine's validated Request (INVALID_ARGUMENT)
a token's log-probabilities ──token_logprob──► TokenLogprob
a model's tokenizer folder ──read_tokenizer_files──► TokenizerFiles
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import grpc

from engine.async_engine import AsyncEngine
from engine.request import Request
from pdserve.block_hash import MAX_REQUEST_SALT_CHARS
from pdserve.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2, node_pb2


class TokenLogprobsLike(Protocol):
    """What `token_logprob` reads (the engine's `TokenLogprobs` has these fields)."""

    @property
    def token_id(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def rank(self) -> int: ...
    @property
    def top(self) -> Sequence[tuple[int, float]]: ...


class NodeRequest(Protocol):
    """What `to_engine_request` reads: a PrefillRequest or a DecodeRequest."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def sampling(self) -> node_pb2.NodeSamplingParams: ...
    @property
    def cache_salt(self) -> str: ...


async def to_engine_request(
    engine: AsyncEngine,
    request: NodeRequest,
    context: grpc.aio.ServicerContext,
    output_token_ids: Sequence[int] = (),
) -> Request:
    """The engine's Request for a node RPC's request, validated by the engine (token ids in
    the vocabulary, context length, sampling values); the call ends INVALID_ARGUMENT if not.
    `output_token_ids`: a migrated request's tokens generated elsewhere (its output so far).
    Built here on the event loop (`AsyncEngine.make_request` reads only fixed configuration):
    a trip to the engine thread would wait for its current step, up to a whole prefill chunk."""
    try:
        params = SamplingParams.from_proto(request.sampling)
        _check_cache_salt(request.cache_salt)
        engine_request = engine.make_request(
            request.request_id, request.prompt_token_ids, params, request.cache_salt
        )
        if output_token_ids:
            outputs = list(output_token_ids)
            _check_outputs(outputs, params, engine.vocab_size)
            engine_request.output_token_ids = outputs
        return engine_request
    except ValueError as error:  # InvalidRequestError included
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        raise AssertionError("context.abort returned") from None  # it raises AbortError


def _check_cache_salt(cache_salt: str) -> None:
    """The request's prefix-cache namespace (the router's digest of its tenant): short and
    printable."""
    if len(cache_salt) > MAX_REQUEST_SALT_CHARS or not cache_salt.isprintable():
        raise ValueError(
            f"cache_salt must be at most {MAX_REQUEST_SALT_CHARS} printable characters, got "
            f"{len(cache_salt)} characters"
        )


def _check_outputs(outputs: list[int], params: SamplingParams, vocab_size: int) -> None:
    if len(outputs) >= params.max_tokens:
        raise ValueError(
            f"a migrated request's {len(outputs)} output tokens leave none of max_tokens "
            f"({params.max_tokens}) to generate"
        )
    bad = [t for t in outputs if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"output token ids must be in [0, {vocab_size}); got {bad[:5]}")


def token_logprob(logprobs: TokenLogprobsLike) -> generation_pb2.TokenLogprob:
    """One sampled token's log-probability, rank and top alternatives, as sent on the wire."""
    return generation_pb2.TokenLogprob(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        rank=logprobs.rank,
        top=[
            generation_pb2.TopLogprob(token_id=token_id, logprob=logprob)
            for token_id, logprob in logprobs.top
        ],
    )


def read_tokenizer_files(
    folder: Path | None, chat_template: str | None = None
) -> node_pb2.TokenizerFiles:
    """`tokenizer.json` and `tokenizer_config.json` of `folder` (empty when absent: a synthetic
    model has no tokenizer, and the router can then take token ids only), and the chat template
    the node resolved (`""` when none)."""
    if folder is None:
        return node_pb2.TokenizerFiles(chat_template=chat_template or "")
    config_path = folder / "tokenizer_config.json"
    return node_pb2.TokenizerFiles(
        tokenizer_json=(folder / "tokenizer.json").read_bytes(),
        tokenizer_config_json=config_path.read_bytes() if config_path.is_file() else b"",
        chat_template=chat_template or "",
    )
