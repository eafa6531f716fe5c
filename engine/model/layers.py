"""Small building blocks of the Llama family: RMSNorm and the SwiGLU activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMS normalization over the last dim, computed in float32 like Hugging Face's LlamaRMSNorm.

    Works on any leading shape: [num_tokens, hidden] for the layer norms, [num_tokens,
    num_heads, head_dim] for Qwen3's per-head q/k norm.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        x_fp32 = x.float()
        variance = x_fp32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x_fp32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the fused gate|up projection: [..., 2 * d] -> [..., d]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
