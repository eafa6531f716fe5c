"""Issue 15: the router answers malformed requests INVALID_ARGUMENT (not UNKNOWN), and
concurrent requests sharing one client request_id all complete (each gets a unique internal
id; the client's id stays their prefix). A real router over real in-process nodes."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.config import RouterConfig
from pdserve.v1 import generation_pb2
from router.client import GenerationClient
from router.server import RouterServer
from tests.unit.decode_node.node_harness import prompt, run, running_nodes

pytestmark = pytest.mark.timeout(180)

MALFORMED = {
    "not protobuf": b"\xff\xff\xff\xff",
    "invalid UTF-8 in request_id": b"\x0a\x02\xff\xfe",  # field 1 (request_id), 2 bytes
}
NUM_SHARING = 8


async def _raw_call(channel: grpc.aio.Channel, method: str, raw: bytes, stream: bool):
    identity = {"request_serializer": lambda data: data, "response_deserializer": lambda d: d}
    try:
        if stream:
            call = channel.unary_stream(method, **identity)(raw, timeout=10)
            async for _ in call:
                pass
        else:
            await channel.unary_unary(method, **identity)(raw, timeout=10)
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


async def _assert_malformed_refused(address: str) -> None:
    """Every malformed Generate, and a GetModelInfo of bytes that do not parse, is refused
    INVALID_ARGUMENT (GetModelInfoRequest has no fields: only bytes that do not parse are bad)."""
    async with grpc.aio.insecure_channel(address) as channel:
        calls = [("/pdserve.v1.Generation/Generate", True, raw) for raw in MALFORMED.values()]
        calls.append(("/pdserve.v1.Generation/GetModelInfo", False, MALFORMED["not protobuf"]))
        for method, stream, raw in calls:
            code, details = await _raw_call(channel, method, raw, stream)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, raw, code)
            assert "not a valid protobuf" in details


async def _requests_sharing_an_id(address: str) -> list[list[generation_pb2.GenerateResponse]]:
    """NUM_SHARING requests at once, all with request_id "shared": each one's chunks."""
    async with GenerationClient(address) as client:

        async def one(i: int) -> list[generation_pb2.GenerateResponse]:
            return [
                chunk
                async for chunk in client.generate(
                    prompt_token_ids=prompt(9 + i, seed=i),
                    request_id="shared",
                    temperature=0.0,
                    max_tokens=5,
                    ignore_eos=True,
                    timeout_s=60,
                )  # fmt: skip
            ]

        return await asyncio.gather(*(one(i) for i in range(NUM_SHARING)))


def test_malformed_requests_and_a_shared_request_id() -> None:
    async def main() -> None:
        async with running_nodes("tcp") as nodes:
            router = RouterServer(
                RouterConfig(
                    host="127.0.0.1", port=0, http_port=0, node_wait_s=20,
                    prefill_addrs=(nodes.prefill.address,), decode_addrs=(nodes.decode.address,),
                )
            )  # fmt: skip
            await router.start()
            try:
                await _assert_malformed_refused(router.address)
                results = await _requests_sharing_an_id(router.address)
                for chunks in results:
                    assert sum(len(c.token_ids) for c in chunks) == 5
                    assert chunks[-1].finish_reason == "length"
                assert {chunks[0].request_id for chunks in results} == {"shared"}  # as sent
                internal_ids = set(nodes.decode.traces)  # what the nodes saw: one id each
                assert len(internal_ids) == NUM_SHARING
                assert all(rid.startswith("shared") for rid in internal_ids)
            finally:
                await router.stop()

    run(main(), timeout_s=150)
