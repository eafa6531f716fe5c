"""Issue 39, item 1: with a cluster secret every message of a hand-off carries a MAC under the
transfer's key (secret, transfer id, challenge nonce, connection). A frame that fails it fails
the transfer, and its payload is never unpacked; a payload may be MACed through its device
digest (kernels/kv_digest; here on the CPU, through the reference). A receiver that ended
refuses a late hello with a refusal proved by the secret; a sender acts on no challenge that
does not prove it. An unreachable receiver fails the sender within the connect timeout."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from forger import DST_BLOCK_IDS, LAYOUT, MARKER, NUM_TOKENS, Forger, caches, no_marker
from transfer_helpers import (
    SENTINEL,
    make_raw_peer,
    random_caches,
    run,
    sentinel_caches,
    wait_until,
)

from cache_transfer import KVTransferManager, TransferState, make_transport, protocol
from cache_transfer.frame_auth.challenges import make_challenge
from cache_transfer.frame_auth.frame_key import TO_RECEIVER, seal
from cache_transfer.frame_auth.payload_digests import digest_part
from cache_transfer.tickets import issue_ticket
from cache_transfer.transports.base import TransportError
from cache_transfer.transports.tcp import TcpTransport
from pdserve.security import ClusterAuth
from pdserve.v1 import transfer_pb2
from tests.ports import unlistened_port

pytestmark = pytest.mark.timeout(60)

AUTH = ClusterAuth(b"cluster-secret-0123456789abcdef")


def _decode(backend: str) -> KVTransferManager:
    return KVTransferManager(
        make_transport(backend), LAYOUT, sentinel_caches(LAYOUT, 12), auth=AUTH
    )


def test_a_tampered_payload_fails_the_transfer_and_is_not_unpacked(backend: str) -> None:
    """An on-path attacker flips one byte of the honest sender's first layer in flight."""

    async def scenario() -> tuple[TransferState, str, bool, TransferState]:
        src = random_caches(LAYOUT, 8)
        prefill = KVTransferManager(make_transport(backend), LAYOUT, auth=AUTH)
        decode = _decode(backend)
        transport = prefill._transport.inner
        real = transport.send_many

        async def tamper(peer_address: str, messages: list) -> None:
            tampered = []
            for header, payload in messages:
                if payload is not None and not tampered:
                    payload = payload.clone()
                    payload[7] ^= 1
                tampered.append((header, payload))
            await real(peer_address, tampered)

        transport.send_many = tamper
        receiver = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=10)
        sender = prefill.create_sender(receiver.ticket(), timeout_s=10)
        try:
            k, v = src[0]
            await sender.send_layer(0, k, v, [5, 0, 7])
            state = await receiver.wait(timeout_s=10)
            k_dst, v_dst = caches(decode)[0]
            untouched = bool((k_dst == SENTINEL).all() and (v_dst == SENTINEL).all())
            return state, receiver.error or "", untouched, await sender.wait(timeout_s=10)
        finally:
            await prefill.close()
            await decode.close()

    state, error, untouched, sender_state = run(scenario())
    assert state == TransferState.FAILED and "MAC does not verify" in error, error
    assert untouched, "the tampered layer was not unpacked"
    assert sender_state == TransferState.FAILED  # told by the receiver


@pytest.mark.parametrize("defect", ["no-mac", "other-key", "rewritten-seq", "progress-no-mac"])
def test_a_message_of_the_sender_without_its_mac_fails_the_transfer(backend: str, defect: str):
    async def scenario() -> tuple[TransferState, str, bool]:
        decode = _decode(backend)
        receiver = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=10)
        forger = Forger(await make_raw_peer(backend), receiver, auth=AUTH)
        try:
            await forger.hello()
            await forger.handshake()
            await forger.next_reply("handshake_ack", 10.0)
            if defect in ("no-mac", "progress-no-mac"):
                forger.key = None
            elif defect == "other-key":
                forger.auth = ClusterAuth(b"another-cluster-secret-0123456")
                await forger.hello()  # its key: derived from another secret
            else:  # a valid frame of seq 2, its header rewritten to the expected seq 1
                await rewritten_seq(forger)
            if defect == "progress-no-mac":  # what restarts the no-progress timer, forged
                await forger.send(progress=transfer_pb2.Progress(num_computed_tokens=1))
            elif defect != "rewritten-seq":
                await forger.layer(0, value=MARKER)
            state = await receiver.wait(timeout_s=10)
            return state, receiver.error or "", no_marker(decode)
        finally:
            await decode.close()
            await forger.peer.transport.close()

    state, error, clean = run(scenario())
    assert state == TransferState.FAILED and "MAC" in error, error
    assert clean


async def rewritten_seq(forger: Forger) -> None:
    assert forger.key is not None
    manifest = transfer_pb2.LayerManifest(
        layer_idx=0, block_offset=0, num_blocks=3, num_bytes=LAYOUT.layer_bytes(3),
        token_end=NUM_TOKENS,
    )  # fmt: skip
    payload = torch.full((2, 3, *LAYOUT.block_shape), MARKER).view(torch.uint8).flatten()
    tid = forger.receiver.transfer_id
    signed = protocol.encode(tid, 2, layer_manifest=manifest)
    tag = forger.key.tag(TO_RECEIVER, 2, signed, [memoryview(payload.numpy())])
    await forger.send_raw(seal(protocol.encode(tid, 1, layer_manifest=manifest), tag), payload)


def test_a_payload_maced_through_its_digest(backend: str) -> None:
    """A sender may MAC a payload through its keyed digest (what a GPU sender does): the
    receiver computes the same digest where the payload landed; a changed byte fails it."""

    async def one(tamper: bool) -> tuple[TransferState, bool]:
        decode = _decode(backend)
        receiver = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=10)
        forger = Forger(await make_raw_peer(backend), receiver, auth=AUTH)
        try:
            await forger.hello()
            await forger.handshake()
            await forger.next_reply("handshake_ack", 10.0)
            assert forger.key is not None
            for layer_idx in range(LAYOUT.num_layers):
                manifest = transfer_pb2.LayerManifest(
                    layer_idx=layer_idx, block_offset=0, num_blocks=3,
                    num_bytes=LAYOUT.layer_bytes(3), token_end=NUM_TOKENS, payload_digest=True,
                )  # fmt: skip
                payload = torch.full((2, 3, *LAYOUT.block_shape), 1.0).view(torch.uint8)
                payload = payload.flatten()
                body = protocol.encode(receiver.transfer_id, forger.seq, layer_manifest=manifest)
                part = digest_part(forger.key, payload)
                header = seal(body, forger.key.tag(TO_RECEIVER, forger.seq, body, part))
                forger.seq += 1
                if tamper and layer_idx == 1:
                    payload = payload.clone()
                    payload[3] ^= 0x40
                await forger.send_raw(header, payload)
            await forger.first_token()
            return await receiver.wait(timeout_s=10), receiver.error is None
        finally:
            await decode.close()
            await forger.peer.transport.close()

    assert run(one(tamper=False)) == (TransferState.SUCCESS, True)
    assert run(one(tamper=True)) == (TransferState.FAILED, False)


def test_a_late_hello_gets_a_refusal_proved_with_the_secret(backend: str) -> None:
    async def scenario() -> tuple[TransferState, str, float]:
        prefill = KVTransferManager(make_transport(backend), LAYOUT, auth=AUTH)
        decode = _decode(backend)
        receiver = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=10)
        receiver.abort("the router cancelled it")
        started = time.monotonic()
        sender = prefill.create_sender(receiver.ticket(), timeout_s=10)
        state = await sender.wait(timeout_s=10)
        await prefill.close()
        await decode.close()
        return state, sender.error or "", time.monotonic() - started

    state, error, elapsed_s = run(scenario())
    assert state == TransferState.FAILED and "the receiver refused the transfer" in error, error
    assert "cancelled" in error and elapsed_s < 5.0  # at once, not at the sender's deadline


def test_a_sender_ignores_challenges_it_cannot_trust(backend: str) -> None:
    """A receiver played by hand: a challenge without the secret's proof, and one for another
    connection, are ignored; the receiver's proved one for this connection is taken."""

    async def scenario() -> tuple[list[bool], bool]:
        prefill = KVTransferManager(make_transport(backend), LAYOUT, auth=AUTH)
        receiver = await make_raw_peer(backend)
        ticket = issue_ticket(AUTH, 10, "t-hand", receiver.transport.address, DST_BLOCK_IDS,
                              LAYOUT.layout_hash(), NUM_TOKENS, "")  # fmt: skip
        sender = prefill.create_sender(ticket, timeout_s=10, ceiling_s=10)
        await wait_until(lambda: len(receiver.received) == 1, 10.0)  # the hello
        connection, _ = receiver.received[0]
        taken = []
        for challenge in (
            make_challenge(None, "t-hand", connection, nonce=bytes(16)),  # no proof
            make_challenge(AUTH, "t-hand", connection + "-not", nonce=bytes(16)),
            make_challenge(AUTH, "t-hand", connection, nonce=bytes(16)),
        ):
            header = protocol.encode("t-hand", 0, challenge=challenge)
            await receiver.transport.send(prefill.address, header)
            await asyncio.sleep(0.1)
            taken.append(sender.frames.key is not None)
        finished = sender.finished
        await prefill.close()
        await receiver.transport.close()
        return taken, finished

    taken, finished = run(scenario())
    assert taken == [False, False, True] and not finished


def test_an_unreachable_receiver_fails_the_sender_within_the_connect_timeout() -> None:
    async def scenario(dead: str) -> tuple[float, TransferState, str, float]:
        transport = TcpTransport(connect_timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(TransportError, match="could not connect"):
            await transport.send(dead, b"hello?")
        raw_s = time.monotonic() - started
        prefill = KVTransferManager(transport, LAYOUT)
        decode = KVTransferManager(make_transport("tcp"), LAYOUT, sentinel_caches(LAYOUT, 12))
        ticket = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=30).ticket()
        ticket.dst_address = dead
        started = time.monotonic()
        sender = prefill.create_sender(ticket, timeout_s=30, ceiling_s=30)
        state = await sender.wait(timeout_s=10)  # not started: the hello alone finds out
        elapsed_s = time.monotonic() - started
        await prefill.close()
        await decode.close()
        return raw_s, state, sender.error or "", elapsed_s

    with unlistened_port() as port:  # held: nothing can start to listen there meanwhile
        raw_s, state, error, elapsed_s = run(scenario(f"tcp://127.0.0.1:{port}"))
    assert raw_s < 5.0 and elapsed_s < 5.0, (raw_s, elapsed_s)
    assert state == TransferState.FAILED and "could not reach the receiver" in error, error


def test_an_encrypted_transfer_lands_byte_exact_and_shows_no_plaintext(backend: str) -> None:
    """--kv-encrypt: the payloads and the first token on the wire are ciphertext (no layer's
    bytes, nor the token, appear in what the transport carried); the receiver decrypts them
    after their MAC verified; a receiver that requires encryption refuses a sender without."""

    async def scenario() -> tuple[TransferState, bool, bool, int, TransferState, str]:
        src = random_caches(LAYOUT, 8)
        prefill = KVTransferManager(make_transport(backend), LAYOUT, auth=AUTH, encrypt=True)
        decode = KVTransferManager(
            make_transport(backend), LAYOUT, sentinel_caches(LAYOUT, 12), auth=AUTH, encrypt=True
        )
        wire: list[tuple[bytes, bytes]] = []
        transport = prefill._transport.inner
        real = transport.send_many

        async def record(peer_address: str, messages: list) -> None:
            for header, payload in messages:
                data = b"" if payload is None else payload.numpy().tobytes()
                wire.append((bytes(header), data))
            await real(peer_address, messages)

        transport.send_many = record
        receiver = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=10)
        sender = prefill.create_sender(receiver.ticket(), timeout_s=10)
        for layer_idx, (k, v) in enumerate(src):
            await sender.send_layer(layer_idx, k, v, [5, 0, 7])
        await sender.send_first_token(321)
        state = await receiver.wait(timeout_s=10)
        exact = all(torch.equal(k[DST_BLOCK_IDS[:3]], src[i][0][[5, 0, 7]])
                    for i, (k, _) in enumerate(caches(decode)))  # fmt: skip
        plain = [src[i][0][[5, 0, 7]].numpy().tobytes()[:64] for i in range(LAYOUT.num_layers)]
        hidden = all(p not in data for p in plain for _, data in wire)
        sent_tokens = [m.first_token for m in map(protocol.decode, (h for h, _ in wire))
                       if protocol.kind_of(m) == "first_token"]  # fmt: skip
        hidden &= [(t.token_id, bool(t.sealed)) for t in sent_tokens] == [(0, True)]
        token = receiver.first_token.token_id if receiver.first_token else -1
        open_prefill = KVTransferManager(make_transport(backend), LAYOUT, auth=AUTH)
        refused = decode.create_receiver([0, 1, 3], NUM_TOKENS, timeout_s=10)
        plain_sender = open_prefill.create_sender(refused.ticket(), timeout_s=10)
        refused_state = await plain_sender.wait(timeout_s=10)
        for manager in (prefill, decode, open_prefill):
            await manager.close()
        return state, exact, hidden, token, refused_state, plain_sender.error or ""

    state, exact, hidden, token, refused_state, error = run(scenario())
    assert state == TransferState.SUCCESS and exact and token == 321
    assert hidden, "a layer's bytes crossed the transport in clear"
    assert refused_state == TransferState.FAILED and "encrypted KV frames only" in error, error
