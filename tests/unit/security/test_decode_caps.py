"""Issue 15: a Decode caller cannot pin a decode node's KV pool. The issue's attack, replayed:
twelve DISAGGREGATED Decode calls asking for a 1e9 s hand-off and sending nothing. The
node clamps the hand-off to --max-transfer-timeout-s and refuses a caller's reservations beyond
--max-pending-kv-share of the pool (they wait, bounded, for the caller's own hand-offs,
then RESOURCE_EXHAUSTED saying so); a legitimate request on
another connection still completes, and the attacker's reservations expire at the clamped
timeout (their calls fall back) and every block comes back."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from decode_node.transfer_caps import TransferCapExceeded, TransferCaps
from pdserve.v1 import node_pb2, node_pb2_grpc
from tests.unit.decode_node.node_harness import (
    NUM_BLOCKS,
    RPC_TIMEOUT_S,
    decode_request,
    prompt,
    read_chunks,
    run,
    run_disaggregated,
    running_nodes,
)

pytestmark = pytest.mark.timeout(120)

CLAMP_S = 1.0
SHARE = 0.5  # of NUM_BLOCKS (64) = 32 blocks; each attack prompt of 19 tokens takes 5
NUM_ATTACKS = 12
HUGE_S = 1e9
QUEUE_S = 0.3  # over its cap, a caller waits this long for its own hand-offs (< CLAMP_S)


async def _first_message(call):
    try:
        return await asyncio.wait_for(call.read(), RPC_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        return error


def test_the_issue_attack_cannot_pin_the_pool_and_expires_at_the_clamp() -> None:
    attack_prompt = prompt(19, seed=3)
    legit_prompt = prompt(13, seed=4)

    async def main() -> None:
        async with running_nodes(
            "tcp", max_transfer_timeout_s=CLAMP_S, max_pending_kv_share=SHARE,
            queue_timeout_s=QUEUE_S,
        ) as nodes:  # fmt: skip
            # Its own connection (not the test router's): another caller.
            options = (("grpc.use_local_subchannel_pool", 1),)
            async with grpc.aio.insecure_channel(nodes.decode.address, options=options) as ch:
                stub = node_pb2_grpc.DecodeNodeStub(ch)
                calls = [
                    stub.Decode(
                        decode_request(f"attack-{i}", attack_prompt, transfer_timeout_s=HUGE_S),
                        timeout=RPC_TIMEOUT_S * 6,
                    )
                    for i in range(NUM_ATTACKS)
                ]
                firsts = [await _first_message(call) for call in calls]
                held = [i for i, f in enumerate(firsts) if isinstance(f, node_pb2.DecodeResponse)]
                refused = [f for f in firsts if isinstance(f, grpc.aio.AioRpcError)]
                assert len(held) == 6 and len(refused) == NUM_ATTACKS - 6, firsts
                for error in refused:
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "--max-pending-kv-share" in error.details(), error.details()
                assert nodes.decode.servicer.caps.num_pending == 6
                _, stats = await nodes.stats()
                assert stats.num_free_kv_blocks == NUM_BLOCKS - 6 * 5

                # A legitimate request on the router's connection completes meanwhile.
                handoff = await run_disaggregated(nodes, "legit", legit_prompt)
                assert handoff.chunks[-1].finish_reason == "length"
                assert handoff.transfer_result.ok

                # The attacker's reservations expire at the clamped timeout, not in 1e9 s:
                # each call falls back to local prefill and finishes.
                for i in held:
                    chunks = await read_chunks(calls[i])
                    assert chunks[-1].finish_reason
                assert nodes.decode.servicer.counters.num_fallbacks == len(held)
                assert nodes.decode.servicer.caps.num_pending == 0
                for i in held:
                    assert nodes.decode.traces[f"attack-{i}"].prefilled_locally

    run(main(), timeout_s=100.0)


def test_caps_unit() -> None:
    async def main() -> None:
        caps = TransferCaps(num_pool_blocks=10, max_timeout_s=5.0, max_caller_share=0.5,
                            max_pending=4, max_waiting=1)  # fmt: skip
        assert caps.timeout_s(1e9, 30.0) == 5.0
        assert caps.timeout_s(0.0, 2.0) == 2.0  # the node's default, under the clamp
        assert caps.timeout_s(0.0, 30.0) == 5.0
        big = await caps.acquire("a", 8, 1.0)  # holding nothing, a caller takes any size
        with pytest.raises(TransferCapExceeded, match="max-pending-kv-share"):
            await caps.acquire("a", 1, 0.05)
        b = await caps.acquire("b", 5, 1.0)  # another caller is not held up by "a"
        waiting = asyncio.ensure_future(caps.acquire("b", 1, 30.0))  # over b's cap of 5
        await asyncio.sleep(0.05)
        assert not waiting.done()
        with pytest.raises(TransferCapExceeded, match="max-queued-requests 1"):
            await caps.acquire("a", 1, 30.0)  # over a's cap, and one call already waits
        await caps.acquire("c", 1, 1.0)
        with pytest.raises(TransferCapExceeded, match="max-pending-transfers 4"):
            await caps.acquire("d", 1, 1.0)  # 3 holds + 1 waiter
        b.release()  # b's own hand-off resolved: its waiter gets its hold
        assert (await asyncio.wait_for(waiting, 5.0)).num_blocks == 1
        big.release()
        big.release()  # idempotent
        assert caps.blocks_held("a") == 0 and caps.num_pending == 2
        unlimited = TransferCaps(10, 5.0, 1.0, 8, 0)
        await unlimited.acquire("a", 9, 1.0)
        await unlimited.acquire("a", 9, 1.0)  # share 1: no per-caller cap
        router = TransferCaps(10, 5.0, 0.5, 8, 0)  # no caller may wait over its cap
        held = [await router.acquire("router", 4, 0.05, trusted=True) for _ in range(3)]
        assert router.blocks_held("router") == 12  # a trusted caller (the secret): no cap
        await router.acquire("stranger", 5, 0.05)  # an unproven caller keeps its cap of 5
        with pytest.raises(TransferCapExceeded, match="max-pending-kv-share"):
            await router.acquire("stranger", 1, 0.05)
        for hold in held:
            hold.release()
        assert router.blocks_held("router") == 0

    run(main())
