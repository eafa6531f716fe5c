"""Reference paged attention in plain torch: the CPU production path and the test oracle.

One forward handles a whole flat varlen step without a Python loop over requests:

```
write this step's k/v into the paged cache at slot_mapping
decodes  (first num_decodes requests): q [num_decodes, 1, H, D]      -> one masked SDPA
prefills (the rest):                   q padded [num_prefills, max_q, H, D] -> one masked SDPA
each group gathers its context K/V through block_tables into [B, max_ctx, KVH, D]
```

Query i of a request with context length c (cached tokens before this step) sits at position
c + i; key j is visible iff j <= that position (causal, which also keeps j < seq_len).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.backend import AttentionBackend
from kernels.attention.metadata import AttentionMetadata


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store each token's K/V at its cache slot (slot = block_id * block_size + offset)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    # A view, never a copy (the write must land in the cache): fails loudly if not contiguous.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    max_ctx_len: int,
) -> torch.Tensor:  # [num_reqs, max_ctx_len, num_kv_heads, head_dim]
    """Each request's context K (or V) made contiguous, reading only the blocks needed."""
    num_reqs = block_tables.shape[0]
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    num_blocks = -(-max_ctx_len // block_size)
    # [num_reqs, num_blocks, block_size, num_kv_heads, head_dim]
    blocks = cache[block_tables[:, :num_blocks].long()]
    return blocks.view(num_reqs, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_ctx_len]


def paged_attention(
    q: torch.Tensor,  # [num_reqs, max_q_len, num_heads, head_dim] (padded)
    q_positions: torch.Tensor,  # [num_reqs, max_q_len] int64, position of each query
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:  # [num_reqs, max_q_len, num_heads, head_dim]
    """Causal attention of padded queries over their requests' paged context."""
    k = gather_context(k_cache, block_tables, max_seq_len)  # [B, max_seq_len, KVH, D]
    v = gather_context(v_cache, block_tables, max_seq_len)
    # [num_reqs, max_q_len, max_seq_len]. A real query's position is < its seq_len, so the
    # causal test also hides the rest of the last block and block-table padding. Padded query
    # rows see at least key 0 (no NaN) and are dropped by the caller.
    mask = torch.arange(max_seq_len, device=q.device) <= q_positions[:, :, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


MAX_DECODE_GROUPS = 4
_GROUP_LEN_RATIO = 0.7  # a group's shortest context is at least this fraction of its longest


def length_groups(seq_lens: tuple[int, ...]) -> list[tuple[list[int], int]]:
    """Split request rows into at most MAX_DECODE_GROUPS groups of similar length, longest
    first: [(rows, max_len)]. One group when the lengths are already close."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)
    groups: list[tuple[list[int], int]] = []
    start = 0
    for i in range(1, len(order) + 1):
        last_group = len(groups) == MAX_DECODE_GROUPS - 1
        if i == len(order) or (
            not last_group and seq_lens[order[i]] < _GROUP_LEN_RATIO * seq_lens[order[start]]
        ):
            groups.append((order[start:i], seq_lens[order[start]]))
            start = i
    return groups


def _decode_group(
    q: torch.Tensor,  # [num_rows, num_heads, head_dim]
    seq_lens: torch.Tensor,  # [num_rows] int64
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_rows, max_blocks_per_req]
    max_len: int,
    scale: float,
) -> torch.Tensor:  # [num_rows, num_heads, head_dim]
    out = paged_attention(
        q[:, None], (seq_lens - 1)[:, None], k_cache, v_cache, block_tables, max_len, scale
    )
    return out[:, 0]


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with torch ops only; runs on any device and dtype."""

    name = "torch"
    graph_max_context = 8192

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,  # the caller already stored k/v at meta.slot_mapping
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k.shape[1]})"
            )
        if not kv_written:
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        num_decodes = meta.num_decodes
        if num_decodes > 0:
            out[:num_decodes] = self._decode(q[:num_decodes], k_cache, v_cache, meta, scale)
        if meta.num_reqs > num_decodes:
            out[num_decodes:] = self._prefill(q[num_decodes:], k_cache, v_cache, meta, scale)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
        """One padded attention per group of similar context lengths (at most
        `MAX_DECODE_GROUPS`): padding every decode to the longest context wastes up to half the
        gathered KV when lengths are spread, and the gather is most of decode attention's cost."""
        num_decodes = meta.num_decodes
        seq_lens = meta.seq_lens[:num_decodes].long()
        block_tables = meta.block_tables[:num_decodes]
        if meta.static_shapes:  # one padded group, as long as the block tables hold
            groups = [(list(range(num_decodes)), meta.max_seq_len)]
        else:
            groups = length_groups(meta.seq_lens_cpu[:num_decodes])
        if len(groups) == 1:
            return _decode_group(q, seq_lens, k_cache, v_cache, block_tables, groups[0][1], scale)
        out = torch.empty_like(q)
        for rows, max_len in groups:
            idx = torch.tensor(rows, device=q.device)
            out[idx] = _decode_group(
                q[idx], seq_lens[idx], k_cache, v_cache, block_tables[idx], max_len, scale
            )
        return out

    @staticmethod
    def _prefill(
        q: torch.Tensor,  # [num_prefill_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_prefill_tokens, num_heads, head_dim]
        first = meta.num_decodes
        num_prefills = meta.num_reqs - first
        num_prefill_tokens, num_heads, head_dim = q.shape
        query_start_loc = meta.query_start_loc[first:].long() - meta.query_start_loc[first]
        query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [num_prefills]
        # Where each flat token sits in the padded [num_prefills, max_q_len] layout.
        req_idx = torch.repeat_interleave(
            torch.arange(num_prefills, device=q.device), query_lens, output_size=num_prefill_tokens
        )
        token_idx = torch.arange(num_prefill_tokens, device=q.device) - query_start_loc[req_idx]
        max_q_len = max(meta.query_lens_cpu[first:])
        q_padded = q.new_zeros(num_prefills, max_q_len, num_heads, head_dim)
        q_padded[req_idx, token_idx] = q
        # [num_prefills] tokens cached before this step
        context_lens = meta.seq_lens[first:].long() - query_lens
        q_positions = context_lens[:, None] + torch.arange(max_q_len, device=q.device)
        out = paged_attention(
            q_padded,
            q_positions,
            k_cache,
            v_cache,
            meta.block_tables[first:],
            max(meta.seq_lens_cpu[first:]),
            scale,
        )
        return out[req_idx, token_idx]
