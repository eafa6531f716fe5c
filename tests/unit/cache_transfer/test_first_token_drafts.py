"""Speculative decoding's drafts ride in the FirstToken message (protocol 5): the receiver gets
them as sent; more than 16 (the engine's bound on K) fail the transfer, so the decode node
prefills locally instead of trusting the message."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transfer_helpers import make_layout, make_pair, run

from cache_transfer import TransferState, pack_layer
from cache_transfer.receiver_checks import MAX_DRAFT_TOKENS

pytestmark = pytest.mark.timeout(60)


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
