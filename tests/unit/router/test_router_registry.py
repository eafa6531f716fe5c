"""NodeRegistry and RouterServer start-up: compatibility checks, late nodes, health, tokenizer."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from router_fakes import CHATML_TEMPLATE, TEST_TIMEOUT_S, FakeModel, FakeNode, RouterHarness, run

from pdserve.config import RouterConfig
from pdserve.v1 import node_pb2
from router.node_client import tokenizer_from_files
from router.node_registry import NodeRegistry
from router.node_source import NodeAddress, StaticNodeSource
from router.server import GENERATION_SERVICE, RouterServer
from tests.ports import free_port, start_on_free_ports_async
from tests.waiting import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _start_nodes(files, *specs: tuple[int, dict]) -> list[FakeNode]:
    model = FakeModel([5, 6])
    nodes = [FakeNode(role, model, files, **info) for role, info in specs]
    for node in nodes:
        await node.start()
    return nodes


@pytest.mark.parametrize(
    "mismatch",
    [
        {"layout_hash": "layout-2"},
        {"model_name": "other-model"},
        {"protocol_version": 2},
        {"kv_transport": "tcp"},
    ],
)
def test_a_node_that_disagrees_with_the_others_is_refused(
    tokenizer_files, mismatch, caplog
) -> None:
    async def body():
        decode = await _start_nodes(tokenizer_files, (node_pb2.NODE_ROLE_DECODE, {}))
        registry = NodeRegistry(RouterConfig(node_wait_s=2.0))
        await registry.start(StaticNodeSource((), (decode[0].address,)))  # the reference
        odd = await _start_nodes(tokenizer_files, (node_pb2.NODE_ROLE_PREFILL, mismatch))
        odd_address = NodeAddress(odd[0].address, node_pb2.NODE_ROLE_PREFILL)
        admitted = await registry.add_node(odd_address, deadline_s=time.monotonic() + 2)
        result = admitted, len(registry.prefill_nodes), len(registry.decode_nodes)
        await registry.close()
        for node in (*decode, *odd):
            await node.stop()
        return result

    assert run(body()) == (False, 0, 1)
    (field,) = mismatch
    assert f"{field} " in caplog.text and "differs from the other nodes'" in caplog.text


def test_a_node_reporting_another_role_is_refused(tokenizer_files, caplog) -> None:
    async def body():
        nodes = await _start_nodes(tokenizer_files, (node_pb2.NODE_ROLE_PREFILL, {}))
        registry = NodeRegistry(RouterConfig(node_wait_s=2.0))
        await registry.start(StaticNodeSource((), (nodes[0].address,)))  # listed as decode
        result = len(registry.decode_nodes), registry.tokenizer
        await registry.close()
        await nodes[0].stop()
        return result

    assert run(body()) == (0, None)
    assert "reports role NODE_ROLE_PREFILL, expected decode" in caplog.text


def test_a_node_that_never_comes_up_is_given_up_on_at_the_deadline(caplog) -> None:
    async def body():
        registry = NodeRegistry(RouterConfig(node_wait_s=0.3))
        await registry.start(StaticNodeSource((), ("127.0.0.1:1",)))
        return registry.decode_nodes

    assert run(body()) == []
    assert "decode node 127.0.0.1:1 not added" in caplog.text


def test_nodes_may_come_up_after_the_router_and_health_follows(tokenizer_files) -> None:
    async def body():
        model = FakeModel([5, 6])
        node = FakeNode(node_pb2.NODE_ROLE_DECODE, model, tokenizer_files)
        probe = grpc.aio.server()
        port = probe.add_insecure_port("127.0.0.1:0")  # a free port for the late node
        await probe.stop(None)
        router = RouterServer(
            RouterConfig(port=0, http_port=0, decode_addrs=(f"127.0.0.1:{port}",))
        )
        starting = asyncio.create_task(router.start())
        await wait_until(lambda: router.port is not None, 10.0)  # bound; still connecting
        channel = grpc.aio.insecure_channel(router.address)
        health = health_pb2_grpc.HealthStub(channel)
        before = await health.Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5, wait_for_ready=True
        )
        await node.start(port)
        await asyncio.wait_for(starting, TEST_TIMEOUT_S)
        after = await health.Check(
            health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), timeout=5
        )
        await channel.close()
        await router.stop(0)
        await node.stop()
        return before.status, after.status, starting.done()

    assert run(body()) == (NOT_SERVING, SERVING, True)


def test_tokenizer_from_node_files_uses_the_nodes_chat_template(tokenizer_files) -> None:
    files = type(tokenizer_files)()
    files.CopyFrom(tokenizer_files)
    files.tokenizer_config_json = b'{"chat_template": "config template", "eos_token": "<|im_end|>"}'

    tokenizer = tokenizer_from_files(files, "fake-model")

    assert tokenizer.chat_template == CHATML_TEMPLATE  # the node's template wins
    assert tokenizer.name == "fake-model"
    assert tokenizer.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"),)
    with pytest.raises(ValueError, match="empty tokenizer.json"):
        tokenizer_from_files(type(files)(), "fake-model")
    with pytest.raises(ValueError, match="the tokenizer files of fake-model do not load"):
        tokenizer_from_files(type(files)(tokenizer_json=b"{}"), "fake-model")


def test_a_model_without_a_tokenizer_is_served_on_token_ids_only() -> None:
    no_tokenizer = node_pb2.TokenizerFiles()  # what a synthetic model's node returns

    async def body():
        async with RouterHarness(no_tokenizer, [5, 6, 7], num_prefill=1) as h:
            result = await h.client.generate_all(prompt_token_ids=[3, 4], max_tokens=3)
            failures = []
            for kwargs in (
                {"prompt": "hello"},
                {"messages": [{"role": "user", "content": "hi"}]},
                {"prompt_token_ids": [3], "stop": ["x"]},
            ):
                try:
                    await h.client.generate_all(max_tokens=2, timeout_s=5, **kwargs)
                except grpc.aio.AioRpcError as error:
                    failures.append((error.code(), error.details()))
            info = await h.client.model_info(timeout_s=5)
            return result, failures, info, h.router.registry.tokenizer

    result, failures, info, tokenizer = run(body())
    assert tokenizer is None and info.model_name == "fake-model"
    assert result.token_ids == [5, 6, 7] and result.text == "" and result.finish_reason == "length"
    assert [code for code, _ in failures] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert all("this model has no tokenizer: send prompt_token_ids" in m for _, m in failures)
    assert "stop strings cannot be matched" in failures[2][1]


def test_health_follows_a_decode_node_that_dies_and_comes_back(tokenizer_files) -> None:
    """A static decode node that goes away turns the router's health NOT_SERVING (gRPC) and
    503 (HTTP /health) with no request needed to find out; back on its port, SERVING again."""
    import httpx

    async def body():
        node = FakeNode(node_pb2.NODE_ROLE_DECODE, FakeModel([5, 6]), tokenizer_files)
        address = await node.start()

        async def start_router() -> RouterServer:  # HTTP on a free port, again if it was taken
            config = RouterConfig(port=0, http_port=free_port(), decode_addrs=(address,))
            router = RouterServer(config)
            try:
                await asyncio.wait_for(router.start(), TEST_TIMEOUT_S)
            except BaseException:
                await router.stop(0)
                raise
            return router

        router = await start_on_free_ports_async(start_router)
        channel = grpc.aio.insecure_channel(router.address)
        stub = health_pb2_grpc.HealthStub(channel)
        seen = []

        async def wait_for(want: int, http_status: int) -> None:
            deadline = time.monotonic() + TEST_TIMEOUT_S
            async with httpx.AsyncClient(base_url=router.http.url) as http:
                while time.monotonic() < deadline:
                    check = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                    status = (await http.get("/health")).status_code
                    if (check.status, status) == (want, http_status):
                        seen.append((want, http_status))
                        return
                    await asyncio.sleep(0.1)
            raise TimeoutError(f"health never became {(want, http_status)}")

        try:
            await wait_for(SERVING, 200)
            await node.stop()
            await wait_for(NOT_SERVING, 503)
            await node.start(int(address.rsplit(":", 1)[1]))
            await wait_for(SERVING, 200)
        finally:
            await channel.close()
            await router.stop(0)
            await node.stop()
        return seen

    assert run(body()) == [(SERVING, 200), (NOT_SERVING, 503), (SERVING, 200)]
