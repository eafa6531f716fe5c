"""Where the router learns its nodes: a static list (`--prefill/--decode`), or a registry that
nodes join and leave (`RedisNodeSource`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve.registry import NodeRecord
from pdserve.v1 import node_pb2


@dataclass(frozen=True)
class NodeAddress:
    address: str  # HOST:PORT of the node's gRPC server
    role: node_pb2.NodeRole  # the role the node is expected to report
    record: NodeRecord | None = None  # its registry record (identity, capacity, load)

    @property
    def role_name(self) -> str:
        return "prefill" if self.role == node_pb2.NODE_ROLE_PREFILL else "decode"

    @classmethod
    def from_record(cls, record: NodeRecord) -> NodeAddress:
        return cls(record.address, record.node_role, record)


OnNodes = Callable[[list[NodeAddress]], Awaitable[object]]  # its result is not used


class NodeSource(ABC):
    """Yields the nodes the router should connect to."""

    @abstractmethod
    async def list_nodes(self) -> list[NodeAddress]:
        """Every node known now."""

    async def watch(self, on_nodes: OnNodes) -> None:
        """Calls `on_nodes(every node known)` whenever the set or their load may have changed,
        until cancelled. A fixed source has nothing to report: it returns at once."""
        return

    async def close(self) -> None:
        """Releases what the source holds (connections)."""
        return


class StaticNodeSource(NodeSource):
    """The `--prefill ADDR` / `--decode ADDR` lists."""

    def __init__(self, prefill_addrs: tuple[str, ...], decode_addrs: tuple[str, ...]) -> None:
        self._nodes = [NodeAddress(a, node_pb2.NODE_ROLE_PREFILL) for a in prefill_addrs] + [
            NodeAddress(a, node_pb2.NODE_ROLE_DECODE) for a in decode_addrs
        ]

    async def list_nodes(self) -> list[NodeAddress]:
        return list(self._nodes)
