"""RequestHandler: the one request path behind both client APIs (gRPC Generate and the OpenAI
HTTP routes), so the same request gives the same tokens whichever API carried it.

```
process(GenerateRequest)      InputProcessor: validate + tokenize -> ProcessedRequest, with
                              its cache salt (router.tenancy: tenant + client's cache_salt)
                              (InvalidRequestError; UNAVAILABLE before any node is ready)
process_soon(...)             the same, on a worker thread unless the request is small
                              (token ids or a short text prompt: on the event loop)
stream(processed, api, ...)   request id on every log line of this task (pdserve.logs)
  Dispatcher.run              NodeTokens from P and D (route noted in the RequestRecord)
    OutputProcessor.process   GenerateResponse per chunk (timed: TTFT, ITL)
  however it ends             RouterStats.request_ended: metrics + one access log line
rejected(...)                 a request that failed validation, counted and logged the same way
```
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

import grpc

from pdserve.logs import set_request_id
from pdserve.sampling_params import InvalidRequestError
from pdserve.v1 import generation_pb2
from router.dispatcher import Dispatcher
from router.errors import RouterError
from router.input_processor import InputProcessor, ProcessedRequest, processes_inline
from router.node_registry import NodeRegistry
from router.output_processor import OutputProcessor
from router.request_record import Marks, RequestRecord
from router.stats import RouterStats
from router.tenancy import MAX_CLIENT_SALT_CHARS, CacheSalts

logger = logging.getLogger(__name__)

NO_NODE_MESSAGE = (
    "no node is ready yet: the router learns the model and its tokenizer from its nodes "
    "(check the --prefill/--decode addresses or the --registry, and that the nodes are up)"
)


class RequestHandler:
    """Validates, routes and streams requests for the model of the registry's nodes."""

    def __init__(
        self,
        registry: NodeRegistry,
        dispatcher: Dispatcher,
        stats: RouterStats,
        max_prompt_chars: int = 0,
        salts: CacheSalts | None = None,
    ) -> None:
        self._max_prompt_chars = max_prompt_chars
        self._salts = salts or CacheSalts(None, None, per_tenant=False, keyed_tenants=False)
        self.registry = registry
        self.stats = stats
        self._dispatcher = dispatcher
        self._input_processor: InputProcessor | None = None  # once a node gave the tokenizer

    def process(
        self, request: generation_pb2.GenerateRequest, authorization: str | None = None
    ) -> ProcessedRequest:
        """Validated and tokenized; raises InvalidRequestError, or RouterError(UNAVAILABLE)
        while no node is ready. `authorization`: the client's header (its tenant: the prefix
        cache's namespace, `router.tenancy`)."""
        if len(request.cache_salt) > MAX_CLIENT_SALT_CHARS:
            raise InvalidRequestError(
                f"cache_salt has {len(request.cache_salt)} characters; at most "
                f"{MAX_CLIENT_SALT_CHARS}",
                "cache_salt",
            )
        if self._input_processor is None:
            if self.registry.model_info is None:  # the tokenizer may be None: token ids only
                raise RouterError(grpc.StatusCode.UNAVAILABLE, NO_NODE_MESSAGE)
            self._input_processor = InputProcessor(
                self.registry.tokenizer, self.registry.model_info, self._max_prompt_chars
            )
        salt = self._salts.salt(authorization, request.cache_salt)
        return self._input_processor.process(request, salt)

    async def process_soon(
        self, request: generation_pb2.GenerateRequest, authorization: str | None = None
    ) -> ProcessedRequest:
        """`process`: on the event loop for a small request, else on a worker thread (a long
        prompt's tokenizing, a chat template, must not stall the other requests)."""
        if processes_inline(request):
            return self.process(request, authorization)
        return await asyncio.to_thread(self.process, request, authorization)

    def rejected(
        self, api: str, request_id: str, status: str, message: str, start_s: float
    ) -> None:
        """Counts and logs a request that never ran (bad input: `status` INVALID_ARGUMENT; no
        node ready: UNAVAILABLE)."""
        self.stats.request_started()
        record = RequestRecord(request_id or "-", api, start_s=start_s)
        record.end(status)
        level = logging.INFO if status in ("INVALID_ARGUMENT", "NOT_FOUND") else logging.WARNING
        logger.log(
            level, "%s request rejected: %s: %s", api, status, message,
            extra={"request_id": request_id},
        )  # fmt: skip
        self.stats.request_ended(record)

    async def stream(
        self,
        processed: ProcessedRequest,
        api: str,
        timeout_s: float | None = None,
        start_s: float | None = None,
        marks: Marks = None,
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """The request's responses, the last one with finish_reason and usage. Raises
        RouterError (counted, logged). Run it in a task of its own: it sets the task's
        request id for logging. `marks`: a traced request's milestones (filled in)."""
        set_request_id(processed.request_id)
        record = RequestRecord(
            processed.request_id, api, prompt_tokens=processed.prompt_len, marks=marks
        )
        if start_s is not None:
            record.start_s = start_s
        self.stats.request_started()
        output = OutputProcessor(processed, self.registry.tokenizer)
        status = "CANCELLED"  # unless it finishes or fails
        try:
            stream = self._dispatcher.run(processed, timeout_s, record)
            async with contextlib.aclosing(stream):
                async for tokens in stream:
                    response = output.process(tokens)
                    if response is not None:
                        self._sent(record, len(response.token_ids))
                        if output.finished:
                            status = "OK"
                        yield response
                    if output.finished:
                        break
        except RouterError as error:
            status = error.code.name
            logger.warning("request failed: %s", error)
            raise
        except Exception:  # a bug: counted as one, not as the client's cancel
            status = grpc.StatusCode.INTERNAL.name
            raise
        finally:
            record.cached_tokens = output.num_cached_tokens
            record.end(status, (output.finish_reason or "") if status == "OK" else "")
            self.stats.request_ended(record)

    def _sent(self, record: RequestRecord, num_tokens: int) -> None:
        now = time.monotonic()
        if num_tokens and record.last_token_s is not None:
            self.stats.metrics.observe_itl((now - record.last_token_s) / num_tokens, num_tokens)
        record.tokens_sent(num_tokens, now)
