"""Issue 39 item 8: an engine step longer than any timeout decides no call's fate on a prefill
node. While the engine is in such a step (tests/unit/decode_node/long_step.py), a Prefill call
whose hand-off finishes ends OK with its transfer result; a queued request that is aborted ends
its call ABORTED at once, and so does the one the step is prefilling; a GetStats waits for the
step and answers; nothing is UNKNOWN and no block leaks (the harness checks the engines once
the step ran). Before, `AsyncEngine.call` gave up after a fixed 30 s: the calls ended UNKNOWN
(`Unexpected <class 'TimeoutError'>`) and the aborted request's stream never ended."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.v1 import node_pb2
from tests.unit.decode_node.long_step import HeldStep, jump_loop_clock
from tests.unit.decode_node.node_harness import (
    GREEDY,
    RPC_TIMEOUT_S,
    Nodes,
    decode_request,
    prompt,
    read_chunks,
    read_ticket,
    running_nodes,
    tokens_of,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

TRANSFER_TIMEOUT_S = 600.0  # no transfer deadline falls inside the clock's jump
# (nor the wait for an AttachTicket: --ticket-timeout-s)
TIMEOUTS = dict(transfer_timeout_s=TRANSFER_TIMEOUT_S, ticket_timeout_s=TRANSFER_TIMEOUT_S)


def prefill_call(nodes: Nodes, request_id: str, seed: int) -> grpc.aio.UnaryStreamCall:
    """A Prefill without a ticket (AttachTicket brings it): it prefills at once."""
    request = node_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt(19, seed=seed), sampling=GREEDY
    )
    return nodes.prefill_stub.Prefill(request, timeout=RPC_TIMEOUT_S * 6)


async def status_of(call: grpc.aio.UnaryStreamCall) -> grpc.StatusCode:
    """The status `call` ends with (bounded)."""
    return await asyncio.wait_for(call.code(), RPC_TIMEOUT_S)


async def hand_off(nodes: Nodes, request_id: str, seed: int) -> list[node_pb2.TokenChunk]:
    """D reserves, the ticket reaches P by AttachTicket; D's tokens."""
    decode = nodes.decode_stub.Decode(
        decode_request(request_id, prompt(19, seed=seed), transfer_timeout_s=TRANSFER_TIMEOUT_S),
        timeout=RPC_TIMEOUT_S,
    )
    ticket = await read_ticket(decode)
    attach = node_pb2.AttachTicketRequest(request_id=request_id, ticket=ticket)
    await nodes.prefill_stub.AttachTicket(attach, timeout=RPC_TIMEOUT_S)
    return await read_chunks(decode)


def test_a_prefill_whose_hand_off_ends_during_a_long_step_ends_ok() -> None:
    """... and a GetStats during the step waits for it, then answers."""

    async def main() -> None:
        async with running_nodes("tcp", **TIMEOUTS) as nodes:
            done = prefill_call(nodes, "done", seed=1)  # prefilled before the long step
            first = await asyncio.wait_for(done.read(), RPC_TIMEOUT_S)
            assert first.WhichOneof("kind") == "first_token"
            held = HeldStep(nodes.prefill, "long")
            long = prefill_call(nodes, "long", seed=2)
            try:
                await held.entered()
                stats = asyncio.ensure_future(
                    nodes.prefill_node_stub.GetStats(node_pb2.GetStatsRequest())
                )
                tokens = tokens_of(await hand_off(nodes, "done", seed=1))  # P's engine unneeded
                await wait_until(lambda: handed_off(nodes, "done"))
                jump_loop_clock()  # the step has now lasted longer than any fixed timeout
                result = await asyncio.wait_for(done.read(), RPC_TIMEOUT_S)
                assert result.transfer_result.ok, result
                assert await status_of(done) == grpc.StatusCode.OK
                assert tokens[0] == first.first_token.token_id
                assert not stats.done()  # it waits for the step
            finally:
                held.release()
            answered = await asyncio.wait_for(stats, RPC_TIMEOUT_S)
            assert answered.num_kv_blocks > 0
            assert len(await hand_off(nodes, "long", seed=2)) > 0  # the long one completes too
            assert len(await read_prefill_end(long)) == 2

    asyncio.run(main())  # not harness.run: its bound is loop-timed (pytest's timeout bounds it)


def test_requests_aborted_during_a_long_step_end_at_once() -> None:
    """The one queued behind the step and the one the step prefills: Node.Abort answers and
    their calls end ABORTED while the step still runs; the engine frees both after it."""

    async def main() -> None:
        async with running_nodes("tcp", **TIMEOUTS) as nodes:
            held = HeldStep(nodes.prefill, "long")
            long = prefill_call(nodes, "long", seed=2)
            try:
                await held.entered()
                queued = prefill_call(nodes, "queued", seed=3)  # its add waits for the step
                await wait_until(lambda: nodes.prefill.servicer.num_tickets_held == 2)
                abort = node_pb2.AbortRequest(request_id="queued")
                aborted = asyncio.ensure_future(nodes.prefill_node_stub.Abort(abort))
                await asyncio.sleep(0)
                jump_loop_clock()  # the step has now lasted longer than any fixed timeout
                assert (await asyncio.wait_for(aborted, RPC_TIMEOUT_S)).found
                assert await status_of(queued) == grpc.StatusCode.ABORTED
                assert not long.done()  # the step still prefills it
                abort = node_pb2.AbortRequest(request_id="long")
                assert (await nodes.prefill_node_stub.Abort(abort, timeout=RPC_TIMEOUT_S)).found
                assert await status_of(long) == grpc.StatusCode.ABORTED
            finally:
                held.release()
            stats, _ = await nodes.stats()
            assert stats.num_queued_prefill_tokens == 0

    asyncio.run(main())


async def read_prefill_end(call: grpc.aio.UnaryStreamCall) -> list[node_pb2.PrefillResponse]:
    """A Prefill call's messages up to its end (it must end OK)."""
    messages = []
    while (message := await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)) is not grpc.aio.EOF:
        messages.append(message)
    assert await status_of(call) == grpc.StatusCode.OK
    return messages


def handed_off(nodes: Nodes, request_id: str) -> bool:
    """The prefill node heard the receiver's result for `request_id`'s hand-off."""
    traces = nodes.prefill.traces.values()
    return any(t.request_id == request_id and "result" in t.marks_s for t in traces)
