"""Where the router learns its nodes' addresses: a static list now; a Redis registry (nodes
registering with a TTL heartbeat) can replace it by implementing `NodeSource`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pdserve.v1 import node_pb2


@dataclass(frozen=True)
class NodeAddress:
    address: str  # HOST:PORT of the node's gRPC server
    role: node_pb2.NodeRole.ValueType  # the role the node is expected to report

    @property
    def role_name(self) -> str:
        return "prefill" if self.role == node_pb2.NODE_ROLE_PREFILL else "decode"


class NodeSource(ABC):
    """Yields the nodes the router should connect to."""

    @abstractmethod
    async def list_nodes(self) -> list[NodeAddress]:
        """Every node known now."""


class StaticNodeSource(NodeSource):
    """The `--prefill ADDR` / `--decode ADDR` lists."""

    def __init__(self, prefill_addrs: tuple[str, ...], decode_addrs: tuple[str, ...]) -> None:
        self._nodes = [NodeAddress(a, node_pb2.NODE_ROLE_PREFILL) for a in prefill_addrs] + [
            NodeAddress(a, node_pb2.NODE_ROLE_DECODE) for a in decode_addrs
        ]

    async def list_nodes(self) -> list[NodeAddress]:
        return list(self._nodes)
