"""GenerationServicer: the client API (generation.proto) on top of the registry and dispatcher.

```
Generate(request)
  InputProcessor.process        -> INVALID_ARGUMENT with the validation message
  Dispatcher.run(request)       -> NodeTokens from P and D
    OutputProcessor.process     -> GenerateResponse, written at once; stops at the finish
  RouterError                   -> its status; client cancel -> counted, node calls cancelled
```
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from pdserve.sampling_params import InvalidRequestError
from pdserve.v1 import generation_pb2, generation_pb2_grpc
from router.dispatcher import Dispatcher
from router.errors import RouterError
from router.input_processor import InputProcessor
from router.node_registry import NodeRegistry
from router.output_processor import OutputProcessor
from router.stats import RouterStats

logger = logging.getLogger(__name__)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Serves Generate and GetModelInfo for the model of the registry's nodes."""

    def __init__(
        self,
        registry: NodeRegistry,
        dispatcher: Dispatcher,
        stats: RouterStats,
        max_prompt_chars: int = 0,
    ) -> None:
        self._max_prompt_chars = max_prompt_chars
        self._registry = registry
        self._dispatcher = dispatcher
        self._stats = stats
        self._input_processor: InputProcessor | None = None  # once a node gave the tokenizer

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        self._stats.num_requests += 1
        try:
            await self._generate(request, context)
        except InvalidRequestError as error:
            await self._fail(context, RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(error)))
        except RouterError as error:
            await self._fail(context, error)
        except asyncio.CancelledError:
            self._stats.num_cancelled += 1
            raise

    async def GetModelInfo(
        self, request: generation_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.ModelInfo:
        info = self._registry.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _NO_NODE_MESSAGE)
        return generation_pb2.ModelInfo(
            model_name=info.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
        )

    async def _generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Tokenizing takes a while for a long prompt: off the event loop, so other calls go on.
        processed = await asyncio.to_thread(self._processor().process, request)
        output = OutputProcessor(processed, self._registry.tokenizer)
        stream = self._dispatcher.run(processed, context.time_remaining())
        async with contextlib.aclosing(stream):
            async for tokens in stream:
                response = output.process(tokens)
                if response is not None:
                    await context.write(response)
                if output.finished:
                    break
        self._stats.finish_reasons[output.finish_reason] += 1

    def _processor(self) -> InputProcessor:
        if self._input_processor is None:
            if self._registry.model_info is None:  # the tokenizer may be None: token ids only
                raise RouterError(grpc.StatusCode.UNAVAILABLE, _NO_NODE_MESSAGE)
            self._input_processor = InputProcessor(
                self._registry.tokenizer, self._registry.model_info, self._max_prompt_chars
            )
        return self._input_processor

    async def _fail(self, context: grpc.aio.ServicerContext, error: RouterError) -> None:
        self._stats.errors[error.code.name] += 1
        level = logging.INFO if error.code == grpc.StatusCode.INVALID_ARGUMENT else logging.WARNING
        logger.log(level, "Generate failed: %s", error)
        await context.abort(error.code, error.message)


_NO_NODE_MESSAGE = (
    "no node is ready yet: the router learns the model and its tokenizer from its nodes "
    "(check the --prefill/--decode addresses or the --registry, and that the nodes are up)"
)
