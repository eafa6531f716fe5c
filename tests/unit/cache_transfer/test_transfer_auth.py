"""Issue 15: with a cluster secret, tickets are signed by the decode node and KV handshakes
prove the secret. A forged ticket (any dst_address) makes the prefill node contact nobody; a
sender without the secret writes nothing, even with a real ticket; honest peers still work."""

from __future__ import annotations

import asyncio

import pytest
from forger import DST_BLOCK_IDS, LAYOUT, NUM_TOKENS, Forger, no_marker
from transfer_helpers import (
    make_layout,
    make_raw_peer,
    messages_handled,
    random_caches,
    run,
    sentinel_caches,
    wait_until,
)

from cache_transfer import KVTransferManager, TransferState, make_transport
from pdserve.security import ClusterAuth

pytestmark = pytest.mark.timeout(60)

AUTH = ClusterAuth(b"cluster-secret-0123456789abcdef")


def _decode(backend: str, auth: ClusterAuth | None = AUTH) -> KVTransferManager:
    return KVTransferManager(
        make_transport(backend), LAYOUT, sentinel_caches(LAYOUT, num_blocks=12), auth=auth
    )


def test_honest_peers_with_the_secret_transfer(backend: str) -> None:
    async def scenario():
        layout = make_layout()
        src = random_caches(layout, 8)
        prefill = KVTransferManager(make_transport(backend), layout, auth=AUTH)
        decode = KVTransferManager(
            make_transport(backend), layout, sentinel_caches(layout, 12), auth=AUTH
        )
        receiver = decode.create_receiver([3, 1, 7], num_tokens=10, timeout_s=10)
        ticket = receiver.ticket()
        assert len(ticket.signature) == 32 and ticket.expires_at_unix_s > 0
        sender = prefill.create_sender(ticket, timeout_s=10)
        for layer in range(layout.num_layers):
            k, v = src[layer]
            await sender.send_layer(layer, k, v, [0, 1, 2])
        await sender.send_first_token(5)
        states = await asyncio.gather(receiver.wait(), sender.wait())
        await prefill.close()
        await decode.close()
        return states

    assert run(scenario()) == [TransferState.SUCCESS, TransferState.SUCCESS]


@pytest.mark.parametrize("forgery", ["unsigned", "other-address", "other-blocks", "bad-key"])
def test_a_forged_ticket_contacts_nobody(backend: str, forgery: str) -> None:
    async def scenario():
        victim = await make_raw_peer(backend)  # the address a forger aims the prefill node at
        decode = _decode(backend)
        receiver = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=10)
        ticket = receiver.ticket()
        if forgery == "unsigned":
            ticket.ClearField("signature")
            ticket.dst_address = victim.transport.address
        elif forgery == "other-address":
            ticket.dst_address = victim.transport.address
        elif forgery == "other-blocks":
            ticket.dst_address = victim.transport.address
            ticket.dst_block_ids[0] = 0
        else:
            other = KVTransferManager(
                make_transport(backend), LAYOUT, sentinel_caches(LAYOUT, 12),
                auth=ClusterAuth(b"another-cluster-secret-0123456"),
            )  # fmt: skip
            ticket = other.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=10).ticket()
            ticket.dst_address = victim.transport.address
            await other.close()
        prefill = KVTransferManager(make_transport(backend), LAYOUT, auth=AUTH)
        sender = prefill.create_sender(ticket, timeout_s=10)
        state = await sender.wait(timeout_s=5)
        await asyncio.sleep(0.3)  # anything sent would have arrived by now
        received = list(victim.received)
        await prefill.close()
        await decode.close()
        await victim.transport.close()
        return state, sender.error, received

    state, error, received = run(scenario())
    assert state == TransferState.FAILED
    assert "refused the ticket" in (error or "")
    assert received == []  # the prefill node sent nothing to the forged address


def test_a_sender_without_the_secret_writes_nothing_even_with_a_real_ticket(backend: str):
    async def scenario():
        decode = _decode(backend)
        receiver = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=1.5)
        forger = Forger(await make_raw_peer(backend), receiver)
        await forger.handshake()  # no proof: ignored, not answered
        for layer in range(LAYOUT.num_layers):
            await forger.layer(layer)
        await forger.first_token()
        state = await receiver.wait()  # the deadline: the decode node then prefills itself
        replies = list(forger.peer.received)
        clean = no_marker(decode)
        await decode.close()
        await forger.peer.transport.close()
        return state, replies, clean, receiver.num_bytes_received

    state, replies, clean, num_bytes = run(scenario())
    assert state == TransferState.FAILED
    assert clean and num_bytes == 0
    assert replies == []  # not even a refusal goes to an unproven src_address


def test_a_handshake_proof_for_another_transfer_is_refused(backend: str):
    async def scenario():
        decode = _decode(backend)
        first = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=1.5)
        second = decode.create_receiver([0, 1, 3, 5], NUM_TOKENS, timeout_s=1.5)
        from cache_transfer.tickets import handshake_proof

        forger = Forger(await make_raw_peer(backend), second, auth=AUTH)
        await forger.hello()  # second's challenge for the forger's connection
        proof = handshake_proof(AUTH, first.ticket(), forger.peer.transport.address,
                                forger.nonce or b"", forger.connection)  # fmt: skip
        await forger.handshake(proof=proof)  # a proof made for another transfer
        await forger.layer(0)
        state = await second.wait()
        clean = no_marker(decode)
        first.abort("test over")
        await decode.close()
        await forger.peer.transport.close()
        return state, clean

    state, clean = run(scenario())
    assert state == TransferState.FAILED and clean


def test_no_secret_keeps_the_open_protocol(backend: str):
    """Without a secret (an open cluster) tickets carry no signature and work as before."""

    async def scenario():
        decode = _decode(backend, auth=None)
        ticket = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=5).ticket()
        await decode.close()
        return ticket

    ticket = run(scenario())
    assert ticket.signature == b"" and ticket.expires_at_unix_s == 0


def test_with_the_secret_only_a_proven_sender_takes_a_session_over(backend: str):
    """The prefill retry's takeover under a cluster secret: a handshake without a proof is
    ignored (the first sender keeps the session), one proving the secret takes it over."""

    async def scenario():
        decode = _decode(backend)
        receiver = decode.create_receiver(DST_BLOCK_IDS, NUM_TOKENS, timeout_s=10)
        first = Forger(await make_raw_peer(backend), receiver, auth=AUTH)
        retry = Forger(await make_raw_peer(backend), receiver, auth=AUTH)
        unproven = Forger(await make_raw_peer(backend), receiver)
        peers = [first, unproven, retry]
        try:
            await first.hello()
            await first.handshake()
            await first.layer(0, value=1.0)
            await wait_until(lambda: receiver.state == TransferState.TRANSFERRING, 10.0)
            handled = messages_handled(decode)  # from here: the unproven handshake only
            await unproven.handshake()  # no proof: ignored, the session stays the first's
            await wait_until(lambda: handled == ["complete"], 10.0)
            kept = receiver.state == TransferState.TRANSFERRING and not unproven.peer.received
            await retry.hello()
            await retry.handshake()
            for layer in range(LAYOUT.num_layers):
                await retry.layer(layer, value=2.0)
            await retry.first_token()
            state = await receiver.wait(timeout_s=5)
            k_cache, _ = decode._kv_caches[0]
            return kept, state, bool((k_cache[DST_BLOCK_IDS[:3]] == 2.0).all()), receiver.error
        finally:
            await decode.close()
            for forger in peers:
                await forger.peer.transport.close()

    kept, state, landed, error = run(scenario())
    assert kept and state == TransferState.SUCCESS and landed, error
