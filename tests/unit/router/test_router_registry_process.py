"""A router that follows a Redis registry, as a process: pd-router needs no node addresses with
one, refuses bad registry flags, starts before Redis does, and stops promptly mid-call."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

from registry_fakes import OUTPUT_IDS, WAIT_S, addresses, registrar, registry_config
from router_fakes import FakeModel, FakeNode, run

from pdserve.config import RegistryConfig, RouterConfig
from pdserve.v1 import node_pb2
from router.client import GenerationClient
from router.server import RouterServer
from tests.redis_server import RedisServer
from tests.waiting import wait_until


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
