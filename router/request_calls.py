"""RequestCalls: the node calls of one request on one route, read into one token stream.

```
stream()
  D.Decode(DISAGGREGATED | LOCAL_PREFILL)     ─ read ticket first (ticket_timeout_s) when P
  P.Prefill(request)                          ─ at once, beside D.Decode: P computes while D
                                                reserves (the ticket is not in yet)
  _read_prefill task: P.AttachTicket(ticket) once D's ticket is in (node_rpc_timeout_s);
                      PrefillFirstToken -> NodeTokens(0); PrefillTransferResult (logged)
                      P unreachable before its first token: Prefill on another prefill node
                      (retry_prefill, the ticket inline), once; P failed otherwise (its
                      AttachTicket too), or reported a failed
                      transfer: D.CancelTransfer (D frees the reservation and prefills
                      locally at once, not at its transfer deadline)
  _read_decode task:  TokenChunk -> NodeTokens(output_index) ... until finish_reason
  both tasks -> one queue -> yielded (token_timeout_s per wait) until a finish_reason
  D UNAVAILABLE before any token was yielded: NodeUnreachableError (the dispatcher retries)
  D UNAVAILABLE after:  DecodeLostError (the dispatcher migrates the request)
A migrated request (output_token_ids: its tokens already streamed) runs LOCAL_PREFILL on D,
which prefills prompt + those tokens and numbers its chunks from len(output_token_ids).
close (always): D not finished -> D.Abort (awaited; in the background when the client
  cancelled); cancel both calls and both tasks (a cancelled call ends the request on its node,
  freeing its blocks; the Abort covers a cancellation grpc lost: one that reached the node
  ~1 ms after the call started left its handler running, seen once in ~200 tries)
```

In-flight accounting: D's `NodeLoad` counts the request (prompt + max_tokens) until close; P's
counts its prompt tokens until its Prefill call ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable, Sequence

import grpc

from pdserve.config import RouterConfig
from pdserve.v1 import node_pb2
from router.errors import DecodeLostError, NodeUnreachableError, RouterError, node_error
from router.input_processor import ProcessedRequest
from router.node_client import NodeClient
from router.node_load import InflightWork
from router.output_processor import NodeTokens
from router.policies import Route
from router.stats import RouterStats

logger = logging.getLogger(__name__)

_TASK_EXIT_TIMEOUT_S = 1.0  # cancelled reader tasks end at their next await
_background_aborts: set[asyncio.Task[None]] = set()  # D.Aborts sent for cancelled requests

# Given the prefill node that was unreachable: another one to run the Prefill on (counted as a
# retry), or None.
RetryPrefill = Callable[[NodeClient], NodeClient | None]


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
    ) -> None:
        self._decode = route.decode
        # The current prefill node (a retry changes it); a migrated request prefills on D.
        self._prefill = route.prefill if not output_token_ids else None
        self._output_token_ids = list(output_token_ids)
        self._request = request
        self._config = config
        self._stats = stats
        self._timeout_s = timeout_s
        self._retry_prefill = retry_prefill
        self._events: asyncio.Queue[NodeTokens | RouterError] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._decode_call: grpc.aio.UnaryStreamCall | None = None
        self._prefill_call: grpc.aio.UnaryStreamCall | None = None
        self._ticket_sent = False  # the current Prefill call has the ticket (inline or attached)
        self._decode_ended = False  # D's stream delivered its finish or failed
        self._num_yielded = 0
        self._prefill_sent_first = False  # P's first token is in the queue
        max_tokens = request.sampling_params.max_tokens
        self._decode_work = self._decode.load.track(request.prompt_len + max_tokens)
        self._prefill_work: InflightWork | None = None

    async def stream(self) -> AsyncGenerator[NodeTokens, None]:
        prefill = self._prefill
        disaggregated = prefill is not None
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
        if prefill is not None:
            self._start_prefill(prefill, None)  # close() cancels it if D sends no ticket
            ticket = await self._read_ticket(decode_call)
            self._tasks.append(asyncio.create_task(self._read_prefill(ticket)))
        self._tasks.append(asyncio.create_task(self._read_decode(decode_call)))
        while True:
            try:  # asyncio.timeout: a client's cancel stays a cancel (see RedisNodeSource.watch)
                async with asyncio.timeout(self._config.token_timeout_s):
                    event = await self._events.get()
            except TimeoutError:
                raise RouterError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"request {self._request.request_id}: no tokens from decode node "
                    f"{self._decode.address} for {self._config.token_timeout_s} s",
                ) from None
            if isinstance(event, RouterError):
                raise self._decode_failure(event)
            self._num_yielded += 1
            yield event
            if event.finish_reason:
                return

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
            for task in self._tasks:
                task.cancel()
            for call in (self._decode_call, self._prefill_call):
                if call is not None:
                    call.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=_TASK_EXIT_TIMEOUT_S)
            self._decode_work.done()
            if self._prefill_work is not None:
                self._prefill_work.done()

    def _decode_failure(self, error: RouterError) -> RouterError:
        """D's stream failed: retryable if it was unreachable before any token went out."""
        if error.code != grpc.StatusCode.UNAVAILABLE:
            return error
        if self._num_yielded == 0 and not self._output_token_ids:
            return NodeUnreachableError(error.detail)
        return DecodeLostError(f"{error.detail} (mid-stream)", self._num_yielded)

    async def _read_ticket(self, decode_call: grpc.aio.UnaryStreamCall) -> node_pb2.TransferTicket:
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
        except grpc.aio.AioRpcError as error:
            self._decode_ended = True
            raise self._decode_failure(node_error("decode", decode.address, error)) from None
        if message is grpc.aio.EOF or message.WhichOneof("kind") != "ticket":
            raise RouterError(
                grpc.StatusCode.INTERNAL,
                f"decode node {decode.address} did not start request "
                f"{self._request.request_id} with a transfer ticket",
            )
        ticket: node_pb2.TransferTicket = message.ticket
        return ticket

    async def _read_decode(self, decode_call: grpc.aio.UnaryStreamCall) -> None:
        address = self._decode.address
        try:
            while True:
                message = await decode_call.read()
                if message is grpc.aio.EOF or message.WhichOneof("kind") != "tokens":
                    self._events.put_nowait(self._protocol_error(address, message))
                    return
                chunk = message.tokens
                self._events.put_nowait(
                    NodeTokens(
                        output_index=chunk.output_index,
                        token_ids=list(chunk.token_ids),
                        logprobs=list(chunk.logprobs),
                        finish_reason=chunk.finish_reason,
                        num_cached_tokens=chunk.num_cached_tokens,
                    )
                )
                if chunk.finish_reason:
                    return
        except grpc.aio.AioRpcError as error:
            self._events.put_nowait(node_error("decode", address, error))
        finally:
            self._decode_ended = True

    def _protocol_error(self, address: str, message: object) -> RouterError:
        what = "ended its stream" if message is grpc.aio.EOF else "sent a non-token message"
        return RouterError(
            grpc.StatusCode.INTERNAL,
            f"decode node {address} {what} for request {self._request.request_id} before a "
            "finish_reason",
        )

    def _start_prefill(self, prefill: NodeClient, ticket: node_pb2.TransferTicket | None) -> None:
        """P.Prefill on `prefill` (the current prefill node from now), with `ticket` inline, or
        (None) to be attached by _forward_prefill."""
        # P starts the prefill within transfer_timeout_s and ends the hand-off within
        # transfer_timeout_s of that (as D waits): the call outlives neither.
        timeout_s = 2 * self._config.transfer_timeout_s
        if self._timeout_s is not None:
            timeout_s = min(timeout_s, self._timeout_s)
        if self._prefill_work is not None:
            self._prefill_work.done()
        self._prefill = prefill
        self._prefill_work = prefill.load.track(self._request.prompt_len)
        self._prefill_call = prefill.prefill_stub.Prefill(
            node_pb2.PrefillRequest(
                request_id=self._request.request_id,
                prompt_token_ids=self._request.prompt_token_ids,
                sampling=self._request.node_sampling,
                ticket=ticket,
                transfer_timeout_s=self._config.transfer_timeout_s,
                cache_salt=self._request.cache_salt,
            ),
            timeout=timeout_s,
        )
        self._ticket_sent = ticket is not None

    async def _read_prefill(self, ticket: node_pb2.TransferTicket) -> None:
        """Forwards P's first token; if P is unreachable before it, runs the Prefill on another
        prefill node once; if P fails otherwise before the hand-off ends, tells D to prefill
        locally instead of waiting out its transfer timeout."""
        try:
            failure = await self._forward_prefill_with_retry(ticket)
        finally:
            if self._prefill_work is not None:
                self._prefill_work.done()
        if failure is None:
            return
        self._stats.prefill_failure()
        prefill, call = self._prefill_leg()
        logger.warning(
            "request %s: prefill node %s failed (%s); decode node %s prefills locally",
            self._request.request_id,
            prefill.address,
            failure,
            self._decode.address,
        )
        call.cancel()  # (P may still wait for its ticket, holding blocks)
        await self._cancel_transfer(ticket.transfer_id, f"prefill node failed: {failure}")

    async def _forward_prefill_with_retry(self, ticket: node_pb2.TransferTicket) -> str | None:
        """`_forward_prefill`, once more on another prefill node if the first was unreachable
        before its first token; why the hand-off failed, or None."""
        prefill, call = self._prefill_leg()
        try:
            return await self._forward_prefill(ticket)
        except grpc.aio.AioRpcError as error:
            failure = _describe(error)
            other = None
            if error.code() == grpc.StatusCode.UNAVAILABLE and not self._prefill_sent_first:
                other = self._retry_prefill(prefill)
            if other is None:
                return failure
        logger.warning(
            "request %s: prefill node %s unreachable (%s); retrying on %s",
            self._request.request_id, prefill.address, failure, other.address,
        )  # fmt: skip
        call.cancel()
        self._start_prefill(other, ticket)
        try:
            return await self._forward_prefill(ticket)
        except grpc.aio.AioRpcError as error:
            return _describe(error)

    async def _forward_prefill(self, ticket: node_pb2.TransferTicket) -> str | None:
        """Attaches the ticket if P's call went without it, reads P's two messages; returns
        why the hand-off failed (P's stream, or the transfer P reports failed), or None."""
        prefill, call = self._prefill_leg()
        if not self._ticket_sent:
            self._ticket_sent = True
            await prefill.attach_ticket(
                self._request.request_id, ticket, self._config.node_rpc_timeout_s
            )
        message = await call.read()
        if message is grpc.aio.EOF or message.WhichOneof("kind") != "first_token":
            return "its stream did not start with the first token"
        first = message.first_token
        self._prefill_sent_first = True
        self._events.put_nowait(
            NodeTokens(
                output_index=0,
                token_ids=[first.token_id],
                logprobs=[first.logprob] if first.HasField("logprob") else [],
                finish_reason=first.finish_reason,
                num_cached_tokens=first.num_cached_tokens,
            )
        )
        message = await call.read()
        if message is grpc.aio.EOF or message.WhichOneof("kind") != "transfer_result":
            return "its stream ended without a transfer result"
        result = message.transfer_result
        if not result.ok:  # D is told at once (it may never hear from P: a broken connection)
            return f"its KV transfer failed: {result.error}"
        return None

    def _prefill_leg(self) -> tuple[NodeClient, grpc.aio.UnaryStreamCall]:
        """The current prefill node and its Prefill call (set by `_start_prefill`, which a
        disaggregated route runs before any reader of P's stream starts)."""
        if self._prefill is None or self._prefill_call is None:
            raise RuntimeError(f"request {self._request.request_id}: no Prefill call started")
        return self._prefill, self._prefill_call

    async def _cancel_transfer(self, transfer_id: str, reason: str) -> None:
        decode = self._decode
        try:
            await decode.cancel_transfer(transfer_id, reason, self._config.node_rpc_timeout_s)
        except grpc.aio.AioRpcError as error:  # D still falls back at its transfer timeout
            logger.warning("CancelTransfer %s on %s failed: %s", transfer_id, decode.address, error)

    async def _abort_decode(self) -> None:
        try:  # bounded by node_rpc_timeout_s
            await self._decode.abort(self._request.request_id, self._config.node_rpc_timeout_s)
        except grpc.aio.AioRpcError:  # cancelling the call aborts it too
            pass
        except Exception:  # noqa: BLE001 - e.g. the channel closed under a background abort
            logger.debug("abort of %s failed", self._request.request_id, exc_info=True)


def _describe(error: grpc.aio.AioRpcError) -> str:
    return f"{error.code().name}: {error.details()}"
