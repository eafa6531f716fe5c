"""NodeRegistry: the ready nodes by role, all serving one model with one KV layout.

```
start(static source) ── per node, concurrently ──> add_node: NodeClient.connect (retry until
                         node_wait_s) └─ admit: role as expected, and model_name, layout_hash,
                         kv_transport, protocol_version equal to the first admitted node's; the
                         first one's GetTokenizer becomes the router's tokenizer (None: the
                         model has none). Otherwise refused (logged).
sync(registered nodes)   (RedisNodeSource, at every resync)
  one record per address: several may name one (a restarted node's old record, a forged
                     one): the admitted node's role first, then one not refused
  new address        record disagrees with the served model? refused, logged once per node id;
                     else add_node in the background
  known address      its NodeLoad takes the record's load report
  address gone       out of the routing view now; its channel closes once idle
mark_unreachable     the node is skipped for UNREACHABLE_COOLDOWN_S (unless every node is)
```
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from pdserve.config import RouterConfig
from pdserve.security import ClusterAuth
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import node_pb2
from router.node_client import NodeClient
from router.node_source import NodeAddress, NodeSource

logger = logging.getLogger(__name__)

# NodeInfo fields that every node behind one router must agree on (a prefill node's KV must
# fit the decode node's cache, and both must speak the same transfer protocol).
MATCHED_FIELDS = ("model_name", "layout_hash", "kv_transport", "protocol_version")
UNREACHABLE_COOLDOWN_S = 3.0  # a node found unreachable is skipped this long
_IDLE_POLL_S = 0.1  # how often a node that left is checked for requests still in flight


class NodeRegistry:
    """Connects to nodes, admits the compatible ones, and lists the ready ones by role."""

    def __init__(
        self,
        config: RouterConfig,
        on_change: Callable[[], Awaitable[None]] | None = None,
        auth: ClusterAuth | None = None,
    ) -> None:
        """`auth`: the cluster secret the router proves on every node call (None: open)."""
        self._config = config
        self._auth = auth
        self._on_change = on_change
        self._ready: dict[str, NodeClient] = {}  # by address, in admission order
        self._admit_lock = asyncio.Lock()
        self._registered: dict[str, NodeAddress] = {}  # the last sync's nodes, by address
        self._joining: dict[str, asyncio.Task[None]] = {}  # by address
        self._refused: dict[str, set[str]] = {}  # address -> node ids refused (logged once)
        self._leaving: set[asyncio.Task[None]] = set()
        self.model_info: node_pb2.NodeInfo | None = None  # the first admitted node's
        self.tokenizer: Tokenizer | None = None  # None with a model info: token ids only

    @property
    def prefill_nodes(self) -> list[NodeClient]:
        return self._routable(node_pb2.NODE_ROLE_PREFILL)

    @property
    def decode_nodes(self) -> list[NodeClient]:
        return self._routable(node_pb2.NODE_ROLE_DECODE)

    @property
    def ready_addresses(self) -> list[str]:
        return list(self._ready)

    @property
    def ready_nodes(self) -> list[NodeClient]:
        """Every admitted node, both roles (unreachable ones too)."""
        return list(self._ready.values())

    def serving(self) -> bool:
        """At least one admitted decode node whose connection looks alive (`NodeClient.up`):
        what the router's health reports. A static node list never shrinks, so without this
        a router whose every decode node died would go on reporting healthy."""
        decode = [n for n in self._ready.values() if n.info.role == node_pb2.NODE_ROLE_DECODE]
        return any([node.up() for node in decode])  # every channel asked: each one reconnects

    def mark_unreachable(self, node: NodeClient) -> None:
        """`node` did not answer: policies skip it for UNREACHABLE_COOLDOWN_S."""
        node.unreachable_until_s = time.monotonic() + UNREACHABLE_COOLDOWN_S

    async def start(self, source: NodeSource) -> None:
        """Connects to every node of `source` concurrently; returns once each one is admitted,
        refused, or given up on at `node_wait_s`."""
        deadline_s = time.monotonic() + self._config.node_wait_s
        nodes = await source.list_nodes()
        await asyncio.gather(*(self.add_node(node, deadline_s) for node in nodes))
        logger.info(
            "%d prefill and %d decode nodes ready (of %d listed)",
            len(self.prefill_nodes),
            len(self.decode_nodes),
            len(nodes),
        )

    async def watch(self, source: NodeSource) -> None:
        """Follows a dynamic source (`sync` at each of its updates) until cancelled."""
        await source.watch(self.sync)

    async def sync(self, nodes: list[NodeAddress]) -> list[asyncio.Task[None]]:
        """Makes the registered nodes `nodes`: joins new ones (in the background; the tasks are
        returned), updates the load of known ones, removes those gone."""
        ids: dict[str, set[str]] = {}
        for node in nodes:
            ids.setdefault(node.address, set()).add(_node_id(node))
        self._refused = {a: r & ids[a] for a, r in self._refused.items() if r & ids.get(a, set())}
        self._registered = self._pick(nodes)
        for address in [a for a, c in self._ready.items() if _registered(c)]:
            if address not in self._registered:
                await self._remove(address, "left the registry")
        for node in self._registered.values():
            client = self._ready.get(node.address)
            if client is not None:
                if node.record is not None and node.role == client.info.role:
                    client.load.update(node.record)
                    if _registered(client):  # a static node stays static (never removed)
                        client.record = node.record
            elif node.address not in self._joining and not self._is_refused(node):
                self._join(node)
        return list(self._joining.values())

    def _pick(self, nodes: list[NodeAddress]) -> dict[str, NodeAddress]:
        """One record per address. Several records may name one address (a restarted node's
        old record not yet expired, or a forged one): the admitted node's role first, then
        any not refused, so a record refused at an address never hides a genuine one."""

        def rank(node: NodeAddress) -> tuple[bool, bool]:
            client = self._ready.get(node.address)
            return (client is not None and client.info.role != node.role, self._is_refused(node))

        picked: dict[str, NodeAddress] = {}
        for node in nodes:
            current = picked.get(node.address)
            if current is None or rank(node) < rank(current):
                picked[node.address] = node
        return picked

    def _is_refused(self, node: NodeAddress) -> bool:
        return _node_id(node) in self._refused.get(node.address, set())

    async def add_node(self, node: NodeAddress, deadline_s: float) -> bool:
        """Connects to `node` (retrying until `deadline_s`, monotonic) and admits it if it is
        compatible; returns whether it was admitted."""
        if node.address in self._ready:
            return True
        client = NodeClient(node.address, self._config.security, self._auth)
        client.record = node.record
        if node.record is not None:
            client.load.update(node.record)
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
        for task in [*self._joining.values(), *self._leaving]:
            task.cancel()
        await asyncio.gather(*self._joining.values(), *self._leaving, return_exceptions=True)
        clients, self._ready = list(self._ready.values()), {}
        await asyncio.gather(*(client.close() for client in clients))

    def _routable(self, role: node_pb2.NodeRole) -> list[NodeClient]:
        """The ready nodes of `role`, less those in their unreachable cool-down (all of them
        when every one is: better to try than to refuse)."""
        nodes = [n for n in self._ready.values() if n.info.role == role]
        now = time.monotonic()
        reachable = [n for n in nodes if n.unreachable_until_s <= now]
        return reachable or nodes

    def _join(self, node: NodeAddress) -> None:
        refusal = self._record_refusal(node)
        if refusal is not None:
            self._refused.setdefault(node.address, set()).add(_node_id(node))
            logger.error("%s node %s refused: %s", node.role_name, node.address, refusal)
            return
        deadline_s = time.monotonic() + self._config.node_wait_s
        task = asyncio.create_task(self._add_registered(node, deadline_s))
        self._joining[node.address] = task

    async def _add_registered(self, node: NodeAddress, deadline_s: float) -> None:
        try:
            admitted = await self.add_node(node, deadline_s)
        finally:
            self._joining.pop(node.address, None)
        if not admitted:
            self._refused.setdefault(node.address, set()).add(_node_id(node))
        elif node.address not in self._registered:  # it left while we connected
            await self._remove(node.address, "left the registry while joining")

    async def _remove(self, address: str, why: str) -> None:
        client = self._ready.pop(address)
        logger.info("%s node %s %s: no new requests go there", _role_name(client), address, why)
        task = asyncio.create_task(self._close_when_idle(client))
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)
        if self._on_change is not None:
            await self._on_change()

    async def _close_when_idle(self, client: NodeClient) -> None:
        """Closing the channel would cancel the requests still running there (a draining node
        finishes them): wait for the router's last one to end."""
        with contextlib.suppress(asyncio.CancelledError):
            while not client.load.idle:
                await asyncio.sleep(_IDLE_POLL_S)
        await client.close()

    def _record_refusal(self, node: NodeAddress) -> str | None:
        """Why a registered node's record shows it cannot join, before connecting to it."""
        if node.record is None or self.model_info is None:
            return None
        for name in MATCHED_FIELDS:
            theirs, ours = getattr(node.record, name), getattr(self.model_info, name)
            if theirs != ours:
                return f"its record's {name} {theirs!r} differs from the served {ours!r}"
        return None

    async def _admit(self, node: NodeAddress, client: NodeClient) -> bool:
        info = client.info
        refusal = self._refusal(node, info)
        if refusal is not None:
            logger.error("%s node %s refused: %s", node.role_name, node.address, refusal)
            return False
        if self.model_info is None:
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


def _registered(client: NodeClient) -> bool:
    return client.record is not None


def _node_id(node: NodeAddress) -> str:
    return node.record.node_id if node.record is not None else ""


def _role_name(client: NodeClient) -> str:
    return "prefill" if client.info.role == node_pb2.NODE_ROLE_PREFILL else "decode"
