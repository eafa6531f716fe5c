"""A route's bytes: a head slice cut from a rank's packed layer (prefill), or views of a rank's
pool over a head slice for a route to land in (decode).

A packed layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V) of the
rank's heads; a route that carries some of them (a wider decode node: each of its ranks holds
fewer heads) sends `[2, num_blocks, block_size, end - start, head_dim]`, one strided copy. A
route that carries all of them sends the packed layer itself.
"""

from __future__ import annotations

import torch

from cache_transfer.layout import KVCaches, KVLayout


def slice_packed(
    payload: torch.Tensor, layout: KVLayout, num_blocks: int, start: int, end: int
) -> torch.Tensor:
    """Heads `[start, end)` (of the rank's `layout.num_kv_heads`) of a packed layer of
    `num_blocks` blocks, as a new flat uint8 buffer on the payload's device (the current
    stream)."""
    if not 0 <= start < end <= layout.num_kv_heads:
        raise ValueError(f"heads [{start}, {end}) outside the {layout.num_kv_heads} packed")
    shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    packed = payload.view(layout.torch_dtype).view(shape)  # [2, n, block, heads, dim]
    out = torch.empty(
        (2, num_blocks, layout.block_size, end - start, layout.head_dim),
        dtype=layout.torch_dtype, device=payload.device,
    )  # fmt: skip
    out.copy_(packed[:, :, :, start:end])
    return out.view(-1).view(torch.uint8)


def head_views(kv_caches: KVCaches, start: int, end: int) -> KVCaches:
    """Per layer `(k, v)` views `[num_blocks, block_size, end - start, head_dim]` over heads
    `[start, end)` of the rank's caches (strided unless they are all of them)."""
    return [(k[:, :, start:end], v[:, :, start:end]) for k, v in kv_caches]
