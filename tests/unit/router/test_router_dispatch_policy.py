"""Dispatch under a policy through a real RouterServer over fake nodes: retries on unreachable
nodes, mid-stream failure, conditional disaggregation and the router's counters."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from router_fakes import TEST_TIMEOUT_S, RouterHarness, run

from pdserve.v1 import node_pb2

OUTPUT_IDS = [5, 6, 7, 8, 9, 10]


def test_an_unreachable_decode_node_is_retried_once_elsewhere_then_skipped(tokenizer_files):
    async def body():
        async with RouterHarness(tokenizer_files, OUTPUT_IDS, num_prefill=0, num_decode=2) as h:
            dead, alive = h.decode
            await dead.stop()  # still listed: the router finds out on the first request
            results = [
                await h.client.generate_all(prompt_token_ids=[3, 4], max_tokens=3, timeout_s=5)
                for _ in range(4)
            ]
            return results, h.router.stats, dead.address, alive

    results, stats, dead_address, alive = run(body())
    assert [r.token_ids for r in results] == [OUTPUT_IDS[:3]] * 4
    assert stats.num_retries == 1  # later picks skip the node in its cool-down
    assert stats.requests_routed[dead_address] == 1
    assert stats.requests_routed[alive.address] == 4 == len(alive.requests)
    assert stats.num_errors == 0


def test_with_every_decode_node_unreachable_the_request_fails_unavailable(tokenizer_files):
    async def body():
        async with RouterHarness(tokenizer_files, OUTPUT_IDS, num_prefill=0, num_decode=2) as h:
            for node in h.decode:
                await node.stop()
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await h.client.generate_all(prompt_token_ids=[3], max_tokens=2, timeout_s=5)
            return failure.value, h.router.stats

    error, stats = run(body())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode node" in error.details()
    assert stats.num_retries == 1  # once, not a loop


def test_an_unreachable_prefill_node_is_retried_on_another_with_the_same_ticket(
    tokenizer_files,
):
    async def body():
        async with RouterHarness(tokenizer_files, OUTPUT_IDS, num_prefill=2, num_decode=1) as h:
            dead, alive = h.prefill
            await dead.stop()  # round robin picks it for one of the two requests
            results = [
                await h.client.generate_all(prompt_token_ids=[3, 4], max_tokens=4, timeout_s=5)
                for _ in range(2)
            ]
            return results, h.router.stats, alive, h.decode[0]

    results, stats, alive, decode = run(body())
    assert [r.token_ids for r in results] == [OUTPUT_IDS[:4]] * 2
    assert stats.num_retries == 1 and stats.num_prefill_failures == 0
    assert len(alive.requests) == 2
    assert decode.cancelled_transfers == []  # the KV came from the other prefill node
    assert {r.mode for r in decode.requests} == {node_pb2.DECODE_MODE_DISAGGREGATED}


async def _kill_mid_stream(h) -> tuple[list[int], asyncio.Task]:
    """Starts one request whose decode node stops after 2 tokens; stops that node and lets
    the others stream."""
    for node in h.decode:
        node.hold_at = 2  # 2 tokens, then wait
        node.gate.clear()
    received = []

    async def consume():
        async for chunk in h.client.generate(prompt_token_ids=[3], max_tokens=6, timeout_s=10):
            received.extend(chunk.token_ids)

    task = asyncio.create_task(consume())
    async with asyncio.timeout(TEST_TIMEOUT_S):
        while len(received) < 2:
            await asyncio.sleep(0.01)
    victim = next(n for n in h.decode if n.requests)
    await victim.stop()  # the stream breaks: UNAVAILABLE, as a killed node's would
    for node in h.decode:
        node.gate.set()
    return received, task


def test_a_decode_node_dying_mid_stream_migrates_the_request(tokenizer_files):
    async def body():
        async with RouterHarness(tokenizer_files, OUTPUT_IDS, num_prefill=0, num_decode=2) as h:
            received, task = await _kill_mid_stream(h)
            await asyncio.wait_for(task, TEST_TIMEOUT_S)
            survivor = next(n for n in h.decode if n.requests and n.requests[-1].output_token_ids)
            return received, h.router.stats, survivor.requests

    received, stats, survivor_requests = run(body())
    assert received == OUTPUT_IDS  # no gap, no duplicate
    assert stats.num_migrations == 1 and stats.num_retries == 0
    (migrated,) = survivor_requests
    assert list(migrated.output_token_ids) == OUTPUT_IDS[:2]
    assert migrated.mode == node_pb2.DECODE_MODE_LOCAL_PREFILL
    assert list(migrated.prompt_token_ids) == [3]


def test_with_no_decode_node_left_a_mid_stream_failure_is_unavailable(tokenizer_files):
    async def body():
        async with RouterHarness(tokenizer_files, OUTPUT_IDS, num_prefill=0, num_decode=1) as h:
            received, task = await _kill_mid_stream(h)
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await asyncio.wait_for(task, TEST_TIMEOUT_S)
            return failure.value, received, h.router.stats

    error, received, stats = run(body())
    assert received == OUTPUT_IDS[:2]
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "mid-stream" in error.details() and "no other decode node" in error.details()
    assert stats.num_retries == 0 and stats.num_migrations == 0


def test_short_prompts_prefill_on_the_decode_node(tokenizer_files):
    async def body():
        async with RouterHarness(
            tokenizer_files, OUTPUT_IDS, local_prefill_max_tokens=4, policy="least_loaded"
        ) as h:
            short = await h.client.generate_all(prompt_token_ids=[3] * 4, max_tokens=3)
            long = await h.client.generate_all(prompt_token_ids=[3] * 5, max_tokens=3)
            return short, long, h.prefill[0].requests, h.decode[0].requests, h.router.stats

    short, long, prefill_requests, decode_requests, stats = run(body())
    assert short.token_ids == long.token_ids == OUTPUT_IDS[:3]
    assert [len(r.prompt_token_ids) for r in prefill_requests] == [5]
    assert [r.mode for r in decode_requests] == [
        node_pb2.DECODE_MODE_LOCAL_PREFILL,
        node_pb2.DECODE_MODE_DISAGGREGATED,
    ]
    assert stats.local_prefill_routes == {"short_prompt": 1}
