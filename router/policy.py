"""RoutingPolicy: which prefill node (or none: prefill on the decode node) and which decode
node serve a request."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from router.node_client import NodeClient


@dataclass(frozen=True)
class Route:
    prefill: NodeClient | None  # None: the decode node prefills locally (colocated mode)
    decode: NodeClient


class RoutingPolicy(ABC):
    """Picks a route among the ready nodes. Called with at least one decode node."""

    @abstractmethod
    def pick(
        self,
        prompt_len: int,
        prefill_nodes: Sequence[NodeClient],
        decode_nodes: Sequence[NodeClient],
    ) -> Route: ...


class RoundRobinPolicy(RoutingPolicy):
    """Each pool in turn; disaggregated whenever a prefill node is ready."""

    def __init__(self) -> None:
        self._num_prefill_picks = 0
        self._num_decode_picks = 0

    def pick(
        self,
        prompt_len: int,
        prefill_nodes: Sequence[NodeClient],
        decode_nodes: Sequence[NodeClient],
    ) -> Route:
        if not decode_nodes:
            raise ValueError("a route needs at least one decode node")
        decode = decode_nodes[self._num_decode_picks % len(decode_nodes)]
        self._num_decode_picks += 1
        prefill = None
        if prefill_nodes:
            prefill = prefill_nodes[self._num_prefill_picks % len(prefill_nodes)]
            self._num_prefill_picks += 1
        return Route(prefill=prefill, decode=decode)


def make_policy(name: str) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; available: round_robin")
