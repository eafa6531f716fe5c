"""KVSender and KVReceiver fail cleanly, once per backend: a peer that disappears, an abort,
a ticket for another layout, a wait that times out, a closing manager, a layer the transport
abandons; neither end writes a block after the failure."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch
from transfer_helpers import make_layout, make_pair, run, untouched

from cache_transfer import KVSender, KVTransferManager, TransferState

pytestmark = pytest.mark.timeout(60)


def test_sender_that_disappears_mid_transfer_fails_the_receiver_by_its_deadline(
    backend: str,
) -> None:
    async def scenario() -> None:
        pair = await make_pair(backend, make_layout())
        receiver = pair.decode.create_receiver([1, 2, 3], num_tokens=12, timeout_s=0.5)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        k_cache, v_cache = pair.src_caches[0]
        await sender.send_layer(0, k_cache, v_cache, [0, 1, 2])
        await pair.prefill._transport.close()  # the prefill node dies: no goodbye

        start_s = time.monotonic()
        assert await receiver.wait() == TransferState.FAILED
        assert time.monotonic() - start_s < 2.0  # the peer-side timeout is 10 s
        # By the deadline, or sooner where the transport saw the connection break mid-layer.
        assert re.search("timed out|connection .* broke", receiver.error or ""), receiver.error
        assert pair.decode.num_pending == 0 and pair.decode.num_failed == 1
        assert pair.decode.get(receiver.transfer_id) is None
        await pair.decode.close()

    run(scenario())


def test_receiver_that_disappears_fails_the_sender_by_its_deadline(backend: str) -> None:
    async def scenario() -> None:
        pair = await make_pair(backend, make_layout())
        receiver = pair.decode.create_receiver([1, 2, 3], num_tokens=12, timeout_s=10)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=0.5)
        k_cache, v_cache = pair.src_caches[0]
        await sender.send_layer(0, k_cache, v_cache, [0, 1, 2])
        await pair.decode._transport.close()  # the decode node dies
        for layer_idx in (1, 2):
            await sender.send_layer(layer_idx, k_cache, v_cache, [0, 1, 2])
        await sender.send_first_token(1)

        start_s = time.monotonic()
        assert await sender.wait() == TransferState.FAILED
        assert time.monotonic() - start_s < 2.0  # the peer-side timeout is 10 s
        assert pair.prefill.num_pending == 0 and pair.prefill.num_failed == 1
        await pair.prefill.close()

    run(scenario())


def test_abort_on_the_receiver_fails_the_sender_at_once(backend: str) -> None:
    async def scenario() -> None:
        pair = await make_pair(backend, make_layout())
        receiver = pair.decode.create_receiver([1, 2, 3], num_tokens=12, timeout_s=10)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        k_cache, v_cache = pair.src_caches[0]
        await sender.send_layer(0, k_cache, v_cache, [0, 1, 2])

        assert pair.decode.abort(receiver.transfer_id, "client went away")
        assert not pair.decode.abort(receiver.transfer_id, "again")
        assert await sender.wait(timeout_s=2) == TransferState.FAILED
        assert "client went away" in (sender.error or "")
        # Later layers are no-ops; the receiver's blocks stay as the first layer left them.
        await sender.send_layer(1, k_cache, v_cache, [0, 1, 2])
        assert untouched(pair.dst_caches[1:])
        await pair.close()

    run(scenario())


def test_ticket_for_another_layout_fails_both_ends_without_sending_kv(backend: str) -> None:
    async def scenario() -> None:
        pair = await make_pair(backend, make_layout())
        receiver = pair.decode.create_receiver([1, 2, 3], num_tokens=12, timeout_s=10)
        ticket = receiver.ticket()
        ticket.layout_hash = make_layout("bfloat16").layout_hash()

        sender = pair.prefill.create_sender(ticket, timeout_s=10)

        assert sender.state == TransferState.FAILED and "layout_hash" in (sender.error or "")
        assert await receiver.wait(timeout_s=2) == TransferState.FAILED
        assert untouched(pair.dst_caches)
        await pair.close()

    run(scenario())


def test_wait_timeout_fails_a_session_nobody_talks_to(backend: str) -> None:
    async def scenario() -> None:
        pair = await make_pair(backend, make_layout())
        receiver = pair.decode.create_receiver([1, 2, 3], num_tokens=12, timeout_s=30)

        assert await receiver.wait(timeout_s=0.05) == TransferState.FAILED
        assert pair.decode.num_pending == 0
        await pair.close()

    run(scenario())


def test_closing_a_manager_fails_its_sessions_and_tells_the_peer(backend: str) -> None:
    async def scenario() -> None:
        pair = await make_pair(backend, make_layout())
        receiver = pair.decode.create_receiver([1, 2, 3], num_tokens=12, timeout_s=10)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        await asyncio.wait_for(_wait_state(sender, TransferState.WAITING), 5)

        await pair.prefill.close()

        assert sender.state == TransferState.FAILED
        assert await receiver.wait(timeout_s=2) == TransferState.FAILED
        assert "closing" in (receiver.error or "")
        await pair.decode.close()

    run(scenario())


async def _wait_state(sender: KVSender, state: TransferState) -> None:
    while sender.state < state:
        await asyncio.sleep(0.002)


def test_a_layer_the_transport_abandons_fails_the_receiver_at_once(backend: str) -> None:
    """What a transport does when a connection breaks mid-payload (ucx): the session fails
    before its deadline, the layer's blocks stay untouched, its staging goes back."""

    async def scenario() -> None:
        pair = await make_pair(backend, make_layout())
        receiver = pair.decode.create_receiver([1, 2, 3], num_tokens=12, timeout_s=10)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        manager = pair.decode

        def break_payloads(peer_id: str, header: bytes, payload: torch.Tensor | None) -> None:
            if payload is None:
                KVTransferManager.complete(manager, peer_id, header, payload)
            else:
                manager.abandon(peer_id, header, payload)

        manager.complete = break_payloads  # type: ignore[method-assign]
        k_cache, v_cache = pair.src_caches[0]
        await sender.send_layer(0, k_cache, v_cache, [0, 1, 2])

        assert await receiver.wait(timeout_s=2) == TransferState.FAILED
        assert "broke while layer 0 was landing" in (receiver.error or "")
        assert await sender.wait(timeout_s=2) == TransferState.FAILED
        assert untouched(pair.dst_caches)
        assert manager._staging.num_lent == 0 and manager.num_pending == 0
        await pair.close()

    run(scenario())
