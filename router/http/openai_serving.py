"""OpenAIServing: runs parsed OpenAI requests on the router's `RequestHandler` (the same path
as gRPC Generate), one task per choice, and builds the responses (`openai_responses`).

```
prepare(parsed)     model check (404), per choice: request id "<id>-<i>", RequestHandler.process
                    (bad input: 400; chat without max_tokens: the rest of the context)
complete(...)       every choice to its end -> one JSON body (MAX_CHOICES_IN_FLIGHT at a time)
open_stream(...)    SSE once the first token is in (a failure before it: its HTTP status, never
                    a 200 then an error): "data: {chunk}" ... [usage chunk] "data: [DONE]"
                    (continuous_usage_stats: every chunk carries the usage so far)
```
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc

from pdserve.sampling_params import InvalidRequestError
from pdserve.v1 import generation_pb2, node_pb2
from router.errors import RouterError
from router.http.openai_errors import OpenAIError
from router.http.openai_protocol import OpenAIRequest
from router.http.openai_responses import ChoiceState, ResponseBuilder
from router.input_processor import ProcessedRequest, processes_inline
from router.request_handler import NO_NODE_MESSAGE, RequestHandler

logger = logging.getLogger(__name__)

_Event = tuple[int, generation_pb2.GenerateResponse | RouterError | None]
# Choices of one request run at most this many at a time, the rest as those finish: a batch of
# hundreds of prompts would otherwise meet a decode node's cap on awaited hand-offs
# (--max-pending-transfers, 256 by default) all at once and fail with a 429 on every retry.
MAX_CHOICES_IN_FLIGHT = 64


@dataclasses.dataclass
class PreparedRequest:
    parsed: OpenAIRequest
    request_id: str
    processed: list[ProcessedRequest]  # one per choice
    start_s: float


class OpenAIServing:
    def __init__(self, handler: RequestHandler) -> None:
        self.handler = handler

    def model_name(self) -> str | None:
        info = self.handler.registry.model_info
        return info.model_name if info is not None else None

    def models(self) -> dict[str, Any]:
        info = self.handler.registry.model_info
        data = []
        if info is not None:
            data.append({
                "id": info.model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                "max_model_len": info.max_model_len,
            })  # fmt: skip
        return {"object": "list", "data": data}

    async def prepare(
        self, parsed: OpenAIRequest, start_s: float, authorization: str | None = None
    ) -> PreparedRequest:
        """Validated and tokenized choices; raises OpenAIError (counted as rejected).
        Tokenizing (and the chat template) runs off the event loop, as for gRPC Generate,
        unless the request is one small choice (`processes_inline`).
        `authorization`: the client's header (its tenant, router.tenancy)."""
        prefix = "chatcmpl" if parsed.chat else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            served = self.model_name()
            if served is None:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, NO_NODE_MESSAGE)
            if parsed.model != served:
                raise OpenAIError(
                    f"the model {parsed.model!r} does not exist; this server serves {served!r}",
                    "model", status=404, error_type="not_found_error", code="model_not_found",
                )  # fmt: skip
            if len(parsed.choices) == 1 and processes_inline(parsed.choices[0].request):
                processed = self._process_choices(parsed, request_id, authorization)
            else:  # a batch, a long prompt, a chat template: off the event loop
                processed = await asyncio.to_thread(
                    self._process_choices, parsed, request_id, authorization
                )
        except InvalidRequestError as error:
            invalid = OpenAIError(str(error), self._param(parsed, error.param))
            raise self._rejected(request_id, invalid, start_s) from None
        except RouterError as error:
            raise self._rejected(
                request_id, OpenAIError.from_router_error(error), start_s
            ) from None
        except OpenAIError as error:
            raise self._rejected(request_id, error, start_s) from None
        return PreparedRequest(parsed, request_id, processed, start_s)

    @staticmethod
    def _param(parsed: OpenAIRequest, param: str | None) -> str | None:
        """The request's name for a parameter the router's validation blamed."""
        if param in ("prompt", "prompt_token_ids"):
            return "messages" if parsed.chat else "prompt"
        if param == "max_tokens":
            return parsed.max_tokens_param
        return param

    def reject(self, error: OpenAIError, start_s: float) -> OpenAIError:
        """Counts a request refused before it was parsed."""
        return self._rejected("-", error, start_s)

    def _rejected(self, request_id: str, error: OpenAIError, start_s: float) -> OpenAIError:
        status = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED"}.get(
            error.status, error.code
        )
        self.handler.rejected("http", request_id, status or "UNKNOWN", error.message, start_s)
        return error

    def _process_choices(
        self, parsed: OpenAIRequest, request_id: str, authorization: str | None
    ) -> list[ProcessedRequest]:
        return [
            self._process(parsed, choice.request, f"{request_id}-{i}", authorization)
            for i, choice in enumerate(parsed.choices)
        ]

    def _process(
        self,
        parsed: OpenAIRequest,
        request: generation_pb2.GenerateRequest,
        request_id: str,
        authorization: str | None,
    ) -> ProcessedRequest:
        request.request_id = request_id
        if parsed.max_tokens_set:
            return self.handler.process(request, authorization)
        # Chat without max_tokens: whatever the context leaves after the prompt. Validated with
        # the least it may be (min_tokens, at least 1), then widened: the prompt is tokenized once.
        request.sampling.max_tokens = max(1, request.sampling.min_tokens)
        processed = self.handler.process(request, authorization)
        info = self.handler.registry.model_info
        if info is None:  # every node left since `prepare` looked
            raise RouterError(grpc.StatusCode.UNAVAILABLE, NO_NODE_MESSAGE)
        max_model_len = info.max_model_len
        max_tokens = max(request.sampling.max_tokens, max_model_len - processed.prompt_len)
        params = dataclasses.replace(processed.sampling_params, max_tokens=max_tokens)
        return dataclasses.replace(
            processed,
            sampling_params=params,
            node_sampling=params.to_proto(node_pb2.NodeSamplingParams),
        )

    async def complete(self, prepared: PreparedRequest) -> dict[str, Any]:
        builder = self._builder(prepared)
        states = [ChoiceState() for _ in prepared.processed]
        async for index, response in self._run(prepared):
            states[index].add(response)
        return builder.full_response(states)

    async def open_stream(self, prepared: PreparedRequest) -> AsyncIterator[str]:
        """The request's server-sent events, once its first token is in: a request that fails
        before it (a node overloaded, none reachable) raises OpenAIError here, so the client
        gets that status, not a 200 followed by an error event."""
        events = self._run(prepared)
        try:
            first = await anext(events, None)
        except BaseException:
            await events.aclose()
            raise
        return self._stream(prepared, first, events)

    async def _stream(
        self,
        prepared: PreparedRequest,
        first: tuple[int, generation_pb2.GenerateResponse] | None,
        events: AsyncGenerator[tuple[int, generation_pb2.GenerateResponse], None],
    ) -> AsyncIterator[str]:
        """Server-sent events, ending with "data: [DONE]"; an error mid-stream is sent as an
        error event (the status line went out already)."""
        builder = self._builder(prepared)
        states = [ChoiceState() for _ in prepared.processed]
        try:
            for chunk in builder.first_chunks():
                yield _sse(builder.with_usage(chunk, states))
            if first is not None:
                states[first[0]].add(first[1])
                yield _sse(builder.with_usage(builder.chunk(*first), states))
                async for index, response in events:
                    states[index].add(response)
                    yield _sse(builder.with_usage(builder.chunk(index, response), states))
            if prepared.parsed.include_usage:
                yield _sse(builder.usage_chunk(states))
        except OpenAIError as error:
            yield _sse(error.body())
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"

    def _builder(self, prepared: PreparedRequest) -> ResponseBuilder:
        return ResponseBuilder(
            prepared.parsed,
            prepared.request_id,
            [p.prompt_token_ids for p in prepared.processed],
            self.handler.registry.tokenizer,
        )

    async def _run(
        self, prepared: PreparedRequest
    ) -> AsyncGenerator[tuple[int, generation_pb2.GenerateResponse], None]:
        """(choice index, GenerateResponse) as they come, from one task per choice; a failed
        choice raises OpenAIError; leaving early cancels every choice."""
        queue: asyncio.Queue[_Event] = asyncio.Queue()
        gate = asyncio.Semaphore(MAX_CHOICES_IN_FLIGHT)
        tasks = [
            asyncio.create_task(self._run_choice(i, p, prepared.start_s, queue, gate))
            for i, p in enumerate(prepared.processed)
        ]
        try:
            remaining = len(tasks)
            while remaining:
                index, event = await queue.get()
                if event is None:
                    remaining -= 1
                elif isinstance(event, RouterError):
                    raise OpenAIError.from_router_error(event)
                else:
                    yield index, event
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_choice(
        self,
        index: int,
        processed: ProcessedRequest,
        start_s: float,
        queue: asyncio.Queue[_Event],
        gate: asyncio.Semaphore,
    ) -> None:
        try:
            async with gate:
                async for response in self.handler.stream(processed, "http", None, start_s):
                    queue.put_nowait((index, response))
            queue.put_nowait((index, None))
        except RouterError as error:
            queue.put_nowait((index, error))
        except Exception as error:  # a bug: fail the request, never hang it
            logger.exception("choice %d failed", index)
            queue.put_nowait((index, RouterError(grpc.StatusCode.INTERNAL, repr(error))))


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def now_s() -> int:
    return int(time.time())
