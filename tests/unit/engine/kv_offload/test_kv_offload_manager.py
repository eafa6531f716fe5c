"""KVCacheManager with a host tier: blocks that turn cached are queued for demotion, a lookup
continues the hash chain from the device into the host tier and promotes what it finds, the
leak check covers both tiers. Accounting only (no tensors)."""

from __future__ import annotations

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.kv_offload import HostBlockManager
from engine.request import Request
from pdserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_manager(num_blocks: int, num_host_blocks: int = 8, **kwargs) -> KVCacheManager:
    return KVCacheManager(
        num_blocks, BLOCK_SIZE, host_tier=HostBlockManager(num_host_blocks), **kwargs
    )


def make_request(request_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=4))


def prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """Admit `request` with its hit (either tier), compute its prompt, register full blocks;
    return the hit's block ids."""
    block_ids, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, block_ids)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    return block_ids


def evict_everything(manager: KVCacheManager) -> None:
    """Fill the whole device pool with fresh blocks (evicting every cached one), free them."""
    manager.free_blocks(manager.reserve(manager.num_total_blocks * BLOCK_SIZE))


def test_evicted_prefix_comes_back_from_the_host_tier():
    manager = make_manager(num_blocks=4)
    tier = manager.host_tier
    first = make_request("a", list(range(9)))  # 2 full blocks + 1 token
    prefill(manager, first)
    computed = first.block_ids[:2]
    hashes = first.block_hashes[:2]
    manager.free(first)
    demoted = tier.take_commands()  # (a launch flushes the round)
    host_ids = [tier.find(block_hash) for block_hash in hashes]
    assert sorted(zip(demoted.demote_src, demoted.demote_dst)) == sorted(zip(computed, host_ids))
    evict_everything(manager)
    assert tier.take_commands().num_copies == 0  # on the host already: nothing copied again

    second = make_request("b", list(range(9)))
    block_ids = prefill(manager, second)
    assert len(block_ids) == 2 and second.block_ids[:2] == block_ids
    promoted = tier.take_commands()
    assert (promoted.promote_src, promoted.promote_dst) == (tuple(host_ids), tuple(block_ids))
    stats = manager.prefix_cache_stats
    assert (stats.hit_tokens, stats.host_hit_tokens) == (8, 8)
    manager.free(second)
    manager.check_no_leaks()
    # Promoted blocks are ordinary device cache entries now.
    assert manager.get_computed_blocks(make_request("c", list(range(9)))) == (block_ids, 8)
    assert tier.take_commands().num_copies == 0


def test_lookup_continues_on_the_device_after_a_host_block():
    manager = make_manager(num_blocks=6)
    tier = manager.host_tier
    first = make_request("a", list(range(13)))  # 3 full blocks + 1 token
    prefill(manager, first)
    head, middle, tail = first.block_ids[:3]
    middle_hash = first.block_hashes[1]
    manager.free(first)
    tier.take_commands()
    # Make the middle block the least recently used one (no public path evicts a chain's middle
    # first; the lookup must still cope), then evict just it.
    manager._evictable.move_to_end(head)
    manager._evictable.move_to_end(tail)
    manager.free_blocks(manager.reserve(4 * BLOCK_SIZE))  # 3 never-hashed blocks, then `middle`

    block_ids, num_hit_tokens = manager.get_computed_blocks(make_request("b", list(range(13))))
    assert num_hit_tokens == 12 and (block_ids[0], block_ids[2]) == (head, tail)
    commands = tier.take_commands()
    assert (commands.promote_src, commands.promote_dst) == (
        (tier.find(middle_hash),),
        (block_ids[1],),
    )
    assert manager.get_computed_blocks(make_request("c", list(range(13))))[0] == block_ids
    manager.check_no_leaks()


def test_promotion_never_evicts_the_hit_it_extends():
    manager = make_manager(num_blocks=3)
    first = make_request("a", list(range(9)))
    prefill(manager, first)
    head = first.block_ids[0]
    manager.free(first)
    manager.host_tier.take_commands()
    holder = make_request("h", list(range(100, 108)))
    assert manager.allocate_slots(holder, 8)  # the free block and the tail: `head` is all left
    probe = make_request("b", list(range(9)))
    assert manager.get_computed_blocks(probe) == ([head], 4)  # no block to promote the tail into
    assert manager.host_tier.num_pending_copies == 0
    assert manager.get_computed_blocks(probe) == ([head], 4)  # `head` still holds its KV
    manager.free(holder)
    manager.check_no_leaks()


def test_no_device_block_to_promote_into_ends_the_hit():
    manager = make_manager(num_blocks=3)
    first = make_request("a", list(range(9)))
    prefill(manager, first)
    manager.free(first)
    manager.host_tier.take_commands()
    evict_everything(manager)
    holder = make_request("h", list(range(100, 112)))  # takes all 3 device blocks
    assert manager.allocate_slots(holder, 12)
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert manager.host_tier.num_pending_copies == 0
    manager.free(holder)
    manager.check_no_leaks()


def test_host_hits_are_counted_once_per_admission():
    manager = make_manager(num_blocks=4)
    first = make_request("a", list(range(9)))
    prefill(manager, first)
    manager.free(first)
    manager.host_tier.take_commands()
    evict_everything(manager)
    again = make_request("b", list(range(9)))
    manager.get_computed_blocks(again)  # promoted; say the admission waits for a step
    block_ids, _ = manager.get_computed_blocks(again)  # now a device hit: promoted already
    assert manager.host_tier.num_pending_copies == 2
    assert manager.allocate_slots(again, 1, block_ids)
    stats = manager.prefix_cache_stats
    assert (stats.hit_tokens, stats.host_hit_tokens) == (8, 8)
    manager.free(again)
    manager.check_no_leaks()


def test_kv_that_may_not_be_shared_never_reaches_the_host_tier():
    manager = make_manager(num_blocks=4)
    unverified = make_request("a", list(range(9)))
    unverified.cache_kv = False  # e.g. KV received without an authenticated hand-off
    prefill(manager, unverified)
    manager.free(unverified)
    assert manager.host_tier.take_commands().num_copies == 0
    assert manager.host_tier.num_free_blocks == manager.host_tier.num_total_blocks


def test_reset_prefix_cache_clears_both_tiers():
    manager = make_manager(num_blocks=4)
    first = make_request("a", list(range(9)))
    prefill(manager, first)
    manager.free(first)
    manager.host_tier.take_commands()
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert manager.host_tier.num_free_blocks == manager.host_tier.num_total_blocks


def test_leak_check_covers_the_host_tier():
    manager = make_manager(num_blocks=4)
    first = make_request("a", list(range(9)))
    prefill(manager, first)
    manager.free(first)
    manager.host_tier.take_commands()
    manager.check_no_leaks()
    manager.host_tier._lru.popitem()  # a host block that is nowhere
    with pytest.raises(AssertionError, match="host tier of 8 blocks"):
        manager.check_no_leaks()


def test_without_prefix_caching_there_is_no_tier():
    manager = make_manager(num_blocks=4, enable_prefix_caching=False)
    assert manager.host_tier is None
