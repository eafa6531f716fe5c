"""Reference paged attention in plain torch: the CPU production path and the test oracle.

One forward handles a whole flat varlen step without a Python loop over requests:

```
write this step's k/v into the paged cache at slot_mapping
decodes  (first num_decodes requests): q [rows, Q, H, D] (Q = decode_query_len: 1, or K + 1 in
         a verify batch), one masked SDPA per length group
prefills (the rest):                   q padded [num_prefills, max_q, H, D] -> one masked SDPA
each SDPA gathers its rows' context K/V through block_tables into [B, max_ctx, KVH, D]
  (a lone row whose blocks are consecutive, on CPU: a view of the cache, no copy)
decodes of one query, with cpu_decode_kernel (bf16/fp16 on CPU, what the selector builds
  there): the C++ kernel of cpu_paged_decode.py reads each row's blocks in place, no gather
```

Query i of a request with context length c (cached tokens before this step) sits at position
c + i; key j is visible iff j <= that position (causal, which also keeps j < seq_len).

Everything that depends only on the step's metadata (length groups, row indices, the flat block
ids each gather reads, causal masks, the prefill padding map) is a `StepPlan`, built once per
step and reused by every layer: the backend keeps the plan of the last `AttentionMetadata` it
saw. A static-shape (CUDA graph) batch builds it per call, as its buffers change under it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import cpu_paged_decode, kv_quant
from kernels.attention.backend import AttentionBackend
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.torch_step_plan import AttentionGroup, PrefillPlan, StepPlan, step_plan


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
            and meta.decode_query_len == 1
        )  # fmt: skip
        plan = self._plan(meta, k_cache.shape[1], plan_decodes=not kernel)
        out = torch.empty_like(q)
        num_decodes, num_rows = meta.num_decodes, meta.num_decode_tokens
        if kernel:
            out[:num_decodes] = cpu_paged_decode.paged_decode_attention(
                q[:num_decodes], k_cache, v_cache, meta.block_tables[:num_decodes],
                meta.seq_lens[:num_decodes], scale,
            )  # fmt: skip
        elif plan.decode_groups:
            q_decode = q[:num_rows].view(num_decodes, meta.decode_query_len, *q.shape[1:])
            out[:num_rows] = _decode(q_decode, k_cache, v_cache, plan, scale, kv_scales).flatten(
                0, 1
            )
        if plan.prefill is not None:
            out[num_rows:] = _prefill(
                q[num_rows:], k_cache, v_cache, plan.prefill, scale, kv_scales
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
    q: torch.Tensor,  # [num_decodes, Q, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: StepPlan,
    scale: float,
    kv_scales: torch.Tensor | None,
) -> torch.Tensor:  # [num_decodes, Q, num_heads, head_dim]
    """One padded attention per length group."""
    groups = plan.decode_groups
    if len(groups) == 1 and groups[0].rows is None:
        return paged_attention(q, k_cache, v_cache, groups[0], scale, kv_scales)
    out = torch.empty_like(q)
    for group in groups:
        assert group.rows is not None, "a group of several names its rows"
        q_group = q.index_select(0, group.rows)  # [n, Q, H, D]
        out_group = paged_attention(q_group, k_cache, v_cache, group, scale, kv_scales)
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
