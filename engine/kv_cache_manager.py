"""`KVCacheManager`: which KV blocks each request holds, and the hash-chained prefix cache.

Pure accounting over block ids; the tensors live in `KVCachePool`. Every block is in one state:

    free     ref 0, no hash      ──┐ allocate: a free block if any, else evict the least
    cached   ref 0, hash kept    ──┘ recently used cached block (its hash entry dropped)
    in use   ref >= 1            <── allocate, or a prefix hit on a cached/in-use block

A block gets its hash once it is full of computed tokens (`cache_full_blocks`); dropping the
last ref turns a hashed block into a cached one (LRU, most recently freed last), an unhashed
one into a free one. `free(request)` drops refs tail-first, so a prompt's tail is evicted
before its head. Every operation costs O(blocks touched), never O(pool).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from engine.block_hash import request_block_hashes
from engine.request import Request
from pdserve.block_hash import BlockHash, root_hash


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted once per admission (first block allocation)."""

    num_queries: int = 0
    query_tokens: int = 0  # tokens the admitted requests had
    hit_tokens: int = 0  # of those, tokens found in the cache


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        prefix_cache_salt: str | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}"
            )
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = root_hash(prefix_cache_salt)  # parent of every first block's digest
        self.prefix_cache_stats = PrefixCacheStats()
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pops 0, 1, ...
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, LRU first
        self._cached: dict[BlockHash, int] = {}  # the prefix cache: block hash -> block id
        self._num_hashed_blocks: dict[str, int] = {}  # request_id -> its leading hashed blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of `request`'s tokens in full blocks: (block ids, tokens).

        At least one token is left out so the request still computes its last token (it must
        sample from it). Takes no refs: pass the ids to `allocate_slots`.
        """
        if not self.enable_prefix_caching:
            return [], 0
        block_size = self.block_size
        num_hit_blocks = (request.num_tokens - 1) // block_size
        hashes = request_block_hashes(request, num_hit_blocks, block_size, self.root_hash)
        block_ids: list[int] = []
        for block_hash in islice(hashes, num_hit_blocks):
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * block_size

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
        hashes = request_block_hashes(request, num_full_blocks, block_size, self.root_hash)
        for block_id, block_hash in zip(
            request.block_ids[num_hashed:num_full_blocks],
            hashes[num_hashed:num_full_blocks],
            strict=True,
        ):
            self._block_hashes[block_id] = block_hash
            # An equal block computed concurrently by another request keeps the entry.
            self._cached.setdefault(block_hash, block_id)
        self._num_hashed_blocks[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Drop `request`'s refs, tail block first, and clear its block table."""
        self.free_blocks(request.block_ids)
        # Rebind instead of clearing: a ScheduledChunk may still share the old table.
        request.block_ids = []
        self._num_hashed_blocks.pop(request.request_id, None)

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
        self._cached.clear()
        return True

    def check_no_leaks(self) -> None:
        """Assert every block is free or evictable (call once nothing runs)."""
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
            self._block_hashes[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id

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
        if block_hash is not None and self._cached.setdefault(block_hash, block_id) == block_id:
            self._evictable[block_id] = None  # most recently used: evicted last
        else:
            self._block_hashes[block_id] = None
            self._free.append(block_id)
