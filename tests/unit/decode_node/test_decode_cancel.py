"""Cancellation, Abort and refused requests on the decode node: nothing leaks, within 1 s."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdserve.v1 import node_pb2
from tests.unit.decode_node.node_harness import (
    RPC_TIMEOUT_S,
    Nodes,
    decode_request,
    engine_config,
    prompt,
    read_chunks,
    read_ticket,
    run,
    running_nodes,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

LONG = node_pb2.NodeSamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, seed=1)


async def read_tokens(call: grpc.aio.UnaryStreamCall, num_chunks: int) -> None:
    for _ in range(num_chunks):
        message = await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)
        assert message.WhichOneof("kind") == "tokens" and not message.tokens.finish_reason


async def blocks_in_use(nodes: Nodes) -> int:
    _, decode_stats = await nodes.stats()
    return decode_stats.num_kv_blocks - decode_stats.num_free_kv_blocks


def start_decode(
    nodes: Nodes, request_id: str, prompt_ids: list[int], sampling=LONG, *, disaggregated=True
) -> grpc.aio.UnaryStreamCall:
    """A Decode call, not yet read; a disaggregated one awaits its KV for up to 60 s."""
    request = decode_request(request_id, prompt_ids, sampling, disaggregated=disaggregated,
                             transfer_timeout_s=60.0 if disaggregated else 0.0)  # fmt: skip
    return nodes.decode_stub.Decode(request, timeout=RPC_TIMEOUT_S)


async def holding_blocks(
    nodes: Nodes, request_id: str, prompt_ids: list[int], sampling=LONG
) -> grpc.aio.UnaryStreamCall:
    """A disaggregated Decode call that has its ticket: its blocks stay reserved (the KV never
    comes) until the call is cancelled."""
    call = start_decode(nodes, request_id, prompt_ids, sampling)
    await read_ticket(call)
    return call


@pytest.mark.parametrize("disaggregated", [False, True], ids=["local", "while-awaiting-kv"])
def test_router_cancel_frees_everything(disaggregated: bool) -> None:
    """Cancel mid-stream (local prefill) or while the KV is awaited (disaggregated): the
    decode node's blocks are all free again within 1 s and the receiver is gone."""
    prompt_ids = prompt(30, seed=1)

    async def main() -> None:
        async with running_nodes("local") as nodes:
            call = nodes.decode_stub.Decode(
                decode_request(
                    "c", prompt_ids, LONG, disaggregated=disaggregated, transfer_timeout_s=60.0
                ),
                timeout=RPC_TIMEOUT_S,
            )
            if disaggregated:
                await read_ticket(call)
                assert nodes.decode.manager.num_pending == 1
            else:
                await read_tokens(call, 3)
            assert await blocks_in_use(nodes) > 0
            call.cancel()
            # leaving the context asserts the pools are whole within FREE_WITHIN_S (1 s)

    run(main())


def test_cancel_after_handoff_mid_decode() -> None:
    """Cancel a resumed (disaggregated) request while it decodes: blocks free within 1 s."""
    prompt_ids = prompt(17, seed=2)

    async def main() -> None:
        async with running_nodes("local") as nodes:
            call = nodes.decode_stub.Decode(
                decode_request("h", prompt_ids, LONG), timeout=RPC_TIMEOUT_S
            )
            ticket = await read_ticket(call)
            prefill_call = nodes.prefill_stub.Prefill(
                node_pb2.PrefillRequest(
                    request_id="h", prompt_token_ids=prompt_ids, sampling=LONG, ticket=ticket
                ),
                timeout=RPC_TIMEOUT_S,
            )
            async for _ in prefill_call:
                pass
            await read_tokens(call, 4)
            call.cancel()

    run(main())


@pytest.mark.parametrize("disaggregated", [False, True], ids=["in-engine", "while-awaiting-kv"])
def test_abort_ends_the_stream(disaggregated: bool) -> None:
    prompt_ids = prompt(12, seed=3)

    async def main() -> None:
        async with running_nodes("local") as nodes:
            call = nodes.decode_stub.Decode(
                decode_request(
                    "a", prompt_ids, LONG, disaggregated=disaggregated, transfer_timeout_s=60.0
                ),
                timeout=RPC_TIMEOUT_S,
            )
            if disaggregated:
                await read_ticket(call)
            else:
                await read_tokens(call, 2)
            abort = node_pb2.AbortRequest(request_id="a")
            assert (await nodes.decode_node_stub.Abort(abort, timeout=RPC_TIMEOUT_S)).found
            chunks = await read_chunks(call)
            assert chunks[-1].finish_reason == "abort"
            assert await asyncio.wait_for(call.read(), RPC_TIMEOUT_S) is grpc.aio.EOF
            assert not (await nodes.decode_node_stub.Abort(abort, timeout=RPC_TIMEOUT_S)).found
            _, decode_stats = await nodes.stats()
            assert decode_stats.num_local_prefills == (0 if disaggregated else 1)

    run(main())


BAD_REQUESTS = {
    "unspecified-mode": node_pb2.DecodeRequest(
        request_id="x", prompt_token_ids=[5, 6], mode=node_pb2.DECODE_MODE_UNSPECIFIED
    ),
    "empty-prompt": decode_request("x", []),
    "token-outside-vocab": decode_request("x", [5, 512]),
    "negative-temperature": decode_request(
        "x", [5, 6], node_pb2.NodeSamplingParams(temperature=-1.0)
    ),
    "nan-top-p": decode_request("x", [5, 6], node_pb2.NodeSamplingParams(top_p=float("nan"))),
    "too-long": decode_request("x", [5] * 20, node_pb2.NodeSamplingParams(max_tokens=1020)),
    "no-request-id": decode_request("", [5, 6]),
    "negative-timeout": decode_request("x", [5, 6], transfer_timeout_s=-1.0),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_is_invalid_argument(name: str) -> None:
    async def main() -> None:
        async with running_nodes("local") as nodes:
            call = nodes.decode_stub.Decode(BAD_REQUESTS[name], timeout=RPC_TIMEOUT_S)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.value.details()

    run(main())


def test_out_of_blocks_the_reservation_waits_for_blocks_then_gets_them() -> None:
    """16 blocks of 4 tokens: a 40-token prompt reserves 11; a second one finds 5 free and
    waits (queued) until the first call ends, then gets its ticket."""
    prompt_ids = prompt(40, seed=4)
    small = engine_config(prefill_only=False, num_blocks=16)

    async def main() -> None:
        # One caller holding 11 of 16 blocks would exceed a per-caller cap: off here.
        async with running_nodes("local", decode_engine=small, max_pending_kv_share=1.0) as nodes:
            sampling = node_pb2.NodeSamplingParams(max_tokens=8, temperature=0.0)
            first = await holding_blocks(nodes, "first", prompt_ids, sampling)
            second = start_decode(nodes, "second", prompt_ids, sampling)
            admission = nodes.decode.servicer.admission
            await wait_until(lambda: admission.num_queued == 1)
            first.cancel()
            await asyncio.wait_for(read_ticket(second), RPC_TIMEOUT_S)
            assert admission.num_refused == 0
            second.cancel()

    run(main())


def test_out_of_blocks_with_the_queue_full_is_resource_exhausted_at_once() -> None:
    prompt_ids = prompt(40, seed=4)
    small = engine_config(prefill_only=False, num_blocks=16)

    async def main() -> None:
        async with running_nodes(
            "local", decode_engine=small, max_queued_requests=1, queue_timeout_s=30.0,
            max_pending_kv_share=1.0,  # one caller: no per-caller cap here
        ) as nodes:  # fmt: skip
            sampling = node_pb2.NodeSamplingParams(max_tokens=8, temperature=0.0)
            # The first gets blocks, the second waits for them.
            calls = [await holding_blocks(nodes, "first", prompt_ids, sampling)]
            calls.append(start_decode(nodes, "second", prompt_ids, sampling))
            await wait_until(lambda: nodes.decode.servicer.admission.num_queued == 1)
            third = start_decode(nodes, "third", prompt_ids, sampling, disaggregated=False)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await asyncio.wait_for(third.read(), RPC_TIMEOUT_S)
            assert time.monotonic() - started < 5.0  # refused, not queued for 30 s
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "retry in about" in error.value.details()
            metadata = dict(await third.trailing_metadata())
            assert float(metadata["pdserve-retry-after-s"]) > 0
            for call in calls:
                call.cancel()

    run(main())


def test_a_queued_local_prefill_times_out_resource_exhausted() -> None:
    prompt_ids = prompt(40, seed=4)
    small = engine_config(prefill_only=False, num_blocks=16)

    async def main() -> None:
        async with running_nodes("local", decode_engine=small, queue_timeout_s=0.5) as nodes:
            sampling = node_pb2.NodeSamplingParams(max_tokens=8, temperature=0.0)
            first = await holding_blocks(nodes, "first", prompt_ids, sampling)
            second = start_decode(nodes, "second", prompt_ids, sampling, disaggregated=False)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await asyncio.wait_for(second.read(), RPC_TIMEOUT_S)
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue-timeout-s" in error.value.details()
            first.cancel()

    run(main())


def test_duplicate_request_id_is_refused() -> None:
    async def main() -> None:
        async with running_nodes("local") as nodes:
            first = await holding_blocks(nodes, "dup", [5, 6, 7])
            second = start_decode(nodes, "dup", [5, 6, 7], disaggregated=False)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await asyncio.wait_for(second.read(), RPC_TIMEOUT_S)
            assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
            first.cancel()
            await wait_until(lambda: nodes.decode.manager.num_pending == 0)

    run(main())


def test_stop_cuts_in_flight_calls_after_the_grace_period() -> None:
    """stop(): health NOT_SERVING, in-flight calls get grace_s, then end with an error
    instead of hanging; a second stop is a no-op."""
    prompt_ids = prompt(9, seed=5)

    async def main() -> None:
        async with running_nodes("tcp", check_free=False) as nodes:
            call = nodes.decode_stub.Decode(
                decode_request("inflight", prompt_ids, transfer_timeout_s=60.0),
                timeout=RPC_TIMEOUT_S,
            )
            await read_ticket(call)
            start_s = time.monotonic()
            await nodes.decode.stop(grace_s=0.2)
            assert time.monotonic() - start_s < 5.0
            with pytest.raises(grpc.aio.AioRpcError):
                await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)
            await nodes.decode.stop()

    run(main())
