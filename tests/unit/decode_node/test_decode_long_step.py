"""Issue 39 item 8 on a decode node: while its engine is in a step longer than any timeout
(long_step.py), a Decode that waits for blocks gets its ticket once the step ran and completes,
the local prefill the step runs ends with finish_reason "abort" as soon as it is aborted, a
queued one that is aborted ends "abort" once the engine gets to it, and nothing is UNKNOWN or
leaked (the harness checks the engines). Before, `AsyncEngine.call` gave up after a fixed 30 s:
each of these calls ended UNKNOWN (`Unexpected <class 'TimeoutError'>`)."""

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
    read_prefill,
    read_ticket,
    running_nodes,
    tokens_of,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

TRANSFER_TIMEOUT_S = 600.0  # no transfer deadline falls inside the clock's jump


def decode_call(
    nodes: Nodes, request_id: str, seed: int, disaggregated: bool = False
) -> grpc.aio.UnaryStreamCall:
    request = decode_request(
        request_id, prompt(19, seed=seed), disaggregated=disaggregated,
        transfer_timeout_s=TRANSFER_TIMEOUT_S,
    )  # fmt: skip
    return nodes.decode_stub.Decode(request, timeout=RPC_TIMEOUT_S * 6)


async def abort(nodes: Nodes, request_id: str) -> bool:
    request = node_pb2.AbortRequest(request_id=request_id)
    return (await nodes.decode_node_stub.Abort(request, timeout=RPC_TIMEOUT_S)).found


async def finish_reason(call: grpc.aio.UnaryStreamCall) -> str:
    chunks = await read_chunks(call)
    assert await asyncio.wait_for(call.code(), RPC_TIMEOUT_S) == grpc.StatusCode.OK
    return chunks[-1].finish_reason


async def prefill_for(nodes: Nodes, call: grpc.aio.UnaryStreamCall, seed: int) -> list[int]:
    """The prefill node's part of a disaggregated Decode `call`; D's tokens."""
    ticket = await read_ticket(call)
    request = node_pb2.PrefillRequest(
        request_id="disagg", prompt_token_ids=prompt(19, seed=seed), sampling=GREEDY,
        ticket=ticket,
    )  # fmt: skip
    await read_prefill(nodes.prefill_stub.Prefill(request, timeout=RPC_TIMEOUT_S))
    return tokens_of(await read_chunks(call))


def test_decode_calls_around_a_step_longer_than_any_timeout_end_with_a_status() -> None:
    async def main() -> None:
        async with running_nodes("tcp", transfer_timeout_s=TRANSFER_TIMEOUT_S) as nodes:
            held = HeldStep(nodes.decode, "long")
            long = decode_call(nodes, "long", seed=1)
            try:
                await held.entered()
                queued = decode_call(nodes, "queued", seed=2)  # waits for room: the engine
                disagg = decode_call(nodes, "disagg", seed=3, disaggregated=True)  # blocks
                await wait_until(lambda: {"queued", "disagg"} <= set(nodes.decode.traces))
                jump_loop_clock()  # the step has now lasted longer than any fixed timeout
                await asyncio.sleep(0.2)  # timers that came due fire
                assert not queued.done() and not disagg.done()  # they wait for the step
                assert await abort(nodes, "queued")
                assert await abort(nodes, "long")
                assert await finish_reason(long) == "abort"  # the step still runs
            finally:
                held.release()
            assert await finish_reason(queued) == "abort"
            assert len(await prefill_for(nodes, disagg, seed=3)) == GREEDY.max_tokens

    asyncio.run(main())  # not harness.run: its bound is loop-timed (pytest's timeout bounds it)
