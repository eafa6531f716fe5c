"""Issue 39, item 1: a passive observer of a secured hand-off cannot take it over. It captures
the honest sender's hello and handshake off the wire and replays them byte for byte from its
own connection, then sends layers of its own and a first token: the receiver drops all of it
(the proof covers the nonce it challenged the honest connection with, and that connection),
no forged byte lands, and the honest transfer completes byte-exact. A proof is accepted once."""

from __future__ import annotations

import asyncio

import pytest
import torch
from forger import DST_BLOCK_IDS, LAYOUT, MARKER, NUM_TOKENS, Forger, caches, no_marker
from transfer_helpers import make_raw_peer, random_caches, run, sentinel_caches, wait_until

from cache_transfer import KVTransferManager, TransferState, make_transport, protocol
from pdserve.security import ClusterAuth

pytestmark = pytest.mark.timeout(60)

AUTH = ClusterAuth(b"cluster-secret-0123456789abcdef")
SRC_BLOCK_IDS = [5, 0, 7]


def captured(manager: KVTransferManager) -> list[bytes]:
    """Every header `manager` sends from now on, as it went on the wire."""
    headers: list[bytes] = []
    transport = manager._transport.inner
    real = transport.send_many

    async def send_many(peer_address: str, messages: list) -> None:
        headers.extend(bytes(header) for header, _ in messages)
        await real(peer_address, messages)

    transport.send_many = send_many  # type: ignore[method-assign]
    return headers


def of_kind(headers: list[bytes], kind: str) -> bytes:
    return next(h for h in headers if protocol.kind_of(protocol.decode(h)) == kind)


def test_a_captured_handshake_replayed_from_another_connection_is_worthless(backend: str):
    async def scenario() -> tuple[TransferState, str | None, bool, bool, list]:
        src = random_caches(LAYOUT, 8)
        prefill = KVTransferManager(make_transport(backend), LAYOUT, auth=AUTH)
        decode = KVTransferManager(
            make_transport(backend), LAYOUT, sentinel_caches(LAYOUT, 12), auth=AUTH
        )
        wire = captured(prefill)
        receiver = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=10)
        sender = prefill.create_sender(receiver.ticket(), timeout_s=10)
        attacker = Forger(await make_raw_peer(backend), receiver)  # no secret
        try:
            await wait_until(lambda: receiver.state == TransferState.WAITING, 10.0)
            await attacker.send_raw(of_kind(wire, "hello"))  # a challenge for its connection...
            outstanding = receiver.challenges.outstanding  # ...goes to the honest sender: ignored
            await wait_until(lambda: attacker.connection in outstanding(), 10.0)
            await attacker.send_raw(of_kind(wire, "handshake"))  # byte for byte
            attacker.seq = 1
            for layer_idx in range(LAYOUT.num_layers):
                await attacker.layer(layer_idx, value=MARKER)
            await attacker.first_token()
            for layer_idx, (k, v) in enumerate(src):
                await sender.send_layer(layer_idx, k, v, SRC_BLOCK_IDS)
            await sender.send_first_token(5)
            states = await asyncio.gather(receiver.wait(timeout_s=10), sender.wait(timeout_s=10))
            landed = all(
                torch.equal(k[DST_BLOCK_IDS[:3]], src[i][0][SRC_BLOCK_IDS])
                and torch.equal(v[DST_BLOCK_IDS[:3]], src[i][1][SRC_BLOCK_IDS])
                for i, (k, v) in enumerate(caches(decode))
            )
            replies = [protocol.kind_of(protocol.decode(h)) for _, h in attacker.peer.received]
            return states[0], receiver.error, landed, no_marker(decode), replies
        finally:
            await prefill.close()
            await decode.close()
            await attacker.peer.transport.close()

    state, error, landed, clean, replies = run(scenario())
    assert state == TransferState.SUCCESS, error
    assert landed and clean, "the honest KV landed, none of the attacker's"
    assert replies == [], "the attacker got nothing (its challenge went to the honest sender)"


def test_a_handshake_proof_is_accepted_once(backend: str):
    """A proving sender's handshake, replayed by another connection that holds the secret and
    a challenge of its own, is not a takeover: the proof covers the first connection's nonce,
    which its handshake used."""

    async def scenario() -> tuple[TransferState, str | None, bool, list]:
        decode = KVTransferManager(
            make_transport(backend), LAYOUT, sentinel_caches(LAYOUT, 12), auth=AUTH
        )
        receiver = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=10)
        first = Forger(await make_raw_peer(backend), receiver, auth=AUTH)
        second = Forger(await make_raw_peer(backend), receiver, auth=AUTH)
        try:
            await first.hello()
            await first.handshake()
            await first.next_reply("handshake_ack", 10.0)
            await second.hello()
            await second.send_raw(first.headers[0])  # first's handshake, on second's connection
            await second.layer(0, value=MARKER, seq=1)  # (MACed under second's own key)
            for layer_idx in range(LAYOUT.num_layers):
                await first.layer(layer_idx, value=1.0)
            await first.first_token()
            state = await receiver.wait(timeout_s=10)
            replies = [protocol.kind_of(protocol.decode(h)) for _, h in second.peer.received]
            return state, receiver.error, no_marker(decode), replies
        finally:
            await decode.close()
            for forger in (first, second):
                await forger.peer.transport.close()

    state, error, clean, replies = run(scenario())
    assert state == TransferState.SUCCESS and clean, error
    assert replies == ["challenge"], replies  # its own challenge, nothing more


def test_the_same_connection_cannot_prove_a_used_challenge_again(backend: str):
    """The nonce is taken by the handshake that proved it: after a takeover the first sender,
    superseded, cannot come back with its old proof, nor can anyone reuse it."""

    async def scenario() -> tuple[bool, dict]:
        decode = KVTransferManager(
            make_transport(backend), LAYOUT, sentinel_caches(LAYOUT, 12), auth=AUTH
        )
        receiver = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=10)
        first = Forger(await make_raw_peer(backend), receiver, auth=AUTH)
        try:
            await first.hello()
            outstanding = receiver.challenges.outstanding()
            await first.handshake()
            await first.next_reply("handshake_ack", 10.0)
            return first.connection in outstanding, receiver.challenges.outstanding()
        finally:
            await decode.close()
            await first.peer.transport.close()

    issued, left = run(scenario())
    assert issued and left == {}, "the challenge was issued, then taken by the handshake"
