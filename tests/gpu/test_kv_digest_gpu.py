"""Issue 39: the KV frame MAC of GPU payloads. The keyed digest (kernels/kv_digest) compiled on
CUDA at llama3-8b layer sizes equals the torch reference on the GPU and on the CPU, bit for bit;
a secured hand-off of CUDA caches (local, and ucx where it imports) MACs its payloads through
the digest, lands byte-exact, and a payload changed in flight fails it, unpacked."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cache_transfer import KVLayout, KVTransferManager, TransferState, make_transport
from cache_transfer.frame_auth.frame_key import FrameKey
from cache_transfer.transports import ucx_available
from kernels.kv_digest import kv_digest
from pdserve.security import ClusterAuth

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

AUTH = ClusterAuth(b"gpu-test-secret-0123456789abcdef")
LAYER_BYTES = [8 << 20, 32 << 20, 2 * 3 * 16 * 8 * 128 * 2 + 2]  # 2K and 8K tokens; odd chunks


@pytest.mark.parametrize("num_bytes", LAYER_BYTES)
def test_the_triton_digest_equals_the_reference_on_gpu_and_cpu(num_bytes: int) -> None:
    key = FrameKey(AUTH, "t", bytes(16), "c")
    payload = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device="cuda")
    fast = kv_digest(payload, key.digest_key(payload.device), impl="triton")
    reference = kv_digest(payload, key.digest_key(payload.device), impl="torch")
    on_cpu = kv_digest(payload.cpu(), key.digest_key(torch.device("cpu")), impl="torch")
    assert torch.equal(fast, reference) and torch.equal(fast.cpu(), on_cpu)
    payload[num_bytes // 3] ^= 1
    assert not torch.equal(kv_digest(payload, key.digest_key(payload.device)), fast)


def _layout() -> KVLayout:
    return KVLayout(model="gpu-test", num_layers=4, num_kv_heads=8, head_dim=128, block_size=16,
                    dtype="bfloat16")  # fmt: skip


def _caches(layout: KVLayout, num_blocks: int, fill: float | None = None) -> list:
    shape = (num_blocks, *layout.block_shape)

    def one() -> torch.Tensor:
        if fill is None:
            return torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        return torch.full(shape, fill, device="cuda", dtype=torch.bfloat16)

    return [(one(), one()) for _ in range(layout.num_layers)]


BACKENDS = ["local", pytest.param("ucx", marks=pytest.mark.skipif(not ucx_available(),
                                                                  reason="no ucxx"))]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tamper", [False, True], ids=["honest", "tampered"])
def test_a_secured_gpu_hand_off_macs_through_the_digest(backend: str, tamper: bool) -> None:
    layout, src_ids, dst_ids = _layout(), [3, 9, 1, 4], [7, 0, 2, 5, 6]
    num_tokens = 4 * 16 - 5

    async def scenario() -> tuple[TransferState, bool, bool, bool]:
        src, dst = _caches(layout, 16), _caches(layout, 16, fill=-7.0)
        prefill = KVTransferManager(make_transport(backend), layout, auth=AUTH)
        decode = KVTransferManager(make_transport(backend), layout, dst, auth=AUTH)
        digested: list[bool] = []
        if tamper:
            transport = prefill._transport.inner
            real = transport.send_many

            async def flip(peer_address: str, messages: list) -> None:
                for _, payload in messages:
                    if payload is not None:
                        payload.view(-1)[5] ^= 1  # in flight, after the MAC
                await real(peer_address, messages)

            transport.send_many = flip
        receiver = decode.create_receiver(dst_ids, num_tokens, timeout_s=30)
        real_prepare = receiver.prepare

        def prepare(peer_id, msg, payload_bytes):
            digested.append(msg.layer_manifest.payload_digest)
            return real_prepare(peer_id, msg, payload_bytes)

        receiver.prepare = prepare
        sender = prefill.create_sender(receiver.ticket(), timeout_s=30)
        for layer_idx, (k, v) in enumerate(src):
            await sender.send_layer(layer_idx, k, v, src_ids)
        await sender.send_first_token(11)
        state = await receiver.wait(timeout_s=30)
        torch.cuda.synchronize()
        exact = all(
            torch.equal(dk[dst_ids[:4]], sk[src_ids]) and torch.equal(dv[dst_ids[:4]], sv[src_ids])
            for (dk, dv), (sk, sv) in zip(dst, src)
        )
        untouched = all(bool((dk == -7).all() and (dv == -7).all()) for dk, dv in dst)
        await prefill.close()
        await decode.close()
        return state, exact, untouched, bool(digested) and all(digested)

    state, exact, untouched, digested = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert digested, "GPU payloads are MACed through their device digest"
    if tamper:
        assert state == TransferState.FAILED and untouched
    else:
        assert state == TransferState.SUCCESS and exact
