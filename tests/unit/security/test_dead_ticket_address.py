"""Issue 39, item 7 (regression): Prefill calls whose tickets name an address where nobody
listens (an open cluster takes any ticket) end within the KV transport's connect timeout, on a
busy prefill node (calls queued behind one another, chunked), each with a clear status, and free
every block; no servicer exception, no untagged traceback. Before, each stayed open until its
transfer deadline (here 60 s; the adversary saw 150 s) or a manual Node.Abort.

Real prefill and decode nodes in this process, tcp KV transport."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
import pytest

from pdserve.v1 import node_pb2
from tests.ports import unlistened_port
from tests.unit.decode_node.node_harness import GREEDY, engine_config, prompt, run, running_nodes

pytestmark = pytest.mark.timeout(180)

CONNECT_TIMEOUT_S = 5.0  # cache_transfer.transports.tcp.CONNECT_TIMEOUT_S
SLACK_S = 5.0  # a loaded 2-core machine
NUM_CALLS, PROMPT_LEN = 6, 96
TRANSFER_TIMEOUT_S = 60.0  # what the calls waited for before


async def dead_prefill(nodes, dead_address: str, seed: int) -> tuple[str, str, float]:
    """(status name, details or transfer error, seconds) of one Prefill call."""
    ids = prompt(PROMPT_LEN, seed=seed)
    ticket = node_pb2.TransferTicket(
        transfer_id=uuid.uuid4().hex, dst_address=dead_address,
        dst_block_ids=list(range(nodes.prefill.layout.num_blocks_for(PROMPT_LEN + 1))),
        layout_hash=nodes.prefill.layout.layout_hash(), num_tokens=PROMPT_LEN,
    )  # fmt: skip
    request = node_pb2.PrefillRequest(
        request_id=f"dead-{seed}", prompt_token_ids=ids, sampling=GREEDY, ticket=ticket
    )
    started = time.monotonic()
    outcome = ("OK", "")
    try:
        async for message in nodes.prefill_stub.Prefill(request, timeout=TRANSFER_TIMEOUT_S / 2):
            if message.WhichOneof("kind") == "transfer_result" and not message.transfer_result.ok:
                outcome = ("OK, transfer failed", message.transfer_result.error)
    except grpc.aio.AioRpcError as error:
        outcome = (error.code().name, error.details() or "")
    return (*outcome, time.monotonic() - started)


def test_prefill_calls_to_a_dead_address_end_within_the_connect_timeout(caplog) -> None:
    caplog.set_level(logging.WARNING)

    async def main() -> list[tuple[str, str, float]]:
        busy = engine_config(prefill_only=True, num_blocks=512, max_num_batched_tokens=64)
        async with running_nodes(
            "tcp", prefill_engine=busy, transfer_timeout_s=TRANSFER_TIMEOUT_S
        ) as nodes:
            with unlistened_port() as port:  # held: nothing can start to listen there meanwhile
                dead = f"tcp://127.0.0.1:{port}"
                return await asyncio.gather(
                    *(dead_prefill(nodes, dead, seed) for seed in range(NUM_CALLS))
                )  # (running_nodes asserts both pools whole again at exit)

    outcomes = run(main(), timeout_s=150)
    for status, details, elapsed_s in outcomes:
        assert status in ("ABORTED", "OK, transfer failed"), (status, details)
        assert "could not reach" in details, details
        assert elapsed_s < CONNECT_TIMEOUT_S + SLACK_S, (status, details, elapsed_s)
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "Unexpected" not in logged and "could not abort" not in logged, logged
    untagged = [r for r in caplog.records if r.exc_info and r.levelno >= logging.ERROR]
    assert not untagged, [r.getMessage() for r in untagged]
