"""`KVEventLog` (engine/kv_events.py): the hashes an engine holds, both tiers together. A copy
built from the first snapshot and every batch after it equals exactly what the tiers cache,
through prefills, hits, evictions, demotions, promotions and a reset; a hash stored and removed
between two looks is in neither list."""

from __future__ import annotations

import random

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import KVEventLog
from engine.kv_offload import HostBlockManager
from engine.request import Request
from pdserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def test_log_semantics() -> None:
    log = KVEventLog()
    log.add(b"a")  # off: nothing recorded
    assert log.take().stored == [] and not log.enabled
    log.enable([b"a", b"b", b"b"])  # b in two tiers
    assert sorted(log.held()) == [b"a", b"b"]
    log.discard(b"b")  # still in the other tier
    log.add(b"c")
    log.discard(b"a")
    log.add(b"d")
    log.discard(b"d")  # stored and removed in between: neither
    batch = log.take()
    assert (batch.stored, batch.removed) == ([b"c"], [b"a"])
    log.discard(b"b")
    log.add(b"b")  # removed and stored again: no change
    assert log.take() == type(batch)()
    assert sorted(log.held()) == [b"b", b"c"]


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4))


def cached_everywhere(manager: KVCacheManager) -> set[bytes]:
    host = manager.host_tier.cached_hashes() if manager.host_tier is not None else []
    return set(manager._cached) | set(host)


@pytest.mark.parametrize("num_host_blocks", [0, 12])
def test_a_copy_from_events_equals_what_the_tiers_hold(num_host_blocks: int) -> None:
    host = HostBlockManager(num_host_blocks) if num_host_blocks else None
    manager = KVCacheManager(10, BLOCK_SIZE, host_tier=host)
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 500) for _ in range(12)] for _ in range(4)]
    mirror: set[bytes] | None = None
    for step in range(300):
        if step == 20:  # a router starts watching mid-way
            manager.watch_kv_events()
            mirror = set(manager.kv_events.held())
        tokens = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 9))]
        r = request(f"r{step}", tokens)
        hit_ids, hit_tokens = manager.get_computed_blocks(r)
        if manager.allocate_slots(r, r.num_tokens - hit_tokens, hit_ids):
            r.num_computed_tokens = r.num_tokens
            manager.cache_full_blocks(r)
            manager.free(r)
        if host is not None:
            host.take_commands()  # a round ends (pinned host blocks are cached or free)
        if step == 150:
            assert manager.reset_prefix_cache()
        if mirror is not None:
            batch = manager.kv_events.take()
            assert not set(batch.stored) & mirror and set(batch.removed) <= mirror
            mirror = (mirror | set(batch.stored)) - set(batch.removed)
            assert mirror == cached_everywhere(manager), step
    assert mirror is not None and mirror == set(manager.kv_events.held())


def test_a_block_evicted_from_the_device_but_on_the_host_stays_held() -> None:
    manager = KVCacheManager(4, BLOCK_SIZE, host_tier=HostBlockManager(8))
    manager.watch_kv_events()
    r = request("a", list(range(3, 12)))  # 2 full blocks
    ids, _ = manager.get_computed_blocks(r)
    assert manager.allocate_slots(r, r.num_tokens, ids)
    r.num_computed_tokens = r.num_tokens
    manager.cache_full_blocks(r)
    manager.free(r)
    manager.host_tier.take_commands()  # demoted
    assert sorted(manager.kv_events.take().stored) == sorted(r.block_hashes[:2])
    manager.free_blocks(manager.reserve(4 * BLOCK_SIZE))  # evicts both from the device
    assert not manager._cached
    assert manager.kv_events.take() == type(manager.kv_events.take())()  # still held (host)
