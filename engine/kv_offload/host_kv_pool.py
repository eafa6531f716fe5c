"""`HostKVPool`: the host tier's memory, in the device pool's layout.

On CUDA the tensor is page-locked in place with cudaHostRegister (exactly its size: torch's
pinned allocator rounds every allocation up to a power of two, 100 GiB -> 128 GiB), and
`device_view` is a CUDA tensor over the same bytes: with unified addressing the GPU reads and
writes registered host memory at the host pointer itself, so one copy kernel moves a batch of
blocks between the pools (no staging buffer, no copy per block). On CPU `device_view` is the
buffer itself.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from engine.kv_cache_pool import KVCachePool


class HostKVPool:
    """`buffer`: `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` on the host,
    the device pool's layout without its scratch block."""

    def __init__(self, device_pool: KVCachePool, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV pool needs at least one block, got {num_blocks}")
        shape = list(device_pool.buffer.shape)
        shape[2] = num_blocks
        self.num_blocks = num_blocks
        self.bytes_per_block = device_pool.bytes_per_block
        self.buffer = torch.empty(shape, dtype=device_pool.buffer.dtype)
        self.device_view = self.buffer
        device = device_pool.buffer.device
        if device.type == "cuda":
            self.device_view = _registered_view(self.buffer, device)

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @staticmethod
    def num_blocks_for(budget_bytes: int, bytes_per_block: int) -> int:
        """How many blocks `budget_bytes` of host memory hold; ValueError when none, or when
        the budget exceeds the host's physical memory."""
        physical_bytes = _physical_memory_bytes()
        if physical_bytes is not None and budget_bytes > physical_bytes:
            raise ValueError(
                f"kv_offload_memory ({budget_bytes} bytes) exceeds this host's memory "
                f"({physical_bytes} bytes); lower --kv-offload-memory"
            )
        num_blocks = budget_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_offload_memory ({budget_bytes} bytes) holds no KV block (one takes "
                f"{bytes_per_block} bytes); raise --kv-offload-memory, or 0 turns the tier off"
            )
        return num_blocks


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no check
        return None


class _CudaArray:
    """`__cuda_array_interface__` over raw bytes at a device-visible address; keeps `owner`
    (the host tensor) alive as long as a tensor made from it lives."""

    def __init__(self, ptr: int, num_bytes: int, owner: torch.Tensor) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,  # no stream to synchronize with: the memory is idle
        }


def _registered_view(buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Page-lock `buffer` (unregistered when it is freed) and return a CUDA tensor of its
    shape and dtype over the same memory."""
    cudart = torch.cuda.cudart()
    ptr, num_bytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    with torch.cuda.device(device):
        code = _error_code(cudart.cudaHostRegister(ptr, num_bytes, 0))
    if code != 0:
        raise RuntimeError(
            f"cudaHostRegister of the {num_bytes}-byte host KV pool failed (CUDA error {code}); "
            "lower --kv-offload-memory"
        )
    weakref.finalize(buffer, cudart.cudaHostUnregister, ptr)
    with torch.cuda.device(device):
        raw = torch.as_tensor(_CudaArray(ptr, num_bytes, buffer), device=device)
    return raw.view(buffer.dtype).view(buffer.shape)


def _error_code(result: Any) -> int:
    if isinstance(result, tuple):
        result = result[0]
    return int(getattr(result, "value", result))
