"""LeastLoadedPolicy: the node with the least outstanding work, from load reports and the
router's own in-flight accounting (`NodeLoad`).

```
prefill:  fewest queued prefill tokens
decode:   among nodes whose free KV blocks hold the prompt (all of them if none does):
          fewest load tokens, then most free KV blocks; ties in turn
```
"""

from __future__ import annotations

from collections.abc import Sequence

from router.input_processor import ProcessedRequest
from router.node_client import NodeClient
from router.policies.base import RoutingPolicy


class LeastLoadedPolicy(RoutingPolicy):
    """Each request to the least busy node of each pool."""

    def pick_prefill(self, request: ProcessedRequest, nodes: Sequence[NodeClient]) -> NodeClient:
        return self.least("prefill", nodes, key=lambda node: node.load.queued_prefill_tokens)

    def pick_decode(
        self, request: ProcessedRequest, nodes: Sequence[NodeClient], prefills_locally: bool
    ) -> NodeClient:
        def key(node: NodeClient) -> tuple[bool, int, int]:
            load = node.load
            num_blocks = -(-(request.prompt_len + 1) // max(node.info.block_size, 1))
            return (not load.fits(num_blocks), load.load_tokens, -(load.num_free_kv_blocks or 0))

        return self.least("decode", nodes, key=key)
