"""Wire conversions both node roles need.

a Prefill/Decode request ──to_engine_request──► the engine's validated Request (INVALID_ARGUMENT)
  = check_request (sampling values, cache salt, migrated outputs, the engine's checks)
    ──► GrammarPrep.start: its structured output's grammar compiled off the loop, within the
        call's deadline (cached by digest) ──► GrammarPrep.request: the Request, once it is
        (a refused spec or one too slow: INVALID_ARGUMENT; too many compiling: RESOURCE_EXHAUSTED)
  (a decode node starts the compile, reserves blocks meanwhile, then waits for it)
a token's log-probabilities ──token_logprob──► TokenLogprob (prompt_logprobs: a first output's)
a model's tokenizer folder ──read_tokenizer_files──► TokenizerFiles
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, Protocol

import grpc

from engine.async_engine import AsyncEngine
from engine.outputs import StepOutput
from engine.request import Request
from engine.structured import CompiledGrammar, StructuredOutputBusyError
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
    the vocabulary, context length, sampling values) with its grammar compiled; the call ends
    INVALID_ARGUMENT (or RESOURCE_EXHAUSTED: too many grammars compiling) if not.
    `output_token_ids`: a migrated request's tokens generated elsewhere (its output so far).
    Built here on the event loop (`AsyncEngine.make_request` reads only fixed configuration):
    a trip to the engine thread would wait for its current step, up to a whole prefill chunk."""
    params = await check_request(engine, request, context, output_token_ids)
    grammar = GrammarPrep.start(engine, params, context)
    try:
        return await grammar.request(request, output_token_ids)
    finally:
        grammar.close()


async def check_request(
    engine: AsyncEngine,
    request: NodeRequest,
    context: grpc.aio.ServicerContext,
    output_token_ids: Sequence[int] = (),
) -> SamplingParams:
    """The request's sampling parameters, once every check that needs no grammar passed (the
    call ends INVALID_ARGUMENT otherwise)."""
    try:
        params = SamplingParams.from_proto(request.sampling)
        _check_cache_salt(request.cache_salt)
        engine.validate(request.prompt_token_ids, params)
        if output_token_ids:
            _check_outputs(list(output_token_ids), params, engine.vocab_size)
        return params
    except ValueError as error:  # InvalidRequestError included
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))


class GrammarPrep:
    """One request's grammar, compiling (or found cached) while the caller does other work;
    `request` waits for it and builds the Request. `close` when done, however it went."""

    def __init__(
        self,
        engine: AsyncEngine,
        params: SamplingParams,
        context: grpc.aio.ServicerContext,
        task: asyncio.Task[CompiledGrammar | None] | None,
    ) -> None:
        self._engine = engine
        self._params = params
        self._context = context
        self._task = task

    @classmethod
    def start(
        cls, engine: AsyncEngine, params: SamplingParams, context: grpc.aio.ServicerContext
    ) -> GrammarPrep:
        """Starts the compile of `params.structured_output` (nothing without one), given the
        call's remaining time (the engine caps it at its compile timeout)."""
        task = None
        if params.structured_output is not None:
            timeout_s = context.time_remaining()
            task = asyncio.ensure_future(engine.prepare_structured(params, timeout_s=timeout_s))
        return cls(engine, params, context, task)

    async def request(self, request: NodeRequest, output_token_ids: Sequence[int] = ()) -> Request:
        """The validated Request, with its grammar once compiled (see the module docstring for
        the statuses a failure ends the call with)."""
        code = grpc.StatusCode.INVALID_ARGUMENT
        try:
            grammar = await self._task if self._task is not None else None
            engine_request = self._engine.make_request(
                request.request_id, request.prompt_token_ids, self._params, request.cache_salt,
                grammar=grammar,
            )  # fmt: skip
        except StructuredOutputBusyError as error:
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, f"structured output: {error}"
        except ValueError as error:  # InvalidRequestError included
            message = str(error)
        else:
            if output_token_ids:
                engine_request.output_token_ids = list(output_token_ids)
            return engine_request
        await _abort(self._context, code, message)

    def close(self) -> None:
        """Stop waiting for the compile (it goes on for the cache); its outcome is consumed."""
        if self._task is None:
            return
        if not self._task.done():
            self._task.cancel()
        self._task.add_done_callback(_consume)


def _consume(task: asyncio.Task[CompiledGrammar | None]) -> None:
    """Done-callback of a compile nobody awaits any more: its error is not logged as lost."""
    with contextlib.suppress(asyncio.CancelledError):
        task.exception()


async def _abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str
) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("context.abort returned")  # it raises AbortError


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


def prompt_logprobs(output: StepOutput) -> list[generation_pb2.TokenLogprob]:
    """The prompt logprobs an engine output carries (with a request's first token, when asked
    for), as sent on the wire: prompt tokens 2..n (the first has none)."""
    return [token_logprob(entry) for entry in (output.prompt_logprobs or [])[1:] if entry]


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
