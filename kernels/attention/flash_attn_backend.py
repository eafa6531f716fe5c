"""Paged attention through flash-attn 2 (imported only when this backend is chosen).

Decodes go to `flash_attn_with_kvcache` (split-KV decode over the block table; a verify batch's
K + 1 queries per request with its bottom-right causal mask), prefills to
`flash_attn_varlen_func` with `block_table`, whose causal mask is aligned bottom-right: query i
of a request with context c sees keys [0, c + i], as the contract requires. FA2's paged KV
needs block_size % 256 == 0 and fp16/bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from kernels.attention.backend import AttentionBackend
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.selector import FLASH_ATTN_BLOCK_SIZE
from kernels.attention.torch_backend import write_kv_cache


class FlashAttnBackend(AttentionBackend):
    """flash-attn 2 paged decode and varlen prefill."""

    name = "flash_attn"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, block_size: int) -> bool:
        return (
            device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16)
            and block_size % FLASH_ATTN_BLOCK_SIZE == 0
        )

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
        kv_scales: torch.Tensor | None = None,  # an FP8 cache's: refused (the selector too)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if k_cache.dtype == torch.float8_e4m3fn:
            raise ValueError(
                "the flash_attn backend does not read an FP8 KV cache: use "
                "--attention-backend triton (or torch) with --kv-cache-dtype fp8_e4m3"
            )
        if not kv_written:
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        num_decodes, query_len = meta.num_decodes, meta.decode_query_len
        num_rows = meta.num_decode_tokens
        if num_decodes > 0:
            # [num_decodes, Q, num_heads, head_dim]: Q > 1 (a verify batch) is causal from the
            # bottom right, query i seeing keys up to cache_seqlens - Q + i
            q_decode = q[:num_rows].view(num_decodes, query_len, *q.shape[1:])
            out[:num_rows] = flash_attn_with_kvcache(
                q_decode,
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens[:num_decodes],
                block_table=meta.block_tables[:num_decodes],
                softmax_scale=scale,
                causal=True,
            ).flatten(0, 1)
        if meta.num_reqs > num_decodes:
            seq_lens = meta.seq_lens[num_decodes:]
            # [num_prefills + 1] int32 each; the decodes own the first num_rows tokens.
            cu_seqlens_q = meta.query_start_loc[num_decodes:] - num_rows
            cu_seqlens_k = F.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
            out[num_rows:] = flash_attn_varlen_func(
                q[num_rows:],
                k_cache,
                v_cache,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max(meta.query_lens_cpu[num_decodes:]),
                max_seqlen_k=max(meta.seq_lens_cpu[num_decodes:]),
                softmax_scale=scale,
                causal=True,
                block_table=meta.block_tables[num_decodes:],
            )
        return out
