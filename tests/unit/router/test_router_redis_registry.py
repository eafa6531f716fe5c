"""The router's live view of a real Redis registry, over fake nodes registered by the real
NodeRegistrar: discovery, joins, clean leaves (in-flight requests finish), expiry, refusal,
and Redis going away and restarting."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
from router_fakes import FakeModel, FakeNode, run

from node_common.node_registrar import NodeRegistrar
from pdserve.config import RegistryConfig, RouterConfig
from pdserve.registry import node_record
from pdserve.v1 import node_pb2
from router.client import GenerationClient
from router.server import RouterServer
from tests.redis_server import RedisServer
from tests.waiting import wait_until

OUTPUT_IDS = [5, 6, 7, 8, 9, 10]
WAIT_S = 5.0


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


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


def test_registered_nodes_are_discovered_and_a_late_one_joins(tokenizer_files, redis_server):
    config = registry_config(redis_server)
    roles = [node_pb2.NODE_ROLE_PREFILL, node_pb2.NODE_ROLE_DECODE]

    async def body():
        async with cluster(tokenizer_files, config, roles) as (router, client, nodes, _):
            ready = (
                addresses(router.registry.prefill_nodes),
                addresses(router.registry.decode_nodes),
            )
            result = await client.generate_all(prompt_token_ids=[3, 4], max_tokens=4, timeout_s=5)
            late = FakeNode(node_pb2.NODE_ROLE_DECODE, nodes[0].model, tokenizer_files)
            await late.start()
            late_registrar = registrar(late, config)
            await late_registrar.start()
            await wait_until(lambda: late.address in addresses(router.registry.decode_nodes))
            await late_registrar.stop()
            await late.stop()
            return ready, result, nodes

    (prefill, decode), result, nodes = run(body())
    assert prefill == {nodes[0].address} and decode == {nodes[1].address}
    assert result.token_ids == OUTPUT_IDS[:4]
    assert len(nodes[0].requests) == 1 and len(nodes[1].requests) == 1  # disaggregated


def test_a_node_that_deregisters_leaves_at_once_and_its_request_finishes(
    tokenizer_files, redis_server
):
    config = registry_config(redis_server, heartbeat_s=5.0)  # no periodic resync in the test
    roles = [node_pb2.NODE_ROLE_DECODE, node_pb2.NODE_ROLE_DECODE]

    async def body():
        async with cluster(tokenizer_files, config, roles) as (router, client, nodes, registrars):
            for node in nodes:
                node.hold_at = 2  # streams stop after 2 tokens until the gate opens
                node.gate.clear()
            held = asyncio.create_task(
                client.generate_all(prompt_token_ids=[3], max_tokens=6, timeout_s=5)
            )
            await wait_until(lambda: any(n.requests for n in nodes))
            leaving = 0 if nodes[0].requests else 1
            staying = nodes[1 - leaving]
            await registrars[leaving].stop()  # DEL + "leave": dropped long before a resync
            await wait_until(
                lambda: addresses(router.registry.decode_nodes) == {staying.address}, 1.0
            )
            for node in nodes:
                node.gate.set()  # the draining node finishes what it holds
            result = await held
            after = [
                await client.generate_all(prompt_token_ids=[3], max_tokens=2, timeout_s=5)
                for _ in range(3)
            ]
            return result, after, len(nodes[leaving].requests), len(staying.requests)

    result, after, num_leaving, num_staying = run(body())
    assert result.token_ids == OUTPUT_IDS and result.finish_reason == "length"
    assert all(r.token_ids == OUTPUT_IDS[:2] for r in after)
    assert (num_leaving, num_staying) == (1, 3)


def test_a_record_that_expires_drops_its_node(tokenizer_files, redis_server):
    config = registry_config(redis_server)
    roles = [node_pb2.NODE_ROLE_DECODE, node_pb2.NODE_ROLE_DECODE]

    async def body():
        async with cluster(tokenizer_files, config, roles) as (router, _, nodes, registrars):
            registrars[0]._task.cancel()  # heartbeats stop, as after kill -9: no DEL, no event
            loop = asyncio.get_running_loop()
            started = loop.time()
            await wait_until(lambda: len(router.registry.decode_nodes) == 1)
            return loop.time() - started, addresses(router.registry.decode_nodes), nodes

    elapsed_s, left, nodes = run(body())
    assert left == {nodes[1].address}
    assert elapsed_s <= config.ttl_s + 2 * config.heartbeat_s + 1.0


def test_a_node_of_another_model_is_refused_and_logged_once(tokenizer_files, redis_server, caplog):
    config = registry_config(redis_server)

    async def body():
        roles = [node_pb2.NODE_ROLE_DECODE]
        async with cluster(tokenizer_files, config, roles) as (router, _, nodes, _):
            odd = FakeNode(
                node_pb2.NODE_ROLE_DECODE, nodes[0].model, tokenizer_files, model_name="other"
            )
            await odd.start()
            odd_registrar = registrar(odd, config)
            await odd_registrar.start()
            await asyncio.sleep(6 * config.heartbeat_s)  # several resyncs
            ready = addresses(router.registry.decode_nodes)
            await odd_registrar.stop()
            await odd.stop()
            return ready, nodes, odd.requests

    with caplog.at_level(logging.INFO):
        ready, nodes, odd_calls = run(body())
    assert ready == {nodes[0].address} and odd_calls == []
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1
    assert "model_name 'other' differs from the served 'fake-model'" in refusals[0].getMessage()


def test_redis_away_keeps_the_view_and_a_restart_recovers_it(tokenizer_files, redis_server, caplog):
    config = registry_config(redis_server, heartbeat_s=0.3)
    roles = [node_pb2.NODE_ROLE_DECODE, node_pb2.NODE_ROLE_DECODE]

    async def body():
        async with cluster(tokenizer_files, config, roles) as (router, client, nodes, registrars):
            registrars[1]._task.cancel()  # node 1 will not re-register after the restart
            views = []

            async def watch_view():
                while True:
                    views.append(addresses(router.registry.decode_nodes))
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch_view())
            redis_server.kill()
            await asyncio.sleep(1.0)
            during = await client.generate_all(prompt_token_ids=[3], max_tokens=3, timeout_s=5)
            await asyncio.to_thread(redis_server.start)
            await wait_until(lambda: len(router.registry.decode_nodes) == 1)
            await asyncio.sleep(0.5)
            watcher.cancel()
            return views, during, nodes

    with caplog.at_level(logging.INFO, logger="router.redis_node_source"):
        views, during, nodes = run(body())
    assert during.token_ids == OUTPUT_IDS[:3]
    assert all(nodes[0].address in view for view in views)  # never dropped
    assert views[-1] == {nodes[0].address}  # the one that did not re-register is gone
    messages = [r.getMessage() for r in caplog.records if r.name == "router.redis_node_source"]
    assert sum("unreachable" in m for m in messages) == 1, messages
    assert sum("reachable again" in m for m in messages) == 1, messages


def test_pd_router_with_a_registry_needs_no_node_addresses(tokenizer_files, redis_server):
    config = registry_config(redis_server)

    async def body():
        node = FakeNode(node_pb2.NODE_ROLE_DECODE, FakeModel(OUTPUT_IDS), tokenizer_files)
        await node.start()
        node_registrar = registrar(node, config)
        await node_registrar.start()
        router = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.cli", "--port", "0", "--http-port", "0", "--registry", redis_server.url,
            "--registry-heartbeat-s", "0.2", "--registry-ttl-s", "0.6", "--policy",
            "least_loaded", "--log-level", "warning",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            line = (await asyncio.wait_for(router.stdout.readline(), WAIT_S)).decode()
            async with GenerationClient(line.rsplit(" ", 1)[-1].strip()) as client:
                result = await client.generate_all(prompt_token_ids=[3], max_tokens=3, timeout_s=5)
        finally:
            router.send_signal(signal.SIGTERM)
            returncode = await asyncio.wait_for(router.wait(), WAIT_S)
            await node_registrar.stop()
            await node.stop()
        return line, result, returncode

    line, result, returncode = run(body(), timeout_s=30)
    assert line.startswith("pd-router listening on 127.0.0.1:")
    assert result.token_ids == OUTPUT_IDS[:3] and returncode == 0


def test_pd_router_refuses_bad_registry_flags() -> None:
    def fails(*argv: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "router.cli", *argv], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 2
        return done.stderr

    assert "or a --registry URL where nodes register" in fails()
    assert "registry URL must look like redis://HOST:PORT/DB" in fails("--registry", "localhost")
    assert "must exceed heartbeat_s" in fails(
        "--registry", "redis://h:1/0", "--registry-ttl-s", "0.5"
    )


def test_a_router_started_before_redis_finds_the_nodes_once_it_is_up(tokenizer_files, tmp_path):
    server = RedisServer(tmp_path / "late-redis")  # not started yet
    config = registry_config(server)

    async def body():
        router = RouterServer(
            RouterConfig(port=0, http_port=0, registry=config, node_wait_s=2.0, grace_s=0)
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        await router.start()  # Redis away: logged, not raised
        start_s = loop.time() - started
        empty = router.registry.decode_nodes
        await asyncio.to_thread(server.start)
        node = FakeNode(node_pb2.NODE_ROLE_DECODE, FakeModel(OUTPUT_IDS), tokenizer_files)
        await node.start()
        node_registrar = registrar(node, config)
        await node_registrar.start()
        try:
            await wait_until(lambda: addresses(router.registry.decode_nodes) == {node.address})
        finally:
            await router.stop()
            await node_registrar.stop()
            await node.stop()
            server.kill()
        return start_s, empty

    start_s, empty = run(body())
    assert empty == [] and start_s < 2.0


def test_the_router_stops_promptly_while_following_the_registry(redis_server):
    config = RegistryConfig(redis_server.url, heartbeat_s=0.01, ttl_s=0.05, timeout_s=0.3)

    async def body():
        stop_times_s = []
        for i in range(10):  # a stop landing in the middle of a Redis call must still stop
            router = RouterServer(
                RouterConfig(port=0, http_port=0, registry=config, node_wait_s=1, grace_s=0)
            )
            await router.start()
            await asyncio.sleep(0.013 * i)
            loop = asyncio.get_running_loop()
            started = loop.time()
            await router.stop()
            stop_times_s.append(loop.time() - started)
        return stop_times_s

    assert max(run(body(), timeout_s=30)) < 1.0


def test_records_naming_a_registered_node_with_another_role_do_not_hide_it(
    tokenizer_files, redis_server
):
    """Forged (or stale) records at the prefill node's address claiming a decode node, in the
    registry before the router starts: whatever order the registry lists them in, they are
    refused and the genuine prefill node still joins (the view is one record per address, and
    a refusal is per record, not per address)."""
    config = registry_config(redis_server)

    async def body():
        model = FakeModel(OUTPUT_IDS)
        prefill, decode = (FakeNode(role, model, tokenizer_files)
                           for role in (node_pb2.NODE_ROLE_PREFILL, node_pb2.NODE_ROLE_DECODE))  # fmt: skip
        registrars = []
        for node in (prefill, decode):
            await node.start()
            registrars.append(registrar(node, config))
        forged_info = node_pb2.NodeInfo()
        forged_info.CopyFrom(prefill.info)
        forged_info.role = node_pb2.NODE_ROLE_DECODE
        stats = node_pb2.NodeStats(num_kv_blocks=64, num_free_kv_blocks=64)
        for i in range(4):  # several ids: some list before the genuine record, some after
            record = node_record(f"forged-{i}", prefill.address, "local://x", forged_info,
                                 stats, config)  # fmt: skip

            async def make_record(record=record):
                return record

            registrars.append(NodeRegistrar(config, f"forged-{i}", make_record))
        for reg in registrars:
            await reg.start()
        router = RouterServer(
            RouterConfig(port=0, http_port=0, registry=config, node_wait_s=2.0, grace_s=0.0)
        )
        await router.start()
        client = GenerationClient(router.address)
        try:
            await asyncio.sleep(6 * config.heartbeat_s)  # several resyncs
            await wait_until(lambda: addresses(router.registry.prefill_nodes) == {prefill.address})
            views = (addresses(router.registry.prefill_nodes),
                     addresses(router.registry.decode_nodes))  # fmt: skip
            return views, await client.generate_all("hello", max_tokens=3)
        finally:
            await client.close()
            await router.stop()
            for reg in registrars:
                await reg.stop()
            for node in (prefill, decode):
                await node.stop()

    (prefill_view, decode_view), result = run(body())
    assert len(prefill_view) == 1 and len(decode_view) == 1
    assert result.token_ids == OUTPUT_IDS[:3]
