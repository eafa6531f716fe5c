"""`PrefillServicer`: the `PrefillNode.Prefill` and `PrefillNode.AttachTicket` RPCs.

check the request, and its ticket if it carries one (layout hash: FAILED_PRECONDITION; shape:
    INVALID_ARGUMENT); build the Request (bad params: INVALID_ARGUMENT), its structured output's
    grammar compiled first (refused: INVALID_ARGUMENT; too many compiling: RESOURCE_EXHAUSTED):
    the first token is sampled under it
LayerStreamer.open(request_id, prompt_len)
hand-off task: the ticket (inline, or from AttachTicket via the TicketBox within the ticket
    timeout, the router's capped by --ticket-timeout-s, not the no-progress one: KV held
    meanwhile; none: DEADLINE_EXCEEDED; checked as inline) ─► PrefillHandOffs.sender(ticket,
    the request's transfer_timeout_s capped by the node's: the no-progress timeout; the
    ceiling: that + the prompt tokens queued here, this one's included, /
    --min-prefill-tokens-per-s; one KVSender, or with tensor parallelism rank 0's routes and
    the other ranks told) ─► LayerStreamer.attach   (the sender handshakes at once;
    ProgressBeats keep the receiver waiting while this node's engine makes progress)
AsyncEngine.generate: one StepOutput (prefill_done, or finished)     (meanwhile, concurrently)
    the hand-off fails first (no or bad ticket; the sender fails: no progress, its ceiling,
    the decode side failed it, the connection broke) ──► abort the prefill (queued: at once;
    computing: after the step under way, whose first token still goes out; one line logged)
    ──► the ticket's status, or ABORTED (the router cancels D's side)
──► PrefillFirstToken (+ the prompt logprobs asked for)  at once
await the hand-off task; LayerStreamer.finish: layers sent, first token sent, the result awaited
AsyncEngine.release_nowait (held blocks) ──► PrefillTransferResult
cancelled / aborted anywhere: abort in the engine, fail the sender; nothing stays held (an
    abort ends the prefill's engine stream at once, even inside a long engine step: the engine
    frees the request when it gets to it)
an error no branch above maps ──► UNAVAILABLE (the engine stopped) or INTERNAL, never UNKNOWN
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncGenerator
from typing import NoReturn

import grpc

from cache_transfer import TransferState, dtype_mismatch
from cache_transfer.tickets import ticket_misfit
from engine.outputs import StepOutput
from engine.request import FinishReason, Request
from node_common.node_base import NodeBase
from node_common.node_messages import prompt_logprobs, to_engine_request, token_logprob
from node_common.role_servicer import NodeCounters, RoleServicer, abort_call, ends_with_status
from pdserve.logs import set_request_id
from pdserve.v1 import node_pb2, node_pb2_grpc
from prefill_node.hand_offs import HandOffRefused, PrefillHandOffs
from prefill_node.layer_streamer import LayerStreamer
from prefill_node.outgoing import KVSink
from prefill_node.ticket_box import PutResult, TicketBox
from prefill_node.transfer_trace import TransferTrace

logger = logging.getLogger(__name__)


class TicketError(Exception):
    """The hand-off cannot start: no ticket in time, or a ticket this node refuses."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PrefillServicer(RoleServicer, node_pb2_grpc.PrefillNodeServicer):
    def __init__(self, node: NodeBase, streamer: LayerStreamer) -> None:
        """Counters: num_finished_requests counts prefills whose first token went out."""
        super().__init__(
            node.engine, node.manager, node.config.transfer_timeout_s, node.metrics,
            NodeCounters(),
        )  # fmt: skip
        self._streamer = streamer
        self._hand_offs = PrefillHandOffs(node, node.manager)
        self._prefill_rate = node.config.min_prefill_tokens_per_s
        self._layout = node.layout
        self._layout_hash = node.layout.layout_hash()
        self._tickets = TicketBox()
        self._ticket_timeout_s = node.config.ticket_timeout_s

    @property
    def num_tickets_held(self) -> int:
        """Prefill calls waiting for their AttachTicket, and tickets waiting for their call."""
        return len(self._tickets)

    async def AttachTicket(
        self, request: node_pb2.AttachTicketRequest, context: grpc.aio.ServicerContext
    ) -> node_pb2.AttachTicketResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        result = self._tickets.put(request.request_id, request.ticket)
        if result == PutResult.DUPLICATE:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id} has its ticket"
            )
        if result == PutResult.FULL:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "too many tickets wait for a Prefill call that has not arrived",
            )
        return node_pb2.AttachTicketResponse()

    @ends_with_status
    async def Prefill(
        self, request: node_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[node_pb2.PrefillResponse, None]:
        arrived_s = time.monotonic()
        request_id = request.request_id
        set_request_id(request_id)  # this call's log lines carry the request id
        engine_request, trace = await self._open(request, context)
        trace.marks_s["rpc"] = arrived_s
        handoff = asyncio.create_task(self._attach(request, trace))
        held = False  # the engine holds the request's blocks (prefill done, transfer pending)
        num_queued = engine_request.prompt_len  # load, reported until the prefill ends
        self.counters.num_queued_prefill_tokens += num_queued
        try:
            first = await self._prefill(engine_request, handoff)
            self.counters.num_queued_prefill_tokens -= num_queued
            num_queued = 0
            if first is None:
                await _abort_call(context, request_id, handoff)
            held = first.prefill_done
            first_token = _first_token(first)
            if first.finish_reason is None:  # drafts the decode node verifies first
                drafts = self._engine.first_drafts(engine_request, first_token.token_id)
                first_token.draft_token_ids.extend(drafts)
            trace.mark("first_token")
            yield node_pb2.PrefillResponse(first_token=first_token)
            self.counters.num_finished_requests += 1
            result = await self._hand_off(engine_request, first_token, handoff, context)
            if held:  # the engine frees them before its next step
                self._engine.release_nowait(request_id)
                held = False
            yield node_pb2.PrefillResponse(transfer_result=result)
        finally:
            handoff.cancel()
            self._tickets.drop(request_id)
            self.counters.num_queued_prefill_tokens -= num_queued
            self._streamer.close(request_id, "the prefill call ended before the hand-off")
            self._hand_offs.close(request_id, "the prefill call ended")
            if held:  # cancelled while the transfer was pending
                self._engine.abort_nowait(request_id)

    async def _open(
        self, request: node_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> tuple[Request, TransferTrace]:
        """The checked request, as the engine's, and its KV opened on the streamer."""
        await self._check_request(request, context)
        engine_request = await to_engine_request(self._engine, request, context)
        try:
            trace = self._streamer.open(request.request_id, engine_request.prompt_len)
        except ValueError as error:  # the request id is already prefilling here
            await abort_call(context, grpc.StatusCode.ALREADY_EXISTS, str(error))
        return engine_request, trace

    async def _hand_off(
        self,
        request: Request,
        first_token: node_pb2.PrefillFirstToken,
        handoff: asyncio.Task[KVSink],
        context: grpc.aio.ServicerContext,
    ) -> node_pb2.PrefillTransferResult:
        """After the first token went out: every layer and the first token sent, and the
        receiver's result (within the sender's deadline)."""
        try:
            await handoff
        except TicketError as error:  # after the first token: the router tells D
            await abort_call(context, error.code, str(error))
        sender = await self._streamer.finish(
            request.request_id,
            first_token.token_id,
            first_token.logprob if first_token.HasField("logprob") else None,
            first_token.finish_reason,
            first_token.draft_token_ids,
        )
        result = _transfer_result(sender)
        logger.info(
            "prefill done: %d prompt tokens (%d cached), %d drafts, KV hand-off %s: %d bytes in "
            "%.1f ms", request.prompt_len, first_token.num_cached_tokens,
            len(first_token.draft_token_ids),
            "ok" if result.ok else f"failed ({result.error})", result.num_bytes,
            result.elapsed_s * 1000,
        )  # fmt: skip
        return result

    async def _check_request(
        self, request: node_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> None:
        problem = None
        if not request.request_id:
            problem = "request_id is empty"
        for name in ("transfer_timeout_s", "ticket_timeout_s"):
            value = getattr(request, name)
            if problem is None and not value >= 0:
                problem = f"{name} must be >= 0 (0: the node's default), got {value}"
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad PrefillRequest: {problem}")
        if request.HasField("ticket"):  # refused before any work
            try:
                self._check_ticket(request, request.ticket)
            except TicketError as error:
                await context.abort(error.code, str(error))

    def _check_ticket(
        self, request: node_pb2.PrefillRequest, ticket: node_pb2.TransferTicket
    ) -> None:
        """Raises TicketError if this node cannot send the request's KV on `ticket`."""
        if ticket.layout_hash != self._layout_hash:
            dtypes = dtype_mismatch(self._layout.dtype, ticket.kv_cache_dtype)
            raise TicketError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{dtypes}; "
                * bool(dtypes)
                + f"the ticket's KV layout hash {ticket.layout_hash!r} differs from this prefill "
                f"node's {self._layout_hash!r} ({self._layout}): pair nodes serving the same "
                "model, dtype and block size",
            )
        problem = None
        if not ticket.transfer_id or not ticket.dst_address:
            problem = "the ticket needs a transfer_id and a dst_address"
        elif ticket.num_tokens != len(request.prompt_token_ids):
            problem = (
                f"the ticket is for {ticket.num_tokens} tokens but the prompt has "
                f"{len(request.prompt_token_ids)}"
            )
        else:
            problem = ticket_misfit(self._layout, ticket)  # blocks for what it asks for
        if problem is not None:
            raise TicketError(grpc.StatusCode.INVALID_ARGUMENT, f"bad PrefillRequest: {problem}")

    async def _attach(self, request: node_pb2.PrefillRequest, trace: TransferTrace) -> KVSink:
        """The request's sender, attached to the streamer: on its inline ticket, or on the one
        AttachTicket brings within the ticket timeout, as long as the router waits for D's
        reservation, not the no-progress one (marked "ticket"). Raises TicketError."""
        request_id = request.request_id
        timeout_s = min(request.transfer_timeout_s or math.inf, self._transfer_timeout_s)
        ticket = request.ticket
        if not request.HasField("ticket"):
            wait_s = min(request.ticket_timeout_s or math.inf, self._ticket_timeout_s)
            try:
                async with asyncio.timeout(wait_s):
                    ticket = await self._tickets.expect(request_id)
            except TimeoutError:
                raise TicketError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"request {request_id}: no AttachTicket within {wait_s:.3g} s (the decode "
                    "node did not reserve in time)",
                ) from None
            self._check_ticket(request, ticket)
        trace.mark("ticket")
        # the queue ahead of it counts: the engine computes it first (ProgressBeats say so)
        ceiling_s = timeout_s + self.counters.num_queued_prefill_tokens / self._prefill_rate
        try:
            sender = self._hand_offs.sender(request_id, ticket, timeout_s, ceiling_s)
        except HandOffRefused as error:  # a TP hand-off's ticket (signature, sizes)
            raise TicketError(error.code, str(error)) from None
        except ValueError as error:  # the transfer id is already in progress here
            raise TicketError(grpc.StatusCode.ALREADY_EXISTS, str(error)) from None
        sender.add_finish_callback(self._metrics.transfer_finished)
        self._streamer.attach(request_id, sender)
        return sender

    async def _prefill(self, request: Request, handoff: asyncio.Task[KVSink]) -> StepOutput | None:
        """Run the prefill; its one output (prefill done, or finished by the first token), or
        None when the request was aborted (also when its hand-off failed first: nobody would
        receive the KV)."""
        first = None
        request_id = request.request_id

        def abort_soon() -> None:
            if first is None:
                # Queued: its stream ends now. Computing: when the engine gets to the abort,
                # after the step under way, whose first token still comes (TTFT) if it has it.
                computing = self._streamer.computing(request_id)
                self._engine.abort_nowait(request_id, at_once=not computing)

        def on_handoff(task: asyncio.Task[KVSink]) -> None:
            if _handoff_failed(task):
                abort_soon()
            elif not task.cancelled():
                sender = task.result()

                def on_finished(_session: object) -> None:
                    if sender.state == TransferState.FAILED:
                        abort_soon()

                sender.add_finish_callback(on_finished)

        handoff.add_done_callback(on_handoff)
        await asyncio.sleep(0)  # the hand-off task runs: on an inline ticket it is done now
        if _handoff_failed(handoff):  # before the prefill was even queued
            return None
        async for out in self._engine.generate(request):
            first = out
        if first is None or first.finish_reason == FinishReason.ABORT or not first.new_token_ids:
            if handoff.done() and not handoff.cancelled() and handoff.exception() is None:
                handoff.result().cancel("the request was aborted on the prefill node")
            return None
        return first


def _handoff_failed(handoff: asyncio.Task[KVSink]) -> bool:
    """The hand-off ended without a live sender: no or a bad ticket, or its sender failed."""
    if not handoff.done() or handoff.cancelled():
        return False
    return handoff.exception() is not None or handoff.result().state == TransferState.FAILED


async def _abort_call(
    context: grpc.aio.ServicerContext, request_id: str, handoff: asyncio.Task[KVSink]
) -> NoReturn:
    """End the call of a prefill that was aborted, with the hand-off's failure if it failed."""
    if handoff.done() and not handoff.cancelled():
        error = handoff.exception()
        if isinstance(error, TicketError):
            await abort_call(context, error.code, str(error))
        if error is None and handoff.result().error:
            why = handoff.result().error
            await abort_call(
                context,
                grpc.StatusCode.ABORTED,
                f"request {request_id} was aborted: its KV transfer failed ({why})",
            )
    await abort_call(context, grpc.StatusCode.ABORTED, f"request {request_id} was aborted")


def _first_token(out: StepOutput) -> node_pb2.PrefillFirstToken:
    (token_id,) = out.new_token_ids
    first = node_pb2.PrefillFirstToken(
        token_id=token_id,
        finish_reason=out.finish_reason.value if out.finish_reason is not None else "",
        num_cached_tokens=out.num_cached_tokens,
    )
    if out.new_logprobs:
        first.logprob.CopyFrom(token_logprob(out.new_logprobs[0]))
    first.prompt_logprobs.extend(prompt_logprobs(out))
    return first


def _transfer_result(sender: KVSink) -> node_pb2.PrefillTransferResult:
    ok = sender.state == TransferState.SUCCESS
    return node_pb2.PrefillTransferResult(
        ok=ok,
        error="" if ok else (sender.error or f"ended in state {sender.state.name}"),
        num_bytes=sender.num_bytes_sent,
        elapsed_s=sender.elapsed_s,
    )
