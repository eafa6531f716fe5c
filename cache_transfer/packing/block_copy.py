"""Block to block, nothing packed: what a sender that writes into the receiver's own pool
(writes in place, one GPU) does with a layer.

`LayerBlocks` is some blocks of one layer's caches, left where they are; `copy_layer` moves them
straight into another pool's block ids, one pass over the bytes (`copy_layers`: several
layers, one launch). The same `LayerBlocks` packs itself (`pack_layer`) when it is sent instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cache_transfer.packing.block_ids import BlockIds, CheckedIds, check_block_ids
from cache_transfer.packing.checked_caches import derived
from cache_transfer.packing.packed_layer import pack_layer
from cache_transfer.packing.rows import IMPLS, as_rows, use_triton
from kernels.kv_copy import copy_blocks, copy_blocks_layers, layers_table, triton_available

RowPair = tuple[torch.Tensor, torch.Tensor]  # one layer's K rows and V rows
# every layer's source rows, destination rows, and the offsets table of one launch
LaunchPlan = tuple[list[RowPair], list[RowPair], torch.Tensor]


@dataclass(frozen=True)
class LayerBlocks:
    """Some blocks of one layer's caches, left where they are: called with a buffer, packs
    them into it (`pack_layer`); `copy_layer` copies them into another pool's blocks."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_ids: BlockIds | CheckedIds

    def __call__(self, out: torch.Tensor) -> None:
        pack_layer(self.k_cache, self.v_cache, self.block_ids, out)


def copy_layer(
    src: LayerBlocks,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: BlockIds | CheckedIds,
    impl: str = "auto",
) -> None:
    """`src`'s blocks into `block_ids` (distinct) of another layer's caches of the same block
    shape, dtype and device, K and V together: no packed buffer between (one Triton launch on
    CUDA, one pass over the bytes; `impl="torch"`: index_select + index_copy_)."""
    caches = (src.k_cache, src.v_cache, k_cache, v_cache)
    rows = derived(caches, lambda: _copy_rows(*caches))
    src_ids = check_block_ids(src.block_ids, src.k_cache.shape[0], src.k_cache.device)
    dst_ids = check_block_ids(block_ids, k_cache.shape[0], k_cache.device, unique=True)
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copy_layer: {len(src_ids)} src blocks into {len(dst_ids)} dst blocks")
    src_k, src_v, dst_k, dst_v = rows
    if use_triton(k_cache, src_k, dst_k, impl) and all(r.is_contiguous() for r in rows):
        copy_blocks(src_k, src_v, src_ids.index, dst_k, dst_v, dst_ids.index)
        return
    dst_k.index_copy_(0, dst_ids.index, src_k.index_select(0, src_ids.index))
    dst_v.index_copy_(0, dst_ids.index, src_v.index_select(0, src_ids.index))


def _copy_rows(*caches: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """src K, src V, dst K, dst V as rows of one element type and width (checked: one block
    shape, dtype and device)."""
    src_k, dst_k = caches[0], caches[2]
    same = all(
        c.shape[1:] == src_k.shape[1:] and c.dtype == src_k.dtype and c.device == src_k.device
        for c in caches
    )
    if not same:
        raise ValueError(
            f"copy_layer needs caches of one block shape, dtype and device: src "
            f"{list(src_k.shape)} {src_k.dtype} on {src_k.device}, dst "
            f"{list(dst_k.shape)} {dst_k.dtype} on {dst_k.device}"
        )
    rows = [as_rows(cache) for cache in caches]
    if len({(r.dtype, r.shape[1]) for r in rows}) != 1:  # word views differ in alignment
        rows = [cache.view(cache.shape[0], -1) for cache in caches]
    return tuple(rows)


def copy_layers(
    srcs: Sequence[LayerBlocks],
    dsts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    block_ids: BlockIds | CheckedIds,
    impl: str = "auto",
) -> None:
    """`copy_layer(srcs[l], *dsts[l], block_ids)` for every layer. Layers whose blocks are the
    same source ids (one `CheckedIds`, as `KVSender.send_layers` builds them) in pools of one
    size go in one Triton launch on CUDA (one launch, not one per layer: the host cost of a
    launch is what a batch of layers paid most); anything else layer by layer."""
    if len(srcs) != len(dsts):
        raise ValueError(f"copy_layers: {len(srcs)} source layers for {len(dsts)} destinations")
    if impl not in IMPLS:
        raise ValueError(f"impl must be auto, torch or triton, got {impl!r}")
    one_launch = (
        len(srcs) > 1
        and triton_available()
        and (impl == "triton" or (impl == "auto" and dsts[0][0].device.type == "cuda"))
        and all(s.block_ids is srcs[0].block_ids for s in srcs)
    )
    if one_launch:
        caches = [c for s in srcs for c in (s.k_cache, s.v_cache)] + [c for d in dsts for c in d]
        plan = derived(caches, lambda: _one_launch_plan(srcs, dsts))
        if plan is not None:
            src_rows, dst_rows, table = plan
            first, first_k = srcs[0], dsts[0][0]
            src_ids = check_block_ids(first.block_ids, first.k_cache.shape[0], first_k.device)
            dst_ids = check_block_ids(block_ids, first_k.shape[0], first_k.device, unique=True)
            if len(src_ids) != len(dst_ids):
                raise ValueError(f"copy_layers: {len(src_ids)} src blocks into {len(dst_ids)}")
            copy_blocks_layers(src_rows, src_ids.index, dst_rows, dst_ids.index, table)
            return
    for src, (k_cache, v_cache) in zip(srcs, dsts, strict=True):
        copy_layer(src, k_cache, v_cache, block_ids, impl)


def _one_launch_plan(
    srcs: Sequence[LayerBlocks], dsts: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> LaunchPlan | None:
    """Rows and the offsets table (on the caches' device) that copy every layer in one launch,
    or None when the caches do not allow it (block shapes, pool sizes, alignment)."""
    caches = [c for s in srcs for c in (s.k_cache, s.v_cache)] + [c for d in dsts for c in d]
    first = caches[0]
    same = (
        all(c.shape[1:] == first.shape[1:] and c.dtype == first.dtype for c in caches)
        and all(c.device == first.device and c.is_contiguous() for c in caches)
        and len({s.k_cache.shape[0] for s in srcs} | {s.v_cache.shape[0] for s in srcs}) == 1
        and len({c.shape[0] for d in dsts for c in d}) == 1
    )
    if not same:
        return None
    src_rows = [(as_rows(s.k_cache), as_rows(s.v_cache)) for s in srcs]
    dst_rows = [(as_rows(k), as_rows(v)) for k, v in dsts]
    table = layers_table(src_rows, dst_rows)
    return None if table is None else (src_rows, dst_rows, table)
