"""`KVEventLog`: which block hashes an engine holds, device and host tiers together, as the
changes since the last look (a part `KVCacheManager` owns; both tiers report to it).

```
enable(held)        from now on (off until a router watches: no cost before); `held`: every
                    hash the tiers cache at that moment
add(h) / discard(h) a tier cached / dropped `h` (each tier holds a hash at most once)
take()              the changes since the last take: hashes now held that were not
                    (`stored`), and held then, not now (`removed`); a hash stored and removed
                    in between is in neither
held()              every hash held now (a snapshot; the changes so far are part of it)
```

A hash is held while either tier caches it, so a block demoted to host memory and evicted
from the device is still held (the node's prefix lookup finds it there). Pending changes are
keyed by hash: at most one per hash held or recently dropped, bounded by the tiers' sizes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.block_hash import BlockHash


@dataclass(frozen=True)
class KVEventBatch:
    """Changes to the held hashes since the previous batch."""

    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)


class KVEventLog:
    def __init__(self) -> None:
        self.enabled = False
        self._tiers: dict[BlockHash, int] = {}  # hash -> how many tiers cache it (1 or 2)
        self._changed: dict[BlockHash, bool] = {}  # hash -> held now (it was not, or was)

    def enable(self, held: Iterable[BlockHash]) -> None:
        """Start (again) from `held`: every hash each tier caches now (once per tier)."""
        self.enabled = True
        self._tiers.clear()
        self._changed.clear()
        for block_hash in held:
            self._tiers[block_hash] = self._tiers.get(block_hash, 0) + 1

    def add(self, block_hash: BlockHash) -> None:
        if not self.enabled:
            return
        count = self._tiers.get(block_hash, 0)
        self._tiers[block_hash] = count + 1
        if count == 0:
            self._toggle(block_hash, True)

    def discard(self, block_hash: BlockHash) -> None:
        if not self.enabled:
            return
        count = self._tiers.pop(block_hash, 0)
        if count > 1:
            self._tiers[block_hash] = count - 1
        elif count == 1:
            self._toggle(block_hash, False)

    def take(self) -> KVEventBatch:
        changed, self._changed = self._changed, {}
        return KVEventBatch(
            stored=[h for h, held in changed.items() if held],
            removed=[h for h, held in changed.items() if not held],
        )

    def held(self) -> list[BlockHash]:
        return list(self._tiers)

    def _toggle(self, block_hash: BlockHash, held: bool) -> None:
        """`block_hash` turned held (or not): a change, or undoes the pending one."""
        if self._changed.pop(block_hash, None) is None:
            self._changed[block_hash] = held
