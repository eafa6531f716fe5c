"""HostBlockManager: the host tier's ledger (hash -> host block, LRU, pins, rounds, guards)."""

from __future__ import annotations

import pytest

from engine.kv_offload import HostBlockManager


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_demotion_takes_a_host_block_and_queues_one_copy_per_hash():
    tier = HostBlockManager(4)
    tier.demote(7, h(1))
    tier.demote(8, h(2))
    tier.demote(9, h(1))  # the host holds h(1) already (pending): no second copy
    assert tier.find(h(1)) == 0 and tier.find(h(2)) == 1 and tier.find(h(3)) is None
    commands = tier.take_commands()
    assert (commands.seq, commands.demote_src, commands.demote_dst) == (1, (7, 8), (0, 1))
    assert commands.promote_src == () and commands.guard_seq == 0
    assert tier.counters.num_demoted_blocks == 2
    assert tier.take_commands().num_copies == 0  # the next round starts empty
    tier.check_no_leaks()


def test_a_full_host_tier_evicts_its_least_recently_used_block():
    tier = HostBlockManager(2)
    tier.demote(0, h(1))
    tier.demote(1, h(2))
    tier.take_commands()
    tier.demote(5, h(1))  # on the host already: touched, h(2) is now the oldest
    tier.demote(2, h(3))
    assert tier.find(h(2)) is None
    assert tier.find(h(1)) == 0 and tier.find(h(3)) == 1
    assert tier.take_commands().demote_dst == (1,)
    tier.check_no_leaks()


def test_blocks_of_a_round_are_pinned_until_its_commands_are_taken():
    tier = HostBlockManager(2)
    tier.demote(0, h(1))
    tier.demote(1, h(2))
    tier.demote(2, h(3))  # both host blocks are written this round: nothing to evict
    assert tier.find(h(3)) is None
    tier.take_commands()
    tier.promote(tier.find(h(1)), block_id=9)  # read this round: h(2)'s block goes first
    tier.demote(3, h(4))
    tier.demote(4, h(5))  # only pinned blocks left
    assert tier.find(h(1)) == 0 and tier.find(h(4)) == 1 and tier.find(h(5)) is None
    commands = tier.take_commands()
    assert (commands.promote_src, commands.promote_dst) == ((0,), (9,))
    assert (commands.demote_src, commands.demote_dst) == ((3,), (1,))
    tier.check_no_leaks()


def test_reusing_a_device_block_guards_the_round_that_copies_it():
    tier = HostBlockManager(4)
    tier.demote(5, h(1))
    tier.take_commands()  # round 1 copies device block 5
    tier.demote(6, h(2))
    tier.reused(7)  # never copied: no guard
    tier.reused(5)
    commands = tier.take_commands()  # round 2
    assert commands.guard_seq == 1 and commands.demote_src == (6,)
    tier.reused(6)
    tier.reused(5)  # guarded once: its copy is waited for before the write that reuses it
    assert tier.take_commands().guard_seq == 2


def test_a_promotion_into_a_block_reused_in_the_same_round_is_dropped():
    tier = HostBlockManager(4)
    tier.demote(1, h(1))
    tier.take_commands()
    tier.promote(0, block_id=3)
    tier.reused(3)  # its target now holds other KV: copying into it would corrupt that
    commands = tier.take_commands()
    assert commands.promote_src == () and commands.guard_seq == 2
    assert tier.find(h(1)) == 0  # the host block stays cached
    tier.check_no_leaks()


def test_reset_forgets_hashes_but_keeps_queued_copies():
    tier = HostBlockManager(3)
    tier.demote(0, h(1))
    tier.take_commands()
    tier.demote(1, h(2))
    tier.reset()
    assert tier.find(h(1)) is None and tier.find(h(2)) is None
    assert tier.take_commands().demote_src == (1,)  # into a block that is free again
    assert tier.num_free_blocks == 3
    tier.check_no_leaks()


def test_promote_refuses_a_block_holding_nothing():
    tier = HostBlockManager(2)
    with pytest.raises(ValueError, match="holds no cached KV"):
        tier.promote(1, block_id=0)


def test_leak_check_finds_a_lost_or_doubly_held_block():
    tier = HostBlockManager(3)
    tier.demote(0, h(1))
    tier.take_commands()
    tier._free.pop()  # a block neither free, cached nor pinned
    with pytest.raises(AssertionError, match="1 blocks lost"):
        tier.check_no_leaks()
    tier = HostBlockManager(3)
    tier.demote(0, h(1))
    tier.take_commands()
    tier._free.append(tier.find(h(1)))  # cached and free at once
    with pytest.raises(AssertionError, match="two states"):
        tier.check_no_leaks()


def test_a_tier_needs_a_block():
    with pytest.raises(ValueError, match="at least one block"):
        HostBlockManager(0)
