"""RoundRobinPolicy: each node of each pool in turn."""

from __future__ import annotations

from collections.abc import Sequence

from router.input_processor import ProcessedRequest
from router.node_client import NodeClient
from router.policies.base import RoutingPolicy


class RoundRobinPolicy(RoutingPolicy):
    """Each node of each pool in turn."""

    def pick_prefill(self, request: ProcessedRequest, nodes: Sequence[NodeClient]) -> NodeClient:
        return self.next_in_turn("prefill", nodes)

    def pick_decode(
        self, request: ProcessedRequest, nodes: Sequence[NodeClient], prefills_locally: bool
    ) -> NodeClient:
        return self.next_in_turn("decode", nodes)
