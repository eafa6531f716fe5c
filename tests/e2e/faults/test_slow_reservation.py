"""Issue 40 (the lean router's follow-up): the decode node's reservation takes longer than the
hand-off's no-progress timeout, and the request still hands off. The router starts P's Prefill
beside D's Decode; P computes the prompt while D waits for KV blocks, and the ticket follows in
an AttachTicket. P's wait for that ticket follows D's reservation (the router's
ticket_timeout_s), not the no-progress timeout: no fallback to a local prefill on D, the prompt
prefilled once (the nodes' counters), no prefill failure counted by the router.

Real nodes and a real router in one process. D's pool is full: a hand-off whose KV never comes
holds every block (the test plays its router and leaves it pending), so the request's
reservation queues in D's KV admission until that one ends (its call cancelled), twice the
no-progress timeout after P began waiting. Before the fix P gave up at the no-progress timeout
("no AttachTicket within 3 s") and D prefilled the prompt again."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.v1 import node_pb2
from tests.e2e.faults.fault_tools import Outcome, router_over, run_one
from tests.e2e.faults.table import FaultRow, record
from tests.unit.decode_node.node_harness import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    RPC_TIMEOUT_S,
    decode_request,
    prompt,
    read_ticket,
    running_nodes,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

TRANSFER_TIMEOUT_S = 3.0  # the hand-offs' no-progress timeout (the fault suite's)
HELD_S = 2 * TRANSFER_TIMEOUT_S  # D's reservation waits this long after P began waiting
PROMPT_LEN, MAX_TOKENS = 40, 6
DEADLINE_S = 90.0  # the client's: a bound on a loaded machine, not an expectation
# a prompt whose reservation (prompt + 1 tokens) takes D's whole pool (and that fits it)
FILLER_LEN = NUM_BLOCKS * BLOCK_SIZE - 1
ONE_TOKEN = node_pb2.NodeSamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


async def hold_whole_pool(nodes):
    """A disaggregated Decode whose KV never comes (its transfer timeout far beyond the test):
    D reserves its whole pool for it until the call is cancelled."""
    call = nodes.decode_stub.Decode(
        decode_request("filler", prompt(FILLER_LEN, seed=1), ONE_TOKEN, transfer_timeout_s=120.0),
        timeout=DEADLINE_S,
    )
    await read_ticket(call)
    _, decode_stats = await nodes.stats()
    assert decode_stats.num_free_kv_blocks == 0, decode_stats
    return call


async def through_router(nodes) -> tuple[Outcome, int]:
    """The request, with D's pool held until P waited HELD_S for its ticket; its outcome and
    the router's prefill failures."""
    async with router_over(nodes, TRANSFER_TIMEOUT_S) as (router, client):
        filler = await hold_whole_pool(nodes)
        try:
            request = asyncio.create_task(
                run_one(
                    client,
                    DEADLINE_S,
                    prompt_token_ids=prompt(PROMPT_LEN, seed=2),
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    ignore_eos=True,
                )
            )
            # P computes the prompt and waits for its ticket; D's reservation queues behind the pool
            await wait_until(lambda: nodes.prefill.servicer.num_tickets_held == 1, RPC_TIMEOUT_S)
            await wait_until(lambda: nodes.decode.servicer.admission.num_queued == 1, RPC_TIMEOUT_S)
            await asyncio.sleep(HELD_S)
            filler.cancel()  # the other request ends: its blocks free up, the reservation goes on
            outcome = await request
            return outcome, router.stats.num_prefill_failures
        finally:
            filler.cancel()


def test_a_reservation_longer_than_the_no_progress_timeout_still_hands_off():
    async def main():
        async with running_nodes(
            "tcp", transfer_timeout_s=TRANSFER_TIMEOUT_S, queue_timeout_s=60.0,
            max_pending_kv_share=1.0,  # the test's caller may hold the whole pool
        ) as nodes:  # fmt: skip
            outcome, prefill_failures = await through_router(nodes)
            prefill_stats, decode_stats = await nodes.stats()
            traces = list(nodes.prefill.traces.values())  # (none: P never had its ticket)
            ticket_wait_s = max((t.marks_s["ticket"] - t.marks_s["rpc"] for t in traces), default=0)
            return outcome, prefill_failures, prefill_stats, decode_stats, ticket_wait_s

    outcome, prefill_failures, prefill, decode, ticket_wait_s = asyncio.run(
        asyncio.wait_for(main(), 150)
    )
    record(FaultRow(
        f"D's reservation queued {HELD_S:g} s (no-progress timeout {TRANSFER_TIMEOUT_S:g} s)",
        1, int(outcome.code is None), 0,
        0,  # running_nodes asserts both pools whole again on exit
        int(outcome.elapsed_s > DEADLINE_S),
        f"P waited {ticket_wait_s:.1f} s for its ticket; prefill failures={prefill_failures}",
    ))  # fmt: skip
    assert outcome.code is None, (outcome.code, outcome.details)
    assert outcome.num_tokens == MAX_TOKENS and outcome.finish_reason == "length"
    assert prefill_failures == 0  # pdserve_prefill_failures_total unchanged
    # P's wait outlasted the no-progress timeout (else nothing was tested)
    assert ticket_wait_s > TRANSFER_TIMEOUT_S, ticket_wait_s
    assert decode.num_local_prefills == 0  # no fallback
    assert prefill.num_failed_transfers == 0
    assert decode.num_failed_transfers == 1  # the filler's (cancelled), not the request's
    # the prompt computed once, on the prefill node (the filler never reached an engine step)
    assert (prefill.num_prefilled_tokens, decode.num_prefilled_tokens) == (PROMPT_LEN, 0)
