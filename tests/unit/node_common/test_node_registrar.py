"""NodeRegistrar against a real redis-server: register with a TTL, heartbeat, deregister,
survive Redis going away and coming back."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from node_common.node_registrar import NodeRegistrar
from pdserve.config import RegistryConfig
from pdserve.registry import EVENTS_CHANNEL, NodeLoadReport, NodeRecord, node_key
from tests.redis_server import RedisServer
from tests.unit.pdserve.test_registry import record

TIMEOUT_S = 20.0


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


def _config(server: RedisServer) -> RegistryConfig:
    return RegistryConfig(server.url, heartbeat_s=0.2, ttl_s=1.0, timeout_s=0.3)


async def _events(server: RedisServer, ready: asyncio.Event, out: list[dict]) -> None:
    from pdserve.registry import registry_client

    client = registry_client(_config(server))
    pubsub = client.pubsub()
    await pubsub.subscribe(EVENTS_CHANNEL)
    ready.set()
    try:
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if message is not None:
                out.append(json.loads(message["data"]))
    finally:
        await pubsub.aclose()
        await client.aclose()


def test_registrar_registers_with_a_ttl_heartbeats_and_deregisters(redis_server) -> None:
    made: list[int] = []

    async def make_record() -> NodeRecord:
        made.append(1)
        return record(load=NodeLoadReport(num_running_requests=len(made)))

    async def body():
        events: list[dict] = []
        ready = asyncio.Event()
        listener = asyncio.create_task(_events(redis_server, ready, events))
        await ready.wait()
        registrar = NodeRegistrar(_config(redis_server), "n1", make_record)
        await registrar.start()
        with redis_server.client() as client:
            first_ttl_ms = client.pttl(node_key("n1"))
            await asyncio.sleep(1.2)  # past one TTL: only heartbeats keep it alive
            alive = NodeRecord.from_json(client.get(node_key("n1")))
            await registrar.stop()
            gone = client.exists(node_key("n1"))
        await asyncio.sleep(0.2)
        listener.cancel()
        return first_ttl_ms, alive, gone, registrar.num_heartbeats, events

    first_ttl_ms, alive, gone, num_heartbeats, events = asyncio.run(
        asyncio.wait_for(body(), TIMEOUT_S)
    )
    assert 0 < first_ttl_ms <= 1000
    assert alive.load.num_running_requests >= 3 and num_heartbeats >= 3
    assert gone == 0
    assert events == [{"event": "join", "node_id": "n1"}, {"event": "leave", "node_id": "n1"}]


def test_registrar_rides_out_redis_going_away_and_registers_again(redis_server, caplog) -> None:
    async def make_record() -> NodeRecord:
        return record()

    async def body():
        registrar = NodeRegistrar(_config(redis_server), "n1", make_record)
        await registrar.start()
        redis_server.kill()
        await asyncio.sleep(1.0)  # 5 heartbeats fail; each is bounded by the timeout
        down = registrar.registered
        await asyncio.to_thread(redis_server.start)  # the same port, empty
        await asyncio.sleep(0.5)
        with redis_server.client() as client:
            back = client.exists(node_key("n1"))
        await registrar.stop()
        return down, back, registrar.registered

    with caplog.at_level(logging.INFO, logger="node_common.node_registrar"):
        down, back, after_stop = asyncio.run(asyncio.wait_for(body(), TIMEOUT_S))
    assert (down, back, after_stop) == (False, 1, False)
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 1, [r.getMessage() for r in unreachable]  # logged once
    assert any("registered decode node n1" in r.getMessage() and "again" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_registrar_start_and_stop_are_bounded_without_redis(tmp_path) -> None:
    server = RedisServer(tmp_path / "never-started")  # a free port nobody listens on

    async def make_record() -> NodeRecord:
        return record()

    async def body():
        registrar = NodeRegistrar(_config(server), "n1", make_record)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await registrar.start()
        await registrar.stop()
        return loop.time() - started, registrar.registered

    elapsed_s, registered = asyncio.run(asyncio.wait_for(body(), TIMEOUT_S))
    assert not registered and elapsed_s < 2.0


def test_registrar_stops_promptly_mid_heartbeat(redis_server) -> None:
    config = RegistryConfig(redis_server.url, heartbeat_s=0.01, ttl_s=0.05, timeout_s=0.3)

    async def make_record() -> NodeRecord:
        return record()

    async def body():
        stop_times_s = []
        for i in range(10):  # a stop landing in the middle of a Redis call must still stop
            registrar = NodeRegistrar(config, f"n{i}", make_record)
            await registrar.start()
            await asyncio.sleep(0.013 * i)
            loop = asyncio.get_running_loop()
            started = loop.time()
            await registrar.stop()
            stop_times_s.append(loop.time() - started)
        return stop_times_s

    assert max(asyncio.run(asyncio.wait_for(body(), TIMEOUT_S))) < 1.0
