"""RoutingPolicy: which prefill node (or none: prefill on the decode node) and which decode
node serve a request.

```
pick(request, prefill_nodes, decode_nodes)
  no prefill node ready                          -> Route(None, pick_decode(local)) "colocated"
  prompt_len <= local_prefill_max_tokens         -> Route(None, pick_decode(local)) "short_prompt"
  every prefill node saturated                   -> Route(None, pick_decode(local)) "prefill_saturated"
  otherwise                                      -> Route(pick_prefill, pick_decode)
```

Subclasses choose the nodes (`pick_prefill`, `pick_decode`); the decision to disaggregate at
all (conditional disaggregation) is shared. A policy may follow the ready nodes (`follow`),
prepare a request before its first pick (`prepare`) and end its background work (`close`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.input_processor import ProcessedRequest
from router.node_client import NodeClient

LOCAL_REASONS = ("colocated", "short_prompt", "prefill_saturated")


@dataclass(frozen=True)
class Route:
    prefill: NodeClient | None  # None: the decode node prefills locally
    decode: NodeClient
    local_reason: str = ""  # why prefill is None: one of LOCAL_REASONS


class RoutingPolicy(ABC):
    """Picks a route among the ready nodes. Called with at least one decode node."""

    def __init__(self, local_prefill_max_tokens: int = 0, prefill_saturation_tokens: int = 0):
        """`local_prefill_max_tokens`: prompts this short prefill on their decode node;
        `prefill_saturation_tokens`: a prefill node with this many queued prompt tokens is
        saturated. 0 turns either off."""
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.prefill_saturation_tokens = prefill_saturation_tokens
        self._turns: Counter[str] = Counter()  # picks so far, per pool (rotates ties)

    def pick(
        self,
        request: ProcessedRequest,
        prefill_nodes: Sequence[NodeClient],
        decode_nodes: Sequence[NodeClient],
    ) -> Route:
        if not decode_nodes:
            raise ValueError("a route needs at least one decode node")
        reason = self.local_prefill_reason(request, prefill_nodes)
        if reason:
            decode = self.pick_decode(request, decode_nodes, prefills_locally=True)
            return Route(prefill=None, decode=decode, local_reason=reason)
        prefill = self.pick_prefill(request, prefill_nodes)
        decode = self.pick_decode(request, decode_nodes, prefills_locally=False)
        return Route(prefill=prefill, decode=decode)

    def follow(self, nodes: Sequence[NodeClient]) -> None:
        """The ready nodes changed to `nodes` (every role): a policy that watches nodes
        follows them (the kv_events policy's streams). Nothing by default."""
        return None

    async def prepare(self, request: ProcessedRequest, block_size: int) -> None:
        """Before the request's first pick, off the pick's path: work a pick would do on the
        event loop (hashing a long prompt). Nothing by default."""
        return None

    async def close(self) -> None:
        """The router stops: end what the policy runs in the background."""
        return None

    def local_prefill_reason(
        self, request: ProcessedRequest, prefill_nodes: Sequence[NodeClient]
    ) -> str:
        """Why the decode node should prefill this request itself, or "" to disaggregate."""
        if not prefill_nodes:
            return "colocated"
        if request.prompt_len <= self.local_prefill_max_tokens:
            return "short_prompt"
        saturation = self.prefill_saturation_tokens
        if saturation and all(n.load.queued_prefill_tokens >= saturation for n in prefill_nodes):
            return "prefill_saturated"
        return ""

    @abstractmethod
    def pick_prefill(self, request: ProcessedRequest, nodes: Sequence[NodeClient]) -> NodeClient:
        """One of `nodes` (never empty) to prefill the request."""

    @abstractmethod
    def pick_decode(
        self, request: ProcessedRequest, nodes: Sequence[NodeClient], prefills_locally: bool
    ) -> NodeClient:
        """One of `nodes` (never empty) to decode the request (and prefill it, if
        `prefills_locally`)."""

    def next_in_turn(self, pool: str, nodes: Sequence[NodeClient]) -> NodeClient:
        """Each of `nodes` in turn (per pool: "prefill" or "decode")."""
        return self.rotated(pool, nodes)[0]

    def least(
        self, pool: str, nodes: Sequence[NodeClient], key: Callable[[NodeClient], Any]
    ) -> NodeClient:
        """The node of smallest `key`; ties go to each node in turn."""
        return min(self.rotated(pool, nodes), key=key)

    def rotated(self, pool: str, nodes: Sequence[NodeClient]) -> list[NodeClient]:
        """`nodes` starting one further along at each call for `pool`."""
        start = self._turns[pool] % len(nodes)
        self._turns[pool] += 1
        return [*nodes[start:], *nodes[:start]]
