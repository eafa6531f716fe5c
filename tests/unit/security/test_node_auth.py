"""Issue 15: with a cluster secret, every node RPC without a valid proof ends UNAUTHENTICATED
(health stays open), the router's NodeClient proves the secret without sending it, and a
malformed request ends INVALID_ARGUMENT instead of UNKNOWN. Issue 39: a proof names the node it
is for, and another node refuses it. A real GrpcNodeServer on loopback over a fake backend (no
engine)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from node_common.grpc_node_server import GrpcNodeServer
from pdserve.security import AUTH_METADATA_KEY, ClusterAuth
from pdserve.v1 import node_pb2, node_pb2_grpc
from router.node_client import NodeClient

SECRET = b"s3cret-s3cret-s3cret-0123456789"
TIMEOUT_S = 20.0


class FakeBackend:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    node_info = node_pb2.NodeInfo(model_name="fake", role=node_pb2.NODE_ROLE_DECODE)
    tokenizer_files = node_pb2.TokenizerFiles()
    kv_address = "tcp://127.0.0.1:1"

    async def stats(self) -> node_pb2.NodeStats:
        return node_pb2.NodeStats(num_kv_blocks=7)

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def _serve(backend: FakeBackend, auth: ClusterAuth | None) -> GrpcNodeServer:
    return GrpcNodeServer(
        "127.0.0.1", 0, backend, "pdserve.v1.DecodeNode", lambda server: None, auth=auth
    )


def _run(body):
    return asyncio.run(asyncio.wait_for(body(), TIMEOUT_S))


async def _code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_node_rpcs_need_the_cluster_proof():
    backend = FakeBackend()

    async def body():
        server = _serve(backend, ClusterAuth(SECRET))
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = node_pb2_grpc.NodeStub(channel)
                plain = {
                    "GetNodeInfo": await _code(stub.GetNodeInfo(node_pb2.GetNodeInfoRequest())),
                    "GetStats": await _code(stub.GetStats(node_pb2.GetStatsRequest())),
                    "GetTokenizer": await _code(stub.GetTokenizer(node_pb2.GetTokenizerRequest())),
                    "Abort": await _code(stub.Abort(node_pb2.AbortRequest(request_id="victim"))),
                }
                forged_token = ClusterAuth(b"not-the-secret-0123456789").call_token(
                    "/pdserve.v1.Node/Abort", server.address
                )
                forged = await _code(
                    stub.Abort(
                        node_pb2.AbortRequest(request_id="victim"),
                        metadata=((AUTH_METADATA_KEY, forged_token),),
                    )
                )
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="")
                )
            client = NodeClient(server.address, auth=ClusterAuth(SECRET))
            stats = await client.node_stub.GetStats(node_pb2.GetStatsRequest(), timeout=5)
            found = await client.abort("mine", timeout_s=5)
            await client.close()
            return plain, forged, health.status, stats, found
        finally:
            await server.stop(0)

    plain, forged, health_status, stats, found = _run(body)
    assert set(plain.values()) == {grpc.StatusCode.UNAUTHENTICATED}, plain
    assert forged == grpc.StatusCode.UNAUTHENTICATED
    assert health_status == health_pb2.HealthCheckResponse.SERVING  # probes stay open
    assert stats.num_kv_blocks == 7 and found
    assert backend.aborted == ["mine"]  # the unauthenticated Aborts reached nothing


def test_a_replayed_proof_is_refused():
    auth = ClusterAuth(SECRET)

    async def body():
        server = _serve(FakeBackend(), auth)
        await server.start()
        try:
            token = auth.call_token("/pdserve.v1.Node/GetStats", server.address)
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = node_pb2_grpc.NodeStub(channel)
                md = ((AUTH_METADATA_KEY, token),)
                first = await _code(stub.GetStats(node_pb2.GetStatsRequest(), metadata=md))
                again = await _code(stub.GetStats(node_pb2.GetStatsRequest(), metadata=md))
                other = auth.call_token("/pdserve.v1.Node/GetStats", server.address)
                wrong_method = await _code(
                    stub.Abort(
                        node_pb2.AbortRequest(request_id="x"),
                        metadata=((AUTH_METADATA_KEY, other),),
                    )
                )
            return first, again, wrong_method
        finally:
            await server.stop(0)

    first, again, wrong_method = _run(body)
    assert first == grpc.StatusCode.OK
    assert again == grpc.StatusCode.UNAUTHENTICATED
    assert wrong_method == grpc.StatusCode.UNAUTHENTICATED  # a proof is bound to its method


def test_a_proof_made_for_one_node_is_refused_by_another():
    """Issue 39, item 2 (regression): the router's proofs for decode node D, captured and
    replayed to prefill node P within the window (P has never seen their nonces), are refused
    there, for GetStats and for Abort; D itself accepted them. Each node keeps its own replay
    cache (its own ClusterAuth), as separate processes do."""
    decode_auth, prefill_auth = ClusterAuth(SECRET), ClusterAuth(SECRET)
    prefill_backend = FakeBackend()
    seen: dict[str, str] = {}  # method -> the proof D was sent for it
    real_check = decode_auth.check_call

    def spy(method: str, token: str | None, *names: object) -> str | None:
        seen[method] = token or ""
        return real_check(method, token, *names)  # type: ignore[arg-type]

    decode_auth.check_call = spy  # type: ignore[method-assign]

    async def body():
        decode, prefill = _serve(FakeBackend(), decode_auth), _serve(prefill_backend, prefill_auth)
        await decode.start()
        await prefill.start()
        try:
            router = NodeClient(decode.address, auth=ClusterAuth(SECRET))
            accepted = [
                (await router.node_stub.GetStats(node_pb2.GetStatsRequest(), timeout=5)).num_kv_blocks,
                await router.abort("on-decode", timeout_s=5),
            ]  # fmt: skip
            await router.close()
            async with grpc.aio.insecure_channel(prefill.address) as channel:
                stub = node_pb2_grpc.NodeStub(channel)

                def replayed(method: str) -> tuple[tuple[str, str], ...]:
                    return ((AUTH_METADATA_KEY, seen[f"/pdserve.v1.Node/{method}"]),)

                refused = [
                    await _code(stub.GetStats(node_pb2.GetStatsRequest(), metadata=replayed("GetStats"))),
                    await _code(stub.Abort(node_pb2.AbortRequest(request_id="victim"),
                                           metadata=replayed("Abort"))),
                ]  # fmt: skip
            return accepted, refused
        finally:
            await decode.stop(0)
            await prefill.stop(0)

    accepted, refused = _run(body)
    assert accepted == [7, True], "D accepted the router's proofs"
    assert refused == [grpc.StatusCode.UNAUTHENTICATED] * 2, refused
    assert prefill_backend.aborted == [], "the replayed Abort reached nothing on P"


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xff\xff\xff", b"\x0a\x02\xff\xfe"],  # not protobuf; request_id of invalid UTF-8
    ids=["malformed", "invalid-utf8"],
)
def test_malformed_requests_are_invalid_argument(raw):
    backend = FakeBackend()

    async def body():
        server = _serve(backend, None)  # an open node: the request still gets parsed here
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                abort = channel.unary_unary(
                    "/pdserve.v1.Node/Abort",
                    request_serializer=lambda data: data,
                    response_deserializer=node_pb2.AbortResponse.FromString,
                )
                try:
                    await abort(raw, timeout=5)
                except grpc.aio.AioRpcError as error:
                    return error.code(), error.details()
                return grpc.StatusCode.OK, ""
        finally:
            await server.stop(0)

    code, details = _run(body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "not a valid protobuf" in details
    assert backend.aborted == []


def test_a_short_secret_is_refused(tmp_path):
    from pdserve.config import SecurityConfig
    from pdserve.security import load_cluster_auth

    path = tmp_path / "secret"
    path.write_text("short\n")
    with pytest.raises(ValueError, match="at least 16"):
        load_cluster_auth(SecurityConfig(cluster_secret_file=str(path)))
    path.write_text(SECRET.decode() + "\n")
    assert load_cluster_auth(SecurityConfig(cluster_secret_file=str(path))) is not None
    assert load_cluster_auth(SecurityConfig()) is None
