"""The attention backend interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kernels.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over a flat varlen batch.

    `forward` first writes this step's K/V into the paged cache at `meta.slot_mapping` (unless
    `kv_written`: the caller's fused rotary kernel stored them already), then
    computes causal attention of every query token over its request's whole context (cached
    prefix + this step's tokens), with grouped-query heads (num_heads % num_kv_heads == 0).
    An FP8 cache (float8_e4m3fn, `kernels.attention.kv_quant`) is written quantized and read
    dequantized with `kv_scales` (K's and V's per KV head); flash_attn refuses one.
    """

    name: ClassVar[str]
    # The longest context a CUDA-graph decode batch may be sized for (None: any). The torch
    # reference gathers the whole capacity per step in a graph, so it is kept short.
    graph_max_context: ClassVar[int | None] = None

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, block_size: int) -> bool:
        return True

    @abstractmethod
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
        ...
