"""The KV hand-off's block kernels compiled on CUDA at llama3-8b sizes (bf16, block 16, 8 KV
heads x 128): the Triton gather, scatter and block-to-block copy move exactly the bytes torch
indexing moves, into exactly the blocks asked for."""

from __future__ import annotations

import pytest
import torch

from cache_transfer import LayerBlocks, copy_layer, pack_layer, unpack_layer

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
