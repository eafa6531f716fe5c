"""Random paged-attention batches and a dead-simple per-request reference, for backend tests.

Shared by the CPU unit tests and tests/gpu/test_attention_gpu.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kernels.attention.metadata import AttentionMetadata


@dataclass
class AttentionBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata
    scale: float
    block_ids: list[list[int]]  # per request, its blocks in order

    def clone_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.clone(), self.v_cache.clone()


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_decodes: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    num_spare_blocks: int = 3,
    decode_query_len: int = 1,
) -> AttentionBatch:
    """A batch whose request i has context_lens[i] cached tokens and query_lens[i] new ones;
    the first `num_decodes` have `decode_query_len` each (> 1: a speculative verify batch).

    Block ids are a random permutation of the pool (non-contiguous, unsorted); the whole
    cache, spare blocks included, holds random values.
    """
    if any(n != decode_query_len for n in query_lens[:num_decodes]):
        raise ValueError(f"the first {num_decodes} query_lens must be {decode_query_len}")
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + num_spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_ids, start = [], 0
    for n in blocks_per_req:
        block_ids.append(perm[start : start + n])
        start += n
    num_tokens = sum(query_lens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    meta = _metadata(block_ids, query_lens, context_lens, block_size, num_decodes, device)
    meta = dataclasses.replace(meta, decode_query_len=decode_query_len)
    return AttentionBatch(
        q=randn(num_tokens, num_heads, head_dim),
        k=randn(num_tokens, num_kv_heads, head_dim),
        v=randn(num_tokens, num_kv_heads, head_dim),
        k_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        v_cache=randn(num_blocks, block_size, num_kv_heads, head_dim),
        meta=meta,
        scale=head_dim**-0.5,
        block_ids=block_ids,
    )


def _metadata(
    block_ids: list[list[int]],
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    num_decodes: int,
    device: str | torch.device,
) -> AttentionMetadata:
    """The batch's attention metadata: block tables and slots from each request's blocks."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    block_tables = torch.zeros(len(seq_lens), max(map(len, block_ids)), dtype=torch.int32)
    slots = []
    for i, ids in enumerate(block_ids):
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for pos in range(context_lens[i], seq_lens[i]):
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]).to(
            device=device, dtype=torch.int32
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )


def reference_attention(batch: AttentionBatch) -> torch.Tensor:
    """Per-request dense causal attention in float32, from the cache *before* the forward.

    Returns [num_tokens, num_heads, head_dim] float32.
    """
    meta = batch.meta
    block_size = batch.k_cache.shape[1]
    group = batch.q.shape[1] // batch.k.shape[1]
    outs = []
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        start = int(meta.query_start_loc[i])
        context_len = seq_len - query_len
        slots = [
            batch.block_ids[i][pos // block_size] * block_size + pos % block_size
            for pos in range(context_len)
        ]
        k = torch.cat([batch.k_cache.flatten(0, 1)[slots], batch.k[start : start + query_len]])
        v = torch.cat([batch.v_cache.flatten(0, 1)[slots], batch.v[start : start + query_len]])
        k = k.float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.float().repeat_interleave(group, dim=1)
        q = batch.q[start : start + query_len].float()  # [query_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        query_pos = torch.arange(query_len)[:, None] + context_len
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)
