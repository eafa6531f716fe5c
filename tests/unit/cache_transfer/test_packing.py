"""pack_layer / unpack_layer: gather a request's blocks, scatter them into other block ids;
copy_layer: the same move with no packed buffer between (writes in place)."""

from __future__ import annotations

import pytest
import torch
from transfer_helpers import SENTINEL, make_layout, random_caches, sentinel_caches

from cache_transfer import LayerBlocks, copy_layer, pack_layer, unpack_layer
from cache_transfer.packing.packed_layer import alloc_staging, check_kv_cache, packed_view


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_into_different_block_ids(dtype: str) -> None:
    layout = make_layout(dtype)
    (src_k, src_v), *_ = random_caches(layout, num_blocks=12)
    (dst_k, dst_v), *_ = sentinel_caches(layout, num_blocks=20)
    src_ids, dst_ids = [5, 1, 11, 7], [0, 19, 3, 8]
    staging = alloc_staging(layout.layer_bytes(len(src_ids)))

    pack_layer(src_k, src_v, src_ids, staging)
    unpack_layer(staging, dst_k, dst_v, dst_ids)

    assert torch.equal(dst_k[dst_ids], src_k[src_ids])
    assert torch.equal(dst_v[dst_ids], src_v[src_ids])
    others = [b for b in range(20) if b not in dst_ids]
    assert bool((dst_k[others] == SENTINEL).all() and (dst_v[others] == SENTINEL).all())


def test_packed_buffer_is_k_then_v_in_block_order() -> None:
    layout = make_layout("bfloat16")
    (k, v), *_ = random_caches(layout, num_blocks=6)
    ids = torch.tensor([4, 0, 2])
    staging = alloc_staging(layout.layer_bytes(3))

    pack_layer(k, v, ids, staging)

    packed = packed_view(staging, 3, k)  # [2, 3, block_size, kvh, hd]
    assert torch.equal(packed[0], k[ids]) and torch.equal(packed[1], v[ids])
    # The CPU staging is plain bytes a transport can send without a copy.
    assert staging.numpy().nbytes == layout.layer_bytes(3)


def test_pack_refuses_a_staging_buffer_of_the_wrong_size() -> None:
    layout = make_layout()
    (k, v), *_ = random_caches(layout, num_blocks=6)
    staging = alloc_staging(layout.layer_bytes(2) + 1)

    with pytest.raises(ValueError, match=r"holds \d+ bytes; 2 blocks of K and V need"):
        pack_layer(k, v, [0, 1], staging)


@pytest.mark.parametrize(
    ("block_ids", "message"),
    [([0, 6], "outside the cache's"), ([-1], "outside the cache's"), ([], "block_ids is empty")],
)
def test_pack_refuses_bad_source_block_ids(block_ids: list[int], message: str) -> None:
    layout = make_layout()
    (k, v), *_ = random_caches(layout, num_blocks=6)
    staging = alloc_staging(layout.layer_bytes(max(len(block_ids), 1)))

    with pytest.raises(ValueError, match=message):
        pack_layer(k, v, block_ids, staging)


def test_unpack_refuses_repeated_destination_blocks_and_writes_nothing() -> None:
    layout = make_layout()
    (k, v), *_ = random_caches(layout, num_blocks=6)
    (dst_k, dst_v), *_ = sentinel_caches(layout, num_blocks=6)
    staging = pack_layer(k, v, [0, 1], alloc_staging(layout.layer_bytes(2)))

    with pytest.raises(ValueError, match="must be distinct"):
        unpack_layer(staging, dst_k, dst_v, [3, 3])
    assert bool((dst_k == SENTINEL).all() and (dst_v == SENTINEL).all())


def test_check_kv_cache_names_the_mismatch() -> None:
    layout = make_layout()
    (k, v), *_ = random_caches(layout, num_blocks=4)

    check_kv_cache(layout, k, v)
    with pytest.raises(ValueError, match=r"k_cache must be \[num_blocks, block_size"):
        check_kv_cache(layout, k[:, :2], v)
    with pytest.raises(ValueError, match="v_cache dtype is torch.float16"):
        check_kv_cache(layout, k, v.half())
    with pytest.raises(ValueError, match="must match in shape"):
        check_kv_cache(layout, k, v[:2])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_copy_layer_moves_blocks_as_a_pack_and_unpack_would(dtype: str) -> None:
    layout = make_layout(dtype)
    (src_k, src_v), *_ = random_caches(layout, num_blocks=12)
    (dst_k, dst_v), *_ = sentinel_caches(layout, num_blocks=20)
    (ref_k, ref_v), *_ = sentinel_caches(layout, num_blocks=20)
    src_ids, dst_ids = [5, 1, 11, 7], [0, 19, 3, 8]
    blocks = LayerBlocks(src_k, src_v, src_ids)

    copy_layer(blocks, dst_k, dst_v, dst_ids)
    staging = alloc_staging(layout.layer_bytes(len(src_ids)))
    blocks(staging)  # a LayerBlocks packs itself when it is sent instead
    unpack_layer(staging, ref_k, ref_v, dst_ids)

    assert torch.equal(dst_k, ref_k) and torch.equal(dst_v, ref_v)
    assert torch.equal(dst_v[dst_ids], src_v[src_ids])
    others = [b for b in range(20) if b not in dst_ids]
    assert bool((dst_k[others] == SENTINEL).all() and (dst_v[others] == SENTINEL).all())


def test_copy_layer_refuses_mismatched_caches_and_ids_and_writes_nothing() -> None:
    layout = make_layout("float32")
    (src_k, src_v), *_ = random_caches(layout, num_blocks=6)
    (dst_k, dst_v), *_ = sentinel_caches(layout, num_blocks=6)
    with pytest.raises(ValueError, match="one block shape, dtype and device"):
        copy_layer(LayerBlocks(src_k.bfloat16(), src_v.bfloat16(), [0]), dst_k, dst_v, [1])
    with pytest.raises(ValueError, match="2 src blocks into 1 dst blocks"):
        copy_layer(LayerBlocks(src_k, src_v, [0, 1]), dst_k, dst_v, [1])
    with pytest.raises(ValueError, match="distinct"):
        copy_layer(LayerBlocks(src_k, src_v, [0, 1]), dst_k, dst_v, [2, 2])
    with pytest.raises(ValueError, match="outside"):
        copy_layer(LayerBlocks(src_k, src_v, [9]), dst_k, dst_v, [2])
    assert bool((dst_k == SENTINEL).all() and (dst_v == SENTINEL).all())
