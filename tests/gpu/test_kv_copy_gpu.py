"""The KV hand-off's block kernels compiled on CUDA at llama3-8b sizes (bf16, block 16, 8 KV
heads x 128): the Triton gather, scatter and block-to-block copy move exactly the bytes torch
indexing moves, into exactly the blocks asked for."""

from __future__ import annotations

import pytest
import torch

from cache_transfer import LayerBlocks, copy_layer, copy_layers, pack_layer, unpack_layer
from cache_transfer.packing.block_ids import check_block_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

POOL_BLOCKS, BLOCK_SHAPE = 1024, (16, 8, 128)
NUM_BLOCKS = 512  # an 8K-token prompt


def _pool(fill: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the engine holds them: views of one [2, blocks, ...] allocation."""
    shape = (2, POOL_BLOCKS, *BLOCK_SHAPE)
    if fill is None:
        slab = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    else:
        slab = torch.full(shape, fill, device="cuda", dtype=torch.bfloat16)
    return slab[0], slab[1]


def test_triton_gather_scatter_and_copy_match_torch_on_the_gpu() -> None:
    gen = torch.Generator().manual_seed(0)
    src_ids = torch.randperm(POOL_BLOCKS, generator=gen)[:NUM_BLOCKS].tolist()
    dst_ids = torch.randperm(POOL_BLOCKS, generator=gen)[:NUM_BLOCKS].tolist()
    k, v = _pool()
    nbytes = 2 * NUM_BLOCKS * k[0].numel() * k.element_size()
    fast = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ref = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pack_layer(k, v, src_ids, fast, impl="triton")
    pack_layer(k, v, src_ids, ref, impl="torch")
    assert torch.equal(fast, ref)

    unpacked, copied = _pool(-7.0), _pool(-7.0)
    unpack_layer(fast, *unpacked, dst_ids, impl="triton")
    copy_layer(LayerBlocks(k, v, src_ids), *copied, dst_ids, impl="triton")
    torch.cuda.synchronize()
    for dst in (unpacked, copied):
        assert torch.equal(dst[0][dst_ids], k[src_ids]) and torch.equal(dst[1][dst_ids], v[src_ids])
        rest = torch.ones(POOL_BLOCKS, dtype=torch.bool)
        rest[dst_ids] = False
        assert bool((dst[0][rest.cuda()] == -7).all() and (dst[1][rest.cuda()] == -7).all())


def test_layers_copied_in_one_launch_match_layer_by_layer_on_the_gpu() -> None:
    """`copy_layers` (every layer of a request in one launch, the base of each as an offset
    from layer 0's) writes exactly what one `copy_layer` per layer writes: 32 layers of one
    pool slab into another, whose layers lie in a different order in memory."""
    num_layers, gen = 32, torch.Generator().manual_seed(1)
    shape = (num_layers, 2, POOL_BLOCKS, *BLOCK_SHAPE)
    src_slab = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    src = [(src_slab[i, 0], src_slab[i, 1]) for i in range(num_layers)]
    batched, one_by_one = (
        torch.full(shape, -7.0, device="cuda", dtype=torch.bfloat16) for _ in "ab"
    )
    order = torch.randperm(num_layers, generator=gen).tolist()  # dst layer i lives at slot order[i]
    src_ids = check_block_ids(
        torch.randperm(POOL_BLOCKS, generator=gen)[:NUM_BLOCKS], POOL_BLOCKS, "cuda"
    )
    dst_ids = torch.randperm(POOL_BLOCKS, generator=gen)[:NUM_BLOCKS].tolist()
    copy_layers(
        [LayerBlocks(k, v, src_ids) for k, v in src],
        [(batched[order[i], 0], batched[order[i], 1]) for i in range(num_layers)],
        dst_ids,
        impl="triton",
    )
    for i, (k, v) in enumerate(src):
        dst = one_by_one[order[i]]
        copy_layer(LayerBlocks(k, v, src_ids), dst[0], dst[1], dst_ids, impl="torch")
    torch.cuda.synchronize()
    assert torch.equal(batched, one_by_one)
