"""PrefillLeg: the prefill node's side of one disaggregated request, as `RequestCalls` runs it.

```
start(P)         P.Prefill(request) without its ticket, and the reader task, at once: P
                 computes while D reserves, and P's first token reaches the client the moment
                 it comes (it waits neither for D's ticket nor for AttachTicket)
attach(ticket)   D's ticket is in (the decode reader hands it over): P.AttachTicket
                 (node_rpc_timeout_s); a failed AttachTicket fails the leg (P's call cancelled)
reader task      PrefillFirstToken (with the prompt logprobs asked for) -> emit(NodeTokens(0)),
                 then first_out is set (also when the reader ends without it: D's index 0
                 waits for it when prompt logprobs are asked for); PrefillTransferResult
  P unreachable before its first token (its call or its AttachTicket UNAVAILABLE):
      Prefill on another prefill node (retry_prefill) with the ticket inline, once
  P failed otherwise, or reported a failed transfer: D.CancelTransfer(ticket) (D frees the
      reservation and prefills locally at once, not after its no-progress timeout), unless
      P's first token finished the request (its hand-off is moot: DEBUG)
tokens_in_flight prompt tokens P has in flight, this one's included
close()          the reader task and P's call cancelled; P's in-flight accounting ends
```

In-flight accounting: P's `NodeLoad` counts the prompt's tokens until its Prefill call ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from pdserve.config import RouterConfig
from pdserve.v1 import node_pb2
from router.input_processor import ProcessedRequest
from router.node_client import NodeClient
from router.node_load import InflightWork
from router.output_processor import NodeTokens
from router.request_record import Marks, mark
from router.stats import RouterStats

logger = logging.getLogger(__name__)

# Given the prefill node that was unreachable: another one to run the Prefill on (counted as a
# retry), or None.
RetryPrefill = Callable[[NodeClient], NodeClient | None]


class PrefillLeg:
    """One request's Prefill call (and its one retry), and the task that reads it."""

    def __init__(
        self,
        request: ProcessedRequest,
        config: RouterConfig,
        stats: RouterStats,
        decode: NodeClient,
        timeout_s: float | None,
        retry_prefill: RetryPrefill,
        emit: Callable[[NodeTokens], None],
        marks: Marks = None,
    ) -> None:
        self._request = request
        self._config = config
        self._stats = stats
        self._decode = decode
        self._timeout_s = timeout_s
        self._retry_prefill = retry_prefill
        self._emit = emit
        self._marks = marks
        self._ticket: asyncio.Future[node_pb2.TransferTicket] = (
            asyncio.get_running_loop().create_future()
        )
        self._prefill: NodeClient | None = None
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._work: InflightWork | None = None
        self._task: asyncio.Task[None] | None = None
        self._ticket_sent = False  # the current call has the ticket (inline or attached)
        self._attach_error: grpc.aio.AioRpcError | None = None  # why the current call was cut
        self._sent_first = False  # P's first token was emitted
        self._finished_request = False  # ... and it finished the request
        self.first_out = asyncio.Event()  # P's first token was emitted, or the reader ended

    def start(self, prefill: NodeClient) -> None:
        self._call_prefill(prefill, None)
        self._task = asyncio.create_task(self._read())

    async def attach(self, ticket: node_pb2.TransferTicket) -> None:
        """D's ticket: to the current Prefill call (AttachTicket) unless it has one."""
        if not self._ticket.done():
            self._ticket.set_result(ticket)
        if self._ticket_sent or self._call is None or self._call.done():
            return  # a retry took it inline, or the call already ended (its reader tells)
        self._ticket_sent = True
        prefill, call = self._prefill, self._call
        assert prefill is not None
        try:
            await prefill.attach_ticket(
                self._request.request_id, ticket, self._config.node_rpc_timeout_s
            )
            mark(self._marks, "attached")
        except grpc.aio.AioRpcError as error:
            if call is self._call:  # counts as P failing: its reader takes it from here
                self._attach_error = error
                call.cancel()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._call is not None:
            self._call.cancel()
        if self._work is not None:
            self._work.done()
            self._work = None

    @property
    def tokens_in_flight(self) -> int:
        """Prompt tokens the current prefill node has in flight, this request's included."""
        assert self._prefill is not None  # (started)
        return max(self._prefill.load.queued_prefill_tokens, self._request.prompt_len)

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    def _call_prefill(self, prefill: NodeClient, ticket: node_pb2.TransferTicket | None) -> None:
        """P.Prefill on `prefill` (the current prefill node from now), `ticket` inline or (None)
        attached later."""
        if self._work is not None:
            self._work.done()
        self._prefill = prefill
        self._work = prefill.load.track(self._request.prompt_len)
        # P's ceiling (transfer_timeout_s + the prompt tokens it has in flight at
        # min_prefill_tokens_per_s) and one transfer_timeout_s more: the call outlives neither.
        config = self._config
        timeout_s = 2 * config.transfer_timeout_s
        timeout_s += self.tokens_in_flight / config.min_prefill_tokens_per_s
        if self._timeout_s is not None:
            timeout_s = min(timeout_s, self._timeout_s)
        self._call = prefill.prefill_stub.Prefill(
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
        mark(self._marks, "prefill_sent")
        self._ticket_sent = ticket is not None
        self._attach_error = None

    async def _read(self) -> None:
        """Emits P's first token; if P failed before the hand-off ended, tells D to prefill
        locally instead of waiting out its transfer timeout."""
        try:
            failure = await self._read_with_retry()
        finally:
            self.first_out.set()  # (P failed before it: D's tokens go out as they are)
            if self._work is not None:
                self._work.done()
                self._work = None
        if failure is None:
            return
        prefill, call = self._prefill, self._call
        assert prefill is not None and call is not None
        if self._finished_request:  # the request is done: its hand-off no longer matters
            logger.debug("request %s: the hand-off after a finishing first token ended: %s",
                         self._request.request_id, failure)  # fmt: skip
            return
        self._stats.prefill_failure()
        logger.warning(
            "request %s: prefill node %s failed (%s); decode node %s prefills locally",
            self._request.request_id, prefill.address, failure, self._decode.address,
        )  # fmt: skip
        call.cancel()  # (P may still wait for its ticket, holding blocks)
        ticket = await self._ticket  # (no ticket ever: the request ends, cancelling this task)
        await self._cancel_transfer(ticket.transfer_id, f"prefill node failed: {failure}")

    async def _read_with_retry(self) -> str | None:
        """`_read_call`, once more on another prefill node if the first was unreachable
        before its first token; why the hand-off failed, or None."""
        prefill = self._prefill
        assert prefill is not None
        try:
            return await self._read_call()
        except grpc.aio.AioRpcError as error:
            failure, code = _describe(error), error.code()
        other = None
        if code == grpc.StatusCode.UNAVAILABLE and not self._sent_first:
            other = self._retry_prefill(prefill)
        if other is None:
            return failure
        logger.warning(
            "request %s: prefill node %s unreachable (%s); retrying on %s",
            self._request.request_id, prefill.address, failure, other.address,
        )  # fmt: skip
        assert self._call is not None
        self._call.cancel()
        self._call_prefill(other, await self._ticket)
        try:
            return await self._read_call()
        except grpc.aio.AioRpcError as error:
            return _describe(error)

    async def _read_call(self) -> str | None:
        """Reads P's two messages; returns why the hand-off failed (P's stream, or the
        transfer P reports failed), or None. Raises the AioRpcError that ended the call (its
        AttachTicket's, when that failed)."""
        call = self._call
        assert call is not None
        try:
            message = await call.read()
            if message is grpc.aio.EOF or message.WhichOneof("kind") != "first_token":
                return "its stream did not start with the first token"
            first = message.first_token
            mark(self._marks, "prefill_first_token")
            self._sent_first = True
            self._finished_request = bool(first.finish_reason)
            self._emit(NodeTokens.of_first_token(first))
            self.first_out.set()
            message = await call.read()
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._attach_error is None or (current is not None and current.cancelling()):
                raise  # this task was cancelled (the request ended)
            raise self._attach_error from None  # the call was cut: its AttachTicket failed
        except grpc.aio.AioRpcError:
            if self._attach_error is not None:
                raise self._attach_error from None
            raise
        if message is grpc.aio.EOF or message.WhichOneof("kind") != "transfer_result":
            return "its stream ended without a transfer result"
        result = message.transfer_result
        if not result.ok:  # D is told at once (it may never hear from P: a broken connection)
            return f"its KV transfer failed: {result.error}"
        return None

    async def _cancel_transfer(self, transfer_id: str, reason: str) -> None:
        decode = self._decode
        try:
            await decode.cancel_transfer(transfer_id, reason, self._config.node_rpc_timeout_s)
        except grpc.aio.AioRpcError as error:  # D still falls back after its timeout
            logger.warning("CancelTransfer %s on %s failed: %s", transfer_id, decode.address, error)


def _describe(error: grpc.aio.AioRpcError) -> str:
    return f"{error.code().name}: {error.details()}"
