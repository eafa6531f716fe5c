"""A hand-off that times out, is cancelled, or is forged falls back to local prefill on the
decode node: the stream carries on with the tokens local prefill gives, the counters say so,
no forged byte reaches the KV cache, and every block is free again afterwards."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from pdserve.v1 import node_pb2, transfer_pb2
from tests.unit.decode_node.node_harness import (
    RPC_TIMEOUT_S,
    TRANSPORTS,
    Nodes,
    RawPeer,
    decode_request,
    prompt,
    read_chunks,
    read_ticket,
    run,
    run_local,
    running_nodes,
    tokens_of,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

MARKER = 99.0  # what forged payloads hold; no KV value the model computes is exactly this


async def expect_fallback(
    nodes: Nodes, call, request_id: str, prompt_ids: list[int], within_s: float
) -> None:
    """The Decode stream delivers local prefill's tokens within `within_s`, counted as a
    failed transfer and a local prefill."""
    start_s = time.monotonic()
    chunks = await read_chunks(call)
    assert time.monotonic() - start_s < within_s
    assert tokens_of(chunks) == await run_local(nodes, f"{request_id}-reference", prompt_ids)
    assert nodes.decode.traces[request_id].prefilled_locally
    _, decode_stats = await nodes.stats()
    assert decode_stats.num_failed_transfers == 1
    assert decode_stats.num_local_prefills == 2  # the fallback and the reference
    assert nodes.decode.servicer.counters.num_fallbacks == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transfer_timeout_falls_back(transport: str) -> None:
    prompt_ids = prompt(19, seed=5)

    async def main() -> None:
        async with running_nodes(transport) as nodes:
            call = nodes.decode_stub.Decode(
                decode_request("late", prompt_ids, transfer_timeout_s=0.3), timeout=RPC_TIMEOUT_S
            )
            await read_ticket(call)  # no prefill node ever sends the KV
            _, decode_stats = await nodes.stats()
            assert decode_stats.num_pending_transfers == 1
            await expect_fallback(nodes, call, "late", prompt_ids, within_s=3.0)

    run(main())


def test_node_default_transfer_timeout_applies() -> None:
    """A request without transfer_timeout_s waits the node's own timeout."""
    prompt_ids = prompt(8, seed=6)

    async def main() -> None:
        async with running_nodes("local", transfer_timeout_s=0.2) as nodes:
            call = nodes.decode_stub.Decode(
                decode_request("dflt", prompt_ids), timeout=RPC_TIMEOUT_S
            )
            await read_ticket(call)
            await expect_fallback(nodes, call, "dflt", prompt_ids, within_s=3.0)

    run(main())


def test_cancel_transfer_falls_back_at_once() -> None:
    prompt_ids = prompt(14, seed=7)

    async def main() -> None:
        async with running_nodes("local") as nodes:
            call = nodes.decode_stub.Decode(
                decode_request("cx", prompt_ids, transfer_timeout_s=60.0), timeout=RPC_TIMEOUT_S
            )
            ticket = await read_ticket(call)
            cancel = node_pb2.CancelTransferRequest(
                transfer_id=ticket.transfer_id, reason="prefill node unreachable"
            )
            response = await nodes.decode_stub.CancelTransfer(cancel, timeout=RPC_TIMEOUT_S)
            assert response.found
            await expect_fallback(nodes, call, "cx", prompt_ids, within_s=2.0)
            again = await nodes.decode_stub.CancelTransfer(cancel, timeout=RPC_TIMEOUT_S)
            assert not again.found

    run(main())


def forged_layer(
    nodes: Nodes, ticket: node_pb2.TransferTicket, case: str
) -> tuple[transfer_pb2.LayerManifest, torch.Tensor]:
    """Layer 0's manifest and a MARKER payload, broken the way `case` says."""
    layout = nodes.decode.layout
    num_blocks = layout.num_blocks_for(ticket.num_tokens)
    if case == "block_outside_reservation":  # one block past those the ticket covers
        num_blocks += 1
    num_bytes = layout.layer_bytes(num_blocks)
    manifest = transfer_pb2.LayerManifest(
        layer_idx=0,
        block_offset=0,
        num_blocks=num_blocks,
        num_bytes=num_bytes,
        token_end=ticket.num_tokens,
    )
    if case == "wrong_byte_count":
        num_bytes -= layout.bytes_per_block
    payload = torch.full((num_bytes // 4,), MARKER, dtype=torch.float32).view(torch.uint8)
    return manifest, payload


FORGERIES = ("wrong_transfer_id", "block_outside_reservation", "wrong_byte_count")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", FORGERIES)
def test_forged_transfer_writes_nothing_and_falls_back(transport: str, case: str) -> None:
    """A raw endpoint handshakes correctly, then sends a forged layer: refused at once (or,
    for an unknown transfer id, ignored until the timeout); local prefill takes over."""
    prompt_ids = prompt(23, seed=8)
    timeout_s = 0.5 if case == "wrong_transfer_id" else 60.0

    async def main() -> None:
        async with running_nodes(transport) as nodes:
            peer = RawPeer.start(transport)
            try:
                call = nodes.decode_stub.Decode(
                    decode_request("forged", prompt_ids, transfer_timeout_s=timeout_s),
                    timeout=RPC_TIMEOUT_S,
                )
                ticket = await read_ticket(call)
                await peer.handshake(ticket, nodes.decode.layout)
                await wait_until(lambda: peer.kinds() == ["handshake_ack"])
                assert peer.received[0].handshake_ack.accepted
                manifest, payload = forged_layer(nodes, ticket, case)
                transfer_id = "forged-id" if case == "wrong_transfer_id" else ticket.transfer_id
                await peer.send(ticket.dst_address, transfer_id, payload, layer_manifest=manifest)
                await expect_fallback(nodes, call, "forged", prompt_ids, within_s=3.0)
                for k_cache, v_cache in nodes.decode.core.pool.kv_caches:
                    assert not (k_cache == MARKER).any() and not (v_cache == MARKER).any()
                if case != "wrong_transfer_id":  # the refusal reached the sender
                    await wait_until(lambda: "result" in peer.kinds())
                    assert not peer.received[-1].result.ok
            finally:
                await peer.close()

    run(main())


def test_refused_handshake_fails_the_prefill_side_cleanly() -> None:
    """A ticket whose decode node is gone: the prefill node still streams its first token,
    then a failed transfer result, and frees its blocks (the router's CancelTransfer makes
    the decode node fall back)."""
    prompt_ids = prompt(13, seed=9)

    async def main() -> None:
        async with running_nodes("tcp", transfer_timeout_s=0.5) as nodes:
            call = nodes.decode_stub.Decode(
                decode_request("gone", prompt_ids, transfer_timeout_s=30.0), timeout=RPC_TIMEOUT_S
            )
            ticket = await read_ticket(call)
            dead = node_pb2.TransferTicket()
            dead.CopyFrom(ticket)
            dead.dst_address = "tcp://127.0.0.1:9"  # nothing listens there
            prefill_call = nodes.prefill_stub.Prefill(
                node_pb2.PrefillRequest(
                    request_id="gone",
                    prompt_token_ids=prompt_ids,
                    sampling=decode_request("gone", prompt_ids).sampling,
                    ticket=dead,
                ),
                timeout=RPC_TIMEOUT_S,
            )
            first = await asyncio.wait_for(prefill_call.read(), RPC_TIMEOUT_S)
            result = await asyncio.wait_for(prefill_call.read(), RPC_TIMEOUT_S)
            assert first.WhichOneof("kind") == "first_token"
            assert not result.transfer_result.ok and result.transfer_result.error
            cancel = node_pb2.CancelTransferRequest(transfer_id=ticket.transfer_id)
            assert (await nodes.decode_stub.CancelTransfer(cancel, timeout=RPC_TIMEOUT_S)).found
            chunks = await read_chunks(call)
            assert tokens_of(chunks)[0] == first.first_token.token_id  # same seed, same token

    run(main())
