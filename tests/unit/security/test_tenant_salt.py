"""Issue 39 item 3: every request's prefix cache namespace (its tenant's). The router derives a
salt from the client's API key (a keyed digest, never the key) and the client's cache_salt; the
engine roots the request's block hashes in it; requests of two namespaces never share a block;
the router's prefix-aware policy and both nodes of a hand-off hash alike."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from pdserve.block_hash import block_hashes, root_hash
from pdserve.config import SecurityConfig
from pdserve.grpc_security import open_channel
from pdserve.sampling_params import SamplingParams
from pdserve.security import ClusterAuth, load_cluster_auth
from pdserve.v1 import node_pb2, node_pb2_grpc
from router.tenancy import CacheSalts
from tests.unit.decode_node.node_harness import (
    GREEDY,
    RPC_TIMEOUT_S,
    decode_request,
    read_chunks,
    read_prefill,
    read_ticket,
    run,
    running_nodes,
)

BLOCK_SIZE = 4
PROMPT = list(range(3, 16))  # 3 full blocks + 1 token


def _cached_request(manager: KVCacheManager, request_id: str, salt: str) -> Request:
    request = Request(request_id, list(PROMPT), SamplingParams(max_tokens=4), cache_salt=salt)
    assert manager.allocate_slots(request, len(PROMPT))
    request.num_computed_tokens = len(PROMPT)
    manager.cache_full_blocks(request)
    return request


def test_requests_of_two_namespaces_never_share_a_block(monkeypatch):
    monkeypatch.delenv("PDSERVE_PREFIX_CACHE_SALT", raising=False)
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, prefix_cache_salt="deploy")
    tenant_a = _cached_request(manager, "a", "tenant-a")
    assert tenant_a.block_hashes == block_hashes(
        PROMPT, BLOCK_SIZE, root_hash("deploy", "tenant-a")
    )
    for salt, hit_tokens in [("tenant-a", 12), ("tenant-b", 0), ("", 0)]:
        probe = Request("p", list(PROMPT), SamplingParams(max_tokens=4), cache_salt=salt)
        assert manager.get_computed_blocks(probe)[1] == hit_tokens, salt
    # No salt: the deployment's root, as before tenants existed.
    assert manager.root_for(Request("n", PROMPT, SamplingParams())) == root_hash("deploy")
    manager.free(tenant_a)


def test_roots_differ_by_either_salt_and_cannot_be_spelled_by_another_pair():
    roots = {
        root_hash("", ""), root_hash("", "x"), root_hash("x", ""), root_hash("x", "y"),
        root_hash("xy", ""), root_hash("x", "yz"), root_hash("xy", "z"),
    }  # fmt: skip
    assert len(roots) == 7


def test_the_tenant_salt_is_a_keyed_digest_of_the_api_key():
    salts = CacheSalts(None, None, per_tenant=True, keyed_tenants=True)
    a, b = salts.salt("Bearer key-a", ""), salts.salt("Bearer key-b", "")
    assert a != b and len(a) == 64 and "key-a" not in a
    assert salts.salt("bearer  key-a ", "") == a  # the same key, however the header spells it
    assert salts.salt(None, "") == "" and salts.salt("Bearer key-a", "mine") not in ("", a)
    # The key: the cluster secret's, else the deployment salt's; a guess needs it.
    keyed = CacheSalts(ClusterAuth(b"s" * 32), None, per_tenant=True, keyed_tenants=True)
    assert keyed.salt("Bearer key-a", "") != a
    assert CacheSalts(None, "deploy", True, True).salt("Bearer key-a", "") != a
    # No API keys (an open router), or sharing across tenants: the key does not count.
    for shared in (CacheSalts(None, None, True, False), CacheSalts(None, None, False, True)):
        assert shared.salt("Bearer key-a", "") == "" == shared.salt("Bearer key-b", "")
        assert shared.salt("Bearer key-a", "mine") == shared.salt(None, "mine") != ""


def test_both_nodes_of_a_hand_off_cache_the_request_under_its_salt(tmp_path: Path) -> None:
    """Prefill node and decode node root the request's blocks in its salt: the blocks the
    decode node received are found by the same tenant's next request, not by another's."""
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-0123456789abcdef\n")
    security = SecurityConfig(cluster_secret_file=str(secret))
    auth = load_cluster_auth(security)
    expected = set(block_hashes(PROMPT, BLOCK_SIZE, root_hash(None, "tenant-a")))

    async def main() -> None:
        async with running_nodes("tcp", security=security, check_free=False) as nodes:
            channels = [
                open_channel(n.address, security, auth) for n in (nodes.prefill, nodes.decode)
            ]
            nodes.channels.extend(channels)
            prefill = node_pb2_grpc.PrefillNodeStub(channels[0])
            decode = node_pb2_grpc.DecodeNodeStub(channels[1])
            request = decode_request("a", PROMPT)
            request.cache_salt = "tenant-a"
            call = decode.Decode(request, timeout=RPC_TIMEOUT_S)
            ticket = await read_ticket(call)
            prefill_call = prefill.Prefill(
                node_pb2.PrefillRequest(request_id="a", prompt_token_ids=PROMPT, sampling=GREEDY,
                                        ticket=ticket, cache_salt="tenant-a"),
                timeout=RPC_TIMEOUT_S,
            )  # fmt: skip
            _, result = await read_prefill(prefill_call)
            assert result.transfer_result.ok
            await read_chunks(call)
            await asyncio.sleep(0)
            for server in (nodes.prefill, nodes.decode):
                cached = set(server.core.kv_cache_manager._cached)
                assert expected <= cached, server
            hits = {}
            for salt in ("tenant-a", "tenant-b"):
                local = decode_request(f"again-{salt}", PROMPT, disaggregated=False)
                local.cache_salt = salt
                chunks = await read_chunks(decode.Decode(local, timeout=RPC_TIMEOUT_S))
                hits[salt] = chunks[-1].num_cached_tokens
            assert hits == {"tenant-a": 12, "tenant-b": 0}

    run(main())


@pytest.mark.parametrize("salt", ["x" * 257, "new\nline"])
def test_a_node_refuses_a_salt_that_is_no_digest(salt: str) -> None:
    async def main() -> None:
        async with running_nodes() as nodes:
            request = decode_request("bad", PROMPT, disaggregated=False)
            request.cache_salt = salt
            call = nodes.decode_stub.Decode(request, timeout=RPC_TIMEOUT_S)
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await read_chunks(call)
            assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cache_salt" in (failure.value.details() or "")

    run(main())
