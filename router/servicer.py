"""GenerationServicer: the gRPC client API (generation.proto) over the `RequestHandler`.

```
Generate(request)
  RequestHandler.process        -> INVALID_ARGUMENT with the validation message
  RequestHandler.stream         -> GenerateResponse, written at once; stops at the finish
  RouterError                   -> its status; client cancel -> counted, node calls cancelled
```
"""

from __future__ import annotations

import contextlib
import time

import grpc

from pdserve.sampling_params import InvalidRequestError
from pdserve.v1 import generation_pb2, generation_pb2_grpc
from router.errors import RouterError
from router.request_handler import NO_NODE_MESSAGE, RequestHandler


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Serves Generate and GetModelInfo for the model of the registry's nodes."""

    def __init__(self, handler: RequestHandler) -> None:
        self._handler = handler

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        start_s = time.monotonic()
        try:
            processed = self._handler.process(request)
        except (InvalidRequestError, RouterError) as error:
            error = _as_router_error(error)
            self._handler.rejected(
                "grpc", request.request_id, error.code.name, error.message, start_s
            )
            await context.abort(error.code, error.message)
        try:
            stream = self._handler.stream(processed, "grpc", context.time_remaining(), start_s)
            async with contextlib.aclosing(stream):  # a cancel ends the node calls at once
                async for response in stream:
                    await context.write(response)
        except RouterError as error:
            await context.abort(error.code, error.message)

    async def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        info = self._handler.registry.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, NO_NODE_MESSAGE)
        return generation_pb2.ModelInfo(
            model_name=info.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
        )


def _as_router_error(error: Exception) -> RouterError:
    if isinstance(error, RouterError):
        return error
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(error))
