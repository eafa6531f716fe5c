"""Issue 15: received KV enters the decode node's prefix cache only after a verified transfer
(every layer landed, from a sender that proved the cluster secret). A hand-off that fails
mid-way leaves no prefix-cache entry; in an open cluster (no secret) even a complete hand-off
of forged KV serves only its own request, never a later one (the issue: forged blocks entered
the cache and a later request with the same prefix got garbage with 48 cached tokens); with a
secret, authenticated KV is cached as before."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from pdserve.config import SecurityConfig
from pdserve.grpc_security import open_channel
from pdserve.security import load_cluster_auth
from pdserve.v1 import node_pb2, node_pb2_grpc, transfer_pb2
from tests.unit.decode_node.node_harness import (
    BLOCK_SIZE,
    RPC_TIMEOUT_S,
    Nodes,
    RawPeer,
    decode_request,
    prompt,
    read_chunks,
    read_ticket,
    run,
    run_disaggregated,
    run_local,
    running_nodes,
    tokens_of,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

MARKER = 99.0  # what forged payloads hold; no KV value the model computes is exactly this
PROMPT = prompt(23, seed=11)  # 5 full blocks of 4 + 3 tokens


def _layer(nodes: Nodes, ticket: node_pb2.TransferTicket, layer_idx: int, num_bytes_off: int = 0):
    layout = nodes.decode.layout
    num_blocks = layout.num_blocks_for(ticket.num_tokens)
    num_bytes = layout.layer_bytes(num_blocks) - num_bytes_off
    manifest = transfer_pb2.LayerManifest(
        layer_idx=layer_idx, block_offset=0, num_blocks=num_blocks, num_bytes=num_bytes,
        token_end=ticket.num_tokens,
    )  # fmt: skip
    payload = torch.full((num_bytes // 4,), MARKER, dtype=torch.float32).view(torch.uint8)
    return manifest, payload


def _cached_blocks(nodes: Nodes) -> dict[bytes, int]:
    return dict(nodes.decode.core.kv_cache_manager._cached)


def _marked(nodes: Nodes, block_ids) -> list[int]:
    """Those of `block_ids` holding forged bytes in any layer."""
    marked = []
    for block_id in block_ids:
        for k_cache, v_cache in nodes.decode.core.pool.kv_caches:
            if (k_cache[block_id] == MARKER).any() or (v_cache[block_id] == MARKER).any():
                marked.append(block_id)
                break
    return marked


def test_a_transfer_failing_mid_way_caches_nothing_and_a_later_request_is_right() -> None:
    async def main() -> None:
        async with running_nodes("tcp") as nodes:
            reference = await run_local(nodes, "reference", PROMPT)  # then drop its cache
            assert await nodes.decode.engine.reset_prefix_cache()
            peer = RawPeer.start("tcp")
            try:
                call = nodes.decode_stub.Decode(
                    decode_request("mid", PROMPT, transfer_timeout_s=30.0), timeout=RPC_TIMEOUT_S
                )
                ticket = await read_ticket(call)
                await peer.handshake(ticket, nodes.decode.layout)
                await wait_until(lambda: peer.kinds() == ["handshake_ack"])
                manifest, payload = _layer(nodes, ticket, 0)  # layer 0 lands (forged bytes)
                await peer.send(ticket.dst_address, ticket.transfer_id, payload,
                                layer_manifest=manifest)  # fmt: skip
                await wait_until(lambda: 0 in nodes.decode.traces["mid"].layer_arrived_s, 5.0)
                assert _cached_blocks(nodes) == {}  # landed, but the transfer is not complete
                manifest, payload = _layer(nodes, ticket, 1, num_bytes_off=4)  # then it breaks
                await peer.send(ticket.dst_address, ticket.transfer_id, payload,
                                layer_manifest=manifest)  # fmt: skip
                fallback = tokens_of(await read_chunks(call))
            finally:
                await peer.close()
            assert nodes.decode.servicer.counters.num_fallbacks == 1
            assert fallback == reference
            cached = _cached_blocks(nodes)  # the fallback's own local prefill, nothing forged
            assert len(cached) >= len(PROMPT) // BLOCK_SIZE  # the prompt's (and output's)
            assert _marked(nodes, cached.values()) == []
            later = nodes.decode_stub.Decode(
                decode_request("later", PROMPT, disaggregated=False), timeout=RPC_TIMEOUT_S
            )
            chunks = await read_chunks(later)
            assert tokens_of(chunks) == reference
            assert chunks[-1].num_cached_tokens == (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE

    run(main())


def test_an_open_cluster_never_caches_received_kv() -> None:
    """No secret: a complete hand-off of forged KV decodes its own request (the cluster is
    open, the launchers say so) but leaves nothing in the prefix cache for a later one."""

    async def main() -> None:
        async with running_nodes("tcp") as nodes:
            peer = RawPeer.start("tcp")
            try:
                call = nodes.decode_stub.Decode(
                    decode_request("forged", PROMPT, transfer_timeout_s=30.0),
                    timeout=RPC_TIMEOUT_S,
                )
                ticket = await read_ticket(call)
                await peer.handshake(ticket, nodes.decode.layout)
                await wait_until(lambda: peer.kinds() == ["handshake_ack"])
                for layer_idx in range(nodes.decode.layout.num_layers):
                    manifest, payload = _layer(nodes, ticket, layer_idx)
                    await peer.send(ticket.dst_address, ticket.transfer_id, payload,
                                    layer_manifest=manifest)  # fmt: skip
                await peer.send(ticket.dst_address, ticket.transfer_id,
                                first_token=transfer_pb2.FirstToken(token_id=7))  # fmt: skip
                chunks = await read_chunks(call)
            finally:
                await peer.close()
            assert tokens_of(chunks)[0] == 7 and not nodes.decode.traces["forged"].prefilled_locally
            assert _cached_blocks(nodes) == {}  # nothing of the forged request was cached
            later = nodes.decode_stub.Decode(
                decode_request("later", PROMPT, disaggregated=False), timeout=RPC_TIMEOUT_S
            )
            later_chunks = await read_chunks(later)
            assert later_chunks[-1].num_cached_tokens == 0
            again = await run_local(nodes, "again", PROMPT)  # hits the later one's own blocks
            assert again == tokens_of(later_chunks)

    run(main())


def test_authenticated_kv_is_cached(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a-cluster-secret-0123456789abcdef\n")
    security = SecurityConfig(cluster_secret_file=str(secret))
    auth = load_cluster_auth(security)

    async def main() -> None:
        async with running_nodes("tcp", security=security, check_free=False) as nodes:
            channels = [
                open_channel(n.address, security, auth) for n in (nodes.prefill, nodes.decode)
            ]
            nodes.channels.extend(channels)
            nodes.prefill_stub = node_pb2_grpc.PrefillNodeStub(channels[0])
            nodes.decode_stub = node_pb2_grpc.DecodeNodeStub(channels[1])
            scheduler = nodes.decode.core.scheduler
            admitted_with = []  # the digests a request holds when the engine thread admits it
            add_prefilled = scheduler.add_prefilled

            def spy(request):
                admitted_with.append(list(request.block_hashes))
                return add_prefilled(request)

            scheduler.add_prefilled = spy
            handoff = await run_disaggregated(nodes, "signed", PROMPT)
            assert handoff.transfer_result.ok
            assert not nodes.decode.traces["signed"].prefilled_locally
            await asyncio.sleep(0)
            cached = _cached_blocks(nodes)
            assert len(cached) >= len(PROMPT) // BLOCK_SIZE
            # The prompt's blocks were hashed while its KV was on the way, not on admission.
            [digests] = admitted_with
            assert len(digests) == len(PROMPT) // BLOCK_SIZE and set(digests) <= set(cached)

    run(main())
