"""`KVCacheManager`: which KV blocks each request holds, and the hash-chained prefix cache.

Pure accounting over block ids; the tensors live in `KVCachePool`. Every block is in one state:

    free     ref 0, no hash      ──┐ allocate: a free block if any, else evict the least
    cached   ref 0, hash kept    ──┘ recently used cached block (its hash entry dropped)
    in use   ref >= 1            <── allocate, or a prefix hit on a cached/in-use block

A block gets its hash once it is full of computed tokens (`cache_full_blocks`); dropping the
last ref turns a hashed block into a cached one (LRU, most recently freed last), an unhashed
one into a free one. `free(request)` drops refs tail-first, so a prompt's tail is evicted
before its head. Every operation costs O(blocks touched), never O(pool).

With a host tier (`host_tier`, engine/kv_offload: `--kv-offload-memory`) a block that turns
cached is also queued for a copy to host memory (unless the host holds its hash already), so
its eviction loses nothing; a lookup that misses on the device continues the chain in the host
tier and promotes what it finds into fresh device blocks, cached under their hashes at once
(their copies run, one batch, before the next step reads them). Both tiers are keyed by the
same hash chain (salts included).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

from engine.block_hash import request_block_hashes
from engine.kv_events import KVEventBatch, KVEventLog
from engine.request import Request
from pdserve.block_hash import BlockHash, root_hash

if TYPE_CHECKING:
    from engine.kv_offload.host_block_manager import HostBlockManager


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted once per admission (first block allocation)."""

    num_queries: int = 0
    query_tokens: int = 0  # tokens the admitted requests had
    hit_tokens: int = 0  # of those, tokens found in the cache (either tier)
    host_hit_tokens: int = 0  # of those, tokens found in the host tier (promoted)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        prefix_cache_salt: str | None = None,
        host_tier: HostBlockManager | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._salt = prefix_cache_salt  # None: the environment's (pdserve.block_hash)
        self.root_hash = root_hash(prefix_cache_salt)  # parent of unsalted requests' first blocks
        self.prefix_cache_stats = PrefixCacheStats()
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pops 0, 1, ...
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, LRU first
        self._cached: dict[BlockHash, int] = {}  # the prefix cache: block hash -> block id
        self._num_hashed_blocks: dict[str, int] = {}  # request_id -> its leading hashed blocks
        self.host_tier = host_tier if enable_prefix_caching else None
        self.kv_events = KVEventLog()  # the hashes held, for a router's index (off until asked)
        if self.host_tier is not None:
            self.host_tier.kv_events = self.kv_events
        self._num_promoted: dict[str, int] = {}  # request_id -> blocks its lookups promoted

    def root_for(self, request: Request) -> BlockHash:
        """The parent digest of `request`'s first block: its own namespace (`cache_salt`) in
        the deployment's. Reads fixed state only: any thread may call it."""
        return root_hash(self._salt, request.cache_salt) if request.cache_salt else self.root_hash

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of `request`'s tokens in full blocks: (block ids, tokens).

        At least one token is left out so the request still computes its last token (it must
        sample from it). Takes no refs: pass the ids to `allocate_slots`. With a host tier,
        the blocks found only there are promoted into device blocks first (`_promote`).
        """
        if not self.enable_prefix_caching:
            return [], 0
        block_size = self.block_size
        num_hit_blocks = (request.num_tokens - 1) // block_size
        hashes = request_block_hashes(request, num_hit_blocks, block_size, self.root_for(request))
        block_ids: list[int] = []
        for block_hash in islice(hashes, num_hit_blocks):
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        if self.host_tier is not None and len(block_ids) < num_hit_blocks:
            self._promote(request, hashes[len(block_ids) : num_hit_blocks], block_ids)
        return block_ids, len(block_ids) * block_size

    def _promote(self, request: Request, hashes: list[BlockHash], block_ids: list[int]) -> None:
        """Continue the device hit `block_ids` along the rest of the chain, `hashes`, through
        both tiers: a block in neither (or no device block to promote into) ends the hit."""
        tier = self.host_tier
        assert tier is not None
        if tier.find(hashes[0]) is None:
            return
        for block_id in block_ids:  # held, so the allocations below cannot evict them
            self._take_ref(block_id)
        num_promoted = 0
        for block_hash in hashes:
            cached = self._cached.get(block_hash)  # (the chain may continue on the device)
            if cached is not None:
                self._take_ref(cached)
                block_ids.append(cached)
                continue
            host_id = tier.find(block_hash)
            if host_id is None or not self.num_free_blocks:
                break
            block_id = self._allocate_block()
            self._block_hashes[block_id] = block_hash
            self._cached[block_hash] = block_id
            self.kv_events.add(block_hash)
            tier.promote(host_id, block_id)
            num_promoted += 1
            block_ids.append(block_id)
        self.free_blocks(block_ids)  # cached (evictable) again, or back to their holders
        request_id = request.request_id
        self._num_promoted[request_id] = self._num_promoted.get(request_id, 0) + num_promoted

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()
    ) -> bool:
        """Grow `request.block_ids` to hold its computed tokens, the prefix hit
        `computed_block_ids` (first allocation only) and `num_new_tokens` more.

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        num_hit_blocks = len(computed_block_ids)
        if num_hit_blocks and (request.block_ids or request.num_computed_tokens):
            raise ValueError(
                f"request {request.request_id!r}: computed_block_ids are only accepted on its "
                "first allocation (empty block_ids, num_computed_tokens == 0)"
            )
        num_tokens = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        num_required_blocks = -(-num_tokens // self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(request.block_ids) - num_hit_blocks)
        # Hit blocks that are merely cached stop being allocatable once we hold them.
        num_revived = sum(1 for b in computed_block_ids if self._ref_counts[b] == 0)
        if num_new_blocks > self.num_free_blocks - num_revived:
            return False

        if not request.block_ids and self.enable_prefix_caching:
            stats = self.prefix_cache_stats
            stats.num_queries += 1
            stats.query_tokens += request.num_tokens
            stats.hit_tokens += num_hit_blocks * self.block_size
            num_promoted = self._num_promoted.pop(request.request_id, 0)
            stats.host_hit_tokens += min(num_promoted, num_hit_blocks) * self.block_size
        for block_id in computed_block_ids:
            self._take_ref(block_id)
        if num_hit_blocks:
            self._num_hashed_blocks[request.request_id] = num_hit_blocks
        request.block_ids.extend(computed_block_ids)
        request.block_ids.extend(self._allocate_block() for _ in range(num_new_blocks))
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Hash and register `request`'s blocks that are now full of computed tokens (its
        first `num_computed_tokens`, default all; none for a request whose KV may not be
        shared: `request.cache_kv` False)."""
        if not self.enable_prefix_caching or not request.cache_kv:
            return
        block_size = self.block_size
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        num_full_blocks = num_computed_tokens // block_size
        num_hashed = self._num_hashed_blocks.get(request.request_id, 0)
        if num_full_blocks <= num_hashed:
            return
        hashes = request_block_hashes(request, num_full_blocks, block_size, self.root_for(request))
        for block_id, block_hash in zip(
            request.block_ids[num_hashed:num_full_blocks],
            hashes[num_hashed:num_full_blocks],
            strict=True,
        ):
            self._block_hashes[block_id] = block_hash
            # An equal block computed concurrently by another request keeps the entry.
            self._cache(block_hash, block_id)
        self._num_hashed_blocks[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Drop `request`'s refs, tail block first, and clear its block table."""
        self.free_blocks(request.block_ids)
        # Rebind instead of clearing: a ScheduledChunk may still share the old table.
        request.block_ids = []
        self._num_hashed_blocks.pop(request.request_id, None)
        self._num_promoted.pop(request.request_id, None)

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Keep the blocks holding `request`'s first `num_tokens` tokens, drop the rest, last
        first (a verify step's rejected drafts: blocks only their slots used). Those blocks
        hold no full computed block, so none is hashed: they go back free, never cached."""
        num_kept = -(-num_tokens // self.block_size)
        if num_kept < self._num_hashed_blocks.get(request.request_id, 0):
            raise ValueError(
                f"request {request.request_id!r}: cannot drop hashed blocks (keeping {num_kept})"
            )
        tail = request.block_ids[num_kept:]
        if tail:
            self.free_blocks(tail)
            request.block_ids = request.block_ids[:num_kept]  # rebound: chunks share the old

    def reserve(self, num_tokens: int) -> list[int] | None:
        """Fresh blocks for `num_tokens` incoming tokens (decode role), or None if the pool
        cannot supply them. Hand them to a Request's `block_ids` or back to `free_blocks`."""
        if num_tokens < 1:
            raise ValueError(f"reserve needs num_tokens >= 1, got {num_tokens}")
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks > self.num_free_blocks:
            return None
        return [self._allocate_block() for _ in range(num_blocks)]

    def hold_prefix(self, request: Request) -> tuple[list[int], int]:
        """The longest prefix of `request`'s prompt this cache holds (either tier; the host's
        promoted), each block referenced until `free_blocks` or `admit_prefix` hands it to the
        request: nothing evicts it before its use; and how many of them the host tier gave."""
        hit_ids, _ = self.get_computed_blocks(request)
        for block_id in hit_ids:
            self._take_ref(block_id)
        return hit_ids, min(self._num_promoted.pop(request.request_id, 0), len(hit_ids))

    def admit_prefix(self, request: Request, num_cached_blocks: int, num_promoted: int) -> None:
        """`request` (its `block_ids` reserved, led by `hold_prefix`'s) is admitted with its
        first `num_cached_blocks` from the cache: a prefix lookup, those blocks hashed."""
        if self.enable_prefix_caching:
            stats = self.prefix_cache_stats
            stats.num_queries += 1
            stats.query_tokens += request.prompt_len
            stats.hit_tokens += num_cached_blocks * self.block_size
            stats.host_hit_tokens += num_promoted * self.block_size
        request.num_cached_tokens = num_cached_blocks * self.block_size
        if num_cached_blocks:
            self._num_hashed_blocks[request.request_id] = num_cached_blocks

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop one ref on each block, last block first."""
        for block_id in reversed(block_ids):
            self._drop_ref(block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_total_blocks:
            return False
        for block_id in self._evictable:
            self._block_hashes[block_id] = None
            self._free.append(block_id)
        self._evictable.clear()
        for block_hash in self._cached:
            self.kv_events.discard(block_hash)
        self._cached.clear()
        if self.host_tier is not None:
            self.host_tier.reset()
        return True

    def check_no_leaks(self) -> None:
        """Assert every block is free or evictable, and every host-tier block accounted for
        (call once nothing runs)."""
        if self.host_tier is not None:
            self.host_tier.check_no_leaks()
        if self.num_free_blocks == self.num_total_blocks:
            return
        held = {block_id: ref for block_id, ref in enumerate(self._ref_counts) if ref}
        raise AssertionError(
            f"{len(held)} of {self.num_total_blocks} KV blocks are still referenced "
            f"(block_id: ref_count): {held}"
        )

    def _allocate_block(self) -> int:
        if self._free:
            block_id = self._free.pop()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block_hash = self._block_hashes[block_id]
            assert block_hash is not None, "an evictable block is a cached (hashed) one"
            del self._cached[block_hash]
            self.kv_events.discard(block_hash)
            self._block_hashes[block_id] = None
        if self.host_tier is not None:
            self.host_tier.reused(block_id)  # copies of it finish before it is written
        self._ref_counts[block_id] = 1
        return block_id

    def watch_kv_events(self) -> None:
        """Start logging the hashes held (`kv_events`), from every one cached now."""
        host = self.host_tier.cached_hashes() if self.host_tier is not None else []
        self.kv_events.enable([*self._cached, *host])

    def read_kv_events(self, snapshot: bool) -> tuple[KVEventBatch, list[BlockHash] | None]:
        """The changes since the last read; every hash held with `snapshot` or at the first."""
        if not self.kv_events.enabled:
            self.watch_kv_events()
            return KVEventBatch(), self.kv_events.held()
        return self.kv_events.take(), self.kv_events.held() if snapshot else None

    def _cache(self, block_hash: BlockHash, block_id: int) -> int:
        """The block the prefix cache keeps for `block_hash`: `block_id` unless it has one."""
        cached = self._cached.get(block_hash)
        if cached is None:
            self._cached[block_hash] = block_id
            self.kv_events.add(block_hash)
            return block_id
        return cached

    def _take_ref(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def _drop_ref(self, block_id: int) -> None:
        ref_count = self._ref_counts[block_id]
        if ref_count == 0:
            raise ValueError(f"block {block_id} is freed more often than it was allocated")
        self._ref_counts[block_id] = ref_count - 1
        if ref_count > 1:
            return
        block_hash = self._block_hashes[block_id]
        if block_hash is not None and self._cache(block_hash, block_id) == block_id:
            self._evictable[block_id] = None  # most recently used: evicted last
            if self.host_tier is not None:
                self.host_tier.demote(block_id, block_hash)  # (its eviction then loses nothing)
        else:
            self._block_hashes[block_id] = None
            self._free.append(block_id)
