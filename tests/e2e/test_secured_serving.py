"""Issue 15, end to end: `pd-serve` with the production security shape, as real processes:
a cluster secret, mutual TLS between the router and the nodes, client API keys, and a Redis
registry over rediss:// with an ACL user. Requests complete (disaggregated); a node refuses a
plaintext client; no log line shows the Redis password."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlencode

import grpc
import pytest

from pdserve.v1 import node_pb2, node_pb2_grpc
from router.client import GenerationClient
from tests.e2e.cluster import Cluster
from tests.redis_server import RedisServer
from tests.unit.security.tls_certs import issue, make_ca

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

USER, PASSWORD, API_KEY = "pdserve", "redis-pw-0123", "client-key-0123"


def _rediss_registry(tmp_path: Path, ca, client_files) -> tuple[RedisServer, str]:
    """A redis-server on TLS only (client certificates required) with one ACL user; the
    registry URL that reaches it (credentials and TLS files in the URL)."""
    redis_files = issue(tmp_path, "redis", ca, "ca")
    port = RedisServer(tmp_path).port
    redis = RedisServer(
        tmp_path, port=port,
        args=("--port", "0", "--tls-port", str(port), "--tls-cert-file", redis_files.cert,
              "--tls-key-file", redis_files.key, "--tls-ca-cert-file", redis_files.ca,
              "--user", "default", "off", "--user", USER, "on", f">{PASSWORD}", "~*", "&*",
              "+@all"),
        client_kwargs={"host": "127.0.0.1", "ssl": True, "ssl_ca_certs": redis_files.ca,
                       "ssl_certfile": redis_files.cert, "ssl_keyfile": redis_files.key,
                       "username": USER, "password": PASSWORD},
    ).start()  # fmt: skip
    tls_files = {"ssl_ca_certs": client_files.ca, "ssl_certfile": client_files.cert,
                 "ssl_keyfile": client_files.key}  # fmt: skip
    return redis, f"rediss://{USER}:{PASSWORD}@127.0.0.1:{port}/0?{urlencode(tls_files)}"


async def _code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def _requests(cluster: Cluster) -> tuple[list, grpc.StatusCode, grpc.StatusCode]:
    """Three requests with the API key; then the codes of a keyless request and of a
    plaintext call to the decode node."""
    async with GenerationClient(cluster.router, api_key=API_KEY) as client:
        results = [
            await client.generate_all(
                prompt_token_ids=[3, 4, 5, 6, 7, 8, 9],
                max_tokens=6,
                ignore_eos=True,
                temperature=0.0,
                timeout_s=60,
            )  # fmt: skip
            for _ in range(3)
        ]
    async with GenerationClient(cluster.router) as keyless:
        no_key = await _code(keyless.generate_all(prompt_token_ids=[3, 4], max_tokens=2,
                                                  timeout_s=10))  # fmt: skip
    async with grpc.aio.insecure_channel(cluster.nodes["decode-0"]) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        plaintext = await _code(stub.GetStats(node_pb2.GetStatsRequest(), timeout=10))
    return results, no_key, plaintext


def test_pd_serve_secured_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", API_KEY)  # what pd-client and the start-up probe send
    ca = make_ca(tmp_path, "ca")
    cluster_files = issue(tmp_path, "cluster", ca, "ca")
    secret, keys = tmp_path / "secret", tmp_path / "api-keys"
    secret.write_text("a-cluster-secret-0123456789abcdef\n")
    keys.write_text(f"# client keys\n{API_KEY}\n")
    redis, url = _rediss_registry(tmp_path, ca, cluster_files)
    args = [
        "--model", "synthetic:tiny-llama", "--device", "cpu", "--dtype", "float32",
        "--block-size", "4", "--num-kv-blocks", "64", "--kv-transport", "tcp",
        "--prefill", "1", "--decode", "1", "--registry", url,
        "--cluster-secret-file", str(secret), "--api-key-file", str(keys),
        "--tls-cert", cluster_files.cert, "--tls-key", cluster_files.key,
        "--tls-ca", cluster_files.ca,
    ]  # fmt: skip
    try:
        cluster = Cluster(args).start()
        try:
            results, no_key, plaintext = asyncio.run(asyncio.wait_for(_requests(cluster), 180))
        finally:
            leftover = cluster.stop()
    finally:
        redis.kill()
    for result in results:
        assert len(result.token_ids) == 6 and result.finish_reason == "length"
    assert results[0].token_ids == results[1].token_ids == results[2].token_ids
    assert no_key == grpc.StatusCode.UNAUTHENTICATED
    assert plaintext == grpc.StatusCode.UNAVAILABLE  # TLS only
    assert not leftover, f"processes left behind: {leftover}"
    assert PASSWORD not in "".join(cluster.log), "the Redis password reached a log line"
