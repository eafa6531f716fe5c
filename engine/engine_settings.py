"""The engine's settings resolved against its device: what `auto` async scheduling means, and
the KV block size flash_attn needs (used by `EngineCore` when it starts)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from kernels.attention.selector import FLASH_ATTN_BLOCK_SIZE, resolve_backend_name
from pdserve.config import ASYNC_SCHEDULING, CacheConfig, EngineConfig

logger = logging.getLogger(__name__)


def async_scheduling_on(config: EngineConfig, device: torch.device) -> bool:
    """auto: on CUDA (the host's work hides under the device's), never for the prefill role
    (its steps are long prefills, and its per-layer hook must see each step finish first)."""
    mode = config.scheduler.async_scheduling
    if mode not in ASYNC_SCHEDULING:
        raise ValueError(f"async_scheduling must be one of {ASYNC_SCHEDULING}; got {mode!r}")
    if config.scheduler.prefill_only or mode == "off":
        return False
    return mode == "on" or device.type == "cuda"


def with_backend_block_size(
    config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> EngineConfig:
    """flash_attn asked for by name with the default block size (16): use 256 instead."""
    cache = config.cache
    if (
        config.model.attention_backend != "flash_attn"
        or cache.block_size != CacheConfig().block_size
    ):
        return config
    resolve_backend_name(  # or say why not
        "flash_attn", device, dtype, FLASH_ATTN_BLOCK_SIZE, cache.kv_cache_dtype
    )
    logger.info("flash_attn: KV block size %d (its paged KV needs a multiple of it)",
                FLASH_ATTN_BLOCK_SIZE)  # fmt: skip
    new_cache = dataclasses.replace(cache, block_size=FLASH_ATTN_BLOCK_SIZE)
    return dataclasses.replace(config, cache=new_cache)
