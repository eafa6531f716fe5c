"""Attention backends over the flat varlen batch (`AttentionMetadata`) and the paged KV cache.

Only the torch reference is imported here; the triton and flash_attn backends load on demand
through `get_attention_backend`.
"""

from kernels.attention.backend import AttentionBackend
from kernels.attention.metadata import AttentionMetadata
from kernels.attention.selector import get_attention_backend
from kernels.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "get_attention_backend",
]
