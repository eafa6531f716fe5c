"""FP8 KV hand-offs: the layout names the dtype (its own hash), the bytes on the wire are half
of bf16's on both ends, the blocks land byte-exact, and a dtype mismatch is refused naming
both dtypes."""

from __future__ import annotations

import pytest
import torch
from transfer_helpers import make_layout, make_pair, run, sentinel_caches

from cache_transfer import KVLayout, KVTransferManager, TransferState, make_transport
from cache_transfer.receiver_checks import handshake_refusal
from cache_transfer.tickets import handshake_for, ticket_misfit

pytestmark = pytest.mark.timeout(60)

LLAMA3_8B = dict(model="llama3-8b", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)


def test_fp8_layout_is_half_of_bf16_and_hashes_apart() -> None:
    bf16 = KVLayout(dtype="bfloat16", **LLAMA3_8B)
    fp8 = KVLayout.from_dtype(torch.float8_e4m3fn, **LLAMA3_8B)

    assert fp8.dtype == "fp8_e4m3"
    assert fp8.torch_dtype == torch.float8_e4m3fn
    assert 2 * fp8.bytes_per_block == bf16.bytes_per_block
    assert fp8.layout_hash() != bf16.layout_hash()


def _send_one(backend: str, dtype: str) -> tuple[int, int]:
    """Bytes (sent, received) of one 10-token, 3-layer hand-off; asserts the blocks landed."""

    async def scenario() -> tuple[int, int]:
        pair = await make_pair(backend, make_layout(dtype))
        reserved = [9, 2, 30, 17]
        receiver = pair.decode.create_receiver(reserved, num_tokens=10, timeout_s=10)
        sender = pair.prefill.create_sender(receiver.ticket(), timeout_s=10)
        src_ids = [4, 0, 21]
        for layer_idx, (k_cache, v_cache) in enumerate(pair.src_caches):
            await sender.send_layer(layer_idx, k_cache, v_cache, src_ids)
        await sender.send_first_token(5)
        assert await receiver.wait() == TransferState.SUCCESS
        assert await sender.wait() == TransferState.SUCCESS
        for (src_k, src_v), (dst_k, dst_v) in zip(pair.src_caches, pair.dst_caches):
            assert dst_k.dtype == torch.float8_e4m3fn or dtype != "fp8_e4m3"
            # byte-exact: compare the raw bytes (FP8 NaN-free, but bytes are the contract)
            assert torch.equal(
                dst_k[reserved[:3]].view(torch.uint8), src_k[src_ids].view(torch.uint8)
            )
            assert torch.equal(
                dst_v[reserved[:3]].view(torch.uint8), src_v[src_ids].view(torch.uint8)
            )
        sent, received = sender.num_bytes_sent, receiver.num_bytes_received
        await pair.close()
        return sent, received

    return run(scenario())


def test_fp8_handoff_moves_half_the_bytes_of_bf16_on_both_ends(backend: str) -> None:
    bf16_sent, bf16_received = _send_one(backend, "bfloat16")
    fp8_sent, fp8_received = _send_one(backend, "fp8_e4m3")

    assert bf16_sent == bf16_received == 3 * make_layout("bfloat16").layer_bytes(3)
    assert fp8_sent == fp8_received
    assert 2 * fp8_sent == bf16_sent


def test_a_dtype_mismatch_is_refused_naming_both_dtypes() -> None:
    fp8, bf16 = make_layout("fp8_e4m3"), make_layout("bfloat16")

    async def scenario() -> None:
        decode = KVTransferManager(make_transport("local"), bf16, sentinel_caches(bf16, 8))
        receiver = decode.create_receiver([0, 1, 2, 3], num_tokens=10, timeout_s=10)
        ticket = receiver.ticket()
        # the prefill node (fp8) reads the bf16 decode node's ticket
        misfit = ticket_misfit(fp8, ticket)
        assert misfit is not None and "kv cache dtype fp8_e4m3 vs bfloat16" in misfit
        # the decode node reads an fp8 sender's handshake
        handshake = handshake_for(ticket, fp8, "local://p", None, "", False, 10.0)
        refusal = handshake_refusal(receiver, handshake)
        assert refusal is not None and "kv cache dtype fp8_e4m3 vs bfloat16" in refusal
        assert decode.abort(ticket.transfer_id, "test over")
        await decode.close()

    run(scenario())
