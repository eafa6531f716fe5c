"""Pack one layer of one request into one contiguous buffer, and scatter it back elsewhere.

A packed layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V) in the
cache dtype, carried as a flat `uint8` tensor so transports see plain bytes. The sender gathers
its own block ids; the receiver scatters into *its* block ids, which need not match.

A sender that writes into the receiver's own pool (writes in place, one GPU) packs nothing:
see block_copy.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cache_transfer.layout import KVLayout
from cache_transfer.packing.block_ids import BlockIds, CheckedIds, check_block_ids
from cache_transfer.packing.rows import as_rows, kv_rows, use_triton
from kernels.kv_copy import gather_blocks, scatter_blocks

# What a sender hands over for one layer: its packed bytes, or what packs them into a buffer
# it is given (a LayerBlocks, or a copy of a payload into staging).
LayerSource = torch.Tensor | Callable[[torch.Tensor], object]


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
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: BlockIds | CheckedIds,
    out: torch.Tensor,
    impl: str = "auto",
) -> torch.Tensor:
    """Gather `block_ids` of one layer, K and V together, into `out` (flat uint8, exactly the
    packed size): one Triton launch on CUDA (`impl="torch"`: index_select), one index_select
    on CPU when K and V are views of one allocation (the engine's pool)."""
    ids = check_block_ids(block_ids, k_cache.shape[0], k_cache.device)
    n = len(ids)
    packed = packed_view(out, n, k_cache)  # [2, num_blocks, block_size, kvh, hd]
    if out.device != k_cache.device:  # e.g. a CUDA cache into pinned host staging
        tmp = torch.empty(out.numel(), dtype=torch.uint8, device=k_cache.device)
        pack_layer(k_cache, v_cache, ids, tmp, impl)
        out.copy_(tmp)
        return out
    k_rows, v_rows = as_rows(k_cache), as_rows(v_cache)
    packed_rows = as_rows(packed.view(2 * n, *k_cache.shape[1:]))
    if use_triton(k_cache, packed_rows, k_rows, impl):
        gather_blocks(k_rows, v_rows, ids.index, packed_rows)
    elif (both_rows := kv_rows(k_rows, v_rows)) is not None:
        both = torch.cat((ids.index, ids.index + k_rows.shape[0]))
        torch.index_select(both_rows, 0, both, out=packed_rows)
    else:
        torch.index_select(k_rows, 0, ids.index, out=packed_rows[:n])
        torch.index_select(v_rows, 0, ids.index, out=packed_rows[n:])
    return out


def unpack_layer(
    payload: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: BlockIds | CheckedIds,
    impl: str = "auto",
) -> None:
    """Scatter a packed layer into `block_ids` (distinct) of the receiver's caches, K and V
    together (one launch / one index_copy_ as in `pack_layer`); caches that are a head slice
    of a pool (strided views), K and V each by one index_copy_."""
    ids = check_block_ids(block_ids, k_cache.shape[0], k_cache.device, unique=True)
    n = len(ids)
    packed = packed_view(payload, n, k_cache).to(k_cache.device)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        # a head slice of a pool (a tensor-parallel route, cache_transfer/tp/): its rows are
        # strided, so each block goes in as `[block_size, heads, head_dim]` elements
        k_cache.index_copy_(0, ids.index, packed[0])
        v_cache.index_copy_(0, ids.index, packed[1])
        return
    k_rows, v_rows = as_rows(k_cache), as_rows(v_cache)
    packed_rows = as_rows(packed.reshape(2 * n, *k_cache.shape[1:]))
    if use_triton(k_cache, packed_rows, k_rows, impl):
        scatter_blocks(packed_rows, k_rows, v_rows, ids.index)
    elif (both_rows := kv_rows(k_rows, v_rows)) is not None:
        both = torch.cat((ids.index, ids.index + k_rows.shape[0]))
        both_rows.index_copy_(0, both, packed_rows)
    else:
        k_rows.index_copy_(0, ids.index, packed_rows[:n])
        v_rows.index_copy_(0, ids.index, packed_rows[n:])


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
