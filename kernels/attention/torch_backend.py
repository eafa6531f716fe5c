"""Reference paged attention in plain torch: the CPU production path and the test oracle.

One forward handles a whole flat varlen step without a Python loop over requests:

```
write this step's k/v into the paged cache at slot_mapping
decodes  (first num_decodes requests): q [rows, 1, H, D], one masked SDPA per length group
prefills (the rest):                   q padded [num_prefills, max_q, H, D] -> one masked SDPA
each SDPA gathers its rows' context K/V through block_tables into [B, max_ctx, KVH, D]
  (a lone row whose blocks are consecutive, on CPU: a view of the cache, no copy)
decodes, with cpu_decode_kernel (bf16/fp16 on CPU, what the selector builds there): the C++
  kernel of cpu_paged_decode.py reads each row's blocks in place, no gather, no length groups
```

Query i of a request with context length c (cached tokens before this step) sits at position
c + i; key j is visible iff j <= that position (causal, which also keeps j < seq_len).

Everything that depends only on the step's metadata (length groups, row indices, the flat block
ids each gather reads, causal masks, the prefill padding map) is a `StepPlan`, built once per
step and reused by every layer: the backend keeps the plan of the last `AttentionMetadata` it
saw. A static-shape (CUDA graph) batch builds it per call, as its buffers change under it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention import cpu_paged_decode, kv_quant
from kernels.attention.backend import AttentionBackend
from kernels.attention.metadata import AttentionMetadata


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads] float32: an FP8 cache's scales
) -> None:
    """Store each token's K/V at its cache slot (slot = block_id * block_size + offset); an
    FP8 cache stores them quantized (kv_quant.quantize)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    if kv_quant.is_fp8(k_cache):
        scales = _fp8_scales(kv_scales)
        k = kv_quant.quantize(k, scales[0]).view(torch.uint8)
        v = kv_quant.quantize(v, scales[1]).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)  # (CPU: no fp8
        # index_copy_)
    # A view, never a copy (the write must land in the cache): fails loudly if not contiguous.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _fp8_scales(kv_scales: torch.Tensor | None) -> torch.Tensor:
    if kv_scales is None:
        raise ValueError("an FP8 KV cache needs its kv_scales ([2, num_kv_heads])")
    return kv_scales


@dataclass(frozen=True)
class AttentionGroup:
    """Rows attended by one padded SDPA, and what its gather and mask need."""

    rows: torch.Tensor | None  # [n] int64 rows of the part (decodes / prefills); None: all
    num_rows: int
    block_ids: torch.Tensor  # [n * blocks_per_row] int64: the blocks the gather reads, flat
    max_len: int  # keys per row (the longest context of the group)
    mask: torch.Tensor  # [n, 1, max_q_len, max_len] bool: key visible to query
    # One row whose blocks are consecutive (block_ids[0], block_ids[0] + 1, ...), on CPU: its
    # context is a view of the cache and nothing is gathered (a lone request's usual case).
    first_block: int | None = None


@dataclass(frozen=True)
class PrefillPlan:
    group: AttentionGroup  # all prefill requests, one SDPA
    flat_idx: torch.Tensor  # [num_prefill_tokens] int64: token's row in [n * max_q_len]
    max_q_len: int


@dataclass(frozen=True)
class StepPlan:
    decode_groups: list[AttentionGroup]
    prefill: PrefillPlan | None


def make_group(
    block_tables: torch.Tensor,  # [n, max_blocks_per_req] int32, the group's rows
    q_positions: torch.Tensor,  # [n, max_q_len] int64, position of each query
    max_len: int,
    block_size: int,
    rows: torch.Tensor | None = None,
) -> AttentionGroup:
    num_blocks = -(-max_len // block_size)
    block_ids = block_tables[:, :num_blocks].reshape(-1).long()
    # A real query's position is < its seq_len, so the causal test also hides the rest of the
    # last block and block-table padding. Padded query rows see at least key 0 (no NaN).
    mask = torch.arange(max_len, device=q_positions.device) <= q_positions[:, :, None]
    first_block = None
    if block_ids.device.type == "cpu" and block_tables.shape[0] == 1:
        ids = block_ids.tolist()
        if ids == list(range(ids[0], ids[0] + num_blocks)):
            first_block = ids[0]
    return AttentionGroup(
        rows, block_tables.shape[0], block_ids, max_len, mask[:, None], first_block
    )


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    group: AttentionGroup,
    scale: torch.Tensor | None = None,  # [num_kv_heads]: an FP8 cache's scales
    dtype: torch.dtype | None = None,  # the FP8 cache's values in this dtype
) -> torch.Tensor:  # [n, max_len, num_kv_heads, head_dim]
    """Each row's context K (or V) as [n, max_len, KVH, D], reading only the blocks needed: one
    `index_select` of whole blocks (a memcpy per block, unlike advanced indexing), or a view
    of the cache for a lone row with consecutive blocks. An FP8 cache's blocks are
    dequantized after the gather (only the blocks read)."""
    num_kv_heads, head_dim = cache.shape[2:]
    if group.first_block is not None:  # [blocks_per_row, bs, KVH, D]: a view, no copy
        blocks = cache[group.first_block : group.first_block + group.block_ids.numel()]
    else:
        blocks = cache.index_select(0, group.block_ids)  # [n * blocks_per_row, bs, KVH, D]
    if kv_quant.is_fp8(cache):
        assert scale is not None and dtype is not None, "an FP8 cache is read with its scales"
        blocks = kv_quant.dequantize(blocks, scale, dtype)
    return blocks.view(group.num_rows, -1, num_kv_heads, head_dim)[:, : group.max_len]


def paged_attention(
    q: torch.Tensor,  # [n, max_q_len, num_heads, head_dim] (padded)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads]: an FP8 cache's scales
) -> torch.Tensor:  # [n, max_q_len, num_heads, head_dim]
    """Causal attention of padded queries over their requests' paged context."""
    k_scale, v_scale = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
    k = gather_context(k_cache, group, k_scale, q.dtype)  # [n, max_len, KVH, D]
    v = gather_context(v_cache, group, v_scale, q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=group.mask,
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


def decode_groups(meta: AttentionMetadata, block_size: int) -> list[AttentionGroup]:
    """One group per set of similar context lengths (at most `MAX_DECODE_GROUPS`): padding
    every decode to the longest context wastes up to half the gathered KV when lengths are
    spread, and the gather is most of decode attention's cost. A static-shape batch is one
    group padded to the block tables' capacity (no host decision on its lengths)."""
    num_decodes = meta.num_decodes
    positions = (meta.seq_lens[:num_decodes].long() - 1)[:, None]  # [num_decodes, 1]
    block_tables = meta.block_tables[:num_decodes]
    if meta.static_shapes:
        return [make_group(block_tables, positions, meta.max_seq_len, block_size)]
    groups = length_groups(meta.seq_lens_cpu[:num_decodes])
    if len(groups) == 1:
        return [make_group(block_tables, positions, groups[0][1], block_size)]
    plans = []
    for rows, max_len in groups:
        idx = torch.tensor(rows, device=positions.device)
        plans.append(
            make_group(
                block_tables.index_select(0, idx),
                positions.index_select(0, idx),
                max_len,
                block_size,
                rows=idx,
            )
        )
    return plans


def prefill_plan(meta: AttentionMetadata, block_size: int) -> PrefillPlan:
    """Where each prefill token sits in the padded [num_prefills, max_q_len] layout, and the
    prefills' single group."""
    first = meta.num_decodes
    num_prefills = meta.num_reqs - first
    num_prefill_tokens = meta.num_tokens - first
    device = meta.seq_lens.device
    query_start_loc = meta.query_start_loc[first:].long() - meta.query_start_loc[first]
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [num_prefills]
    req_idx = torch.repeat_interleave(
        torch.arange(num_prefills, device=device), query_lens, output_size=num_prefill_tokens
    )
    token_idx = torch.arange(num_prefill_tokens, device=device) - query_start_loc[req_idx]
    max_q_len = max(meta.query_lens_cpu[first:])
    context_lens = meta.seq_lens[first:].long() - query_lens  # tokens cached before this step
    q_positions = context_lens[:, None] + torch.arange(max_q_len, device=device)
    max_len = max(meta.seq_lens_cpu[first:])
    group = make_group(meta.block_tables[first:], q_positions, max_len, block_size)
    return PrefillPlan(group, req_idx * max_q_len + token_idx, max_q_len)


def step_plan(meta: AttentionMetadata, block_size: int, plan_decodes: bool = True) -> StepPlan:
    """The step's groups; `plan_decodes` False: no decode groups (the decode kernel reads the
    block tables itself)."""
    decodes = decode_groups(meta, block_size) if plan_decodes and meta.num_decodes > 0 else []
    prefill = prefill_plan(meta, block_size) if meta.num_reqs > meta.num_decodes else None
    return StepPlan(decodes, prefill)


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with torch ops only; runs on any device and dtype."""

    name = "torch"
    graph_max_context = 8192

    def __init__(self, cpu_decode_kernel: bool = False) -> None:
        # Decode rows through cpu_paged_decode (the caller checked it is built; CPU tensors).
        self.cpu_decode_kernel = cpu_decode_kernel
        # (meta, its plan): every layer of a step passes the same metadata object. One tuple,
        # replaced whole, so a reader never pairs one step's meta with another's plan.
        self._last_plan: tuple[AttentionMetadata, StepPlan] | None = None

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
        kv_scales: torch.Tensor | None = None,  # [2, num_kv_heads]: an FP8 cache's scales
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k.shape[1]})"
            )
        if not kv_written:
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        fp8 = kv_quant.is_fp8(k_cache)  # (the C++ decode kernel reads bf16/fp16 blocks only)
        kernel = (
            self.cpu_decode_kernel and not fp8 and not meta.static_shapes and meta.num_decodes > 0
        )
        plan = self._plan(meta, k_cache.shape[1], plan_decodes=not kernel)
        out = torch.empty_like(q)
        num_decodes = meta.num_decodes
        if kernel:
            out[:num_decodes] = cpu_paged_decode.paged_decode_attention(
                q[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
                meta.seq_lens[:num_decodes], scale,
            )  # fmt: skip
        elif plan.decode_groups:
            out[:num_decodes] = _decode(q[:num_decodes], k_cache, v_cache, plan, scale, kv_scales)
        if plan.prefill is not None:
            out[num_decodes:] = _prefill(
                q[num_decodes:], k_cache, v_cache, plan.prefill, scale, kv_scales
            )
        return out

    def _plan(self, meta: AttentionMetadata, block_size: int, plan_decodes: bool) -> StepPlan:
        if meta.static_shapes:  # graph buffers: the plan must be recomputed from them
            return step_plan(meta, block_size)
        last = self._last_plan
        if last is not None and last[0] is meta:
            return last[1]
        plan = step_plan(meta, block_size, plan_decodes)
        self._last_plan = (meta, plan)
        return plan


def _decode(
    q: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: StepPlan,
    scale: float,
    kv_scales: torch.Tensor | None,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    """One padded attention per length group."""
    groups = plan.decode_groups
    if len(groups) == 1 and groups[0].rows is None:
        return paged_attention(q[:, None], k_cache, v_cache, groups[0], scale, kv_scales)[:, 0]
    out = torch.empty_like(q)
    for group in groups:
        assert group.rows is not None, "a group of several names its rows"
        q_group = q.index_select(0, group.rows)[:, None]  # [n, 1, H, D]
        out_group = paged_attention(q_group, k_cache, v_cache, group, scale, kv_scales)[:, 0]
        out.index_copy_(0, group.rows, out_group)
    return out


def _prefill(
    q: torch.Tensor,  # [num_prefill_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    kv_scales: torch.Tensor | None,
) -> torch.Tensor:  # [num_prefill_tokens, num_heads, head_dim]
    """One padded attention over every prefill chunk."""
    _, num_heads, head_dim = q.shape
    num_rows = plan.group.num_rows * plan.max_q_len
    q_padded = q.new_zeros(num_rows, num_heads, head_dim)
    q_padded.index_copy_(0, plan.flat_idx, q)
    q_padded = q_padded.view(plan.group.num_rows, plan.max_q_len, num_heads, head_dim)
    out = paged_attention(q_padded, k_cache, v_cache, plan.group, scale, kv_scales)
    return out.reshape(num_rows, num_heads, head_dim).index_select(0, plan.flat_idx)
