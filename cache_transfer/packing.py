"""Pack one layer of one request into one contiguous buffer, and scatter it back elsewhere.

A packed layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V) in the
cache dtype, carried as a flat `uint8` tensor so transports see plain bytes. The sender gathers
its own block ids; the receiver scatters into *its* block ids, which need not match.

A sender that writes into the receiver's own pool (writes in place, one GPU) packs nothing:
`copy_layer` moves a `LayerBlocks` (a layer's blocks where they are) straight into the
receiver's block ids, one pass over the bytes (`copy_layers`: several layers, one launch); the
same `LayerBlocks` packs itself when it is sent instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cache_transfer.checked_caches import derived
from cache_transfer.layout import KVLayout
from kernels.kv_copy import (
    copy_blocks,
    copy_blocks_layers,
    gather_blocks,
    layers_table,
    scatter_blocks,
    triton_available,
)

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


class CheckedIds:
    """Block ids already checked against a pool, as an int64 tensor on the cache's device (the
    hot paths build one per request and slice it per layer: no per-layer validation, no
    per-layer host-to-device copy)."""

    __slots__ = ("index",)

    def __init__(self, index: torch.Tensor) -> None:
        self.index = index

    def __len__(self) -> int:
        return self.index.numel()

    def __getitem__(self, span: slice) -> CheckedIds:
        return CheckedIds(self.index[span])


def check_block_ids(
    block_ids: BlockIds, pool_blocks: int, device: torch.device | str, *, unique: bool = False
) -> CheckedIds:
    """Validate block ids (vectorised: no Python loop over blocks) and put them on `device`;
    from host to a CUDA device the copy is asynchronous (pinned), so it never waits for the
    stream's queued work."""
    if isinstance(block_ids, CheckedIds):
        return block_ids
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device="cpu").reshape(-1)
    if ids.numel() == 0:
        raise ValueError("block_ids is empty: a packed layer needs at least one block")
    low, high = torch.aminmax(ids)
    if low < 0 or high >= pool_blocks:
        bad = ids[(ids < 0) | (ids >= pool_blocks)][:8].tolist()
        raise ValueError(f"block ids {bad} are outside the cache's [0, {pool_blocks}) blocks")
    if unique and torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"destination block ids must be distinct, got {ids[:64].tolist()}")
    device = torch.device(device)
    if device.type == "cuda":
        ids = ids.pin_memory().to(device, non_blocking=True)
    return CheckedIds(ids.to(device))


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
    k_rows, v_rows = _as_rows(k_cache), _as_rows(v_cache)
    packed_rows = _as_rows(packed.view(2 * n, *k_cache.shape[1:]))
    if _use_triton(k_cache, packed_rows, k_rows, impl):
        gather_blocks(k_rows, v_rows, ids.index, packed_rows)
    elif (kv_rows := _kv_rows(k_rows, v_rows)) is not None:
        both = torch.cat((ids.index, ids.index + k_rows.shape[0]))
        torch.index_select(kv_rows, 0, both, out=packed_rows)
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
    together (one launch / one index_copy_ as in `pack_layer`)."""
    ids = check_block_ids(block_ids, k_cache.shape[0], k_cache.device, unique=True)
    n = len(ids)
    packed = packed_view(payload, n, k_cache).to(k_cache.device)
    k_rows, v_rows = _as_rows(k_cache), _as_rows(v_cache)
    packed_rows = _as_rows(packed.reshape(2 * n, *k_cache.shape[1:]))
    if _use_triton(k_cache, packed_rows, k_rows, impl):
        scatter_blocks(packed_rows, k_rows, v_rows, ids.index)
    elif (kv_rows := _kv_rows(k_rows, v_rows)) is not None:
        both = torch.cat((ids.index, ids.index + k_rows.shape[0]))
        kv_rows.index_copy_(0, both, packed_rows)
    else:
        k_rows.index_copy_(0, ids.index, packed_rows[:n])
        v_rows.index_copy_(0, ids.index, packed_rows[n:])


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
    if _use_triton(k_cache, src_k, dst_k, impl) and all(r.is_contiguous() for r in rows):
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
    rows = [_as_rows(cache) for cache in caches]
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
    if impl not in ("auto", "torch", "triton"):
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
) -> tuple[list, list, torch.Tensor] | None:
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
    src_rows = [(_as_rows(s.k_cache), _as_rows(s.v_cache)) for s in srcs]
    dst_rows = [(_as_rows(k), _as_rows(v)) for k, v in dsts]
    table = layers_table(src_rows, dst_rows)
    return None if table is None else (src_rows, dst_rows, table)


def _use_triton(
    cache: torch.Tensor, packed_rows: torch.Tensor, rows: torch.Tensor, impl: str
) -> bool:
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be auto, torch or triton, got {impl!r}")
    if impl == "torch" or not triton_available():
        return False
    same_kind = packed_rows.dtype == rows.dtype and packed_rows.is_contiguous()
    return same_kind and (impl == "triton" or cache.device.type == "cuda")


def _kv_rows(k_rows: torch.Tensor, v_rows: torch.Tensor) -> torch.Tensor | None:
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
