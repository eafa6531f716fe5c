"""`HostBlockManager`: the host tier's ledger, a part `KVCacheManager` owns. Pure accounting
over host block ids (the memory is `HostKVPool`); the copies it decides are queued as
`OffloadCommands` and run by `KVBlockMover` wherever the pools live.

    free      no hash                         ──┐ a demotion takes a free block, else the
    cached    a block hash, LRU                ──┘ least recently used cached one
    pinned    read or written by this round's copies: neither evicted nor reused until the
              round's commands are taken (then cached again, most recently used, or free)

The device side tells it three things: a hashed device block became evictable (`demote`: its
copy is queued unless the host already holds that hash), a device block was handed out again
(`reused`: a copy of this round or of one still running must finish first, `guard_seq`), and a
prefix lookup found a hash here (`find`, then `promote` into a fresh device block).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.kv_events import KVEventLog
from engine.kv_offload.offload_commands import OffloadCommands
from pdserve.block_hash import BlockHash


@dataclass
class HostTierCounters:
    """Blocks copied since the start (counted when their round's commands are taken)."""

    num_demoted_blocks: int = 0
    num_promoted_blocks: int = 0


class HostBlockManager:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.num_total_blocks = num_blocks
        self.counters = HostTierCounters()
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pops 0, 1, ...
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached host blocks, LRU first
        self._pinned: set[int] = set()
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # block hash -> host block id
        self._demotions: dict[int, int] = {}  # this round: host block id -> device block id
        self._promotions: dict[int, int] = {}  # this round: device block id -> host block id
        self._copied: dict[int, int] = {}  # device block id -> round of its latest copy
        self._seq = 1  # the round being filled
        self._guard_seq = 0
        self.kv_events: KVEventLog | None = None  # the owner's, told what the tier caches

    @property
    def num_free_blocks(self) -> int:
        """Host blocks holding nothing."""
        return len(self._free)

    @property
    def num_pending_copies(self) -> int:
        return len(self._demotions) + len(self._promotions)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the tier holds."""
        return list(self._cached)

    def find(self, block_hash: BlockHash) -> int | None:
        """The host block holding `block_hash`, if any."""
        return self._cached.get(block_hash)

    def demote(self, block_id: int, block_hash: BlockHash) -> None:
        """Device block `block_id`, holding `block_hash`, became evictable: queue its copy
        (skipped when the host holds the hash already, or every host block is pinned)."""
        host_id = self._cached.get(block_hash)
        if host_id is not None:
            if host_id in self._lru:
                self._lru.move_to_end(host_id)
            return
        host_id = self._take_block()
        if host_id is None:
            return
        self._hashes[host_id] = block_hash
        self._cached[block_hash] = host_id
        if self.kv_events is not None:
            self.kv_events.add(block_hash)
        self._pinned.add(host_id)
        self._demotions[host_id] = block_id
        self._copied[block_id] = self._seq

    def promote(self, host_id: int, block_id: int) -> None:
        """Queue the copy of host block `host_id` into the fresh device block `block_id`."""
        if self._hashes[host_id] is None:
            raise ValueError(f"host block {host_id} holds no cached KV")
        self._lru.pop(host_id, None)
        self._pinned.add(host_id)
        self._promotions[block_id] = host_id
        self._copied[block_id] = self._seq

    def reused(self, block_id: int) -> None:
        """Device block `block_id` was handed out again: whatever writes it next waits for the
        copies that touch it; a promotion into it that has not run is dropped (its target
        no longer holds that hash)."""
        self._guard_seq = max(self._guard_seq, self._copied.pop(block_id, 0))
        self._promotions.pop(block_id, None)

    def take_commands(self) -> OffloadCommands:
        """This round's copies (the pinned host blocks are cached or free again) and the
        guard; the next round begins."""
        demotions, promotions = self._demotions, self._promotions
        commands = OffloadCommands(
            seq=self._seq,
            demote_src=tuple(demotions.values()),
            demote_dst=tuple(demotions),
            promote_src=tuple(promotions.values()),
            promote_dst=tuple(promotions),
            guard_seq=self._guard_seq,
        )
        self.counters.num_demoted_blocks += len(demotions)
        self.counters.num_promoted_blocks += len(promotions)
        for host_id in self._pinned:
            if self._hashes[host_id] is None:
                self._free.append(host_id)
            else:
                self._lru[host_id] = None
        self._pinned = set()
        self._demotions, self._promotions = {}, {}
        self._seq += 1
        self._guard_seq = 0
        return commands

    def reset(self) -> None:
        """Forget every cached hash (copies already queued still run, into blocks now free)."""
        for host_id in self._lru:
            self._hashes[host_id] = None
            self._free.append(host_id)
        self._lru.clear()
        for host_id in self._pinned:
            self._hashes[host_id] = None
        if self.kv_events is not None:
            for block_hash in self._cached:
                self.kv_events.discard(block_hash)
        self._cached.clear()

    def check_no_leaks(self) -> None:
        """Assert every host block is accounted for: free (no hash), cached or pinned, once."""
        free, lru, pinned = set(self._free), set(self._lru), self._pinned
        problems = []
        if len(free) != len(self._free):
            problems.append("a block is free twice")
        if free & lru or free & pinned or lru & pinned:
            problems.append(
                f"blocks in two states: {sorted(free & lru | free & pinned | lru & pinned)}"
            )
        if len(free | lru | pinned) != self.num_total_blocks:
            problems.append(f"{self.num_total_blocks - len(free | lru | pinned)} blocks lost")
        if any(self._hashes[h] is not None for h in free):
            problems.append("a free block keeps a hash")
        if any(self._hashes[h] != block_hash for block_hash, h in self._cached.items()):
            problems.append("the hash map names a block holding another hash")
        if len(self._cached) != sum(h is not None for h in self._hashes):
            problems.append("a hashed block is missing from the hash map")
        if problems:
            raise AssertionError(f"host tier of {self.num_total_blocks} blocks: {problems}")

    def _take_block(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        host_id, _ = self._lru.popitem(last=False)
        block_hash = self._hashes[host_id]
        assert block_hash is not None, "a cached host block holds a hash"
        del self._cached[block_hash]
        if self.kv_events is not None:
            self.kv_events.discard(block_hash)
        return host_id
