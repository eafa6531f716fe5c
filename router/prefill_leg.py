"""PrefillLeg: the prefill node's side of one disaggregated request (RequestCalls owns one).

```
start(prefill, ticket=None)  P.Prefill on `prefill` (the current prefill node from now): the
                             ticket inline, or attached by read() once D's is in; its deadline
                             covers P's ceiling (transfer_timeout_s + the prompt tokens P has
                             in flight / min_prefill_tokens_per_s) + one transfer_timeout_s
read(ticket)                 (a task) P.AttachTicket if the call went without it; P's first
                             token -> the events queue (NodeTokens 0); P's transfer result.
                             P unreachable before its first token: Prefill once more on another
                             prefill node (retry_prefill, the ticket inline). P failed
                             otherwise, or its hand-off did: D.CancelTransfer (D prefills
                             locally at once, not after its no-progress timeout), unless P's
                             first token finished the request (its hand-off is moot: DEBUG)
tokens_in_flight             prompt tokens P has in flight, this one's included
close()                      cancel the call, give P's load back
```
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from pdserve.config import RouterConfig
from pdserve.v1 import node_pb2
from router.errors import RouterError
from router.input_processor import ProcessedRequest
from router.node_client import NodeClient
from router.node_load import InflightWork
from router.output_processor import NodeTokens
from router.stats import RouterStats

logger = logging.getLogger(__name__)

# Given the prefill node that was unreachable: another one to run the Prefill on (counted as a
# retry), or None.
RetryPrefill = Callable[[NodeClient], NodeClient | None]


class PrefillLeg:
    def __init__(
        self,
        request: ProcessedRequest,
        decode: NodeClient,
        config: RouterConfig,
        stats: RouterStats,
        events: asyncio.Queue[NodeTokens | RouterError],
        timeout_s: float | None,
        retry_prefill: RetryPrefill,
    ) -> None:
        """`events`: where P's first token goes; `timeout_s`: the request's own deadline."""
        self._request = request
        self._decode = decode
        self._config = config
        self._stats = stats
        self._events = events
        self._timeout_s = timeout_s
        self._retry_prefill = retry_prefill
        self.node: NodeClient | None = None  # the current prefill node (a retry changes it)
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._work: InflightWork | None = None
        self._ticket_sent = False  # the current Prefill call has the ticket (inline or attached)
        self.sent_first = False  # P's first token is in the queue
        self.finished_request = False  # ... and it finished the request
        self.first_out = asyncio.Event()  # P's first token is in the queue, or P ended without

    @property
    def tokens_in_flight(self) -> int:
        """Prompt tokens the current prefill node has in flight, this request's included."""
        assert self.node is not None  # (started)
        return max(self.node.load.queued_prefill_tokens, self._request.prompt_len)

    def start(self, prefill: NodeClient, ticket: node_pb2.TransferTicket | None) -> None:
        if self._work is not None:
            self._work.done()
        self.node = prefill
        self._work = prefill.load.track(self._request.prompt_len)
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
                transfer_timeout_s=config.transfer_timeout_s,
                cache_salt=self._request.cache_salt,
            ),
            timeout=timeout_s,
        )
        self._ticket_sent = ticket is not None

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._work is not None:
            self._work.done()

    async def read(self, ticket: node_pb2.TransferTicket) -> None:
        try:
            failure = await self._forward_with_retry(ticket)
        finally:
            self.first_out.set()  # (P failed before it: D's tokens go out as they are)
            if self._work is not None:
                self._work.done()
        if failure is None:
            return
        request_id = self._request.request_id
        if self.finished_request:  # the request is done: its hand-off no longer matters
            logger.debug("request %s: the hand-off after a finishing first token ended: %s",
                         request_id, failure)  # fmt: skip
            return
        prefill, call = self._leg()
        self._stats.prefill_failure()
        logger.warning("request %s: prefill node %s failed (%s); decode node %s prefills locally",
                       request_id, prefill.address, failure, self._decode.address)  # fmt: skip
        call.cancel()  # (P may still wait for its ticket, holding blocks)
        await self._cancel_transfer(ticket.transfer_id, f"prefill node failed: {failure}")

    async def _forward_with_retry(self, ticket: node_pb2.TransferTicket) -> str | None:
        """`_forward`, once more on another prefill node if the first was unreachable before
        its first token; why the hand-off failed, or None."""
        prefill, call = self._leg()
        try:
            return await self._forward(ticket)
        except grpc.aio.AioRpcError as error:
            failure = _describe(error)
            other = None
            if error.code() == grpc.StatusCode.UNAVAILABLE and not self.sent_first:
                other = self._retry_prefill(prefill)
            if other is None:
                return failure
        logger.warning(
            "request %s: prefill node %s unreachable (%s); retrying on %s",
            self._request.request_id, prefill.address, failure, other.address,
        )  # fmt: skip
        call.cancel()
        self.start(other, ticket)
        try:
            return await self._forward(ticket)
        except grpc.aio.AioRpcError as error:
            return _describe(error)

    async def _forward(self, ticket: node_pb2.TransferTicket) -> str | None:
        """Attaches the ticket if P's call went without it, reads P's two messages; returns
        why the hand-off failed (P's stream, or the transfer P reports failed), or None."""
        prefill, call = self._leg()
        if not self._ticket_sent:
            self._ticket_sent = True
            await prefill.attach_ticket(
                self._request.request_id, ticket, self._config.node_rpc_timeout_s
            )
        message = await call.read()
        if message is grpc.aio.EOF or message.WhichOneof("kind") != "first_token":
            return "its stream did not start with the first token"
        first = message.first_token
        self.sent_first = True
        self.finished_request = bool(first.finish_reason)
        self._events.put_nowait(NodeTokens.of_first_token(first))
        self.first_out.set()
        message = await call.read()
        if message is grpc.aio.EOF or message.WhichOneof("kind") != "transfer_result":
            return "its stream ended without a transfer result"
        result = message.transfer_result
        if not result.ok:  # D is told at once (it may never hear from P: a broken connection)
            return f"its KV transfer failed: {result.error}"
        return None

    def _leg(self) -> tuple[NodeClient, grpc.aio.UnaryStreamCall]:
        """The current prefill node and its Prefill call (`start` runs before any `read`)."""
        if self.node is None or self._call is None:
            raise RuntimeError(f"request {self._request.request_id}: no Prefill call started")
        return self.node, self._call

    async def _cancel_transfer(self, transfer_id: str, reason: str) -> None:
        decode = self._decode
        try:
            await decode.cancel_transfer(transfer_id, reason, self._config.node_rpc_timeout_s)
        except grpc.aio.AioRpcError as error:  # D still falls back after its timeout
            logger.warning("CancelTransfer %s on %s failed: %s", transfer_id, decode.address, error)


def _describe(error: grpc.aio.AioRpcError) -> str:
    return f"{error.code().name}: {error.details()}"
