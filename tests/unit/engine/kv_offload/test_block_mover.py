"""KVBlockMover on CPU: blocks demoted to the host pool and promoted back are byte-exact, in
every KV dtype and row width, and a round's copies run in order (demotions, then promotions)."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache_pool import KVCachePool
from engine.kv_offload import HostKVPool, KVBlockMover, OffloadCommands
from engine.kv_offload.block_mover import as_words
from engine.model.arch_config import ModelArchConfig
from pdserve.config import CacheConfig


def make_pools(
    dtype: torch.dtype, head_dim: int = 8, num_blocks: int = 10, num_host_blocks: int = 6
) -> tuple[KVCachePool, HostKVPool]:
    arch = ModelArchConfig("LlamaForCausalLM", 64, 32, 64, 3, 4, 2, head_dim, 128)
    cache = CacheConfig(block_size=4, num_blocks=num_blocks)
    device_pool = KVCachePool(arch, cache, torch.device("cpu"), dtype)
    return device_pool, HostKVPool(device_pool, num_host_blocks)


def random_bits(buffer: torch.Tensor, seed: int) -> None:
    """Every bit pattern (NaNs, infinities, -0.0, subnormals included)."""
    raw = buffer.view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def block_bytes(buffer: torch.Tensor, block_id: int) -> bytes:
    return buffer[:, :, block_id].contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    ("dtype", "head_dim"),
    [(torch.float32, 8), (torch.bfloat16, 8), (torch.float16, 3), (torch.float8_e4m3fn, 5)],
)
def test_demoted_then_promoted_blocks_are_byte_exact(dtype, head_dim):
    device_pool, host_pool = make_pools(dtype, head_dim)
    random_bits(device_pool.buffer, seed=1)
    random_bits(host_pool.buffer, seed=2)
    mover = KVBlockMover(device_pool, host_pool)
    sent = {block_id: block_bytes(device_pool.buffer, block_id) for block_id in (7, 2, 5)}
    untouched_host = block_bytes(host_pool.buffer, 1)

    mover.run(OffloadCommands(seq=1, demote_src=(7, 2, 5), demote_dst=(4, 0, 3)))
    for block_id, host_id in zip((7, 2, 5), (4, 0, 3), strict=True):
        assert block_bytes(host_pool.buffer, host_id) == sent[block_id]
    assert block_bytes(host_pool.buffer, 1) == untouched_host

    random_bits(device_pool.buffer, seed=3)  # the device blocks are reused
    neighbour = block_bytes(device_pool.buffer, 8)
    mover.run(OffloadCommands(seq=2, promote_src=(0, 3, 4), promote_dst=(1, 9, 6)))
    for block_id, original in zip((1, 9, 6), (2, 5, 7), strict=True):
        assert block_bytes(device_pool.buffer, block_id) == sent[original]
    assert block_bytes(device_pool.buffer, 8) == neighbour
    bytes_per_block = device_pool.bytes_per_block
    assert (mover.num_demoted_bytes, mover.num_promoted_bytes) == (3 * bytes_per_block,) * 2


def test_a_round_demotes_before_it_promotes():
    """A block demoted and then reused as a promotion's target in one round: its old KV
    reaches the host before the promoted KV overwrites it."""
    device_pool, host_pool = make_pools(torch.float32)
    random_bits(device_pool.buffer, seed=4)
    random_bits(host_pool.buffer, seed=5)
    old_kv = block_bytes(device_pool.buffer, 3)
    promoted_kv = block_bytes(host_pool.buffer, 2)
    mover = KVBlockMover(device_pool, host_pool)
    mover.run(OffloadCommands(1, demote_src=(3,), demote_dst=(5,), promote_src=(2,),
                              promote_dst=(3,)))  # fmt: skip
    assert block_bytes(host_pool.buffer, 5) == old_kv
    assert block_bytes(device_pool.buffer, 3) == promoted_kv


def test_rows_travel_as_the_widest_words_they_hold():
    assert as_words(torch.zeros(2, 2, 3, 4, 2, 8, dtype=torch.bfloat16)).dtype == torch.int64
    assert as_words(torch.zeros(2, 2, 3, 1, 1, 3, dtype=torch.float16)).dtype == torch.int16
    assert as_words(torch.zeros(2, 2, 3, 1, 1, 3, dtype=torch.float8_e4m3fn)).dtype == torch.uint8


def test_host_pool_sizing_refuses_budgets_that_hold_nothing_or_exceed_the_host():
    assert HostKVPool.num_blocks_for(10_000, 1_000) == 10
    with pytest.raises(ValueError, match="holds no KV block"):
        HostKVPool.num_blocks_for(999, 1_000)
    with pytest.raises(ValueError, match="exceeds this host's memory"):
        HostKVPool.num_blocks_for(1 << 60, 1_000)
