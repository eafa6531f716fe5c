"""Service discovery end to end: real node processes registering in a real redis-server, a
router following the registry. Nodes are found, a node killed with SIGKILL stops getting
requests after its TTL while requests keep succeeding, a node started under load gets traffic,
and a Redis restart mid-run loses no request and leaves the registry complete."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from router.client import GenerationClient
from tests.e2e.cluster import Cluster
from tests.e2e.registry_cluster import (
    HEARTBEAT_S,
    MODEL,
    TTL_S,
    LoadLoop,
    RegistryCluster,
    eventually,
)
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TEST_TIMEOUT_S = 60.0
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TEST_TIMEOUT_S))


def test_pd_serve_with_a_registry_discovers_its_nodes_and_deregisters_them(tmp_path) -> None:
    redis = RedisServer(tmp_path / "redis").start()
    args = ["--registry", redis.url, "--registry-heartbeat-s", str(HEARTBEAT_S)]
    args += ["--model", MODEL, "--device", "cpu", "--dtype", "float32", "--block-size", "4"]
    args += ["--num-kv-blocks", "256", "--kv-transport", "tcp", "--prefill", "1", "--decode", "2"]
    cluster = Cluster(args).start()
    try:

        async def generate():
            async with GenerationClient(cluster.router) as client:
                return [
                    await client.generate_all(
                        prompt_token_ids=[3, 4, 5, 6, 7],
                        max_tokens=6,
                        ignore_eos=True,
                        temperature=0.0,
                        timeout_s=30,
                    )  # fmt: skip
                    for _ in range(4)
                ]

        results = run(generate())
        with redis.client() as client:
            num_records = len(list(client.scan_iter("pdserve:node:*")))
        served = {name: cluster.node_stats(name).num_finished_requests for name in cluster.nodes}
    finally:
        leftover = cluster.stop()
        with redis.client() as client:
            num_after_stop = len(list(client.scan_iter("pdserve:node:*")))
        redis.kill()
    assert not leftover
    assert all(len(r.token_ids) == 6 and r.text == "" for r in results)
    assert len({tuple(r.token_ids) for r in results}) == 1  # greedy: the same every time
    assert num_records == 3
    assert served["prefill-0"] == 4 and served["decode-0"] + served["decode-1"] == 4
    assert served["decode-0"] == served["decode-1"] == 2  # round robin over discovered nodes
    assert num_after_stop == 0  # each node deregistered as it stopped


def test_a_killed_decode_node_gets_no_requests_after_its_ttl(tmp_path) -> None:
    async def body(cluster: RegistryCluster):
        async with cluster.router() as (router, client):
            load = LoadLoop(client).start()
            await load.until(10)
            dead = cluster.address("decode-1")
            killed_at_s = time.monotonic()
            cluster.kill("decode-1")
            await asyncio.sleep(TTL_S + 2 * HEARTBEAT_S + 0.2)  # expired and resynced
            routed_after_ttl = router.stats.requests_routed[dead]
            view = [n.address for n in router.registry.decode_nodes]
            await load.until(20)
            await load.stop()
            routed_at_end = router.stats.requests_routed[dead]
            return load, killed_at_s, routed_after_ttl, routed_at_end, view, dead

    with RegistryCluster(tmp_path) as cluster:
        cluster.start_nodes(prefill=1, decode=2)
        load, killed_at_s, routed_after_ttl, routed_at_end, view, dead = run(body(cluster))
    # A request streaming from the node when it died fails (no migration); every request sent
    # after the kill succeeds: those that found it dead were retried on the other node.
    in_flight = [error for started_s, error in load.errors if started_s < killed_at_s]
    assert all("mid-stream" in error for error in in_flight) and len(in_flight) <= 2
    assert [error for started_s, error in load.errors if started_s >= killed_at_s] == []
    assert dead not in view
    assert routed_at_end == routed_after_ttl  # nothing routed to it after its TTL


def test_a_node_started_under_load_joins_and_gets_traffic(tmp_path) -> None:
    async def body(cluster: RegistryCluster):
        async with cluster.router() as (router, client):
            load = LoadLoop(client).start()
            await load.until(5)
            (new,) = await asyncio.to_thread(cluster.start_nodes, decode=1)
            await eventually(lambda: cluster.stats(new).num_finished_requests >= 3, 20.0)
            await load.stop()
            return load, router.stats.requests_routed[cluster.address(new)]

    with RegistryCluster(tmp_path) as cluster:
        cluster.start_nodes(prefill=1, decode=1)
        load, routed_to_new = run(body(cluster))
    assert [error for _, error in load.errors] == []
    assert routed_to_new >= 3


def test_a_redis_restart_mid_run_loses_no_request(tmp_path) -> None:
    async def body(cluster: RegistryCluster):
        async with cluster.router() as (router, client):
            load = LoadLoop(client).start()
            await load.until(5)
            cluster.redis.kill()
            await asyncio.sleep(TTL_S + HEARTBEAT_S)  # longer than a record lives
            await load.until(10)  # Redis away: routing goes on from the last view
            await asyncio.to_thread(cluster.redis.start)  # same port, empty
            await eventually(lambda: len(cluster.registered_roles()) == 3, 5.0)
            before = await asyncio.to_thread(cluster.counters, "num_finished_requests")
            await load.until(20)
            await load.stop()
            after = await asyncio.to_thread(cluster.counters, "num_finished_requests")
            view = sorted(router.registry.ready_addresses)
            return load, before, after, view

    with RegistryCluster(tmp_path) as cluster:
        cluster.start_nodes(prefill=1, decode=2)
        load, before, after, view = run(body(cluster))
        roles = cluster.registered_roles()
        addresses = sorted(cluster.address(name) for name in cluster.nodes)
    assert [error for _, error in load.errors] == []
    assert roles == ["decode", "decode", "prefill"]  # the registry is complete again
    assert view == addresses
    assert all(after[name] > before[name] for name in after)  # every node still gets traffic


def test_a_node_stopped_cleanly_deregisters_then_finishes_its_requests(tmp_path) -> None:
    async def body(cluster: RegistryCluster):
        async with cluster.router() as (router, client):
            long = client.generate(
                prompt_token_ids=[3, 4, 5], max_tokens=300, timeout_s=30, **GREEDY
            )
            token_ids = list((await anext(long)).token_ids)
            running = await asyncio.to_thread(cluster.counters, "num_running_requests")
            (stopping,) = [name for name, n in running.items() if n == 1]
            cluster.nodes[stopping].process.send_signal(signal.SIGTERM)
            await eventually(lambda: cluster.registered_roles() == ["decode"], 2.0)
            draining = cluster.nodes[stopping].process.poll() is None
            others = [
                await client.generate_all(prompt_token_ids=[3], max_tokens=4) for _ in range(4)
            ]
            async for chunk in long:  # the stopping node drains: the stream completes
                token_ids += chunk.token_ids
                finish_reason = chunk.finish_reason
            exit_code = await asyncio.to_thread(cluster.nodes[stopping].process.wait, 10)
            return token_ids, finish_reason, draining, others, exit_code, stopping, router.stats

    with RegistryCluster(tmp_path) as cluster:
        cluster.start_nodes(decode=2)
        token_ids, finish_reason, draining, others, exit_code, stopping, stats = run(body(cluster))
        stopped_address = cluster.address(stopping)
    assert draining, "the node was gone when its record went: make the long request longer"
    assert len(token_ids) == 300 and finish_reason == "length"
    assert all(len(r.token_ids) == 4 for r in others)
    assert stats.requests_routed[stopped_address] == 1 and stats.num_retries == 0
    assert exit_code == 0
