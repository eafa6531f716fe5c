"""A KV hand-off between tensor-parallel sizes, in process: every prefill rank sends its own
heads straight to the decode rank(s) holding them; each decode rank's pool holds exactly its
heads of the prefill node's KV, in the ticket's blocks, and nothing else; rank 0 gets the
first token (and its drafts); one route failing fails the whole hand-off on every rank."""

from __future__ import annotations

import asyncio

import pytest

from cache_transfer.state import TransferState
from tests.unit.cache_transfer.tp.tp_nodes import DST_IDS, SENTINEL, TPPair
from tests.unit.cache_transfer.transfer_helpers import run

pytestmark = pytest.mark.timeout(120)

SIZES = [(4, a, b) for a in (1, 2, 4) for b in (1, 2, 4) if (a, b) != (1, 1)]
REPLICATED = [(2, 4, 1), (2, 1, 4), (2, 4, 2), (2, 2, 4), (2, 4, 4)]


@pytest.mark.parametrize(("num_kv_heads", "src_tp", "dst_tp"), SIZES + REPLICATED)
def test_every_rank_gets_exactly_its_heads(num_kv_heads, src_tp, dst_tp):
    async def main():
        pair = await TPPair.start(num_kv_heads, src_tp, dst_tp)
        try:
            receiver = pair.open_receiver()
            sending = pair.open_senders(receiver.ticket())
            await pair.send_all(sending, first_token=42, drafts=[7, 8, 9])
            assert await asyncio.wait_for(receiver.wait(), 10) == TransferState.SUCCESS
            assert receiver.first_token.token_id == 42
            assert list(receiver.first_token.draft_token_ids) == [7, 8, 9]  # on rank 0's route
            assert await pair.prefill[0].fan_out.wait() == TransferState.SUCCESS
            await asyncio.wait_for(receiver.writes_settled.wait(), 5)
            assert pair.landed_as_sent()
            for rank in pair.decode:  # nothing outside the ticket's blocks
                for k, v in rank.caches:
                    others = [b for b in range(k.shape[0]) if b not in DST_IDS]
                    assert bool((k[others] == SENTINEL).all() and (v[others] == SENTINEL).all())
            senders = {r.heads.rank for r in sending}
            if num_kv_heads < src_tp:  # replicated heads go once: from their lowest rank
                assert len(senders) == num_kv_heads
            assert all(r.manager.num_pending == 0 for r in [*pair.prefill, *pair.decode])
            if dst_tp == 1 and receiver.direct is not None:  # retired: counted nowhere
                assert pair.decode[0].manager.num_failed == 0
        finally:
            await pair.close()

    run(main(), 60)


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (2, 2), (1, 2)])
def test_a_suffix_hand_off_skips_the_held_blocks_on_every_route(src_tp, dst_tp):
    """The decode node holds the prompt's first block (KVSuffix): every route's ticket says so
    (signed), each route sends only the rest, into the ticket's blocks; the held block's
    slot is untouched on every rank."""
    held = 1

    async def main():
        pair = await TPPair.start(4, src_tp, dst_tp)
        try:
            receiver = pair.open_receiver(held)
            ticket = receiver.ticket()
            assert ticket.num_cached_blocks == held
            sending = pair.open_senders(ticket)
            for rank in sending:
                assert all(s.suffix.num_cached_blocks == held for _, s in rank.fan_out.routes)
            await pair.send_all(sending, first_token=42, held=held)
            assert await asyncio.wait_for(receiver.wait(), 10) == TransferState.SUCCESS
            assert await pair.prefill[0].fan_out.wait() == TransferState.SUCCESS
            await asyncio.wait_for(receiver.writes_settled.wait(), 5)
            assert pair.landed_as_sent(held)
            for rank in pair.decode:  # the held block's slot: not written
                for k, v in rank.caches:
                    assert bool((k[DST_IDS[0]] == SENTINEL).all())
                    assert bool((v[DST_IDS[0]] == SENTINEL).all())
            assert receiver.num_bytes_skipped == pair.layout.kv_bytes(held)
        finally:
            await pair.close()

    run(main(), 60)


def test_tcp_two_to_one():
    async def main():
        pair = await TPPair.start(4, 2, 1, backend="tcp")
        try:
            receiver = pair.open_receiver()
            await pair.send_all(pair.open_senders(receiver.ticket()))
            assert await asyncio.wait_for(receiver.wait(), 10) == TransferState.SUCCESS
            assert pair.landed_as_sent()
        finally:
            await pair.close()

    run(main(), 60)


def test_a_failed_route_fails_every_rank():
    async def main():
        pair = await TPPair.start(4, 2, 2)
        try:
            receiver = pair.open_receiver()
            sending = pair.open_senders(receiver.ticket())
            sending[1].fan_out.abort("rank 1 broke")
            assert await asyncio.wait_for(receiver.wait(), 10) == TransferState.FAILED
            assert "rank 1 broke" in receiver.error
            assert await pair.prefill[0].fan_out.wait() == TransferState.FAILED
            for rank in pair.decode[1:]:
                assert await asyncio.wait_for(rank.fan_in.group.wait(), 10) == TransferState.FAILED
            await asyncio.wait_for(receiver.writes_settled.wait(), 10)
        finally:
            await pair.close()

    run(main(), 60)


def test_sizes_that_do_not_match_are_refused_with_both_sizes():
    async def main():
        pair = await TPPair.start(4, 2, 2)
        try:
            receiver = pair.open_receiver()
            ticket = receiver.ticket()
            del ticket.ranks[1]  # the decode node's rank 1 (heads 2-3) is missing
            ticket.tp_size = 1
            from cache_transfer.tp.fan_out import FanOutSender, TicketRefused

            with pytest.raises(TicketRefused, match="size 2 .* size 1"):
                FanOutSender.create(pair.prefill[0].manager, ticket, pair.layout,
                                    pair.prefill[0].heads, [r.heads for r in pair.prefill], 5.0)  # fmt: skip
            receiver.abort("test over")
        finally:
            await pair.close()

    run(main(), 30)
