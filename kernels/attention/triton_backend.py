"""Paged attention with Triton kernels: the default backend on CUDA.

The cache write is a torch `index_copy_` (one fused-enough launch per K and V); decodes and
prefills each run one kernel launch (plus a split merge for long-context decode batches).
"""

from __future__ import annotations

import torch

from kernels.attention.backend import AttentionBackend
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.torch_backend import write_kv_cache
from kernels.attention.triton_paged_attention import (
    paged_decode_attention,
    paged_prefill_attention,
)


class TritonAttentionBackend(AttentionBackend):
    """Split-K paged decode + varlen causal paged prefill."""

    name = "triton"

    def __init__(self, decode_partition_len: int | None = None) -> None:
        # Keys per decode split; None sizes the splits to fill the GPU.
        self.decode_partition_len = decode_partition_len

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, block_size: int) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16, torch.float32)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k.shape[1]})"
            )
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        num_decodes = meta.num_decodes
        if num_decodes > 0:
            paged_decode_attention(
                out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, num_decodes,
                max(meta.seq_lens_cpu[:num_decodes]), scale, self.decode_partition_len,
            )  # fmt: skip
        if meta.num_reqs > num_decodes:
            paged_prefill_attention(
                out, q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                meta.seq_lens, num_decodes, max(meta.query_lens_cpu[num_decodes:]), scale,
            )  # fmt: skip
        return out
