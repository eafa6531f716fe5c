"""`PrefillServicer`: the `PrefillNode.Prefill` RPC.

check the ticket (layout hash: FAILED_PRECONDITION; shape: INVALID_ARGUMENT)
build the Request (bad params: INVALID_ARGUMENT)
create_sender(ticket, the request's transfer_timeout_s capped by the node's)  (its handshake
    and deadline start with the prefill: LayerStreamer)
LayerStreamer.open ── AsyncEngine.generate: one StepOutput (prefill_done, or finished)
    the sender fails first (not started within transfer_timeout_s, the decode side failed it,
    the connection broke) ──► abort the prefill ──► ABORTED (the router cancels D's side)
──► PrefillFirstToken                                     at once
LayerStreamer.finish: layers sent, first token sent, the receiver's result awaited
EngineCore.release (held blocks) ──► PrefillTransferResult
cancelled / aborted anywhere: abort in the engine, fail the sender; nothing stays held
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator

import grpc

from cache_transfer import KVSender, TransferState
from engine.outputs import StepOutput
from engine.request import FinishReason, Request
from node_common.node_messages import to_engine_request, token_logprob
from node_common.role_server import RoleServer
from node_common.role_servicer import NodeCounters, RoleServicer
from pdserve.logs import set_request_id
from pdserve.v1 import node_pb2, node_pb2_grpc
from prefill_node.layer_streamer import LayerStreamer, TransferTrace

logger = logging.getLogger(__name__)


class PrefillServicer(RoleServicer, node_pb2_grpc.PrefillNodeServicer):
    def __init__(self, node: RoleServer, streamer: LayerStreamer) -> None:
        """Counters: num_finished_requests counts prefills whose first token went out."""
        super().__init__(node, NodeCounters())
        self._streamer = streamer
        self._layout = node.layout
        self._layout_hash = node.layout.layout_hash()
        self._aborts: set[asyncio.Task[None]] = set()  # prefills whose transfer failed first

    async def Prefill(
        self, request: node_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[node_pb2.PrefillResponse]:
        arrived_s = time.monotonic()
        set_request_id(request.request_id)  # this call's log lines carry the request id
        await self._check_ticket(request, context)
        engine_request = await to_engine_request(self._engine, request, context)
        request_id = request.request_id
        sender, trace = await self._open_sender(request, context)
        trace.marks_s["rpc"] = arrived_s
        held = False  # the engine holds the request's blocks (prefill done, transfer pending)
        num_queued = engine_request.prompt_len  # load, reported until the prefill ends
        self.counters.num_queued_prefill_tokens += num_queued
        try:
            first = await self._prefill(engine_request, sender)
            self.counters.num_queued_prefill_tokens -= num_queued
            num_queued = 0
            if first is None:
                why = f": its KV transfer failed ({sender.error})" if sender.error else ""
                await context.abort(
                    grpc.StatusCode.ABORTED, f"request {request_id} was aborted{why}"
                )
            held = first.prefill_done
            first_token = _first_token(first)
            trace.mark("first_token")
            yield node_pb2.PrefillResponse(first_token=first_token)
            self.counters.num_finished_requests += 1
            sender = await self._streamer.finish(
                request_id,
                first_token.token_id,
                first_token.logprob if first_token.HasField("logprob") else None,
                first_token.finish_reason,
            )
            if held:
                await self._engine.call(lambda core: core.release(request_id))
                held = False
            result = _transfer_result(sender)
            logger.info(
                "prefill done: %d prompt tokens (%d cached), KV hand-off %s: %d bytes in %.1f ms",
                engine_request.prompt_len, first_token.num_cached_tokens,
                "ok" if result.ok else f"failed ({result.error})", result.num_bytes,
                result.elapsed_s * 1000,
            )  # fmt: skip
            yield node_pb2.PrefillResponse(transfer_result=result)
        finally:
            self.counters.num_queued_prefill_tokens -= num_queued
            self._streamer.close(request_id, "the prefill call ended before the hand-off")
            if held:  # cancelled while the transfer was pending
                self._engine.post(lambda core: core.abort(request_id))

    async def _check_ticket(
        self, request: node_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> None:
        ticket = request.ticket
        if ticket.layout_hash != self._layout_hash:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the ticket's KV layout hash {ticket.layout_hash!r} differs from this prefill "
                f"node's {self._layout_hash!r} ({self._layout}): pair nodes serving the same "
                "model, dtype and block size",
            )
        problem = None
        if not request.request_id:
            problem = "request_id is empty"
        elif not request.transfer_timeout_s >= 0:
            problem = (
                f"transfer_timeout_s must be >= 0 (0: the node's default), got "
                f"{request.transfer_timeout_s}"
            )
        elif not ticket.transfer_id or not ticket.dst_address:
            problem = "the ticket needs a transfer_id and a dst_address"
        elif ticket.num_tokens != len(request.prompt_token_ids):
            problem = (
                f"the ticket is for {ticket.num_tokens} tokens but the prompt has "
                f"{len(request.prompt_token_ids)}"
            )
        elif len(ticket.dst_block_ids) < self._layout.num_blocks_for(ticket.num_tokens):
            problem = (
                f"the ticket reserves {len(ticket.dst_block_ids)} blocks; "
                f"{ticket.num_tokens} tokens need {self._layout.num_blocks_for(ticket.num_tokens)}"
            )
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad PrefillRequest: {problem}")

    async def _open_sender(
        self, request: node_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> tuple[KVSender, TransferTrace]:
        try:
            timeout_s = min(request.transfer_timeout_s or math.inf, self._transfer_timeout_s)
            sender = self._manager.create_sender(
                request.ticket, timeout_s, start_timeout_s=timeout_s
            )
        except ValueError as error:  # the transfer id is already in progress here
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(error))
        sender.add_finish_callback(self._metrics.transfer_finished)
        try:
            trace = self._streamer.open(request.request_id, sender)
        except ValueError as error:  # the request id is already prefilling here
            sender.abort(str(error))
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(error))
        return sender, trace

    async def _prefill(self, request: Request, sender: KVSender) -> StepOutput | None:
        """Run the prefill; its one output (prefill done, or finished by the first token), or
        None when the request was aborted (also when its transfer failed first: nobody would
        receive the KV)."""
        first = None
        request_id = request.request_id

        async def abort() -> None:
            try:
                await self._engine.abort(request_id)
            except Exception:  # the engine stopped: the request went with it
                logger.exception("request %s: could not abort the prefill", request_id)

        def on_failed(session: KVSender) -> None:
            if session.state == TransferState.FAILED and first is None:
                task = asyncio.get_running_loop().create_task(abort())
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

        if sender.state == TransferState.FAILED:  # before the prefill was even queued
            return None
        sender.add_finish_callback(on_failed)
        async for out in self._engine.generate(request):
            first = out
        if first is None or first.finish_reason == FinishReason.ABORT or not first.new_token_ids:
            sender.abort("the request was aborted on the prefill node")
            return None
        return first


def _first_token(out: StepOutput) -> node_pb2.PrefillFirstToken:
    (token_id,) = out.new_token_ids
    first = node_pb2.PrefillFirstToken(
        token_id=token_id,
        finish_reason=out.finish_reason.value if out.finish_reason is not None else "",
        num_cached_tokens=out.num_cached_tokens,
    )
    if out.new_logprobs:
        first.logprob.CopyFrom(token_logprob(out.new_logprobs[0]))
    return first


def _transfer_result(sender: KVSender) -> node_pb2.PrefillTransferResult:
    ok = sender.state == TransferState.SUCCESS
    return node_pb2.PrefillTransferResult(
        ok=ok,
        error="" if ok else (sender.error or f"ended in state {sender.state.name}"),
        num_bytes=sender.num_bytes_sent,
        elapsed_s=sender.elapsed_s,
    )
