"""NodeRegistry: the ready nodes by role, all serving one model with one KV layout.

```
start(source) ── per node, concurrently ──> NodeClient.connect (retry until node_wait_s)
                                              └─ admit: role as expected, and model_name,
                                                 layout_hash, kv_transport, protocol_version
                                                 equal to the first admitted node's; the first
                                                 one's GetTokenizer becomes the router's
                                                 tokenizer. Otherwise refused (logged).
```
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from engine.tokenizer import Tokenizer
from pdserve.v1 import node_pb2
from router.config import RouterConfig
from router.node_client import NodeClient
from router.node_source import NodeAddress, NodeSource

logger = logging.getLogger(__name__)

# NodeInfo fields that every node behind one router must agree on (a prefill node's KV must
# fit the decode node's cache, and both must speak the same transfer protocol).
MATCHED_FIELDS = ("model_name", "layout_hash", "kv_transport", "protocol_version")


class NodeRegistry:
    """Connects to nodes, admits the compatible ones, and lists the ready ones by role."""

    def __init__(
        self, config: RouterConfig, on_change: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self._config = config
        self._on_change = on_change
        self._ready: dict[str, NodeClient] = {}  # by address, in admission order
        self._admit_lock = asyncio.Lock()
        self.model_info: node_pb2.NodeInfo | None = None  # the first admitted node's
        self.tokenizer: Tokenizer | None = None

    @property
    def prefill_nodes(self) -> list[NodeClient]:
        return [n for n in self._ready.values() if n.info.role == node_pb2.NODE_ROLE_PREFILL]

    @property
    def decode_nodes(self) -> list[NodeClient]:
        return [n for n in self._ready.values() if n.info.role == node_pb2.NODE_ROLE_DECODE]

    async def start(self, source: NodeSource) -> None:
        """Connects to every node of `source` concurrently; returns once each one is admitted,
        refused, or given up on at `node_wait_s`."""
        deadline_s = time.monotonic() + self._config.node_wait_s
        nodes = await source.list_nodes()
        await asyncio.gather(*(self.add_node(node, deadline_s) for node in nodes))
        logger.info(
            "%d prefill and %d decode nodes ready (of %d configured)",
            len(self.prefill_nodes),
            len(self.decode_nodes),
            len(nodes),
        )

    async def add_node(self, node: NodeAddress, deadline_s: float) -> bool:
        """Connects to `node` (retrying until `deadline_s`, monotonic) and admits it if it is
        compatible; returns whether it was admitted."""
        if node.address in self._ready:
            return True
        client = NodeClient(node.address)
        admitted = False
        try:
            await client.connect(deadline_s, self._config.node_rpc_timeout_s)
            async with self._admit_lock:
                admitted = await self._admit(node, client)
        except (TimeoutError, grpc.aio.AioRpcError, ValueError) as error:
            logger.error("%s node %s not added: %s", node.role_name, node.address, error)
        finally:
            if not admitted:
                await client.close()
        if admitted and self._on_change is not None:
            await self._on_change()
        return admitted

    async def close(self) -> None:
        clients, self._ready = list(self._ready.values()), {}
        await asyncio.gather(*(client.close() for client in clients))

    async def _admit(self, node: NodeAddress, client: NodeClient) -> bool:
        info = client.info
        refusal = self._refusal(node, info)
        if refusal is not None:
            logger.error("%s node %s refused: %s", node.role_name, node.address, refusal)
            return False
        if self.tokenizer is None:
            self.tokenizer = await client.fetch_tokenizer(self._config.node_rpc_timeout_s)
            self.model_info = info
        self._ready[node.address] = client
        logger.info(
            "%s node %s ready: model %s, layout %s, transport %s",
            node.role_name,
            node.address,
            info.model_name,
            info.layout_hash,
            info.kv_transport,
        )
        return True

    def _refusal(self, node: NodeAddress, info: node_pb2.NodeInfo) -> str | None:
        """Why `info` cannot join the admitted nodes, or None."""
        if info.role != node.role:
            return f"it reports role {node_pb2.NodeRole.Name(info.role)}, expected {node.role_name}"
        if self.model_info is None:
            return None
        for name in MATCHED_FIELDS:
            theirs, ours = getattr(info, name), getattr(self.model_info, name)
            if theirs != ours:
                return f"{name} {theirs!r} differs from the other nodes' {ours!r}"
        return None
