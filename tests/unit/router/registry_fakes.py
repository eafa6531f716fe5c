"""What the registry tests of the router share: fake nodes published by the real
NodeRegistrar, a router following the registry, and forged records."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from router_fakes import FakeModel, FakeNode

from node_common.node_registrar import NodeRegistrar
from pdserve.config import RegistryConfig, RouterConfig
from pdserve.registry import NodeRecord, node_record
from pdserve.v1 import node_pb2
from router.client import GenerationClient
from router.server import RouterServer
from tests.redis_server import RedisServer

OUTPUT_IDS = [5, 6, 7, 8, 9, 10]
WAIT_S = 5.0


def registry_config(server: RedisServer, heartbeat_s: float = 0.2) -> RegistryConfig:
    return RegistryConfig(server.url, heartbeat_s, ttl_s=3 * heartbeat_s, timeout_s=0.3)


def registrar(node: FakeNode, config: RegistryConfig, node_id: str = "") -> NodeRegistrar:
    """The real NodeRegistrar, publishing the fake node's NodeInfo."""
    node_id = node_id or f"node-{node.address.rsplit(':', 1)[1]}"

    async def make_record():
        stats = node_pb2.NodeStats(num_kv_blocks=64, num_free_kv_blocks=64)
        return node_record(node_id, node.address, "local://x", node.info, stats, config)

    return NodeRegistrar(config, node_id, make_record)


@contextlib.asynccontextmanager
async def cluster(files, config: RegistryConfig, roles: list[int]) -> AsyncIterator[tuple]:
    """Fake nodes of `roles`, each registered; a router following the registry; a client."""
    model = FakeModel(OUTPUT_IDS)
    nodes = [FakeNode(role, model, files) for role in roles]
    registrars = []
    for node in nodes:
        await node.start()
        registrars.append(registrar(node, config))
        await registrars[-1].start()
    router = RouterServer(
        RouterConfig(port=0, http_port=0, registry=config, node_wait_s=2.0, grace_s=0.0)
    )
    await router.start()
    client = GenerationClient(router.address)
    try:
        yield router, client, nodes, registrars
    finally:
        await client.close()
        await router.stop()
        for reg in registrars:
            await reg.stop()
        for node in nodes:
            await node.stop()


def addresses(nodes) -> set[str]:
    return {n.address for n in nodes}


def forged_registrars(
    config: RegistryConfig, node: FakeNode, role: int, count: int
) -> list[NodeRegistrar]:
    """`count` registrars of records at `node`'s address that claim `role` (its NodeInfo
    otherwise), under ids forged-0.. (some list before the genuine record, some after)."""
    forged_info = node_pb2.NodeInfo()
    forged_info.CopyFrom(node.info)
    forged_info.role = role
    stats = node_pb2.NodeStats(num_kv_blocks=64, num_free_kv_blocks=64)
    registrars = []
    for i in range(count):
        record = node_record(f"forged-{i}", node.address, "local://x", forged_info, stats, config)

        async def make_record(record: NodeRecord = record) -> NodeRecord:
            return record

        registrars.append(NodeRegistrar(config, f"forged-{i}", make_record))
    return registrars
