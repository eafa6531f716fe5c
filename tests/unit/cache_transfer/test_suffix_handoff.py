"""Suffix-only hand-offs (`KVSuffix`): a receiver that holds the prompt's first blocks gets
only the rest, once per backend: exact bytes into the reserved blocks (counted on both sides,
the held ones as skipped), chunked and packed layers, the ticket's count signed, and a sender
that sends the held blocks, or claims another count, is refused. With a cluster secret the
hand-off is challenged and MACed as any other, the handshake's count under its MAC."""

from __future__ import annotations

import pytest
import torch
from forger import LAYOUT, MARKER, NUM_TOKENS, Forger, no_marker
from transfer_helpers import (
    make_layout,
    make_pair,
    make_raw_peer,
    run,
    sentinel_caches,
    untouched,
    wait_until,
)

from cache_transfer import KVTransferManager, TransferState, make_transport, pack_layer, protocol
from cache_transfer.frame_auth.frame_key import TO_RECEIVER, seal
from cache_transfer.packing.block_ids import check_block_ids
from cache_transfer.suffix import KVSuffix
from cache_transfer.tickets import check_ticket, ticket_misfit
from pdserve.security import ClusterAuth
from pdserve.v1 import transfer_pb2

pytestmark = pytest.mark.timeout(60)

AUTH = ClusterAuth(b"cluster-secret-0123456789abcdef")


def test_suffix_spans() -> None:
    suffix = KVSuffix(block_size=4, num_tokens=14, num_cached_blocks=2)
    assert (suffix.cached_tokens, suffix.num_blocks) == (8, 2)
    assert suffix.span(8, 14) == (0, 2)  # prompt blocks 2, 3 -> dst blocks 0, 1
    assert suffix.span(8, 10) == (0, 1) and suffix.span(10, 14) == (0, 2)  # partial resent
    with pytest.raises(ValueError, match="at least one"):
        KVSuffix(block_size=4, num_tokens=8, num_cached_blocks=2)  # nothing left to send
    with pytest.raises(ValueError, match="at least one"):
        KVSuffix(block_size=4, num_tokens=8, num_cached_blocks=-1)


@pytest.mark.parametrize("chunks", [(14,), (10, 13, 14)], ids=["whole", "chunked"])
def test_only_the_blocks_the_receiver_lacks_travel(backend: str, chunks: tuple[int, ...]) -> None:
    async def scenario() -> None:
        layout = make_layout(block_size=4)  # 14 tokens: 4 blocks, the receiver holds 2
        pair = await make_pair(backend, layout)
        dst_ids = [11, 5, 30]  # ceil(15 / 4) - 2 blocks: 2 receive KV, the 3rd stays free
        receiver = pair.decode.create_receiver(dst_ids, 14, timeout_s=10, num_cached_blocks=2)
        ticket = receiver.ticket()
        assert ticket.num_cached_blocks == 2
        sender = pair.prefill.create_sender(ticket, timeout_s=10)
        assert sender.num_blocks == receiver.num_blocks == 2
        src_ids = [7, 3, 20, 9]  # the whole prompt's table on the sender
        for token_end in chunks:
            for layer_idx in range(layout.num_layers):
                k_cache, v_cache = pair.src_caches[layer_idx]
                await sender.send_layer(layer_idx, k_cache, v_cache, src_ids, token_end)
        await sender.send_first_token(42)
        assert await receiver.wait() == TransferState.SUCCESS
        assert await sender.wait() == TransferState.SUCCESS
        for (src_k, src_v), (dst_k, dst_v) in zip(pair.src_caches, pair.dst_caches, strict=True):
            assert torch.equal(dst_k[[11, 5]], src_k[[20, 9]])
            assert torch.equal(dst_v[[11, 5]], src_v[[20, 9]])
        others = [b for b in range(40) if b not in (11, 5)]
        assert untouched([(k[others], v[others]) for k, v in pair.dst_caches])
        held = layout.num_layers * layout.layer_bytes(2)
        assert sender.num_bytes_skipped == receiver.num_bytes_skipped == held
        if len(chunks) == 1:
            assert sender.num_bytes_sent == receiver.num_bytes_received == held
        await pair.close()

    run(scenario())


def test_packed_suffix_layers(backend: str) -> None:
    async def scenario() -> None:
        layout = make_layout(block_size=4)
        pair = await make_pair(backend, layout)
        receiver = pair.decode.create_receiver([8, 1], 11, timeout_s=10, num_cached_blocks=1)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        suffix_ids = check_block_ids([6, 2], 32, torch.device("cpu"))  # prompt blocks 1, 2
        packed = []
        for layer_idx, (k_cache, v_cache) in enumerate(pair.src_caches):
            payload = torch.empty(layout.layer_bytes(2), dtype=torch.uint8)
            packed.append((layer_idx, pack_layer(k_cache, v_cache, suffix_ids, payload)))
        await sender.send_packed_layers(packed)
        await sender.send_first_token(1)
        assert await receiver.wait() == TransferState.SUCCESS
        for (src_k, _), (dst_k, _) in zip(pair.src_caches, pair.dst_caches, strict=True):
            assert torch.equal(dst_k[[8, 1]], src_k[[6, 2]])
        await pair.close()

    run(scenario())


def test_the_sender_checks_the_count_against_the_prompt() -> None:
    async def scenario() -> None:
        caches = sentinel_caches(LAYOUT, 8)
        manager = KVTransferManager(make_transport("local"), LAYOUT, caches)
        receiver = manager.create_receiver([1, 2], NUM_TOKENS, 5, num_cached_blocks=1)
        ticket = receiver.ticket()
        assert ticket_misfit(LAYOUT, ticket) is None
        ticket.num_cached_blocks = 3  # 12 tokens held of a 10-token prompt
        assert "at least one" in (ticket_misfit(LAYOUT, ticket) or "")
        ticket.num_cached_blocks = 0  # the whole prompt: 3 blocks, 2 reserved
        assert "2 dst blocks for 3" in (ticket_misfit(LAYOUT, ticket) or "")
        await manager.close()

    run(scenario())


def test_the_count_is_signed() -> None:
    async def scenario() -> None:
        auth = ClusterAuth(b"s" * 32)
        caches = sentinel_caches(LAYOUT, 8)
        manager = KVTransferManager(make_transport("local"), LAYOUT, caches, auth=auth)
        receiver = manager.create_receiver([1, 2], NUM_TOKENS, 5, num_cached_blocks=1)
        ticket = receiver.ticket()
        assert check_ticket(auth, ticket) is None
        ticket.num_cached_blocks = 0  # a forger asks for the held blocks too
        assert "does not verify" in (check_ticket(auth, ticket) or "")
        await manager.close()

    run(scenario())


async def _suffix_session(backend: str):
    dst = sentinel_caches(LAYOUT, num_blocks=12)
    manager = KVTransferManager(make_transport(backend), LAYOUT, dst)
    receiver = manager.create_receiver([6, 2, 9], NUM_TOKENS, 10, num_cached_blocks=1)
    return manager, receiver, Forger(await make_raw_peer(backend), receiver)


@pytest.mark.parametrize(
    "handshake, layer",
    [
        (dict(num_blocks=2, num_cached_blocks=1), dict(block_offset=0, num_blocks=3)),  # held too
        (dict(num_blocks=3, num_cached_blocks=0), None),  # claims the whole prompt
        (dict(num_blocks=2, num_cached_blocks=2), None),  # claims more held than there is
    ],
    ids=["sends-held-blocks", "whole-prompt", "wrong-count"],
)
def test_a_sender_that_ignores_the_held_prefix_is_refused(backend, handshake, layer) -> None:
    async def scenario() -> None:
        manager, receiver, forger = await _suffix_session(backend)
        await forger.handshake(**handshake)
        if layer is not None:
            await forger.layer(0, payload_blocks=layer["num_blocks"], **layer)
        assert await receiver.wait() == TransferState.FAILED
        await wait_until(lambda: receiver.finished)
        assert no_marker(manager)
        await manager.close()  # first, as the other forger tests do (ucx: the raw peer
        await forger.peer.transport.close()  # closed first crashed ucxx's close)

    run(scenario())


def test_a_well_behaved_suffix_sender_by_hand(backend: str) -> None:
    """The forger sends exactly the suffix: it lands (the forger's view of the protocol)."""

    async def scenario() -> None:
        manager, receiver, forger = await _suffix_session(backend)
        await forger.handshake(num_blocks=2, num_cached_blocks=1)
        for layer_idx in range(LAYOUT.num_layers):
            await forger.layer(
                layer_idx, payload_blocks=2, num_blocks=2, num_bytes=LAYOUT.layer_bytes(2)
            )
        await forger.first_token()
        assert await receiver.wait() == TransferState.SUCCESS
        k_cache = manager._kv_caches[0][0]
        assert bool((k_cache[[6, 2]] == MARKER).all()) and not bool((k_cache[9] == MARKER).any())
        await manager.close()  # first, as the other forger tests do (ucx: the raw peer
        await forger.peer.transport.close()  # closed first crashed ucxx's close)

    run(scenario())


def test_a_secured_suffix_hand_off(backend: str) -> None:
    """With a cluster secret: hello, challenge, a proved handshake, every frame MACed; only the
    blocks the receiver lacks travel."""

    async def scenario() -> None:
        layout = make_layout(block_size=4)
        pair = await make_pair(backend, layout, auth=AUTH)
        receiver = pair.decode.create_receiver([11, 5, 30], 14, timeout_s=10, num_cached_blocks=2)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        for layer_idx, (k_cache, v_cache) in enumerate(pair.src_caches):
            await sender.send_layer(layer_idx, k_cache, v_cache, [7, 3, 20, 9])
        await sender.send_first_token(42)
        assert await receiver.wait() == TransferState.SUCCESS
        assert await sender.wait() == TransferState.SUCCESS
        assert receiver.frames.key is not None and sender.frames.key is not None  # MACed
        for (src_k, src_v), (dst_k, dst_v) in zip(pair.src_caches, pair.dst_caches, strict=True):
            assert torch.equal(dst_k[[11, 5]], src_k[[20, 9]])
            assert torch.equal(dst_v[[11, 5]], src_v[[20, 9]])
        assert sender.num_bytes_sent == layout.num_layers * layout.layer_bytes(2)
        await pair.close()

    run(scenario())


def test_a_held_count_rewritten_in_flight_fails_the_handshake_mac(backend: str, caplog) -> None:
    """An on-path attacker rewrites a proved handshake's num_cached_blocks (the proof covers
    the ticket, not the handshake's fields): its MAC fails, so it is dropped, unanswered; the
    challenge it used is gone, and the receiver ends at its no-progress timeout, nothing
    written."""

    async def scenario() -> tuple[TransferState, str, bool, list[str]]:
        dst = sentinel_caches(LAYOUT, num_blocks=12)
        manager = KVTransferManager(make_transport(backend), LAYOUT, dst, auth=AUTH)
        receiver = manager.create_receiver([6, 2, 9], NUM_TOKENS, 2, num_cached_blocks=1)
        forger = Forger(await make_raw_peer(backend), receiver, auth=AUTH)
        try:
            await forger.hello()
            assert forger.key is not None
            handshake = transfer_pb2.TransferHandshake(
                protocol_version=protocol.PROTOCOL_VERSION, layout_hash=LAYOUT.layout_hash(),
                src_address=forger.peer.transport.address, num_layers=LAYOUT.num_layers,
                num_tokens=NUM_TOKENS, num_blocks=2, num_cached_blocks=1, proof=forger.proof(),
            )  # fmt: skip
            header = protocol.encode(receiver.transfer_id, 0, handshake=handshake)
            sealed = protocol.decode(seal(header, forger.key.tag(TO_RECEIVER, 0, header, [])))
            sealed.handshake.num_cached_blocks, sealed.handshake.num_blocks = 0, 3  # rewritten
            await forger.send_raw(sealed.SerializeToString())
            state = await receiver.wait(timeout_s=10)
            replies = [protocol.kind_of(protocol.decode(h)) for _, h in forger.peer.received]
            return state, receiver.error or "", no_marker(manager), replies
        finally:
            await manager.close()
            await forger.peer.transport.close()

    state, error, clean, replies = run(scenario())
    assert state == TransferState.FAILED and "num_cached_blocks" not in error, error
    assert "handshake message (seq 0) whose MAC does not verify" in caplog.text
    assert replies == ["challenge"] and clean  # no ack: the rewritten handshake went unheard
