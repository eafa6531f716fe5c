"""Dispatcher: runs one request on a (prefill, decode) route and yields its tokens.

```
Dispatcher.run(request)
  RoutingPolicy.pick -> Route(P | None, D)                      no ready D: UNAVAILABLE
  _RequestCalls
    D.Decode(DISAGGREGATED | LOCAL_PREFILL)     ─ read ticket first (ticket_timeout_s) when P
    P.Prefill(request, ticket)                  ─ started once the ticket is in
    _read_prefill task: PrefillFirstToken -> NodeTokens(0); PrefillTransferResult (logged)
                        P failed before the result: D.CancelTransfer (D prefills locally)
    _read_decode task:  TokenChunk -> NodeTokens(output_index) ... until finish_reason
    both tasks -> one queue -> yielded (token_timeout_s per wait) until a finish_reason
  close (always): D not finished and not cancelled by the client -> D.Abort; cancel both
    calls and both tasks (a cancelled call ends the request on its node, freeing its blocks)
```
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from pdserve.v1 import node_pb2
from router.config import RouterConfig
from router.errors import RouterError, node_error
from router.input_processor import ProcessedRequest
from router.node_registry import NodeRegistry
from router.output_processor import NodeTokens
from router.policy import Route, RoutingPolicy
from router.stats import RouterStats

logger = logging.getLogger(__name__)

_TASK_EXIT_TIMEOUT_S = 1.0  # cancelled reader tasks end at their next await


class Dispatcher:
    """Picks a route among the registry's ready nodes and drives the request's node calls."""

    def __init__(
        self,
        registry: NodeRegistry,
        policy: RoutingPolicy,
        config: RouterConfig,
        stats: RouterStats,
    ) -> None:
        self._registry = registry
        self._policy = policy
        self._config = config
        self._stats = stats

    async def run(
        self, request: ProcessedRequest, timeout_s: float | None = None
    ) -> AsyncIterator[NodeTokens]:
        """Yields the request's tokens from both streams, ending after one with a finish_reason.
        `timeout_s` (the client's deadline) bounds the node calls. Use it inside
        `contextlib.aclosing` so that stopping early aborts the request on its nodes at once."""
        decode_nodes = self._registry.decode_nodes
        if not decode_nodes:
            raise RouterError(
                grpc.StatusCode.UNAVAILABLE,
                "no decode node is ready: start one (pd-decode) and give its address to the "
                "router with --decode",
            )
        route = self._policy.pick(request.prompt_len, self._registry.prefill_nodes, decode_nodes)
        calls = _RequestCalls(route, request, self._config, self._stats, timeout_s)
        try:
            async for tokens in calls.stream():
                yield tokens
        finally:
            await calls.close()


class _RequestCalls:
    """The node calls of one request, and the tasks that read them into one queue."""

    def __init__(
        self,
        route: Route,
        request: ProcessedRequest,
        config: RouterConfig,
        stats: RouterStats,
        timeout_s: float | None,
    ) -> None:
        self._route = route
        self._request = request
        self._config = config
        self._stats = stats
        self._timeout_s = timeout_s
        self._events: asyncio.Queue[NodeTokens | RouterError] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._decode_call: grpc.aio.UnaryStreamCall | None = None
        self._prefill_call: grpc.aio.UnaryStreamCall | None = None
        self._decode_ended = False  # D's stream delivered its finish or failed

    async def stream(self) -> AsyncIterator[NodeTokens]:
        disaggregated = self._route.prefill is not None
        self._decode_call = self._route.decode.decode_stub.Decode(
            node_pb2.DecodeRequest(
                request_id=self._request.request_id,
                prompt_token_ids=self._request.prompt_token_ids,
                sampling=self._request.node_sampling,
                mode=node_pb2.DECODE_MODE_DISAGGREGATED
                if disaggregated
                else node_pb2.DECODE_MODE_LOCAL_PREFILL,
                transfer_timeout_s=self._config.transfer_timeout_s if disaggregated else 0.0,
            ),
            timeout=self._timeout_s,
        )
        if disaggregated:
            ticket = await self._read_ticket()
            self._prefill_call = self._start_prefill(ticket)
            self._tasks.append(asyncio.create_task(self._read_prefill(ticket)))
        self._tasks.append(asyncio.create_task(self._read_decode()))
        while True:
            try:
                event = await asyncio.wait_for(self._events.get(), self._config.token_timeout_s)
            except TimeoutError:
                raise RouterError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"request {self._request.request_id}: no tokens from decode node "
                    f"{self._route.decode.address} for {self._config.token_timeout_s} s",
                ) from None
            if isinstance(event, RouterError):
                raise event
            yield event
            if event.finish_reason:
                return

    async def close(self) -> None:
        """Aborts D's request if it is still running (unless the client cancelled: then the
        call's cancellation does it), and cancels every call and reader task."""
        try:
            if not self._decode_ended and not asyncio.current_task().cancelling():
                await self._abort_decode()
        finally:
            for task in self._tasks:
                task.cancel()
            for call in (self._decode_call, self._prefill_call):
                if call is not None:
                    call.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=_TASK_EXIT_TIMEOUT_S)

    async def _read_ticket(self) -> node_pb2.TransferTicket:
        decode = self._route.decode
        try:
            message = await asyncio.wait_for(
                self._decode_call.read(), self._config.ticket_timeout_s
            )
        except TimeoutError:
            raise RouterError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"decode node {decode.address} sent no transfer ticket for request "
                f"{self._request.request_id} in {self._config.ticket_timeout_s} s",
            ) from None
        except grpc.aio.AioRpcError as error:
            self._decode_ended = True
            raise node_error("decode", decode.address, error) from None
        if message is grpc.aio.EOF or message.WhichOneof("kind") != "ticket":
            raise RouterError(
                grpc.StatusCode.INTERNAL,
                f"decode node {decode.address} did not start request "
                f"{self._request.request_id} with a transfer ticket",
            )
        return message.ticket

    async def _read_decode(self) -> None:
        address = self._route.decode.address
        try:
            while True:
                message = await self._decode_call.read()
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

    def _start_prefill(self, ticket: node_pb2.TransferTicket) -> grpc.aio.UnaryStreamCall:
        timeout_s = self._config.transfer_timeout_s  # D falls back to local prefill after it
        if self._timeout_s is not None:
            timeout_s = min(timeout_s, self._timeout_s)
        return self._route.prefill.prefill_stub.Prefill(
            node_pb2.PrefillRequest(
                request_id=self._request.request_id,
                prompt_token_ids=self._request.prompt_token_ids,
                sampling=self._request.node_sampling,
                ticket=ticket,
            ),
            timeout=timeout_s,
        )

    async def _read_prefill(self, ticket: node_pb2.TransferTicket) -> None:
        """Forwards P's first token; if P fails before the hand-off ends, tells D to prefill
        locally instead of waiting out its transfer timeout."""
        prefill = self._route.prefill
        try:
            failure = await self._forward_prefill()
        except grpc.aio.AioRpcError as error:
            failure = f"{error.code().name}: {error.details()}"
        if failure is None:
            return
        self._stats.num_prefill_failures += 1
        logger.warning(
            "request %s: prefill node %s failed (%s); decode node %s prefills locally",
            self._request.request_id,
            prefill.address,
            failure,
            self._route.decode.address,
        )
        await self._cancel_transfer(ticket.transfer_id, f"prefill node failed: {failure}")

    async def _forward_prefill(self) -> str | None:
        """Reads P's two messages; returns why the hand-off failed, or None."""
        message = await self._prefill_call.read()
        if message is grpc.aio.EOF or message.WhichOneof("kind") != "first_token":
            return "its stream did not start with the first token"
        first = message.first_token
        self._events.put_nowait(
            NodeTokens(
                output_index=0,
                token_ids=[first.token_id],
                logprobs=[first.logprob] if first.HasField("logprob") else [],
                finish_reason=first.finish_reason,
                num_cached_tokens=first.num_cached_tokens,
            )
        )
        message = await self._prefill_call.read()
        if message is grpc.aio.EOF or message.WhichOneof("kind") != "transfer_result":
            return "its stream ended without a transfer result"
        result = message.transfer_result
        if not result.ok:  # D refused or lost the KV and falls back on its own
            logger.warning(
                "request %s: KV transfer failed (%s); the decode node prefills locally",
                self._request.request_id,
                result.error,
            )
        return None

    async def _cancel_transfer(self, transfer_id: str, reason: str) -> None:
        decode = self._route.decode
        try:
            await decode.cancel_transfer(transfer_id, reason, self._config.node_rpc_timeout_s)
        except grpc.aio.AioRpcError as error:  # D still falls back at its transfer timeout
            logger.warning("CancelTransfer %s on %s failed: %s", transfer_id, decode.address, error)

    async def _abort_decode(self) -> None:
        decode = self._route.decode
        with contextlib.suppress(grpc.aio.AioRpcError):  # cancelling the call aborts it too
            await decode.abort(self._request.request_id, self._config.node_rpc_timeout_s)
