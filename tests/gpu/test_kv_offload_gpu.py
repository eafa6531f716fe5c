"""The host KV tier on CUDA: demotion and promotion through page-locked host memory (the
Triton copy reading and writing it through its CUDA view, and the torch fallback) are
byte-exact at llama3-8b block sizes; the side stream's copies are ordered against the step's
stream (a reused block is written only after its demotion read it, a promoted block is read
only after its copy); an engine that promotes a prefix back gives the tokens of one that kept
it on the device."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_cache_pool import KVCachePool
from engine.kv_offload import HostKVPool, KVBlockMover, OffloadCommands
from engine.model.synthetic import parse_synthetic
from pdserve.config import CacheConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
]

SHAPE = "synthetic:llama3-8b:layers=8"  # 8 KV heads x 128, block 16: 0.5 MiB a block (bf16)
NUM_BLOCKS = 1024  # the device pool; the host pool holds as many
BATCH = 512  # an 8K-token prefix


def make_mover(fallback: bool = False) -> tuple[KVCachePool, HostKVPool, KVBlockMover]:
    arch = parse_synthetic(SHAPE)
    cache = CacheConfig(block_size=16, num_blocks=NUM_BLOCKS)
    device_pool = KVCachePool(arch, cache, torch.device("cuda"), torch.bfloat16)
    host_pool = HostKVPool(device_pool, NUM_BLOCKS)
    mover = KVBlockMover(device_pool, host_pool)
    assert (mover._to_host is not None) and (mover._to_device is not None)  # one launch each
    if fallback:
        mover._to_host = mover._to_device = None
    return device_pool, host_pool, mover


def block_ids(seed: int) -> list[int]:
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[
        :BATCH
    ].tolist()


def host_bytes(host_pool: HostKVPool, ids: list[int]) -> torch.Tensor:
    return host_pool.buffer[:, :, ids].view(torch.uint8)


def device_bytes(device_pool: KVCachePool, ids: list[int]) -> torch.Tensor:
    return device_pool.buffer[:, :, ids].cpu().view(torch.uint8)


@pytest.mark.parametrize("fallback", [False, True], ids=["triton", "torch"])
def test_demotion_and_promotion_through_page_locked_memory_are_byte_exact(fallback):
    device_pool, host_pool, mover = make_mover(fallback)
    device_pool.buffer.view(torch.uint8).random_(0, 256)  # every bit pattern, NaNs included
    host_pool.buffer.view(torch.uint8).random_(0, 256)
    src, dst = block_ids(1), block_ids(2)
    untouched = sorted(set(range(NUM_BLOCKS)) - set(dst))[:8]
    before = host_bytes(host_pool, untouched).clone()
    mover.run(OffloadCommands(seq=1, demote_src=tuple(src), demote_dst=tuple(dst)))
    mover.synchronize()
    assert torch.equal(host_bytes(host_pool, dst), device_bytes(device_pool, src))
    assert torch.equal(host_bytes(host_pool, untouched), before)

    device_pool.buffer.view(torch.uint8).random_(0, 256)  # the device blocks are reused
    back = block_ids(3)
    mover.run(OffloadCommands(seq=2, promote_src=tuple(dst), promote_dst=tuple(back)))
    mover.synchronize()
    assert torch.equal(device_bytes(device_pool, back), host_bytes(host_pool, dst))
    bytes_per_block = device_pool.bytes_per_block
    assert (mover.num_demoted_bytes, mover.num_promoted_bytes) == (BATCH * bytes_per_block,) * 2


def test_the_steps_stream_waits_for_the_side_streams_copies():
    device_pool, host_pool, mover = make_mover()
    device_pool.buffer.view(torch.uint8).random_(0, 256)
    src, dst = block_ids(4), block_ids(5)
    old_kv = device_bytes(device_pool, src)
    # A demotion, then its blocks reused at once (round 2's guard): the write on the current
    # stream (microseconds) must wait for the copy (~10 ms over PCIe) that reads them.
    mover.run(OffloadCommands(seq=1, demote_src=tuple(src), demote_dst=tuple(dst)))
    mover.run(OffloadCommands(seq=2, guard_seq=1))
    device_pool.buffer[:, :, src] = 0
    torch.cuda.synchronize()
    assert torch.equal(host_bytes(host_pool, dst), old_kv)

    # A promotion, then a read on the current stream at once: it sees the promoted bytes.
    host_pool.buffer.view(torch.uint8).random_(0, 256)
    mover.run(OffloadCommands(seq=3, promote_src=tuple(dst), promote_dst=tuple(src)))
    seen = device_pool.buffer[:, :, src].clone()
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu().view(torch.uint8), host_bytes(host_pool, dst))


def test_a_promoted_prefix_gives_the_tokens_of_a_device_hit():
    """Same device, dtype and steps: the suffix is computed over a prefix the engine kept in
    its device cache, or over the same prefix promoted back from the host tier (the KV bytes
    equal, so the tokens are bitwise the same; a cold run on CUDA could differ by kernel
    rounding, which is not what this tests)."""
    gen = torch.Generator().manual_seed(0)
    conversation, other, follow_up = (torch.randint(100, 49152, (n,), generator=gen).tolist()
                                      for n in (700, 900, 40))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    model = "synthetic:smollm2-135m:layers=8"
    outputs = []
    for num_blocks, offload in ((512, 0), (64, 64 << 20)):  # 1024 tokens: one at a time
        llm = LLM(model, device="cuda", dtype="bfloat16", num_blocks=num_blocks,
                  kv_offload_memory=offload)  # fmt: skip
        turn_1 = llm.generate([conversation], params)[0].token_ids
        llm.generate([other], params)  # evicts the conversation with the small pool
        turn_2 = llm.generate([conversation + turn_1 + follow_up], params)[0]
        outputs.append((turn_1, turn_2.token_ids, turn_2.num_cached_tokens))
        if offload:
            assert llm.engine.stats().kv_offload.host_hit_tokens >= 400
        llm.engine.check_no_leaks()
    assert outputs[0] == outputs[1]


def test_a_reservation_waits_for_the_demotion_of_a_block_it_reuses():
    """A finished request's blocks, their demotion queued, reserved for a KV transfer at once
    and overwritten (on another stream, as a transfer writes): the host keeps the computed KV,
    and a later request promoted from it decodes the tokens of a device-cache hit."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(100, 49152, (900,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    model = "synthetic:smollm2-135m:layers=8"
    reference = LLM(model, device="cuda", dtype="bfloat16", num_blocks=512)
    reference.generate([prompt], params)
    device_hit = reference.generate([prompt], params)[0].token_ids
    del reference
    llm = LLM(model, device="cuda", dtype="bfloat16", num_blocks=64, kv_offload_memory=64 << 20)
    llm.generate([prompt], params)
    engine = llm.engine
    reserved = engine.reserve("transfer", engine.pool.num_blocks * engine.pool.block_size)
    writer = torch.cuda.Stream()
    with torch.cuda.stream(writer):
        engine.pool.buffer[:, :, reserved] = float("nan")
    writer.synchronize()
    engine.abort("transfer")
    again = llm.generate([prompt], params)[0]
    assert again.token_ids == device_hit and again.num_cached_tokens >= 880
    assert engine.stats().kv_offload.host_hit_tokens >= 880
    engine.check_no_leaks()
