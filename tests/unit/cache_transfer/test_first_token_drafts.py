"""Speculative decoding's drafts ride in the FirstToken message (protocol 7): the receiver gets
them as sent; more than 16 (the engine's bound on K) fail the transfer, so the decode node
prefills locally instead of trusting the message. With a cluster secret the frame's MAC covers
them (one changed in flight fails the transfer); encrypted (--kv-encrypt) they are sealed with
the token, never in clear on the wire, and bounded once opened."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch
from transfer_helpers import NodePair, make_layout, make_pair, random_caches, run, sentinel_caches

from cache_transfer import (
    KVReceiver,
    KVTransferManager,
    TransferState,
    make_transport,
    pack_layer,
    protocol,
)
from cache_transfer.frame_auth.frame_key import seal
from cache_transfer.receiver_checks import MAX_DRAFT_TOKENS
from pdserve.security import ClusterAuth

pytestmark = pytest.mark.timeout(60)

AUTH = ClusterAuth(b"cluster-secret-0123456789abcdef")
DRAFTS = [11, 12, 13, 14]


@pytest.mark.parametrize("num_drafts", [0, 4, MAX_DRAFT_TOKENS, MAX_DRAFT_TOKENS + 1])
def test_drafts_travel_with_the_first_token(backend: str, num_drafts: int) -> None:
    drafts = [(7 * i + 3) % 50 for i in range(num_drafts)]

    async def scenario() -> None:
        pair = await make_pair(backend, make_layout(block_size=4))
        receiver = pair.decode.create_receiver([5, 6, 7, 8], num_tokens=14, timeout_s=10)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        src_ids = [3, 1, 2, 0]
        packed = [torch.empty(pair.layout.layer_bytes(4), dtype=torch.uint8) for _ in pair.src_caches]  # fmt: skip
        for (k_cache, v_cache), out in zip(pair.src_caches, packed):
            pack_layer(k_cache, v_cache, src_ids, out)
        try:
            await asyncio.wait_for(sender.send_packed_layers(list(enumerate(packed))), 10)
            await asyncio.wait_for(sender.send_first_token(9, None, "", drafts), 10)
            state = await asyncio.wait_for(receiver.wait(), 10)
            if num_drafts <= MAX_DRAFT_TOKENS:
                assert state == TransferState.SUCCESS
                assert receiver.first_token is not None
                assert receiver.first_token.token_id == 9
                assert list(receiver.first_token.draft_token_ids) == drafts
            else:
                assert state == TransferState.FAILED
                assert f"{num_drafts} draft tokens, at most {MAX_DRAFT_TOKENS}" in receiver.error
            await asyncio.wait_for(sender.wait(), 10)
        finally:
            await pair.close()

    run(scenario())


def _secured_pair(backend: str, encrypt: bool) -> NodePair:
    layout = make_layout(block_size=4)
    src, dst = random_caches(layout, 32), sentinel_caches(layout, 40)
    prefill = KVTransferManager(make_transport(backend), layout, auth=AUTH, encrypt=encrypt)
    decode = KVTransferManager(make_transport(backend), layout, dst, auth=AUTH, encrypt=encrypt)
    return NodePair(layout, prefill, decode, src, dst)


async def _hand_off(
    pair: NodePair, drafts: list[int], rewrite: Callable[[bytes], bytes] | None = None
) -> tuple[TransferState, KVReceiver]:
    """Every layer, then token 9 with `drafts`; `rewrite(header) -> header` sees each message
    the prefill side puts on the wire. The receiver's state, and the receiver."""
    wire = pair.prefill._transport.inner
    real = wire.send_many

    async def through(peer_address: str, messages: list[tuple[bytes, object]]) -> None:
        if rewrite is not None:
            messages = [(rewrite(bytes(header)), payload) for header, payload in messages]
        await real(peer_address, messages)

    wire.send_many = through
    receiver = pair.decode.create_receiver([5, 6, 7, 8], num_tokens=14, timeout_s=10)
    sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
    try:
        for layer_idx, (k, v) in enumerate(pair.src_caches):
            await asyncio.wait_for(sender.send_layer(layer_idx, k, v, [3, 1, 2, 0]), 10)
        await asyncio.wait_for(sender.send_first_token(9, None, "", drafts), 10)
        state = await asyncio.wait_for(receiver.wait(), 10)
        await asyncio.wait_for(sender.wait(), 10)
        return state, receiver
    finally:
        await pair.close()


def test_a_draft_changed_in_flight_fails_the_mac(backend: str) -> None:
    """An on-path attacker rewrites the first draft and keeps the frame's MAC."""
    seen: list[list[int]] = []

    def forge(header: bytes) -> bytes:
        msg = protocol.decode(header)
        if protocol.kind_of(msg) != "first_token":
            return header
        seen.append(list(msg.first_token.draft_token_ids))
        mac = msg.mac
        msg.ClearField("mac")
        msg.first_token.draft_token_ids[0] += 1
        return seal(msg.SerializeToString(), mac)

    async def scenario() -> None:
        honest, receiver = await _hand_off(_secured_pair(backend, False), DRAFTS)
        assert honest == TransferState.SUCCESS
        assert list(receiver.first_token.draft_token_ids) == DRAFTS
        forged, receiver = await _hand_off(_secured_pair(backend, False), DRAFTS, forge)
        assert seen == [DRAFTS]  # in clear without --kv-encrypt, but MACed
        assert forged == TransferState.FAILED
        assert "MAC does not verify" in receiver.error, receiver.error
        assert receiver.first_token is None

    run(scenario())


@pytest.mark.parametrize("num_drafts", [len(DRAFTS), MAX_DRAFT_TOKENS + 1])
def test_encrypted_drafts_are_sealed_with_the_token(backend: str, num_drafts: int) -> None:
    drafts = [(5 * i + 11) % 50 for i in range(num_drafts)]
    on_wire: list[tuple[list[int], int, bool]] = []

    def record(header: bytes) -> bytes:
        msg = protocol.decode(header)
        if protocol.kind_of(msg) == "first_token":
            token = msg.first_token
            on_wire.append((list(token.draft_token_ids), token.token_id, bool(token.sealed)))
        return header

    async def scenario() -> None:
        state, receiver = await _hand_off(_secured_pair(backend, True), drafts, record)
        assert on_wire == [([], 0, True)]  # nothing of the token or its drafts in clear
        if num_drafts <= MAX_DRAFT_TOKENS:
            assert state == TransferState.SUCCESS
            assert receiver.first_token.token_id == 9
            assert list(receiver.first_token.draft_token_ids) == drafts
        else:  # counted once opened: sealing hides no excess
            assert state == TransferState.FAILED
            assert f"{num_drafts} draft tokens, at most {MAX_DRAFT_TOKENS}" in receiver.error

    run(scenario())
