"""KVReceiver refuses every message that does not fit its ticket, once per backend.

A raw transport endpoint (forger.py) plays the prefill node and speaks transfer.proto by hand.
Forged payloads are filled with MARKER, so "no block written" means no MARKER anywhere in the
cache.
"""

from __future__ import annotations

import pytest
import torch
from forger import (
    DST_BLOCK_IDS,
    LAYOUT,
    MARKER,
    NUM_TOKENS,
    Forger,
    caches,
    forged_session,
    full_transfer,
    no_marker,
)
from transfer_helpers import (
    SENTINEL,
    make_raw_peer,
    run,
    sentinel_caches,
    untouched,
    wait_until,
)

from cache_transfer import KVTransferManager, TransferState, make_transport, protocol
from pdserve.v1 import transfer_pb2

pytestmark = pytest.mark.timeout(60)


async def _wrong_layer_index(f: Forger) -> None:
    await f.handshake()
    await f.layer(LAYOUT.num_layers)


async def _short_payload(f: Forger) -> None:
    await f.handshake()
    await f.layer(0, payload_blocks=2)


async def _manifest_byte_count_lies(f: Forger) -> None:
    await f.handshake()
    await f.layer(0, num_bytes=LAYOUT.layer_bytes(2))


async def _wrong_block_range(f: Forger) -> None:
    await f.handshake()
    await f.layer(0, block_offset=1)


async def _layer_before_handshake(f: Forger) -> None:
    await f.layer(0)


async def _sequence_gap(f: Forger) -> None:
    await f.handshake()
    f.seq += 1
    await f.layer(0)


async def _first_token_before_every_layer(f: Forger) -> None:
    await f.handshake()
    await f.layer(0, value=1.0)
    await f.first_token()


async def _payload_on_a_handshake(f: Forger) -> None:
    handshake = transfer_pb2.TransferHandshake(layout_hash=LAYOUT.layout_hash())
    await f.send(torch.zeros(LAYOUT.layer_bytes(3), dtype=torch.uint8), handshake=handshake)


async def _sender_claims_success(f: Forger) -> None:
    await f.handshake()
    await f.send(result=transfer_pb2.TransferResult(ok=True))


REFUSED = {
    "wrong-layout-hash": (lambda f: f.handshake(layout_hash="0" * 64), "layout_hash"),
    "wrong-protocol-version": (lambda f: f.handshake(protocol_version=99), "protocol_version"),
    "wrong-num-tokens": (lambda f: f.handshake(num_tokens=NUM_TOKENS + 1), "num_tokens"),
    "wrong-layer-index": (_wrong_layer_index, "layer index 3 outside [0, 3)"),
    "short-payload": (_short_payload, "payload bytes"),
    "manifest-byte-count-lies": (_manifest_byte_count_lies, "payload bytes"),
    "wrong-block-range": (_wrong_block_range, "expected [0, +3)"),
    "layer-before-handshake": (_layer_before_handshake, "before the handshake"),
    "sequence-gap": (_sequence_gap, "seq 2 out of order"),
    "first-token-too-early": (_first_token_before_every_layer, "layers [1, 2] are incomplete"),
    "payload-on-handshake": (_payload_on_a_handshake, "must not carry a payload"),
    "sender-claims-success": (_sender_claims_success, "only the receiver reports success"),
}


def test_the_hand_driven_protocol_succeeds_when_honest(backend: str) -> None:
    async def scenario() -> None:
        manager, receiver, forger = await forged_session(backend)
        await full_transfer(forger)
        assert await receiver.wait(timeout_s=5) == TransferState.SUCCESS
        k_cache, _ = caches(manager)[0]
        assert bool((k_cache[DST_BLOCK_IDS[:3]] == 1.0).all())
        assert bool((k_cache[DST_BLOCK_IDS[3]] == SENTINEL).all())
        await wait_until(lambda: len(forger.peer.received) == 2)  # ack, then result ok
        replies = [protocol.decode(header) for _, header in forger.peer.received]
        assert [protocol.kind_of(m) for m in replies] == ["handshake_ack", "result"]
        assert [m.seq for m in replies] == [0, 1]
        assert replies[0].handshake_ack.accepted and replies[1].result.ok
        await manager.close()
        await forger.peer.transport.close()

    run(scenario())


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_forged_message_fails_the_session_and_writes_nothing(backend: str, case: str) -> None:
    script, reason = REFUSED[case]

    async def scenario() -> None:
        manager, receiver, forger = await forged_session(backend)
        await script(forger)
        assert await receiver.wait(timeout_s=5) == TransferState.FAILED
        assert reason in (receiver.error or ""), receiver.error
        assert no_marker(manager)
        if case != "first-token-too-early":  # that one landed an honest layer first
            assert untouched(caches(manager))
        assert manager.num_pending == 0 and manager.num_failed == 1
        await manager.close()
        await forger.peer.transport.close()

    run(scenario())


def test_a_refused_handshake_is_answered_with_the_reason(backend: str) -> None:
    async def scenario() -> None:
        manager, receiver, forger = await forged_session(backend)
        await forger.handshake(layout_hash="f" * 64)
        await wait_until(lambda: len(forger.peer.received) == 1)
        ack = protocol.decode(forger.peer.received[0][1]).handshake_ack
        assert not ack.accepted and "layout_hash" in ack.reason
        assert ack.protocol_version == protocol.PROTOCOL_VERSION
        await manager.close()
        await forger.peer.transport.close()

    run(scenario())


def test_a_repeated_layer_is_refused_and_the_first_copy_stays(backend: str) -> None:
    async def scenario() -> None:
        manager, receiver, forger = await forged_session(backend)
        await forger.handshake()
        await forger.layer(0, value=1.0)
        # Landed before the repeat is refused (ucx lands payloads while reading later heads:
        # a layer still landing when its session fails is dropped, never scattered).
        await wait_until(lambda: receiver.state == TransferState.TRANSFERRING)
        await forger.layer(0, value=MARKER)
        assert await receiver.wait(timeout_s=5) == TransferState.FAILED
        assert "token_end 10 must exceed 10" in (receiver.error or "")
        k_cache, v_cache = caches(manager)[0]
        assert bool((k_cache[DST_BLOCK_IDS[:3]] == 1.0).all())
        assert bool((v_cache[DST_BLOCK_IDS[:3]] == 1.0).all())
        assert no_marker(manager)
        await manager.close()
        await forger.peer.transport.close()

    run(scenario())


def test_unknown_transfer_ids_and_garbage_are_refused_without_touching_sessions(
    backend: str,
) -> None:
    async def scenario() -> None:
        manager, receiver, forger = await forged_session(backend)
        await forger.handshake()
        await forger.layer(0, transfer_id="not-a-transfer", seq=1)
        address = receiver.ticket().dst_address
        await forger.peer.transport.send(address, b"\x00garbage", torch.ones(64, dtype=torch.uint8))
        forger.seq = 1  # neither message reached the session, so its next seq is still 1
        await forger.layer(1, value=1.0)

        await wait_until(lambda: receiver.state == TransferState.TRANSFERRING)
        assert no_marker(manager)
        assert untouched([caches(manager)[0], caches(manager)[2]])
        assert manager.num_pending == 1 and manager.num_failed == 0
        await manager.close()
        await forger.peer.transport.close()

    run(scenario())


def test_a_second_peer_cannot_join_a_session(backend: str) -> None:
    async def scenario() -> None:
        manager, receiver, forger = await forged_session(backend)
        await forger.handshake()
        intruder = Forger(await make_raw_peer(backend), receiver, seq=1)
        await intruder.layer(0)

        assert await receiver.wait(timeout_s=5) == TransferState.FAILED
        assert "not from the peer that handshook" in (receiver.error or "")
        assert untouched(caches(manager))
        # The real peer is told the transfer failed.
        await wait_until(lambda: len(forger.peer.received) == 2)
        result = protocol.decode(forger.peer.received[1][1]).result
        assert not result.ok and "not from the peer" in result.error
        await manager.close()
        for peer in (forger.peer, intruder.peer):
            await peer.transport.close()

    run(scenario())


def test_receiver_refuses_a_ticket_that_does_not_fit_its_cache(backend: str) -> None:
    async def scenario() -> None:
        manager = KVTransferManager(
            make_transport(backend), LAYOUT, sentinel_caches(LAYOUT, num_blocks=8)
        )
        with pytest.raises(ValueError, match="need 3 blocks of 4; only 2 dst_block_ids"):
            manager.create_receiver([0, 1], num_tokens=10, timeout_s=1)
        with pytest.raises(ValueError, match="outside the cache's"):
            manager.create_receiver([0, 1, 8], num_tokens=10, timeout_s=1)
        with pytest.raises(ValueError, match="must be distinct"):
            manager.create_receiver([0, 1, 1], num_tokens=10, timeout_s=1)
        manager.create_receiver([0, 1, 2], num_tokens=10, timeout_s=1, transfer_id="t")
        with pytest.raises(ValueError, match="already in progress"):
            manager.create_receiver([3, 4, 5], num_tokens=10, timeout_s=1, transfer_id="t")
        await manager.close()

    run(scenario())


def test_a_payload_landing_after_the_session_failed_is_not_written() -> None:
    """A transport may finish receiving a payload accepted before the session failed (ucx
    receives concurrently): the receiver must drop it, not scatter it."""

    async def scenario() -> None:
        manager, receiver, forger = await forged_session("local")
        await forger.handshake()
        manifest = transfer_pb2.LayerManifest(
            layer_idx=0, num_blocks=3, num_bytes=LAYOUT.layer_bytes(3), token_end=NUM_TOKENS
        )
        msg = protocol.TransferMessage(transfer_id=receiver.transfer_id, seq=1)
        msg.layer_manifest.CopyFrom(manifest)
        peer_id = forger.peer.transport.address
        dst = receiver.prepare(peer_id, msg, LAYOUT.layer_bytes(3))
        assert dst is not None
        dst.copy_(torch.full((dst.numel() // 4,), MARKER).view(torch.uint8))

        receiver.abort("client went away")
        receiver.complete(peer_id, msg, dst)

        assert receiver.state == TransferState.FAILED
        assert untouched(caches(manager))
        await manager.close()
        await forger.peer.transport.close()

    run(scenario())
