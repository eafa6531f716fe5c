"""Writes in place: a sender on the receiver's own device lands each layer in the receiver's
blocks itself (no payload crosses the transport), exactly as a sent layer lands; a receiver
grants it only to a sender on its device; a failed transfer's blocks stay quarantined until the
sender says its writes drained, or its deadline is well past. (InProcessSharing stands in for
CUDA IPC: both managers in one process, caches on the CPU named as one "GPU".)"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transfer_helpers import SENTINEL, make_layout, random_caches, run, wait_until

from cache_transfer import (
    InProcessSharing,
    KVTransferManager,
    TransferState,
    make_transport,
    pack_layer,
)
from cache_transfer.in_place import receiver_grant
from cache_transfer.sender import KVSender
from pdserve.v1 import transfer_pb2

pytestmark = pytest.mark.timeout(60)


LAYOUT = make_layout(block_size=4)
DST_IDS = [5, 6, 7, 8]
SRC_IDS = [3, 1, 2, 0]
NUM_TOKENS = 14


def pool_caches(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sentinel caches as the engine's pool holds them: views of one allocation."""
    pool = torch.full(
        (LAYOUT.num_layers, 2, num_blocks, *LAYOUT.block_shape), SENTINEL, dtype=LAYOUT.torch_dtype
    )
    return [(pool[i, 0], pool[i, 1]) for i in range(LAYOUT.num_layers)]


async def managers(backend: str, src_device: str, dst_device: str, sharing=None):
    sharing = sharing or InProcessSharing()
    dst = pool_caches(40)
    prefill = KVTransferManager(
        make_transport(backend), LAYOUT, sharing=sharing, kv_device=torch.device("cpu"),
        kv_device_name=src_device,
    )  # fmt: skip
    decode = KVTransferManager(
        make_transport(backend), LAYOUT, dst, sharing=sharing, kv_device_name=dst_device
    )
    return prefill, decode, random_caches(LAYOUT, 32), dst


def packed(src, layer_idx: int) -> torch.Tensor:
    k_cache, v_cache = src[layer_idx]
    out = torch.empty(LAYOUT.layer_bytes(len(SRC_IDS)), dtype=torch.uint8)
    return pack_layer(k_cache, v_cache, SRC_IDS, out)


def counting_payloads(manager: KVTransferManager) -> list[int]:
    """Payload bytes `manager`'s transport sends from now on."""
    sent: list[int] = []
    send, send_many = manager._transport.send, manager._transport.send_many

    async def counting_send(address, header, payload=None):
        sent.append(0 if payload is None else payload.numel())
        await send(address, header, payload)

    async def counting_send_many(address, messages):
        sent.extend(0 if payload is None else payload.numel() for _, payload in messages)
        await send_many(address, messages)

    manager._transport.send, manager._transport.send_many = counting_send, counting_send_many
    return sent


@pytest.mark.parametrize("backend", ["local", "tcp"])
@pytest.mark.parametrize("same_device", [True, False])
def test_a_sender_on_the_receivers_device_writes_in_place(backend: str, same_device: bool) -> None:
    async def scenario() -> None:
        dst_device = "GPU-a" if same_device else "GPU-b"
        prefill, decode, src, dst = await managers(backend, "GPU-a", dst_device)
        receiver = decode.create_receiver(DST_IDS, NUM_TOKENS, timeout_s=10)
        landed: list[int] = []
        receiver.add_layer_callback(lambda layer_idx, _: landed.append(layer_idx))
        sender = prefill.create_sender(receiver.ticket(), timeout_s=10)
        payload_bytes = counting_payloads(prefill)
        layers = [(i, packed(src, i)) for i in range(LAYOUT.num_layers)]
        await sender.send_packed_layers(layers[:2])
        await sender.send_packed_layers(layers[2:])
        await sender.send_first_token(9)

        assert await receiver.wait() == TransferState.SUCCESS
        assert await sender.wait() == TransferState.SUCCESS
        assert sender.in_place == receiver.in_place == same_device
        for (src_k, src_v), (dst_k, dst_v) in zip(src, dst):
            assert torch.equal(dst_k[DST_IDS], src_k[SRC_IDS])
            assert torch.equal(dst_v[DST_IDS], src_v[SRC_IDS])
        assert bool((dst[0][0][:5] == SENTINEL).all())  # nothing outside the ticket's blocks
        assert sorted(landed) == list(range(LAYOUT.num_layers))
        assert receiver.num_bytes_received == sender.num_bytes_sent == 3 * LAYOUT.layer_bytes(4)
        assert (sum(payload_bytes) == 0) == same_device  # in place: no KV crossed the transport
        assert receiver.writes_settled.is_set()
        await prefill.close()
        await decode.close()

    run(scenario())


@pytest.mark.parametrize("same_device", [True, False])
def test_send_layers_copies_blocks_in_place_or_sends_them_packed(same_device: bool) -> None:
    async def scenario() -> None:
        prefill, decode, src, dst = await managers(
            "tcp", "GPU-a", "GPU-a" if same_device else "GPU-b"
        )
        receiver = decode.create_receiver(DST_IDS, NUM_TOKENS, timeout_s=10)
        sender = prefill.create_sender(receiver.ticket(), timeout_s=10)
        payload_bytes = counting_payloads(prefill)
        sent_messages = []
        send_many = prefill._transport.send_many

        async def counting_send_many(address, messages):
            sent_messages.append(len(messages))
            await send_many(address, messages)

        prefill._transport.send_many = counting_send_many
        layers = [(i, k, v) for i, (k, v) in enumerate(src)]
        with pytest.raises(ValueError, match="distinct layers"):
            await sender.send_layers([layers[0], layers[0]], SRC_IDS)
        await sender.send_layers(layers, SRC_IDS)  # every layer, one message
        await sender.send_first_token(9)

        assert await receiver.wait() == TransferState.SUCCESS
        assert sender.in_place == same_device
        for (src_k, src_v), (dst_k, dst_v) in zip(src, dst):
            assert torch.equal(dst_k[DST_IDS], src_k[SRC_IDS])
            assert torch.equal(dst_v[DST_IDS], src_v[SRC_IDS])
        assert bool((dst[0][0][:5] == SENTINEL).all())  # nothing outside the ticket's blocks
        # one message: sent, a manifest and payload per layer; in place, one manifest naming all
        assert (1 if same_device else LAYOUT.num_layers) in sent_messages
        assert (sum(payload_bytes) == 0) == same_device
        await prefill.close()
        await decode.close()

    run(scenario())


@pytest.mark.parametrize(
    ("more_layer_ids", "refusal"),
    [([0], "announced twice"), ([LAYOUT.num_layers], "outside"), ([1, 1], "announced twice")],
)
def test_a_manifest_naming_bad_layers_is_refused_and_lands_none(more_layer_ids, refusal) -> None:
    """A manifest of layers written in place names each layer once, each within the layout;
    otherwise the receiver fails the transfer and lands none of them."""

    async def scenario() -> None:
        prefill, decode, _, _ = await managers("tcp", "GPU-a", "GPU-a")
        receiver = decode.create_receiver(DST_IDS, NUM_TOKENS, timeout_s=10)
        landed: list[int] = []
        receiver.add_layer_callback(lambda layer_idx, _: landed.append(layer_idx))
        sender = prefill.create_sender(receiver.ticket(), timeout_s=10)
        assert await sender._wait_acked() and sender.in_place
        manifest = transfer_pb2.LayerManifest(
            layer_idx=0, block_offset=0, num_blocks=4, num_bytes=LAYOUT.layer_bytes(4),
            token_end=NUM_TOKENS, written_in_place=True, more_layer_ids=more_layer_ids,
        )  # fmt: skip
        await sender._send_all([(None, {"layer_manifest": manifest})])
        assert await receiver.wait() == TransferState.FAILED
        assert refusal in receiver.error and landed == []
        await prefill.close()
        await decode.close()

    run(scenario())


def test_a_failed_in_place_transfer_is_quarantined_until_the_sender_drained() -> None:
    """The receiver fails mid-transfer: its blocks may be reused only once the sender said it
    writes nothing more (its drained notice comes after its launched writes complete)."""

    async def scenario() -> None:
        prefill, decode, src, _ = await managers("tcp", "GPU-a", "GPU-a")
        receiver = decode.create_receiver(DST_IDS, NUM_TOKENS, timeout_s=10)
        sender = prefill.create_sender(receiver.ticket(), timeout_s=10)
        await sender.send_packed_layers([(0, packed(src, 0))])
        await wait_until(lambda: receiver.state == TransferState.TRANSFERRING)
        assert receiver.in_place and not receiver.writes_settled.is_set()
        receiver.abort("the decode call ended")
        assert not receiver.writes_settled.is_set()  # the sender has not answered yet
        await wait_until(lambda: receiver.writes_settled.is_set())
        assert sender.state == TransferState.FAILED
        await wait_until(lambda: not decode._quarantined)  # routed there, then forgotten
        await prefill.close()
        await decode.close()

    run(scenario())


def test_a_silent_failed_sender_is_presumed_done_after_its_deadline(monkeypatch) -> None:
    """No drained notice ever comes (the sender is gone): the quarantine ends once the
    sender's own deadline (its handshake's timeout_s) is past by the margin, not before."""
    monkeypatch.setattr(receiver_grant, "QUARANTINE_MARGIN_S", 0.2)

    async def never_notify(self, reason: str) -> None:
        return None

    monkeypatch.setattr(KVSender, "_drain_then_notify", never_notify)

    async def scenario() -> None:
        prefill, decode, src, _ = await managers("local", "GPU-a", "GPU-a")
        receiver = decode.create_receiver(DST_IDS, NUM_TOKENS, timeout_s=10)
        sender = prefill.create_sender(receiver.ticket(), timeout_s=0.6)
        await sender.send_packed_layers([(0, packed(src, 0))])
        loop = asyncio.get_running_loop()
        started = loop.time()
        receiver.abort("the decode call ended")
        await wait_until(lambda: receiver.writes_settled.is_set(), timeout_s=5.0)
        assert loop.time() - started >= 0.5  # (0.6 s sender deadline from before the abort)
        await prefill.close()
        await decode.close()

    run(scenario())


def test_a_receiver_refuses_in_place_writes_it_did_not_grant() -> None:
    async def scenario() -> None:
        prefill, decode, src, dst = await managers("local", "GPU-a", "GPU-b")
        receiver = decode.create_receiver(DST_IDS, NUM_TOKENS, timeout_s=10)
        sender = prefill.create_sender(receiver.ticket(), timeout_s=10)
        sender.start()
        await wait_until(lambda: sender.state == TransferState.WAITING)
        manifest = sender._spans.manifest(0, 0, 4, NUM_TOKENS)
        manifest.written_in_place = True
        await sender._send(layer_manifest=manifest)  # a forged claim: nothing was granted
        assert await receiver.wait() == TransferState.FAILED
        assert "did not grant" in receiver.error
        await prefill.close()
        await decode.close()

    run(scenario())


def test_caches_that_cannot_be_shared_turn_writes_in_place_off() -> None:
    """(e.g. an allocator whose memory has no IPC handle): the node starts, senders on its GPU
    get no grant and send their layers instead."""

    class Unshareable(InProcessSharing):
        def export(self, kv_caches):
            raise RuntimeError("no IPC handle for this allocation")

    async def scenario() -> None:
        prefill, decode, src, dst = await managers("local", "GPU-a", "GPU-a", Unshareable())
        receiver = decode.create_receiver(DST_IDS, NUM_TOKENS, timeout_s=10)
        sender = prefill.create_sender(receiver.ticket(), timeout_s=10)
        await sender.send_packed_layers([(i, packed(src, i)) for i in range(LAYOUT.num_layers)])
        await sender.send_first_token(9)
        assert await receiver.wait() == TransferState.SUCCESS
        assert not receiver.in_place and not sender.in_place
        assert torch.equal(dst[2][1][DST_IDS], src[2][1][SRC_IDS])
        await prefill.close()
        await decode.close()

    run(scenario())
