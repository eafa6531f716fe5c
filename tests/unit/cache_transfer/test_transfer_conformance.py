"""KVSender -> KVReceiver through KVTransferManager, once per backend: exact bytes, any layer
order, chunked layers, many sessions at once, layers packed by the caller, and a clear error
for a caller's misuse. (Clean failures: test_transfer_failures.py.)"""

from __future__ import annotations

import random

import pytest
import torch
from transfer_helpers import (
    SENTINEL,
    NodePair,
    gather_bounded,
    make_layout,
    make_pair,
    run,
    untouched,
    wait_until,
)

from cache_transfer import KVSender, TransferState, pack_layer

pytestmark = pytest.mark.timeout(60)


async def _send_all(
    pair: NodePair, sender: KVSender, src_ids: list[int], layer_order: list[int]
) -> None:
    for layer_idx in layer_order:
        k_cache, v_cache = pair.src_caches[layer_idx]
        await sender.send_layer(layer_idx, k_cache, v_cache, src_ids)
    await sender.send_first_token(123)


def _assert_landed(pair: NodePair, src_ids: list[int], dst_ids: list[int]) -> None:
    for (src_k, src_v), (dst_k, dst_v) in zip(pair.src_caches, pair.dst_caches):
        assert torch.equal(dst_k[dst_ids], src_k[src_ids])
        assert torch.equal(dst_v[dst_ids], src_v[src_ids])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3"])
def test_layers_out_of_order_land_exactly_in_the_reserved_blocks(backend: str, dtype: str) -> None:
    async def scenario() -> None:
        pair = await make_pair(backend, make_layout(dtype))
        reserved = [9, 2, 30, 17]  # ceil((10 + 1) / 4) = 3 blocks for KV, the 4th stays free
        receiver = pair.decode.create_receiver(reserved, num_tokens=10, timeout_s=10)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)

        await _send_all(pair, sender, src_ids=[4, 0, 21], layer_order=[2, 0, 1])

        assert await receiver.wait() == TransferState.SUCCESS
        assert await sender.wait() == TransferState.SUCCESS
        _assert_landed(pair, [4, 0, 21], reserved[:3])
        untouched_ids = [b for b in range(40) if b not in reserved[:3]]
        assert untouched([(k[untouched_ids], v[untouched_ids]) for k, v in pair.dst_caches])
        assert receiver.first_token is not None and receiver.first_token.token_id == 123
        num_bytes = 3 * pair.layout.layer_bytes(3)
        assert sender.num_bytes_sent == receiver.num_bytes_received == num_bytes
        assert pair.decode.num_pending == pair.prefill.num_pending == 0
        assert pair.decode.num_succeeded == pair.prefill.num_succeeded == 1
        await pair.close()

    run(scenario())


def test_chunked_prefill_resends_the_partial_block(backend: str) -> None:
    async def scenario() -> None:
        pair = await make_pair(backend, make_layout(block_size=4))
        receiver = pair.decode.create_receiver([5, 6, 7, 8], num_tokens=14, timeout_s=10)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        src_ids = [3, 1, 2, 0]
        for token_end in (6, 9, 14):  # chunks end mid-block: blocks 1 and 2 are sent twice
            for layer_idx in reversed(range(pair.layout.num_layers)):
                k_cache, v_cache = pair.src_caches[layer_idx]
                await sender.send_layer(layer_idx, k_cache, v_cache, src_ids, token_end)
        await sender.send_first_token(7)

        assert await receiver.wait() == TransferState.SUCCESS
        assert await sender.wait() == TransferState.SUCCESS
        _assert_landed(pair, src_ids, [5, 6, 7, 8])
        await pair.close()

    run(scenario())


def test_many_concurrent_sessions_each_land_their_own_kv(backend: str) -> None:
    num_sessions = 12

    async def one(pair: NodePair, i: int, dst_ids: list[int]) -> None:
        rng = random.Random(i)
        receiver = pair.decode.create_receiver(dst_ids, num_tokens=4 * len(dst_ids), timeout_s=15)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=15)
        src_ids = rng.sample(range(64), len(dst_ids))
        order = rng.sample(range(pair.layout.num_layers), pair.layout.num_layers)
        await _send_all(pair, sender, src_ids, order)
        assert await receiver.wait() == TransferState.SUCCESS
        assert await sender.wait() == TransferState.SUCCESS
        _assert_landed(pair, src_ids, dst_ids)

    async def scenario() -> None:
        pair = await make_pair(backend, make_layout(), num_src_blocks=64, num_dst_blocks=96)
        blocks = random.Random(0).sample(range(96), 96)
        spans = [blocks[8 * i : 8 * i + 1 + i % 8] for i in range(num_sessions)]
        await gather_bounded(*(one(pair, i, span) for i, span in enumerate(spans)))
        assert pair.decode.num_succeeded == num_sessions
        assert pair.decode.num_pending == 0
        await pair.close()

    run(scenario())


def test_sender_refuses_misuse_with_a_clear_error(backend: str) -> None:
    async def scenario() -> None:
        pair = await make_pair(backend, make_layout())
        receiver = pair.decode.create_receiver([1, 2, 3], num_tokens=12, timeout_s=10)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        k_cache, v_cache = pair.src_caches[0]

        with pytest.raises(ValueError, match=r"layer_idx 3 outside \[0, 3\)"):
            await sender.send_layer(3, k_cache, v_cache, [0, 1, 2])
        with pytest.raises(ValueError, match="src_block_ids has 2"):
            await sender.send_layer(0, k_cache, v_cache, [0, 1])
        with pytest.raises(ValueError, match="layers \\[0, 1, 2\\] are incomplete"):
            await sender.send_first_token(5)
        await sender.send_layer(0, k_cache, v_cache, [0, 1, 2])
        with pytest.raises(ValueError, match=r"token_end must be in \(12, 12\]"):
            await sender.send_layer(0, k_cache, v_cache, [0, 1, 2])
        await wait_until(lambda: receiver.state == TransferState.TRANSFERRING)
        assert not pair.dst_caches[0][0].eq(SENTINEL).all()  # layer 0 did land
        await pair.close()

    run(scenario())


def test_send_packed_lands_like_send_layer_and_calls_layer_callbacks(backend: str) -> None:
    async def scenario() -> None:
        pair = await make_pair(backend, make_layout(block_size=4))
        receiver = pair.decode.create_receiver([5, 6, 7, 8], num_tokens=14, timeout_s=10)
        landed: list[tuple[int, int]] = []
        receiver.add_layer_callback(
            lambda layer_idx, token_end: landed.append((layer_idx, token_end))
        )
        receiver.add_layer_callback(lambda *_: 1 / 0)  # a failing callback changes nothing
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        src_ids = [3, 1, 2, 0]
        for token_end, blocks in ((6, [3, 1]), (14, [1, 2, 0])):  # block 1 again: it was partial
            for layer_idx, (k_cache, v_cache) in enumerate(pair.src_caches):
                packed = torch.empty(pair.layout.layer_bytes(len(blocks)), dtype=torch.uint8)
                pack_layer(k_cache, v_cache, blocks, packed)
                await sender.send_packed(layer_idx, packed, token_end)
        await sender.send_first_token(9)

        assert await receiver.wait() == TransferState.SUCCESS
        assert await sender.wait() == TransferState.SUCCESS
        _assert_landed(pair, src_ids, [5, 6, 7, 8])
        layers = range(pair.layout.num_layers)
        assert sorted(landed) == [(i, end) for i in layers for end in (6, 14)]
        await pair.close()

    run(scenario())


def test_send_packed_layers_coalesces_and_every_layer_lands_and_is_reported(
    backend: str,
) -> None:
    """Several layers in one message: byte-exact in the reserved blocks, each layer's landed
    callback called (the decode side's timeline); a bad batch is refused whole."""

    async def scenario() -> None:
        pair = await make_pair(backend, make_layout(block_size=4))
        receiver = pair.decode.create_receiver([5, 6, 7, 8], num_tokens=14, timeout_s=10)
        landed: list[tuple[int, int]] = []
        receiver.add_layer_callback(lambda i, token_end: landed.append((i, token_end)))
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        sent_by = pair.prefill._transport.send_many
        batches: list[int] = []

        async def counting_send_many(peer_address, messages):
            batches.append(sum(payload is not None for _, payload in messages))
            await sent_by(peer_address, messages)

        pair.prefill._transport.send_many = counting_send_many
        src_ids = [3, 1, 2, 0]
        packed = []
        for k_cache, v_cache in pair.src_caches:
            packed.append(torch.empty(pair.layout.layer_bytes(4), dtype=torch.uint8))
            pack_layer(k_cache, v_cache, src_ids, packed[-1])
        with pytest.raises(ValueError, match="distinct layers"):
            await sender.send_packed_layers([(0, packed[0]), (0, packed[0])])
        with pytest.raises(ValueError, match="take"):  # nothing of the batch is consumed
            await sender.send_packed_layers([(0, packed[0]), (1, packed[1][:-1])])
        await sender.send_packed_layers(list(enumerate(packed)))
        await sender.send_first_token(9)

        assert await receiver.wait() == TransferState.SUCCESS
        assert await sender.wait() == TransferState.SUCCESS
        assert [n for n in batches if n] == [pair.layout.num_layers]  # one message: all layers
        _assert_landed(pair, src_ids, [5, 6, 7, 8])
        assert sorted(landed) == [(i, 14) for i in range(pair.layout.num_layers)]
        await pair.close()

    run(scenario())


def test_send_packed_refuses_a_payload_of_the_wrong_size(backend: str) -> None:
    async def scenario() -> None:
        pair = await make_pair(backend, make_layout(block_size=4))
        receiver = pair.decode.create_receiver([5, 6, 7], num_tokens=12, timeout_s=10)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        one_block = torch.zeros(pair.layout.layer_bytes(1), dtype=torch.uint8)
        with pytest.raises(ValueError, match=r"blocks \[0, 3\) of tokens up to 12 take"):
            await sender.send_packed(0, one_block)
        await sender.send_packed(0, one_block, token_end=4)  # the span was not consumed
        with pytest.raises(ValueError, match="contiguous 1-D uint8"):
            await sender.send_packed(1, torch.zeros(2, pair.layout.layer_bytes(1) // 2))
        await pair.close()

    run(scenario())
