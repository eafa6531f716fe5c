"""How the copies see a cache's blocks: `as_rows` (a block as one row of int64 words where it
can be), `kv_rows` (K and V of one slab as one table), `use_triton` (whether a copy runs the
Triton kernel). Bytes are moved unchanged either way."""

from __future__ import annotations

import torch

from kernels.kv_copy import triton_available

IMPLS = ("auto", "torch", "triton")


def use_triton(
    cache: torch.Tensor, packed_rows: torch.Tensor, rows: torch.Tensor, impl: str
) -> bool:
    """`impl` "auto": Triton on CUDA when its rows match; "torch" never; "triton" where it
    imports (on CPU through its interpreter)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be auto, torch or triton, got {impl!r}")
    if impl == "torch" or not triton_available():
        return False
    same_kind = packed_rows.dtype == rows.dtype and packed_rows.is_contiguous()
    return same_kind and (impl == "triton" or cache.device.type == "cuda")


def kv_rows(k_rows: torch.Tensor, v_rows: torch.Tensor) -> torch.Tensor | None:
    """`[2 * pool_blocks, words]` over K then V when V's rows directly follow K's in memory
    (the engine's pool: both are views of one `[2, num_blocks, ...]` slab), else None."""
    pool_blocks, words = k_rows.shape
    adjacent = (
        k_rows.is_contiguous()
        and v_rows.is_contiguous()
        and k_rows.dtype == v_rows.dtype
        and v_rows.data_ptr() == k_rows.data_ptr() + k_rows.numel() * k_rows.element_size()
        and k_rows.untyped_storage().data_ptr() == v_rows.untyped_storage().data_ptr()
    )
    if not adjacent:
        return None
    return k_rows.as_strided((2 * pool_blocks, words), (words, 1))


def as_rows(blocks: torch.Tensor) -> torch.Tensor:
    """Contiguous `[num_blocks, ...]` as `[num_blocks, words]` of int64 when a block is a whole
    number of words (index_copy_ on CPU runs twice as fast on 8-byte elements), else flat in
    its own dtype."""
    block_bytes = blocks[0].numel() * blocks.element_size()
    rows = blocks.view(blocks.shape[0], -1)
    if block_bytes % 8 == 0 and rows.data_ptr() % 8 == 0:
        return rows.view(torch.int64)
    if rows.dtype == torch.float8_e4m3fn:  # (CPU has no index_copy_ of FP8: bytes, the same)
        return rows.view(torch.uint8)
    return rows
