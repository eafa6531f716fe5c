"""The router's live view of a real Redis registry, over fake nodes registered by the real
NodeRegistrar: discovery, joins, clean leaves (in-flight requests finish), expiry, refusal,
forged records, and Redis going away and restarting (the router as a process:
test_router_registry_process.py)."""

from __future__ import annotations

import asyncio
import logging

from registry_fakes import (
    OUTPUT_IDS,
    addresses,
    cluster,
    forged_registrars,
    registrar,
    registry_config,
)
from router_fakes import FakeModel, FakeNode, run

from pdserve.config import RouterConfig
from pdserve.v1 import node_pb2
from router.client import GenerationClient
from router.server import RouterServer
from tests.waiting import wait_until


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
        for node in (prefill, decode):
            await node.start()
        registrars = [registrar(prefill, config), registrar(decode, config)]
        registrars += forged_registrars(config, prefill, node_pb2.NODE_ROLE_DECODE, 4)
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
