"""The first token goes right behind the layers' messages, not after their sends completed:
transports deliver in the order sends begin (KVTransport.send), so waiting for completion
would only add a message's latency to the decode node's start."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transfer_helpers import make_layout, make_pair, run

from cache_transfer import TransferState, pack_layer

pytestmark = pytest.mark.timeout(60)


def test_the_first_token_goes_right_behind_the_layers_not_after_their_sends_complete(
    backend: str,
) -> None:
    """The transport delivers in the order sends begin, so the first token need not wait for
    the layers' sends to complete: with their completion held back (a slow wire), it goes out,
    lands behind every layer and the receiver succeeds before the layers' send returns."""

    async def scenario() -> None:
        pair = await make_pair(backend, make_layout(block_size=4))
        receiver = pair.decode.create_receiver([5, 6, 7, 8], num_tokens=14, timeout_s=10)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        real_send_many, completed = pair.prefill._transport.send_many, asyncio.Event()

        async def late_send_many(peer_address, messages):
            await real_send_many(peer_address, messages)
            if any(payload is not None for _, payload in messages):
                await completed.wait()  # delivered; its completion reported late

        pair.prefill._transport.send_many = late_send_many
        src_ids = [3, 1, 2, 0]
        packed = [torch.empty(pair.layout.layer_bytes(4), dtype=torch.uint8) for _ in pair.src_caches]  # fmt: skip
        for (k_cache, v_cache), out in zip(pair.src_caches, packed):
            pack_layer(k_cache, v_cache, src_ids, out)
        try:
            layers = asyncio.ensure_future(sender.send_packed_layers(list(enumerate(packed))))
            await asyncio.sleep(0)  # the layers are in the sender's hands
            await asyncio.wait_for(sender.send_first_token(9), 10)
            assert await receiver.wait() == TransferState.SUCCESS
            assert await sender.wait() == TransferState.SUCCESS  # the receiver's result is in
            assert not layers.done()  # while the layers' send has not returned yet
            assert sender.num_bytes_sent == receiver.num_bytes_received  # (what metrics count)
            completed.set()
            await asyncio.wait_for(layers, 10)
            for (src_k, src_v), (dst_k, dst_v) in zip(pair.src_caches, pair.dst_caches):
                assert torch.equal(dst_k[[5, 6, 7, 8]], src_k[src_ids])
                assert torch.equal(dst_v[[5, 6, 7, 8]], src_v[src_ids])
        finally:  # a failure must not leave the held send (and the pair) behind
            completed.set()
            await pair.close()

    run(scenario())
