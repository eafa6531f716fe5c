"""TicketBox: a ticket meets its Prefill call whichever comes first; early tickets are bounded
in number and in time."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.v1 import node_pb2
from prefill_node.ticket_box import PutResult, TicketBox


def ticket(transfer_id: str) -> node_pb2.TransferTicket:
    return node_pb2.TransferTicket(transfer_id=transfer_id)


def test_a_ticket_meets_its_call_in_either_order() -> None:
    async def main() -> None:
        box = TicketBox()
        waiting = box.expect("a")
        assert not waiting.done()
        assert box.put("a", ticket("ta")) == PutResult.ATTACHED
        assert (await waiting).transfer_id == "ta"
        assert box.put("a", ticket("again")) == PutResult.DUPLICATE
        assert box.put("b", ticket("tb")) == PutResult.EARLY  # its call comes later
        assert (await box.expect("b")).transfer_id == "tb"
        box.drop("a")
        box.drop("b")
        assert len(box) == 0

    asyncio.run(main())


def test_early_tickets_expire_and_are_capped() -> None:
    async def main() -> None:
        box = TicketBox(early_ttl_s=0.05, max_early=2)
        assert box.put("x", ticket("tx")) == PutResult.EARLY
        assert box.put("y", ticket("ty")) == PutResult.EARLY
        assert box.put("z", ticket("tz")) == PutResult.FULL
        await asyncio.sleep(0.2)  # both expire
        assert len(box) == 0
        assert box.put("z", ticket("tz")) == PutResult.EARLY
        late = box.expect("x")  # its ticket expired: the call waits for a new one
        assert not late.done()
        box.drop("x")
        assert late.cancelled()

    asyncio.run(main())


def test_one_waiting_call_per_request_id() -> None:
    async def main() -> None:
        box = TicketBox()
        box.expect("a")
        with pytest.raises(ValueError, match="already waits"):
            box.expect("a")

    asyncio.run(main())
