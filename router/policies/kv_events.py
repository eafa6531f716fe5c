"""KVEventsPolicy (`--policy kv_events`): each request to the prefill node and the decode node
that hold the longest run of its prompt's leading blocks, as the nodes report what their
prefix caches hold (`KVEventIndex`, fed by `KVEventWatchers`: exact, not a guess from what the
router sent where), weighed against their load.

```
prepare(request)   the prompt's block hashes, once per request (pdserve.block_hash: the
                   nodes' chain, salted as theirs and rooted in the request's namespace, its
                   tenant's cache salt); off the event loop for a long prompt
prefill node       least  (prompt tokens it lacks) + queued prefill tokens
decode node        among nodes whose free blocks hold what it lacks (all, if none does):
                   least  (prompt tokens it lacks) + load tokens
                   (what it holds is neither received nor prefilled again: the suffix-only
                   hand-off, or a local prefill's prefix hit)
```

A node not watched yet, or whose stream broke, counts as holding nothing until its next
snapshot. Ties go to each node in turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pdserve.block_hash import BlockHash, root_hash
from router.input_processor import ProcessedRequest
from router.node_client import NodeClient
from router.policies.kv_event_index import KVEventIndex
from router.policies.kv_event_watchers import KVEventWatchers
from router.policies.least_loaded import LeastLoadedPolicy

OFF_LOOP_TOKENS = 8192  # prompts at least this long are hashed on a worker thread (~0.5 ms)


class KVEventsPolicy(LeastLoadedPolicy):
    def __init__(
        self,
        local_prefill_max_tokens: int = 0,
        prefill_saturation_tokens: int = 0,
        prefix_cache_salt: str | None = None,
    ) -> None:
        super().__init__(local_prefill_max_tokens, prefill_saturation_tokens)
        self._salt = prefix_cache_salt
        self.root_hash = root_hash(prefix_cache_salt)  # of requests without a cache salt
        self.index = KVEventIndex()
        self.watchers = KVEventWatchers(self.index)

    def follow(self, nodes: Sequence[NodeClient]) -> None:
        self.watchers.follow(nodes)

    async def close(self) -> None:
        await self.watchers.close()

    async def prepare(self, request: ProcessedRequest, block_size: int) -> None:
        if request.prompt_len >= OFF_LOOP_TOKENS:
            await asyncio.to_thread(request.block_hashes, block_size, self.root_for(request))

    def pick_prefill(self, request: ProcessedRequest, nodes: Sequence[NodeClient]) -> NodeClient:
        held = self.held_tokens(request, nodes)
        return self.least(
            "prefill",
            nodes,
            key=lambda node: request.prompt_len - held[node.address]
            + node.load.queued_prefill_tokens,
        )  # fmt: skip

    def pick_decode(
        self, request: ProcessedRequest, nodes: Sequence[NodeClient], prefills_locally: bool
    ) -> NodeClient:
        held = self.held_tokens(request, nodes)

        def key(node: NodeClient) -> tuple[bool, int]:
            lacking = request.prompt_len - held[node.address]
            num_blocks = -(-(lacking + 1) // max(node.info.block_size, 1))
            return not node.load.fits(num_blocks), lacking + node.load.load_tokens

        return self.least("decode", nodes, key=key)

    def root_for(self, request: ProcessedRequest) -> BlockHash:
        """The request's namespace (its tenant's): the root its nodes' prefix caches use."""
        if not request.cache_salt:
            return self.root_hash
        return root_hash(self._salt, request.cache_salt)

    def held_tokens(self, request: ProcessedRequest, nodes: Sequence[NodeClient]) -> dict[str, int]:
        """Per node: the prompt's leading tokens its prefix cache holds (full blocks; never
        the last token, which it must compute)."""
        block_size = max(nodes[0].info.block_size, 1)
        hashes: list[BlockHash] = request.block_hashes(block_size, self.root_for(request))
        usable = hashes[: (request.prompt_len - 1) // block_size]
        counts = self.index.prefix_blocks(usable, [node.address for node in nodes])
        return {address: count * block_size for address, count in counts.items()}
