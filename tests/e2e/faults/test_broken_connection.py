"""The P->D KV connection breaks (as after a decode node restarted behind the same address):
the prefill node's sends fail, its failed transfer result reaches the router, and the router's
CancelTransfer frees the decode node's reservation at once: D prefills locally within seconds,
not at its 30 s transfer deadline. Real nodes and a real router in one process; the break is
the prefill node's tcp transport failing the hand-off's last message (the first token), after
every layer went out: D has all the KV but will never hear from P."""

from __future__ import annotations

import asyncio

import pytest

from cache_transfer import protocol
from cache_transfer.transports.base import TransportError
from tests.e2e.faults.fault_tools import CLEAR_CODES, Outcome, router_over, run_one
from tests.e2e.faults.table import FaultRow, record
from tests.unit.decode_node.node_harness import prompt, running_nodes

pytestmark = pytest.mark.timeout(120)

TRANSFER_TIMEOUT_S = 30.0
FAST_S = 10.0  # well under the transfer timeout, generous on a loaded machine


def break_first_token_sends(server) -> None:
    """`server`'s KV transport fails every hand-off's last message (the first token)."""
    transport = server.manager._transport
    send = transport.send

    async def broken_send(peer_address, header, payload=None):
        if protocol.kind_of(protocol.decode(header)) == "first_token":
            raise TransportError(f"connection to {peer_address} reset by peer")
        await send(peer_address, header, payload)

    transport.send = broken_send


def record_cancels(server) -> list[tuple[str, str]]:
    """(transfer_id, reason) of every hand-off `server`'s CancelTransfer cancels (it finds the
    hand-off through its HandOffs, or tells the manager)."""
    cancels: list[tuple[str, str]] = []
    hand_offs, manager = server.servicer._hand_offs, server.manager
    find, manager_cancel = hand_offs.find, manager.cancel

    def recording_find(transfer_id: str):
        hand_off = find(transfer_id)
        if hand_off is not None:
            cancel = hand_off.cancel

            def recording_cancel(reason: str) -> None:
                cancels.append((transfer_id, reason))
                cancel(reason)

            hand_off.cancel = recording_cancel
        return hand_off

    def recording_manager_cancel(transfer_id: str, reason: str) -> bool:
        cancels.append((transfer_id, reason))
        return manager_cancel(transfer_id, reason)

    hand_offs.find, manager.cancel = recording_find, recording_manager_cancel
    return cancels


async def through_router(nodes, num_requests: int) -> list[Outcome]:
    async with router_over(nodes, TRANSFER_TIMEOUT_S) as (_, client):
        return [
            await run_one(
                client,
                60.0,
                prompt_token_ids=prompt(20 + i, seed=i),
                max_tokens=6,
                temperature=0.0,
                ignore_eos=True,
            )  # fmt: skip
            for i in range(num_requests)
        ]


def test_a_broken_p_to_d_connection_cancels_the_reservation_at_once():
    async def main():
        async with running_nodes("tcp", transfer_timeout_s=TRANSFER_TIMEOUT_S) as nodes:
            break_first_token_sends(nodes.prefill)
            cancels = record_cancels(nodes.decode)
            outcomes = await through_router(nodes, 3)
            return outcomes, cancels, nodes.decode.servicer.counters.num_fallbacks

    outcomes, cancels, num_fallbacks = asyncio.run(asyncio.wait_for(main(), 100))
    slowest = max(o.elapsed_s for o in outcomes)
    record(FaultRow(
        "P->D connection broken (P's failed result cancels D's reservation)", len(outcomes),
        sum(o.code is None for o in outcomes),
        sum(o.code in CLEAR_CODES and bool(o.details) for o in outcomes),
        0,  # running_nodes asserts both pools whole again on exit
        sum(o.elapsed_s > FAST_S for o in outcomes), f"slowest {slowest:.1f} s",
    ))  # fmt: skip
    assert all(o.code is None and o.num_tokens == 6 for o in outcomes), outcomes
    assert slowest < FAST_S, [o.elapsed_s for o in outcomes]  # not the 30 s transfer timeout
    assert num_fallbacks == len(outcomes)
    # the mechanism: each reservation was released by the router relaying P's report
    assert len(cancels) == len(outcomes), cancels
    assert all("its KV transfer failed: send to" in reason for _, reason in cancels), cancels
