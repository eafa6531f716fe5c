"""Pack one layer of one request into one contiguous buffer, and scatter it back elsewhere.

A packed layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V) in the
cache dtype, carried as a flat `uint8` tensor so transports see plain bytes. The sender gathers
its own block ids; the receiver scatters into *its* block ids, which need not match.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cache_transfer.layout import KVLayout

BlockIds = Sequence[int] | torch.Tensor


def check_kv_cache(layout: KVLayout, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise ValueError unless both caches are `[num_blocks, *layout.block_shape]` in its dtype."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or tuple(cache.shape[1:]) != layout.block_shape:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim] = "
                f"[*, {', '.join(map(str, layout.block_shape))}], got {list(cache.shape)}"
            )
        if cache.dtype != layout.torch_dtype:
            raise ValueError(f"{name} dtype is {cache.dtype}, the layout says {layout.dtype}")
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if k_cache.shape != v_cache.shape or k_cache.device != v_cache.device:
        raise ValueError(
            f"k_cache {list(k_cache.shape)} on {k_cache.device} and v_cache "
            f"{list(v_cache.shape)} on {v_cache.device} must match in shape and device"
        )


def alloc_staging(num_bytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A flat uint8 buffer for packed layers; pinned host memory when CUDA is present."""
    device = torch.device(device)
    pin = device.type == "cpu" and torch.cuda.is_available()
    return torch.empty(num_bytes, dtype=torch.uint8, device=device, pin_memory=pin)


def pack_layer(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: BlockIds, out: torch.Tensor
) -> torch.Tensor:
    """Gather `block_ids` of one layer into `out` (flat uint8, exactly the packed size)."""
    index = _block_index(block_ids, k_cache, unique=False)
    packed = packed_view(out, index.numel(), k_cache)  # [2, num_blocks, block_size, kvh, hd]
    if out.device == k_cache.device:
        torch.index_select(_as_rows(k_cache), 0, index, out=_as_rows(packed[0]))
        torch.index_select(_as_rows(v_cache), 0, index, out=_as_rows(packed[1]))
    else:  # e.g. a CUDA cache into pinned host staging
        packed[0].copy_(k_cache.index_select(0, index))
        packed[1].copy_(v_cache.index_select(0, index))
    return out


def unpack_layer(
    payload: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: BlockIds
) -> None:
    """Scatter a packed layer into `block_ids` (distinct) of the receiver's caches."""
    index = _block_index(block_ids, k_cache, unique=True)
    packed = packed_view(payload, index.numel(), k_cache)  # [2, num_blocks, block_size, kvh, hd]
    packed = packed.to(k_cache.device)
    _as_rows(k_cache).index_copy_(0, index, _as_rows(packed[0]))
    _as_rows(v_cache).index_copy_(0, index, _as_rows(packed[1]))


def _as_rows(blocks: torch.Tensor) -> torch.Tensor:
    """Contiguous `[num_blocks, ...]` as `[num_blocks, words]` of int64 when a block is a whole
    number of words (index_copy_ on CPU runs twice as fast on 8-byte elements), else flat in
    its own dtype. Bytes are moved unchanged either way."""
    block_bytes = blocks[0].numel() * blocks.element_size()
    rows = blocks.view(blocks.shape[0], -1)
    if block_bytes % 8 == 0 and rows.data_ptr() % 8 == 0:
        return rows.view(torch.int64)
    return rows


def packed_view(buf: torch.Tensor, num_blocks: int, cache: torch.Tensor) -> torch.Tensor:
    """View flat uint8 `buf` as `[2, num_blocks, *cache.shape[1:]]` in the cache dtype."""
    block_bytes = cache[0].numel() * cache.element_size()
    expected = 2 * num_blocks * block_bytes
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"packed buffer must be a contiguous 1-D uint8 tensor, got {buf.dtype} "
            f"{list(buf.shape)}"
        )
    if buf.numel() != expected:
        raise ValueError(
            f"packed buffer holds {buf.numel()} bytes; {num_blocks} blocks of K and V need "
            f"{expected} (2 x {num_blocks} x {block_bytes})"
        )
    return buf.view(cache.dtype).view(2, num_blocks, *cache.shape[1:])


def _block_index(block_ids: BlockIds, cache: torch.Tensor, *, unique: bool) -> torch.Tensor:
    """Block ids as an int64 index on the cache's device, checked against the pool size."""
    ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else list(block_ids)
    num_blocks = cache.shape[0]
    if not ids:
        raise ValueError("block_ids is empty: a packed layer needs at least one block")
    bad = [i for i in ids if not 0 <= i < num_blocks]
    if bad:
        raise ValueError(f"block ids {bad[:8]} are outside the cache's [0, {num_blocks}) blocks")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"destination block ids must be distinct, got {ids}")
    return torch.tensor(ids, dtype=torch.int64, device=cache.device)
