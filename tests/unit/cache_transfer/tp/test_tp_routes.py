"""Route planning between tensor-parallel sizes, route names, route tickets, and the checks a
decode rank runs on a route before it takes it (its rank, its heads, no overlap, one size),
with and without a cluster secret."""

from __future__ import annotations

import asyncio

import pytest

from cache_transfer.state import TransferState
from cache_transfer.tp.head_routes import RankHeads, Route, parse_route_id, plan_routes, route_id
from pdserve.security import ClusterAuth
from tests.unit.cache_transfer.tp.tp_nodes import TPPair, rank_heads
from tests.unit.cache_transfer.transfer_helpers import run

pytestmark = pytest.mark.timeout(60)
AUTH = ClusterAuth(b"cluster-secret-0123456789abcdef")


def test_plan_two_to_one_one_to_two_and_replicated():
    assert plan_routes(rank_heads(8, 2), rank_heads(8, 1), 8) == [
        Route(2, 0, 0, 0, 4), Route(2, 1, 0, 4, 8),
    ]  # fmt: skip
    assert plan_routes(rank_heads(8, 1), rank_heads(8, 2), 8) == [
        Route(1, 0, 0, 0, 4), Route(1, 0, 1, 4, 8),
    ]  # fmt: skip
    # 2 kv heads over 4 prefill ranks: ranks 0, 1 hold head 0, ranks 2, 3 head 1
    assert plan_routes(rank_heads(2, 4), rank_heads(2, 1), 2) == [
        Route(4, 0, 0, 0, 1), Route(4, 2, 0, 1, 2),
    ]  # fmt: skip
    # ... to 4 decode ranks: each needs its head from the lowest prefill rank holding it
    assert [r.src_rank for r in plan_routes(rank_heads(2, 4), rank_heads(2, 4), 2)] == [0, 0, 2, 2]


def test_a_side_missing_heads_is_refused_naming_both_sizes():
    with pytest.raises(ValueError, match="tensor-parallel size 2 .* size 1 .*kv heads \\[2, 3\\]"):
        plan_routes(rank_heads(4, 2), [RankHeads(0, 0, 2)], 4)
    with pytest.raises(ValueError, match="not 0..n-1"):
        plan_routes(rank_heads(4, 2), [RankHeads(1, 0, 4)], 4)


def test_route_names_round_trip_and_junk_names_none():
    route = Route(4, 2, 1, 3, 4)
    assert parse_route_id(route_id("abc", route)) == ("abc", route)
    for junk in ("abc", "abc:", "abc:4.2>1", "abc:4.5>1:3-4", "abc:4.2>1:4-3", ":4.2>1:3-4"):
        assert parse_route_id(junk) is None, junk


@pytest.mark.parametrize("auth", [None, AUTH], ids=["open", "secret"])
def test_a_route_that_does_not_fit_the_rank_is_refused(auth):
    async def main():
        pair = await TPPair.start(4, 1, 2, auth=auth)
        try:
            receiver = pair.open_receiver()
            ticket = receiver.ticket()
            rank1 = pair.decode[1]
            from cache_transfer.protocol import TransferMessage

            def first(route: Route) -> object:
                msg = TransferMessage(transfer_id=route_id(ticket.transfer_id, route))
                return rank1.fan_in.accept("peer", msg)

            assert first(Route(1, 0, 0, 2, 4)) is None  # decode rank 0's route
            assert first(Route(1, 0, 1, 0, 2)) is None  # heads rank 1 does not hold
            assert first(Route(1, 0, 1, 2, 3)) is not None
            assert first(Route(1, 0, 1, 2, 4)) is None  # overlaps the one taken
            assert first(Route(2, 1, 1, 3, 4)) is None  # another prefill size
            receiver.abort("test over")
            assert await asyncio.wait_for(receiver.wait(), 5) == TransferState.FAILED
        finally:
            await pair.close()

    run(main(), 30)


def test_with_a_secret_routes_prove_it_and_a_forged_ticket_is_refused():
    async def main():
        pair = await TPPair.start(4, 2, 2, auth=AUTH)
        try:
            receiver = pair.open_receiver()
            ticket = receiver.ticket()
            forged = type(ticket)()
            forged.CopyFrom(ticket)
            forged.ranks[1].address = "tcp://10.9.9.9:1"  # aim rank 1's heads elsewhere
            from cache_transfer.tp.fan_out import FanOutSender, TicketRefused

            with pytest.raises(TicketRefused, match="signature"):
                FanOutSender.create(pair.prefill[0].manager, forged, pair.layout,
                                    pair.prefill[0].heads, [r.heads for r in pair.prefill], 5.0)  # fmt: skip
            await pair.send_all(pair.open_senders(ticket))
            assert await asyncio.wait_for(receiver.wait(), 10) == TransferState.SUCCESS
            assert pair.landed_as_sent()
        finally:
            await pair.close()

    run(main(), 30)
