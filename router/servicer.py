"""GenerationServicer: the gRPC client API (generation.proto) over the `RequestHandler`.

```
Generate(request)
  RequestHandler.process        -> INVALID_ARGUMENT with the validation message
  RequestHandler.stream         -> GenerateResponse, written at once; stops at the finish
  RouterError                   -> its status; client cancel -> counted, node calls cancelled
  `pdserve-trace` metadata      -> the request's milestones in the trailing metadata
GetTokenizer                    the first ready node's tokenizer files, for clients (pd-bench)
```
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

import grpc

from pdserve.sampling_params import InvalidRequestError
from pdserve.v1 import generation_pb2, generation_pb2_grpc, node_pb2
from router.auth import AUTHORIZATION
from router.errors import RouterError, abort
from router.input_processor import loggable_request_id
from router.request_handler import NO_NODE_MESSAGE, RequestHandler
from router.request_record import TRACE_METADATA, mark

logger = logging.getLogger(__name__)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Serves Generate and GetModelInfo for the model of the registry's nodes."""

    def __init__(self, handler: RequestHandler) -> None:
        self._handler = handler

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        start_s = time.monotonic()
        authorization, traced = _metadata(context)
        marks = {"received": start_s} if traced else None
        try:
            # Tokenizing a long prompt takes a while: off the event loop, so other calls go on.
            processed = await self._handler.process_soon(request, authorization)
            mark(marks, "processed")
        except (InvalidRequestError, RouterError) as error:
            error = _as_router_error(error)
            self._handler.rejected(
                "grpc",
                loggable_request_id(request.request_id),
                error.code.name,
                error.message,
                start_s,
            )
            await abort(context, error.code, error.message)
        try:
            stream = self._handler.stream(
                processed, "grpc", context.time_remaining(), start_s, marks
            )
            async with contextlib.aclosing(stream):  # a cancel ends the node calls at once
                async for response in stream:
                    await context.write(response)
        except RouterError as error:
            await abort(context, error.code, error.message)
        if marks is not None:  # the client asked: its milestones, time.monotonic() by name
            context.set_trailing_metadata(((TRACE_METADATA, json.dumps(marks)),))

    async def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        info = self._handler.registry.model_info
        if info is None:
            await abort(context, grpc.StatusCode.UNAVAILABLE, NO_NODE_MESSAGE)
        return generation_pb2.ModelInfo(
            model_name=info.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            # (NodeSamplingParams shares SamplingParams' field numbers)
            default_sampling=generation_pb2.SamplingParams.FromString(
                info.default_sampling.SerializeToString()
            ),
        )

    async def GetTokenizer(
        self, request: generation_pb2.GetModelTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelTokenizer:
        """The tokenizer files of a ready node (empty for a model without a tokenizer)."""
        registry = self._handler.registry
        nodes = registry.decode_nodes + registry.prefill_nodes
        if registry.model_info is None or not nodes:
            await abort(context, grpc.StatusCode.UNAVAILABLE, NO_NODE_MESSAGE)
        try:
            files: node_pb2.TokenizerFiles = await nodes[0].node_stub.GetTokenizer(
                node_pb2.GetTokenizerRequest(), timeout=_TOKENIZER_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as error:
            failed = RouterError(
                grpc.StatusCode.UNAVAILABLE, f"node {nodes[0].address}: {error.details()}"
            )
            logger.warning("GetTokenizer failed: %s", failed)
            await abort(context, failed.code, failed.message)
        return generation_pb2.ModelTokenizer(
            tokenizer_json=files.tokenizer_json,
            tokenizer_config_json=files.tokenizer_config_json,
            chat_template=files.chat_template,
        )


_TOKENIZER_TIMEOUT_S = 30.0  # a large tokenizer.json is tens of MB


def _metadata(context: grpc.aio.ServicerContext) -> tuple[str | None, bool]:
    """The client's authorization header (its tenant, if any) and whether it asked for a
    trace (`pdserve-trace` metadata)."""
    authorization, traced = None, False
    for name, value in context.invocation_metadata() or ():
        if name == AUTHORIZATION and isinstance(value, str):
            authorization = value
        elif name == TRACE_METADATA:
            traced = True
    return authorization, traced


def _as_router_error(error: Exception) -> RouterError:
    if isinstance(error, RouterError):
        return error
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(error))
