"""RequestCalls: the node calls of one request on one route, read into one token stream.

```
stream()
  D.Decode(DISAGGREGATED | LOCAL_PREFILL)
  PrefillLeg.start(P)           ─ P.Prefill(request) at once, beside D.Decode: P computes while
                                  D reserves; its reader emits P's first token the moment it
                                  comes (router/prefill_leg.py: retry, CancelTransfer)
  _pump_decode task:  DISAGGREGATED: D's first message, the TransferTicket (ticket_timeout_s)
                      -> PrefillLeg.attach(ticket) (P.AttachTicket); then
                      TokenChunk -> NodeTokens(output_index) ... until finish_reason (after
                      P's first token, which carries the prompt logprobs and P's cache hits,
                      or P's end; not when D prefilled itself: TokenChunk.prefilled_here)
  both readers -> one queue -> yielded until a finish_reason (token_timeout_s per wait; the
                      first also waits for the prefill: + the prompt tokens its node has in
                      flight, this one's included, / min_prefill_tokens_per_s)
  (LOCAL_PREFILL: D's stream alone, read by stream() itself: no reader task, no queue)
  D UNAVAILABLE before any token was yielded: NodeUnreachableError (the dispatcher retries)
  D UNAVAILABLE after:  DecodeLostError (the dispatcher migrates the request)
A migrated request (output_token_ids: its tokens already streamed) runs LOCAL_PREFILL on D,
which prefills prompt + those tokens and numbers its chunks from len(output_token_ids).
close (always): D not finished -> D.Abort (awaited; in the background when the client
  cancelled); cancel both calls and both readers (a cancelled call ends the request on its
  node, freeing its blocks; the Abort covers a cancellation grpc lost: one that reached the node
  ~1 ms after the call started left its handler running, seen once in ~200 tries)
```

In-flight accounting: D's `NodeLoad` counts the request (prompt + max_tokens) until close; P's
counts its prompt tokens until its Prefill call ends (PrefillLeg).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence

import grpc

from pdserve.config import RouterConfig
from pdserve.v1 import node_pb2
from router.errors import DecodeLostError, NodeUnreachableError, RouterError, node_error
from router.input_processor import ProcessedRequest
from router.output_processor import NodeTokens
from router.policies import Route
from router.prefill_leg import PrefillLeg, RetryPrefill
from router.request_record import Marks, mark
from router.stats import RouterStats

logger = logging.getLogger(__name__)

_TASK_EXIT_TIMEOUT_S = 1.0  # cancelled reader tasks end at their next await
_background_aborts: set[asyncio.Task[None]] = set()  # D.Aborts sent for cancelled requests


class RequestCalls:
    """The node calls of one request, and the tasks that read them into one queue."""

    def __init__(
        self,
        route: Route,
        request: ProcessedRequest,
        config: RouterConfig,
        stats: RouterStats,
        timeout_s: float | None,
        retry_prefill: RetryPrefill,
        output_token_ids: Sequence[int] = (),
        marks: Marks = None,
    ) -> None:
        self._decode = route.decode
        self._output_token_ids = list(output_token_ids)
        self._request = request
        self._config = config
        self._timeout_s = timeout_s
        self._marks = marks
        self._events: asyncio.Queue[NodeTokens | RouterError] = asyncio.Queue()
        self._decode_task: asyncio.Task[None] | None = None  # disaggregated: D's reader
        self._tokens: AsyncGenerator[NodeTokens, None] | None = (
            None  # else: D's stream, read inline
        )
        self._decode_call: grpc.aio.UnaryStreamCall | None = None
        self._decode_ended = False  # D's stream delivered its finish or failed
        self._num_yielded = 0
        # The prefill side of a disaggregated route (a migrated request prefills on D).
        self._prefill = route.prefill if not output_token_ids else None
        self._leg: PrefillLeg | None = None
        # D's index 0 must not overtake P's first token, which carries the prompt logprobs and
        # P's prefix-cache hits (usage.cached_tokens: a request ending on its first token would
        # report D's 0); once P's is out, the wait costs nothing
        self._wait_prefill_first = self._prefill is not None
        if self._prefill is not None:
            self._leg = PrefillLeg(
                request, config, stats, route.decode, timeout_s, retry_prefill,
                self._events.put_nowait, marks,
            )  # fmt: skip
        max_tokens = request.sampling_params.max_tokens
        self._decode_work = self._decode.load.track(request.prompt_len + max_tokens)

    async def stream(self) -> AsyncGenerator[NodeTokens, None]:
        disaggregated = self._leg is not None
        decode_call = self._decode_call = self._decode.decode_stub.Decode(
            node_pb2.DecodeRequest(
                request_id=self._request.request_id,
                prompt_token_ids=self._request.prompt_token_ids,
                sampling=self._request.node_sampling,
                mode=node_pb2.DECODE_MODE_DISAGGREGATED
                if disaggregated
                else node_pb2.DECODE_MODE_LOCAL_PREFILL,
                transfer_timeout_s=self._config.transfer_timeout_s if disaggregated else 0.0,
                output_token_ids=self._output_token_ids,
                cache_salt=self._request.cache_salt,
            ),
            timeout=self._timeout_s,
        )
        mark(self._marks, "decode_sent")
        get: Callable[[], Awaitable[NodeTokens | RouterError]]
        if self._leg is not None and self._prefill is not None:
            self._leg.start(self._prefill)  # close() cancels it if D sends no ticket
            self._decode_task = asyncio.create_task(self._pump_decode(decode_call))
            get = self._events.get
        else:  # D's stream alone: read here, no reader task
            self._tokens = self._decode_tokens(decode_call)
            get = self._tokens.__anext__
        wait_s = self._first_token_wait_s()
        while True:
            try:
                event = await self._next_event(get, wait_s)
            except RouterError as error:
                raise self._decode_failure(error) from None
            wait_s = self._config.token_timeout_s
            if isinstance(event, RouterError):
                raise self._decode_failure(event)
            self._num_yielded += 1
            yield event
            if event.finish_reason:
                return

    async def _next_event(
        self, get: Callable[[], Awaitable[NodeTokens | RouterError]], wait_s: float
    ) -> NodeTokens | RouterError:
        """The next tokens (or failure), waiting at most `wait_s`."""
        if not self._events.empty():
            return self._events.get_nowait()
        try:  # asyncio.timeout: a client's cancel stays a cancel (see RedisNodeSource.watch)
            async with asyncio.timeout(wait_s):
                return await get()
        except TimeoutError:
            raise RouterError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"request {self._request.request_id}: no tokens from decode node "
                f"{self._decode.address} for {wait_s:.0f} s",
            ) from None

    def _first_token_wait_s(self) -> float:
        """token_timeout_s, and the prefill the first token waits for: the prompt tokens its
        node has in flight, this one's included (D prefills: prompt + a migration's tokens)."""
        if self._leg is not None:
            tokens = self._leg.tokens_in_flight
        else:
            tokens = self._request.prompt_len + len(self._output_token_ids)
        return self._config.token_timeout_s + tokens / self._config.min_prefill_tokens_per_s

    async def close(self) -> None:
        """Aborts D's request if it is still running (in the background when the client
        cancelled: this task ends now), and cancels every call and reader task."""
        try:
            current = asyncio.current_task()
            if not self._decode_ended and current is not None and current.cancelling():
                task = asyncio.get_running_loop().create_task(self._abort_decode())
                _background_aborts.add(task)
                task.add_done_callback(_background_aborts.discard)
            elif not self._decode_ended:
                await self._abort_decode()
        finally:
            tasks = [self._decode_task]
            if self._decode_task is not None:
                self._decode_task.cancel()
            if self._decode_call is not None:
                self._decode_call.cancel()
            if self._leg is not None:
                self._leg.close()
                tasks.append(self._leg.task)
            pending = [task for task in tasks if task is not None and not task.done()]
            if pending:  # cancelled reader tasks end at their next await
                await asyncio.wait(pending, timeout=_TASK_EXIT_TIMEOUT_S)
            if self._tokens is not None:
                await self._tokens.aclose()
            self._decode_work.done()

    def _decode_failure(self, error: RouterError) -> RouterError:
        """D's stream failed: retryable if it was unreachable before any token went out."""
        if error.code != grpc.StatusCode.UNAVAILABLE:
            return error
        if self._num_yielded == 0 and not self._output_token_ids:
            return NodeUnreachableError(error.detail)
        return DecodeLostError(f"{error.detail} (mid-stream)", self._num_yielded)

    async def _read_ticket(self, decode_call: grpc.aio.UnaryStreamCall) -> node_pb2.TransferTicket:
        """D's first message, its TransferTicket; raises RouterError (AioRpcError: D failed)."""
        decode = self._decode
        try:
            async with asyncio.timeout(self._config.ticket_timeout_s):
                message = await decode_call.read()
        except TimeoutError:
            raise RouterError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"decode node {decode.address} sent no transfer ticket for request "
                f"{self._request.request_id} in {self._config.ticket_timeout_s} s",
            ) from None
        if message is grpc.aio.EOF or message.WhichOneof("kind") != "ticket":
            raise RouterError(
                grpc.StatusCode.INTERNAL,
                f"decode node {decode.address} did not start request "
                f"{self._request.request_id} with a transfer ticket",
            )
        mark(self._marks, "ticket")
        ticket: node_pb2.TransferTicket = message.ticket
        return ticket

    async def _pump_decode(self, decode_call: grpc.aio.UnaryStreamCall) -> None:
        """The reader task of a disaggregated route: D's tokens, or its failure, into the
        queue P's first token also goes to."""
        try:
            async for tokens in self._decode_tokens(decode_call):
                self._events.put_nowait(tokens)
        except RouterError as error:
            self._events.put_nowait(error)

    async def _decode_tokens(
        self, decode_call: grpc.aio.UnaryStreamCall
    ) -> AsyncGenerator[NodeTokens, None]:
        """D's ticket (handed to P) when disaggregated, then its TokenChunks until the finish;
        raises RouterError (D failed, no ticket in time, a protocol error)."""
        address = self._decode.address
        try:
            if self._leg is not None:
                await self._leg.attach(await self._read_ticket(decode_call))
            while True:
                message = await decode_call.read()
                if message is grpc.aio.EOF or message.WhichOneof("kind") != "tokens":
                    self._decode_ended = True
                    raise self._protocol_error(address, message)
                chunk = message.tokens
                mark(self._marks, "decode_first_token")
                self._decode_ended = bool(chunk.finish_reason)
                if chunk.prefilled_here:  # D prefilled itself (P's hand-off failed): P's
                    self._wait_prefill_first = False  # first token may never come
                leg = self._leg  # (one check per chunk once P's first token is out)
                if self._wait_prefill_first and leg is not None and not leg.first_out.is_set():
                    await leg.first_out.wait()
                yield NodeTokens.of_chunk(chunk)
                if chunk.finish_reason:
                    return
        except grpc.aio.AioRpcError as error:
            self._decode_ended = True
            raise node_error("decode", address, error) from None

    def _protocol_error(self, address: str, message: object) -> RouterError:
        what = "ended its stream" if message is grpc.aio.EOF else "sent a non-token message"
        return RouterError(
            grpc.StatusCode.INTERNAL,
            f"decode node {address} {what} for request {self._request.request_id} before a "
            "finish_reason",
        )

    async def _abort_decode(self) -> None:
        try:  # bounded by node_rpc_timeout_s
            await self._decode.abort(self._request.request_id, self._config.node_rpc_timeout_s)
        except grpc.aio.AioRpcError:  # cancelling the call aborts it too
            pass
        except Exception:  # noqa: BLE001 - e.g. the channel closed under a background abort
            logger.debug("abort of %s failed", self._request.request_id, exc_info=True)
