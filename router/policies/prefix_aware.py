"""PrefixAwarePolicy: prompts that share leading blocks go to the node that already prefilled
them (its prefix cache then hits), unless that node is much busier than the least loaded one.

```
block_hashes(prompt)     chained sha256 digests of the prompt's full blocks (digest i covers
                         blocks 0..i): pdserve.block_hash, the chain the nodes' engines use,
                         rooted in the request's namespace (its tenant's cache salt)
PrefixIndex.match        the node owning the longest run of them (an LRU-bounded copy of where
                         the router sent each prefix: the nodes' caches, approximately)
  none, or much busier   -> the least loaded node (LeastLoadedPolicy)
  else                   -> that node
PrefixIndex.insert       the prompt's hashes now belong to the chosen node
```

Disaggregated, affinity picks the prefill node and the decode node is least loaded; a local
prefill picks its decode node by affinity (over a separate index).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from pdserve.block_hash import BlockHash, block_hashes, root_hash
from router.input_processor import ProcessedRequest
from router.node_client import NodeClient
from router.policies.least_loaded import LeastLoadedPolicy

# The preferred node is "much busier" when its load exceeds the least loaded node's by more
# than PREFIX_BALANCE_ABS_TOKENS and by a factor of PREFIX_BALANCE_REL (SGLang's cache-aware
# router balances the same way, counting requests).
PREFIX_BALANCE_ABS_TOKENS = 4096
PREFIX_BALANCE_REL = 1.5
MAX_PREFIX_ENTRIES = 1 << 16  # block hashes remembered per pool


class PrefixIndex:
    """Which node each block hash was last sent to, for the most recent `max_entries` hashes."""

    def __init__(self, max_entries: int = MAX_PREFIX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._owners: OrderedDict[BlockHash, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def match(self, hashes: Sequence[BlockHash], addresses: Iterable[str]) -> str | None:
        """The node among `addresses` owning the longest run of leading `hashes`, or None."""
        candidates = set(addresses)
        best = None
        for block_hash in hashes:
            owner = self._owners.get(block_hash)
            if owner is None:
                break
            if owner in candidates:
                best = owner
        return best

    def insert(self, hashes: Sequence[BlockHash], address: str) -> None:
        """`address` now holds every block of `hashes`; the leading blocks are kept longest."""
        for block_hash in reversed(hashes):
            self._owners[block_hash] = address
            self._owners.move_to_end(block_hash)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)


class PrefixAwarePolicy(LeastLoadedPolicy):
    """Prefix affinity for the node that prefills, balanced against load."""

    def __init__(
        self,
        local_prefill_max_tokens: int = 0,
        prefill_saturation_tokens: int = 0,
        prefix_cache_salt: str | None = None,
    ):
        super().__init__(local_prefill_max_tokens, prefill_saturation_tokens)
        self._salt = prefix_cache_salt
        self.root_hash = root_hash(prefix_cache_salt)  # of requests without a cache salt
        self.prefill_index = PrefixIndex()
        self.decode_index = PrefixIndex()

    def pick_prefill(self, request: ProcessedRequest, nodes: Sequence[NodeClient]) -> NodeClient:
        least_loaded = super().pick_prefill
        return self._affine(
            request,
            nodes,
            self.prefill_index,
            lambda node: node.load.queued_prefill_tokens,
            lambda: least_loaded(request, nodes),
        )

    def pick_decode(
        self, request: ProcessedRequest, nodes: Sequence[NodeClient], prefills_locally: bool
    ) -> NodeClient:
        least_loaded = super().pick_decode
        if not prefills_locally:
            return least_loaded(request, nodes, prefills_locally)
        return self._affine(
            request,
            nodes,
            self.decode_index,
            lambda node: node.load.load_tokens,
            lambda: least_loaded(request, nodes, True),
        )

    def _affine(
        self,
        request: ProcessedRequest,
        nodes: Sequence[NodeClient],
        index: PrefixIndex,
        load_of: Callable[[NodeClient], int],
        pick_least: Callable[[], NodeClient],
    ) -> NodeClient:
        """The node holding the request's longest prefix unless it is much busier than the
        least loaded one (then, or with no such node, `pick_least()`); remembers the choice."""
        # The request's namespace (its tenant's): the root its nodes' prefix caches use.
        root = root_hash(self._salt, request.cache_salt) if request.cache_salt else self.root_hash
        hashes = block_hashes(request.prompt_token_ids, max(nodes[0].info.block_size, 1), root)
        by_address = {node.address: node for node in nodes}
        match = index.match(hashes, by_address)
        preferred = by_address.get(match) if match is not None else None
        least_load = min(load_of(node) for node in nodes)
        if preferred is not None and not _much_busier(load_of(preferred), least_load):
            chosen = preferred
        else:
            chosen = pick_least()  # a new prefix: the least loaded, ties in turn
        index.insert(hashes, chosen.address)
        return chosen


def _much_busier(load: int, least_load: int) -> bool:
    return load - least_load > PREFIX_BALANCE_ABS_TOKENS and load > PREFIX_BALANCE_REL * least_load
