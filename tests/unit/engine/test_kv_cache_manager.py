"""KVCacheManager: allocation, ref counts, the hash-chained prefix cache, LRU eviction, leaks."""

from __future__ import annotations

import pytest

from engine.block_hash import request_token_ids
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from pdserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(request_id, list(prompt_token_ids), SamplingParams(max_tokens=4))


def prefill(manager: KVCacheManager, request: Request) -> None:
    """Admit `request` with its prefix hit, compute its whole prompt, register full blocks."""
    computed_block_ids, num_hit_tokens = manager.get_computed_blocks(request)
    num_new_tokens = request.num_tokens - num_hit_tokens
    assert manager.allocate_slots(request, num_new_tokens, computed_block_ids)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)


def test_allocate_grows_the_block_table_and_free_returns_every_block():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(10)))
    assert manager.allocate_slots(request, 10)
    assert request.block_ids == [0, 1, 2]
    assert manager.num_free_blocks == 5
    request.num_computed_tokens = 10
    assert manager.allocate_slots(request, 2)  # 12 tokens: still 3 blocks
    assert len(request.block_ids) == 3
    assert manager.allocate_slots(request, 3)  # 13 tokens: a 4th block
    assert len(request.block_ids) == 4
    manager.free(request)
    assert request.block_ids == []
    assert manager.num_free_blocks == 8
    manager.check_no_leaks()


def test_allocate_fails_without_changing_anything():
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    holder = make_request("holder", list(range(8)))
    assert manager.allocate_slots(holder, 8)
    request = make_request("b", list(range(100, 108)))
    assert not manager.allocate_slots(request, 8)
    assert request.block_ids == []
    assert manager.num_free_blocks == 1
    assert manager.prefix_cache_stats.num_queries == 1  # only the successful admission
    manager.free(holder)
    manager.check_no_leaks()


def test_prefix_hit_shares_blocks_and_counts_refs():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    prefill(manager, first)
    second = make_request("b", list(range(8)) + [50, 51, 52])
    block_ids, num_hit_tokens = manager.get_computed_blocks(second)
    assert (block_ids, num_hit_tokens) == (first.block_ids[:2], 8)
    assert manager.allocate_slots(second, second.num_tokens - 8, block_ids)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert manager.num_free_blocks == 8 - 4  # 3 for `first` + 1 new for `second`

    # The shared blocks stay in use while `second` holds them.
    manager.free(first)
    assert manager.num_free_blocks == 8 - 3
    assert set(manager.reserve(5 * BLOCK_SIZE)).isdisjoint(second.block_ids)
    stats = manager.prefix_cache_stats
    assert (stats.num_queries, stats.query_tokens, stats.hit_tokens) == (2, 21, 8)


def test_hit_leaves_the_last_token_to_compute():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", list(range(9))))
    # Both full blocks are cached, but an 8-token prompt must still run its last token.
    assert manager.get_computed_blocks(make_request("b", list(range(8))))[1] == 4
    assert manager.get_computed_blocks(make_request("c", list(range(9))))[1] == 8


def test_hash_chain_requires_the_same_prefix():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Second block's tokens match, but its parent does not: no hit at all.
    assert manager.get_computed_blocks(make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])) == ([], 0)


def test_freed_blocks_stay_cached_and_a_hit_revives_them():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(9)))
    prefill(manager, first)
    cached_block_ids = first.block_ids[:2]
    manager.free(first)
    assert manager.num_free_blocks == 4
    manager.check_no_leaks()

    second = make_request("b", list(range(9)))
    block_ids, num_hit_tokens = manager.get_computed_blocks(second)
    assert (block_ids, num_hit_tokens) == (cached_block_ids, 8)
    assert manager.allocate_slots(second, 1, block_ids)
    assert manager.num_free_blocks == 1  # the 2 revived blocks are in use again
    # Revived blocks do not count as allocatable: 2 more blocks are refused.
    third = make_request("c", list(range(100, 108)))
    assert not manager.allocate_slots(third, 8)
    manager.free(second)
    manager.check_no_leaks()


def test_eviction_is_lru_and_tail_first():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    old = make_request("old", list(range(8)))  # 2 full blocks
    new = make_request("new", list(range(100, 108)))
    prefill(manager, old)
    prefill(manager, new)
    old_block_ids = list(old.block_ids)
    manager.free(old)
    manager.free(new)
    probe_old = make_request("p", list(range(8)) + [0])
    probe_new = make_request("q", list(range(100, 108)) + [0])
    assert manager.reserve(BLOCK_SIZE) == [old_block_ids[1]]  # old's tail goes first
    assert manager.get_computed_blocks(probe_old) == ([old_block_ids[0]], 4)
    assert manager.reserve(BLOCK_SIZE) == [old_block_ids[0]]
    assert manager.get_computed_blocks(probe_old) == ([], 0)
    assert manager.get_computed_blocks(probe_new)[1] == 8  # not evicted yet


def test_evicted_block_ids_follow_lru_order():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    old = make_request("old", list(range(8)))
    new = make_request("new", list(range(100, 108)))
    prefill(manager, old)
    prefill(manager, new)
    old_block_ids, new_block_ids = list(old.block_ids), list(new.block_ids)
    manager.free(old)
    manager.free(new)
    evicted = [manager.reserve(1)[0] for _ in range(4)]
    assert evicted == old_block_ids[::-1] + new_block_ids[::-1]
    manager.free_blocks(evicted)
    manager.check_no_leaks()


def test_uncached_blocks_are_used_before_evicting():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    cached = make_request("a", list(range(8)))
    prefill(manager, cached)
    manager.free(cached)
    assert manager.reserve(2 * BLOCK_SIZE) == [2, 3]  # never-hashed blocks first
    assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 8


def test_duplicate_blocks_computed_concurrently():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    first, second = make_request("a", list(range(5))), make_request("b", list(range(5)))
    for request in (first, second):  # both miss, then both compute the same block
        assert manager.allocate_slots(request, 5)
    for request in (first, second):
        request.num_computed_tokens = 5
        manager.cache_full_blocks(request)
    first_block_id = first.block_ids[0]
    manager.free(first)
    manager.free(second)
    manager.check_no_leaks()
    # The first registration stays cached; the duplicate went back to the free list.
    probe = make_request("c", list(range(5)))
    assert manager.get_computed_blocks(probe) == ([first_block_id], 4)
    assert manager.reserve(5 * BLOCK_SIZE) is not None  # 5 free blocks: no eviction needed
    assert manager.get_computed_blocks(probe) == ([first_block_id], 4)


def test_prefix_caching_disabled():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    first = make_request("a", list(range(9)))
    prefill(manager, first)
    manager.free(first)
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert manager.prefix_cache_stats.num_queries == 0
    manager.check_no_leaks()


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(9)))
    prefill(manager, first)
    assert not manager.reset_prefix_cache()  # blocks in use
    manager.free(first)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert manager.num_free_blocks == 4


def test_reserve_then_a_request_owns_the_blocks():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    assert manager.reserve(4 * BLOCK_SIZE + 1) is None
    block_ids = manager.reserve(9)
    assert block_ids == [0, 1, 2]
    request = make_request("a", list(range(8)))
    request.block_ids = block_ids
    request.num_computed_tokens = 8
    manager.cache_full_blocks(request)
    manager.free(request)
    manager.check_no_leaks()
    # The transferred prompt's blocks are now in the prefix cache.
    assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 8
    with pytest.raises(ValueError, match="num_tokens >= 1"):
        manager.reserve(0)


def test_check_no_leaks_names_the_leaked_blocks():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    manager.reserve(BLOCK_SIZE)  # block 0, never freed
    shared = make_request("a", list(range(9)))  # blocks 1, 2, 3
    prefill(manager, shared)
    sharer = make_request("b", list(range(9)))  # blocks 1, 2 (hit) and 4
    block_ids, _ = manager.get_computed_blocks(sharer)
    assert manager.allocate_slots(sharer, 1, block_ids)
    manager.free(shared)
    with pytest.raises(AssertionError, match=r"4 of 6 KV blocks .*\{0: 1, 1: 1, 2: 1, 4: 1\}"):
        manager.check_no_leaks()
    manager.free_blocks([0])
    prefill(manager, make_request("c", list(range(9))))  # refs on blocks 1 and 2 again
    with pytest.raises(AssertionError, match=r"\{0: 1, 1: 2, 2: 2, 4: 1\}"):
        manager.check_no_leaks()


def test_double_free_is_refused():
    manager = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    block_ids = manager.reserve(1)
    manager.free_blocks(block_ids)
    with pytest.raises(ValueError, match="freed more often"):
        manager.free_blocks(block_ids)


def test_request_token_ids_spans_prompt_and_output():
    request = make_request("a", [1, 2, 3])
    request.output_token_ids = [4, 5]
    for start, end in [(0, 2), (1, 4), (3, 5), (0, 5), (2, 3)]:
        assert request_token_ids(request, start, end) == request.all_token_ids[start:end]
