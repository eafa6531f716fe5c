"""`KVOffload`: the host tier as `EngineCore` holds it, its ledger and its mover.

EngineCore.__init__   KVOffload.build(cache config, device pool): None when
                      --kv-offload-memory is 0; `host_blocks` goes to the KVCacheManager
EngineCore._launch    flush(): this round's copies queued before the step (the step waits
                      for its promotions, and for copies of blocks it may overwrite)
EngineCore.reserve    settle(): the same, then the caller waits for copies of the reserved
                      blocks (a KV transfer writes them, on no stream of ours)
EngineCore.stats      stats(host hit tokens)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.kv_cache_pool import KVCachePool
from engine.kv_offload.block_mover import KVBlockMover
from engine.kv_offload.host_block_manager import HostBlockManager
from engine.kv_offload.host_kv_pool import HostKVPool
from pdserve.config import CacheConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVOffloadStats:
    """The host tier in `EngineStats` (all 0 when it is off)."""

    num_host_blocks: int = 0
    num_free_host_blocks: int = 0  # holding no KV
    host_hit_tokens: int = 0  # prompt tokens found in the host tier (promoted), since start
    offload_bytes: int = 0  # device -> host (demotions), since start
    promotion_bytes: int = 0  # host -> device, since start


class KVOffload:
    def __init__(self, host_blocks: HostBlockManager, mover: KVBlockMover) -> None:
        self.host_blocks = host_blocks
        self.mover = mover

    @classmethod
    def build(cls, cache_config: CacheConfig, device_pool: KVCachePool) -> KVOffload | None:
        """The tier `cache_config.kv_offload_memory` asks for, over `device_pool`."""
        budget_bytes = cache_config.kv_offload_memory
        if not budget_bytes:
            return None
        if budget_bytes < 0:
            raise ValueError(f"kv_offload_memory must be >= 0 bytes, got {budget_bytes}")
        if not cache_config.enable_prefix_caching:
            raise ValueError(
                "--kv-offload-memory keeps evicted prefix-cache blocks in host memory: it needs "
                "prefix caching (drop --no-prefix-caching, or set --kv-offload-memory 0)"
            )
        num_blocks = HostKVPool.num_blocks_for(budget_bytes, device_pool.bytes_per_block)
        host_pool = HostKVPool(device_pool, num_blocks)
        logger.info(
            "host KV tier: %d blocks (%.2f GiB%s)", num_blocks, host_pool.num_bytes / (1 << 30),
            ", page-locked" if device_pool.buffer.is_cuda else "",
        )  # fmt: skip
        mover = KVBlockMover(device_pool, host_pool)
        mover.warm_up()
        return cls(HostBlockManager(num_blocks), mover)

    def flush(self) -> None:
        """Queue the round's copies ahead of the step about to launch."""
        self.mover.run(self.host_blocks.take_commands())

    def settle(self) -> None:
        """Queue the round's copies and wait until no copy touches a block handed out in it."""
        commands = self.host_blocks.take_commands()
        self.mover.run(commands)
        self.mover.wait_on_host(commands.guard_seq)

    def stats(self, host_hit_tokens: int) -> KVOffloadStats:
        return KVOffloadStats(
            num_host_blocks=self.host_blocks.num_total_blocks,
            num_free_host_blocks=self.host_blocks.num_free_blocks,
            host_hit_tokens=host_hit_tokens,
            offload_bytes=self.mover.num_demoted_bytes,
            promotion_bytes=self.mover.num_promoted_bytes,
        )
