"""Rotary position embedding (the "rotate half" / GPT-NeoX form Hugging Face Llama uses).

```
inv_freq [head_dim / 2]            default, linear (inv_freq / factor) or llama3 (smoothed bands)
cos_sin_cache [max_pos, head_dim]  cos | sin of positions x inv_freq, float32, built once
forward(positions [T])             gather the step's rows once (shared by all layers)
rotation (kernels/fused)           x1, x2 = halves of each head:
                                   (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
```

The frequencies are computed exactly as transformers computes them, so fp32 results match it
bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model.arch_config import RopeConfig


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:  # [head_dim // 2] float32
    """The inverse frequency of each rotated pair, after the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling_type == "default":
        return inv_freq
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    raise ValueError(
        f"rope scaling type {rope.scaling_type!r} is not supported; "
        "supported: 'default', 'linear', 'llama3'"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths / factor, short ones kept, a smooth band between."""
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """The cos/sin table of every position, looked up per step by the flat batch's positions."""

    cos_sin_cache: torch.Tensor  # a buffer: [max_position, head_dim]

    def __init__(self, head_dim: int, rope: RopeConfig, max_position: int) -> None:
        super().__init__()
        if rope.partial_rotary_factor != 1.0:
            raise ValueError(
                f"partial_rotary_factor {rope.partial_rotary_factor} is not supported (only 1.0)"
            )
        inv_freq = rope_inv_freq(head_dim, rope)  # [head_dim // 2]
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_pos, head_dim // 2]
        # [max_position, head_dim]: cos | sin, built in float32 (cast per step)
        cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,  # positions: [num_tokens] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [num_tokens, 1, head_dim // 2]
        """The cos and sin rows of a step's positions, once for all layers."""
        cos_sin = self.cos_sin_cache[positions].to(dtype)  # [num_tokens, head_dim]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return cos, sin
