"""`KVEventIndex`: exactly which block hashes each node holds, as the nodes report them
(`Node.WatchKVEvents`, fed by `KVEventWatchers`), and how many of a prompt's leading blocks
each holds.

```
reset(node) / forget(node)      the node holds nothing we know of (a snapshot follows, or the
                                stream is gone)
apply(node, stored, removed)    a batch of its events (or a part of a snapshot)
prefix_blocks(hashes, nodes)    per node: how many of `hashes` (a prompt's chain, leading
                                block first) it holds from the start: one dict lookup per block,
                                stopping once no candidate node holds the next
```

Bounded: a node reporting more than MAX_HASHES_PER_NODE hashes is forgotten (a watcher then
starts over with its snapshot; a node that truly holds more is treated as holding nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdserve.block_hash import BlockHash

MAX_HASHES_PER_NODE = 1 << 22  # 4M blocks: far more than a device and host tier hold
HASH_BYTES = 32  # a sha256 digest (pdserve.block_hash)


class IndexOverflow(Exception):
    """A node reported more hashes than the index keeps for one node."""


class KVEventIndex:
    def __init__(self, max_hashes_per_node: int = MAX_HASHES_PER_NODE) -> None:
        self.max_hashes_per_node = max_hashes_per_node
        self._held: dict[str, set[BlockHash]] = {}  # node address -> its hashes
        self._holders: dict[BlockHash, set[str]] = {}  # hash -> nodes holding it

    def num_held(self, node: str) -> int:
        return len(self._held.get(node, ()))

    def reset(self, node: str) -> None:
        """Forget what `node` held; it is watched again (a snapshot follows)."""
        self.forget(node)
        self._held[node] = set()

    def forget(self, node: str) -> None:
        for block_hash in self._held.pop(node, ()):
            holders = self._holders[block_hash]
            holders.discard(node)
            if not holders:
                del self._holders[block_hash]

    def apply(self, node: str, stored: Iterable[BlockHash], removed: Iterable[BlockHash]) -> None:
        """`node` now holds `stored` and no longer `removed`. IndexOverflow (the node is
        forgotten) past `max_hashes_per_node`; a hash that is not a digest is skipped."""
        held = self._held.setdefault(node, set())
        for block_hash in stored:
            if len(block_hash) != HASH_BYTES or block_hash in held:
                continue
            held.add(block_hash)
            self._holders.setdefault(block_hash, set()).add(node)
        for block_hash in removed:
            if block_hash in held:
                held.discard(block_hash)
                holders = self._holders[block_hash]
                holders.discard(node)
                if not holders:
                    del self._holders[block_hash]
        if len(held) > self.max_hashes_per_node:
            self.forget(node)
            raise IndexOverflow(f"{node} reported more than {self.max_hashes_per_node} blocks")

    def prefix_blocks(self, hashes: Sequence[BlockHash], nodes: Iterable[str]) -> dict[str, int]:
        """For each of `nodes`: how many leading blocks of `hashes` it holds (0: none)."""
        counts = dict.fromkeys(nodes, 0)
        alive = set(counts)
        for i, block_hash in enumerate(hashes):
            alive &= self._holders.get(block_hash, set())
            if not alive:
                break
            for node in alive:
                counts[node] = i + 1
        return counts
