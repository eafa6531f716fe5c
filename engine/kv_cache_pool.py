"""The paged KV cache memory: one tensor holding every layer's K and V blocks."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.model.arch_config import ModelArchConfig
from engine.model.llama import LlamaAttention
from kernels.attention import kv_quant
from pdserve.config import CacheConfig

CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30


class KVCachePool:
    """Raw KV memory. `kv_caches[layer] = (k_cache, v_cache)`, each
    `[num_blocks, block_size, num_kv_heads, head_dim]` (the flash-attn paged layout), views of
    one allocation `[num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim]`.
    Block `scratch_block` (= num_blocks, the last) is never handed out: padded rows of a
    CUDA-graph batch write there. `reserve_bytes` (CUDA graphs' pool) comes off the budget;
    `extra_bytes_per_block`: memory another pool takes per block of this one (a speculative
    draft model's KV, sized to the same block count), so the budget covers both.
    `agree` (tensor parallelism): the size every rank can hold, from this rank's (each rank's
    pool holds its own kv heads, with rank 0's block ids).
    `kv_cache_dtype` "fp8_e4m3" (`CacheConfig`): the blocks are float8_e4m3fn (half a bf16
    block's bytes, so a budget holds twice the blocks), with `kv_scales`
    `[num_layers, 2, num_kv_heads]` float32 (`attach_scales` hands each layer its own)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        cache_config: CacheConfig,
        device: torch.device,
        dtype: torch.dtype,
        reserve_bytes: int = 0,
        extra_bytes_per_block: int = 0,
        agree: Callable[[int], int] | None = None,
    ) -> None:
        self.block_size = cache_config.block_size
        self.dtype = dtype = kv_quant.kv_storage_dtype(cache_config.kv_cache_dtype, dtype)
        self.kv_scales: torch.Tensor | None = None  # [num_layers, 2, num_kv_heads] (FP8 only)
        if dtype == kv_quant.FP8_DTYPE:
            self.kv_scales = kv_quant.unit_scales(arch.num_layers, arch.num_kv_heads, device)
        self.bytes_per_block = self.block_bytes(arch, self.block_size, dtype)
        self.num_blocks = self._size_pool(
            cache_config, device, reserve_bytes, self.bytes_per_block + extra_bytes_per_block
        )
        if agree is not None:
            self.num_blocks = agree(self.num_blocks)
        self.scratch_block = self.num_blocks
        self.buffer = torch.zeros(
            arch.num_layers,
            2,
            self.num_blocks + 1,
            self.block_size,
            arch.num_kv_heads,
            arch.head_dim,
            dtype=dtype,
            device=device,
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.buffer[layer, 0], self.buffer[layer, 1]) for layer in range(arch.num_layers)
        ]

    def attach_scales(self, layers: nn.ModuleList) -> None:
        """Each decoder layer's attention reads and writes its cache with its layer's scales
        (None: not FP8)."""
        for layer_idx, layer in enumerate(layers):
            attention = layer.get_submodule("self_attn")
            assert isinstance(attention, LlamaAttention), type(attention)
            attention.kv_scales = None if self.kv_scales is None else self.kv_scales[layer_idx]

    @staticmethod
    def block_bytes(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, K and V."""
        elem_bytes = torch.empty((), dtype=dtype).element_size()
        return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * elem_bytes

    def _size_pool(
        self,
        cache_config: CacheConfig,
        device: torch.device,
        reserve_bytes: int,
        bytes_per_block: int,  # this pool's and any pool sized with it
    ) -> int:
        if cache_config.num_blocks is not None:
            num_blocks = cache_config.num_blocks
        else:
            budget_bytes = cache_config.kv_cache_memory
            if budget_bytes is None and device.type == "cuda":
                free_bytes, _ = torch.cuda.mem_get_info(device)
                budget_bytes = int(free_bytes * cache_config.gpu_memory_utilization)
                budget_bytes -= reserve_bytes + bytes_per_block  # graphs, scratch block
            if budget_bytes is None:
                budget_bytes = CPU_DEFAULT_KV_CACHE_BYTES
            num_blocks = budget_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget holds no block (one block of {self.block_size} tokens takes "
                f"{bytes_per_block} bytes); raise kv_cache_memory or num_blocks"
            )
        return int(num_blocks)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block
